"""Spec-Bench: speculative decoding against plain decoding and transformers ``generate``.

Xia et al., "Unlocking Efficiency in Large Language Model Inference: A Comprehensive Survey
of Speculative Decoding" (Spec-Bench, 2024). For every question and temperature each method
answers in turn (interleaved, so machine load hits all alike): transformers ``generate``,
this engine's plain decoding, and speculative decoding at each tree size. mt_bench questions
have two turns; each method keeps its own first answer in the context of the second.

Metrics (docs/design.md): tokens/s of a question = its new tokens over its wall time (both turns,
prefill included); speed-up = mean over questions of the tokens/s ratio; tau = accepted
tokens over steps, pooled over all steps of a subtask. Warm-up generations are not timed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from elsi.config import like, opt
from elsi.data.conversations import Sample, render
from elsi.data.spec_bench import SUBTASKS, Question, load_questions
from elsi.decode.engine import DecodeConfig, Drafter, TargetRunner, generate, stop_tokens
from elsi.decode.tree import TreeConfig
from elsi.io import ProgressFile, file_sha256
from elsi.models import DEFAULT_MODEL
from elsi.runtime import machine_info, timing_key
from elsi.stats.sampling import mean
from elsi.text import num


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark runs."""

    model: str = opt(DEFAULT_MODEL, "target: alias, HF model directory, .gguf file or hub id")
    draft: str = opt("", "draft: a trained draft directory, 'random' (untrained EAGLE3 draft), "
                         "'target' (the target itself: a perfect drafter); empty = no speculative runs")
    subtasks: list[str] = opt(["all"], f"Spec-Bench subtasks ({', '.join(SUBTASKS)}) or all")
    questions_per_subtask: int = opt(80, "questions per subtask (file order)")
    max_new_tokens: int = like(DecodeConfig, "max_new_tokens", help_suffix=" (per turn)")
    temperature: list[float] = opt([0.0], "temperatures to run (0 = greedy)")
    top_p: float = like(DecodeConfig, "top_p")
    tree_nodes: list[int] = opt([60], "tree sizes to run (drafted tokens per step)")
    depth: int = like(TreeConfig, "depth")
    top_k: int = like(TreeConfig, "top_k")
    hf_generate: bool = opt(True, "also time transformers generate (the reference baseline)")
    plain: bool = opt(True, "also time this engine's plain decoding (the speed-ups' baseline); off when the "
                            "plain answers are timed once elsewhere (elsi study)")
    warmup: int = opt(1, "untimed warm-up answers per method before the timed ones")
    seed: int = opt(0, "seed of the sampling generators")
    exact: bool = opt(False, "τ at temperature 0 from the exact evaluator instead of live decoding: the target's "
                             "cached greedy answers, no decoding loop, no timing (elsi.specbench.exact)")
    out: str = opt("", "write the results JSON here")

    def __post_init__(self) -> None:
        if self.questions_per_subtask < 1:
            raise ValueError(f"questions_per_subtask must be >= 1, got {self.questions_per_subtask}")
        for n in self.tree_nodes:
            TreeConfig(n, self.depth, self.top_k)  # validates
        for t in self.temperature:
            DecodeConfig(self.max_new_tokens, t, self.top_p)
        if not (self.hf_generate or self.plain or self.draft):
            raise ValueError("nothing to run: no --draft, and both --no-hf-generate and --no-plain")
        if self.exact:
            bad = [t for t in self.temperature if t != 0]
            if bad:
                raise ValueError(f"--exact computes τ at temperature 0 only, got --temperature {bad}: sampled "
                                 "acceptance is random and needs live decoding (leave --exact off for T > 0)")
            if self.draft in ("", "target"):
                raise ValueError(f"--exact replays an EAGLE draft's trees: give --draft a draft directory or 'random', "
                                 f"got {self.draft!r}")


def encode_chat(tokenizer, turns: list[tuple[str, str]], raw: bool = False) -> list[int]:
    """Token ids of a conversation ending in a generation prompt (``raw``: the last text as is)."""
    if raw:
        return list(tokenizer(turns[-1][1])["input_ids"])
    text = render(Sample(id="q", messages=tuple(turns)), tokenizer, add_generation_prompt=True)
    templated = bool(getattr(tokenizer, "chat_template", None))
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


@dataclass
class Answer:
    """One method's answer to one question (all turns)."""

    question_id: int
    subtask: str
    method: str  # "hf_generate", "plain" or "spec"
    temperature: float
    tree_nodes: int | None
    new_tokens: int
    time_s: float
    steps: int  # engine steps (0 for hf_generate)
    accepted: int  # tokens added by those steps (tau = accepted / steps)
    profile: dict[str, float]  # engine phases, seconds

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0


# A method: (tokenizer-encoded prompt ids, generator) -> (new token ids, seconds, steps, accepted, profile)
Method = Callable[[list[int], torch.Generator], tuple[list[int], float, int, int, dict]]


def engine_method(runner: TargetRunner, dcfg: DecodeConfig, eos: set[int], drafter: Drafter | None = None,
                  tree: TreeConfig | None = None) -> Method:
    def run(ids: list[int], gen: torch.Generator):
        g = generate(runner, ids, dcfg, drafter, tree, eos, gen)
        return g.tokens, g.total_s, g.steps, sum(g.accepted), g.profile

    return run


def hf_method(model, dcfg: DecodeConfig, eos: set[int], pad: int) -> Method:
    """transformers ``generate`` with the same stopping rule and sampling settings."""
    from transformers import GenerationConfig

    sample = dcfg.temperature > 0
    gcfg = GenerationConfig(max_new_tokens=dcfg.max_new_tokens, do_sample=sample,
                            temperature=dcfg.temperature if sample else None,
                            top_p=dcfg.top_p if sample else None, top_k=0 if sample else None,
                            eos_token_id=sorted(eos), pad_token_id=pad)
    device = next(model.parameters()).device

    def run(ids: list[int], gen: torch.Generator):
        x = torch.tensor([ids], device=device)  # (1, P)
        if sample:  # generate draws from the global generator: seed it from ours
            torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=gen, device=gen.device)))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gcfg)
        dt = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), dt, 0, 0, {}

    return run


def answer(method: Method, name: str, q: Question, tokenizer, temperature: float, tree_nodes: int | None,
           gen: torch.Generator) -> Answer:
    """All turns of ``q``; each answer is kept in the context of the next turn."""
    turns: list[tuple[str, str]] = []
    new = steps = acc = 0
    total = 0.0
    prof: dict[str, float] = {}
    for text in q.turns:
        turns.append(("user", text))
        toks, dt, s, a, p = method(encode_chat(tokenizer, turns), gen)
        turns.append(("assistant", tokenizer.decode(toks, skip_special_tokens=True)))
        new, total, steps, acc = new + len(toks), total + dt, steps + s, acc + a
        for k, v in p.items():
            prof[k] = prof.get(k, 0.0) + v
    return Answer(q.question_id, q.subtask, name, temperature, tree_nodes, new, total, steps, acc, prof)


def progress_path(out: str | Path) -> Path:
    """Where a benchmark writing ``out`` keeps its finished work until it is done (one writer: the process holding
    ``out``'s lock, ``elsi bench --out`` or ``elsi study``; ``elsi.io.lock``)."""
    out = Path(out)
    return out.with_name(out.name + ".progress")


def draft_digest(draft: str) -> str | None:
    """SHA-256 of a draft directory's weights (its top-level ``*.safetensors``: names and their SHA-256); None for
    no directory."""
    path = Path(draft) if draft else None
    if path is None or not path.is_dir():
        return None
    files = sorted(path.glob("*.safetensors"))
    return hashlib.sha256("".join(f"{f.name}:{file_sha256(f)};" for f in files).encode()).hexdigest()


class AnswerProgress(ProgressFile):
    """The finished questions of one ``run_bench`` (``ProgressFile``): an interrupted benchmark resumes at the
    question it was on, with the answers already given kept. Every question draws from its own generator (seed +
    question id), so the resumed answers are those of an uninterrupted run. The file is taken up only for the same
    settings, the same draft weights and the same kind of machine (``timing_key``: timings of another machine would
    mix into the speed-ups)."""

    def __init__(self, path: str | Path | None, cfg: BenchConfig) -> None:
        key = {} if path is None else {  # nothing hashed or probed when nothing is kept
            "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "out"},
            "draft_sha256": draft_digest(cfg.draft), "timing": timing_key(machine_info())}
        super().__init__(path, key, names={"draft_sha256": "draft weights", "timing": "kind of machine"})

    @staticmethod
    def part(temperature: float, question_id: int) -> str:
        return f"{temperature}:{question_id}"

    def restore(self, temperature: float, question_id: int) -> list[Answer] | None:
        """A finished question's answers (every method's), or None."""
        rec = self.get(self.part(temperature, question_id))
        return None if rec is None else [Answer(**a) for a in rec]

    def save(self, temperature: float, question_id: int, answers: list[Answer]) -> None:
        self.put(self.part(temperature, question_id), [dataclasses.asdict(a) for a in answers])


def run_bench(target, drafter: Drafter | None, cfg: BenchConfig,
              on_answer: Callable[[Answer, int, int, bool], None] | None = None,
              progress: str | Path | None = None) -> dict:
    """Every method on every question at every temperature -> the results dict (see ``summarize``).

    Methods: transformers ``generate`` (``cfg.hf_generate``), plain decoding (``cfg.plain``) and,
    with a drafter, speculative decoding at each tree size. ``on_answer(answer, done, total, kept)`` after each
    question, ``kept`` where it came back from ``progress`` rather than being answered now. ``progress``
    (``progress_path``): a file that keeps the finished questions across an interruption (``AnswerProgress``); the
    caller removes it once the results are written.
    """
    if drafter is None and not (cfg.hf_generate or cfg.plain):
        raise ValueError("run_bench: no drafter and neither hf_generate nor plain: nothing to run")
    questions = load_questions(cfg.subtasks, cfg.questions_per_subtask)
    runner = TargetRunner.from_target(target)
    eos = stop_tokens(target.model, target.tokenizer)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else min(eos)
    answers: list[Answer] = []
    total = len(cfg.temperature) * len(questions)
    done = 0
    kept = AnswerProgress(progress, cfg)
    for temp in cfg.temperature:
        dcfg = DecodeConfig(cfg.max_new_tokens, temp, cfg.top_p)
        methods: list[tuple[str, int | None, Method]] = []
        if cfg.hf_generate:
            methods.append(("hf_generate", None, hf_method(target.model, dcfg, eos, pad)))
        if cfg.plain:
            methods.append(("plain", None, engine_method(runner, dcfg, eos)))
        if drafter is not None:
            for n in cfg.tree_nodes:
                tree = TreeConfig(n, cfg.depth, cfg.top_k)
                methods.append(("spec", n, engine_method(runner, dcfg, eos, drafter, tree)))
        to_answer = any(kept.get(kept.part(temp, q.question_id)) is None for q in questions)
        warm = DecodeConfig(min(16, cfg.max_new_tokens), temp, cfg.top_p)
        for _ in range(cfg.warmup if to_answer else 0):  # nothing to warm up for when every question is kept
            for name, n, _m in methods:
                m = (hf_method(target.model, warm, eos, pad) if name == "hf_generate" else
                     engine_method(runner, warm, eos, drafter if name == "spec" else None,
                                   TreeConfig(n, cfg.depth, cfg.top_k) if n else None))
                answer(m, name, questions[0], target.tokenizer, temp, n,
                       torch.Generator(device=runner.device).manual_seed(cfg.seed))
        for q in questions:
            mine = kept.restore(temp, q.question_id)
            restored = mine is not None
            if not restored:
                mine = []
                for name, n, m in methods:
                    gen = torch.Generator(device=runner.device).manual_seed(cfg.seed + q.question_id)
                    mine.append(answer(m, name, q, target.tokenizer, temp, n, gen))
                kept.save(temp, q.question_id, mine)
            answers.extend(mine)
            a = mine[-1]
            done += 1
            if on_answer is not None:
                on_answer(a, done, total, restored)
    return summarize(answers, cfg)


def _stats(group: list[Answer], base: dict[tuple, Answer], hf: dict[tuple, Answer]) -> dict:
    """Metrics of one method over a group of answers (one subtask or all)."""
    steps = sum(a.steps for a in group)
    key = lambda a: (a.question_id, a.temperature)  # noqa: E731
    vs_plain = [a.tokens_per_s / base[key(a)].tokens_per_s for a in group
                if key(a) in base and base[key(a)].tokens_per_s > 0]
    vs_hf = [a.tokens_per_s / hf[key(a)].tokens_per_s for a in group if key(a) in hf and hf[key(a)].tokens_per_s > 0]
    prof_steps = {}
    if steps:
        for k in sorted({k for a in group for k in a.profile}):
            prof_steps[k] = 1000 * sum(a.profile.get(k, 0.0) for a in group) / steps
    return {
        "questions": len(group),
        "new_tokens": sum(a.new_tokens for a in group),
        "time_s": sum(a.time_s for a in group),
        "tokens_per_s": mean([a.tokens_per_s for a in group]),
        "tau": sum(a.accepted for a in group) / steps if steps else None,
        "steps": steps,
        "speedup_vs_plain": mean(vs_plain),
        "speedup_vs_hf": mean(vs_hf),
        "ms_per_step": prof_steps,
    }


def summarize(answers: list[Answer], cfg: BenchConfig) -> dict:
    """Per (temperature, method, tree size): overall and per-subtask metrics, plus every answer."""
    base = {(a.question_id, a.temperature): a for a in answers if a.method == "plain"}
    hf = {(a.question_id, a.temperature): a for a in answers if a.method == "hf_generate"}
    runs = []
    for key in dict.fromkeys((a.temperature, a.method, a.tree_nodes) for a in answers):
        group = [a for a in answers if (a.temperature, a.method, a.tree_nodes) == key]
        subs = {s: _stats([a for a in group if a.subtask == s], base, hf)
                for s in dict.fromkeys(a.subtask for a in group)}
        runs.append({"temperature": key[0], "method": key[1], "tree_nodes": key[2],
                     "overall": _stats(group, base, hf), "subtasks": subs})
    return {"settings": dataclasses.asdict(cfg), "runs": runs,
            "answers": [dataclasses.asdict(a) for a in answers]}


def summary_rows(results: dict) -> tuple[list[str], list[list]]:
    """A table of the runs: header and rows (tokens/s, tau, speed-ups; tau per subtask)."""
    subtasks = list(dict.fromkeys(s for r in results["runs"] for s in r["subtasks"]))
    header = ["T", "method", "nodes", "tok/s", "tau", "vs plain", "vs HF"] + [f"tau {s}" for s in subtasks]
    f = lambda x, p=2: num(x, p, missing="-")  # noqa: E731
    rows = []
    for r in results["runs"]:
        o = r["overall"]
        rows.append([f(r["temperature"], 1), r["method"], r["tree_nodes"] or "-", f(o["tokens_per_s"], 1),
                     f(o["tau"]) if r["method"].startswith("spec") else "-", f(o["speedup_vs_plain"]),
                     f(o["speedup_vs_hf"])]
                    + [f(r["subtasks"].get(s, {}).get("tau")) if r["method"].startswith("spec") else "-"
                       for s in subtasks])
    return header, rows
