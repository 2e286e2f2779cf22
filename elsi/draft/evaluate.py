"""Offline draft evaluation on Spec-Bench (``elsi eval-draft``).

Step 1: the target answers each question greedily (every turn; turn k's prompt holds the
earlier turns and the target's own answers); answers are cached per target and settings.
Step 2: one target forward over prompt + answer gives the features at the draft's layers.
Step 3: the draft is unrolled ``depth`` steps teacher-forced on that answer; at depth j a
position counts when the token j ahead is an answer token. Reported per subtask and pooled:
top-1 match with the target's greedy token per depth, and the expected acceptance length of
a chain of ``depth`` drafts (accepted drafts + the target's own token), both as measured
(leading run of matches) and as the product formula 1 + Σ_k Π_{j<=k} p_j.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from elsi.config import opt
from elsi.data.spec_bench import SUBTASKS, load_questions
from elsi.draft.features import target_features
from elsi.draft.model import Eagle3Draft
from elsi.draft.train import TRAINING, LabelHead, chain_runs, make_batch, summarize, ttt_loss
from elsi.models.load import Target, cache_dir


@dataclass(frozen=True)
class EvalConfig:
    """Offline evaluation of a trained draft on Spec-Bench."""

    draft: str = opt(help="draft directory written by `elsi train-draft`")
    model: str = opt("smollm2-135m", "target model: alias, HF directory, .gguf file or hub id")
    subtasks: str = opt("all", f"comma-separated Spec-Bench subtasks or 'all' ({', '.join(SUBTASKS)})")
    questions: int = opt(10, "questions per subtask")
    max_new: int = opt(256, "most tokens the target writes per answer")
    depth: int = opt(0, "unroll depth (0 = the draft's training ttt)")
    gen_batch: int = opt(8, "questions answered together")
    json: bool = opt(False, "print JSON")

    def __post_init__(self) -> None:
        if self.questions < 1:
            raise ValueError(f"questions must be >= 1, got {self.questions}")
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {self.depth}")


def subtask_list(spec: str) -> list[str]:
    return list(SUBTASKS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]


def _prompt_ids(target: Target, messages: list[dict]) -> list[int]:
    tok = target.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    from elsi.models.adapters import plain_template

    return tok(plain_template(messages, True))["input_ids"]


@torch.no_grad()
def greedy_answers(target: Target, cfg: EvalConfig, on_progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Per question turn: {"question_id", "subtask", "turn", "prompt", "answer"} (token ids), cached."""
    qs = load_questions(subtask_list(cfg.subtasks), cfg.questions)
    key = hashlib.sha256(json.dumps([target.source, cfg.subtasks, cfg.questions, cfg.max_new]).encode()).hexdigest()[:12]
    path = cache_dir() / "spec_bench_answers" / f"{key}.json"
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            cached = None  # a damaged cache file: the answers are generated again
        if isinstance(cached, list) and all(isinstance(a, dict) and {"prompt", "answer"} <= a.keys() for a in cached):
            return cached
    tok, model = target.tokenizer, target.model
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    convs = {q.question_id: [] for q in qs}
    out: list[dict] = []
    done = 0
    for turn in range(max(len(q.turns) for q in qs)):
        live = [q for q in qs if turn < len(q.turns)]
        for a in range(0, len(live), cfg.gen_batch):
            part = live[a: a + cfg.gen_batch]
            prompts = []
            for q in part:
                convs[q.question_id].append({"role": "user", "content": q.turns[turn]})
                prompts.append(_prompt_ids(target, convs[q.question_id]))
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)  # (B, W)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new, do_sample=False,
                                 pad_token_id=pad)[:, width:].tolist()  # (B, new)
            for q, p, ans in zip(part, prompts, gen):
                if eos in ans:
                    ans = ans[: ans.index(eos) + 1]  # keep the EOS: the draft should predict it too
                out.append({"question_id": q.question_id, "subtask": q.subtask, "turn": turn, "prompt": p,
                            "answer": ans})
                text = tok.decode([t for t in ans if t != eos], skip_special_tokens=True)
                convs[q.question_id].append({"role": "assistant", "content": text})
            done += len(part)
            if on_progress:
                on_progress(done, sum(len(q.turns) for q in qs))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)  # whole or not at all
    return out


@torch.no_grad()
def evaluate_draft(target: Target, draft: Eagle3Draft, answers: list[dict], depth: int,
                   batch_size: int = 4) -> dict:
    """Teacher-forced match rates per subtask and pooled (see the module docstring)."""
    device = target.device
    n_vocab = draft.t2d.numel()
    vocab_ids = torch.nonzero(draft.t2d).flatten()  # (V_draft,) target ids, increasing = draft id order
    draft.eval()
    label_head = LabelHead.build(target, vocab_ids, device)
    per: dict[str, dict] = {}
    for sub in dict.fromkeys(a["subtask"] for a in answers):
        rows = [a for a in answers if a["subtask"] == sub and len(a["answer"]) > 0]
        agg = [{"loss_sum": 0.0, "correct": 0, "scored": 0, "correct_in_vocab": 0, "in_vocab": 0} for _ in range(depth)]
        runs = torch.zeros(depth + 1, dtype=torch.long)
        for k in range(0, len(rows), batch_size):
            part = rows[k: k + batch_size]
            seqs = [a["prompt"] + a["answer"] for a in part]
            if max(max(s) for s in seqs) >= n_vocab:
                raise ValueError(f"token id beyond the draft's target vocabulary ({n_vocab})")
            feats = target_features(target, seqs, draft.layer_ids)
            samples, score = [], []
            for a, seq, (am, fin, st) in zip(part, seqs, feats):
                samples.append({"ids": torch.tensor(seq), "argmax": am, "final": fin, "aux": st.flatten(1)})
                # (T,): the target's prediction at position p counts when token p+1 is an answer token.
                m = torch.zeros(len(seq), dtype=torch.bool)
                m[len(a["prompt"]) - 1: len(seq) - 1] = True
                score.append(m)
            batch = make_batch(target, samples, vocab_ids, draft.t2d, device, score=score, label_head=label_head)
            _, stats, outs = ttt_loss(draft, batch, depth)
            for s, acc in zip(stats, agg):
                acc["loss_sum"] += s["loss"] * s["in_vocab"]
                for key in ("correct", "scored", "correct_in_vocab", "in_vocab"):
                    acc[key] += s[key]
            runs += chain_runs(draft, batch, outs)
        res = summarize(agg, runs)
        res["sequences"] = len(rows)
        res["answer_tokens"] = sum(len(a["answer"]) for a in rows)
        res["_agg"], res["_runs"] = agg, runs
        per[sub] = res
    pooled_agg = [{k: sum(p["_agg"][j][k] for p in per.values()) for k in per[next(iter(per))]["_agg"][j]}
                  for j in range(depth)]
    if pooled_agg[0]["scored"] == 0:
        raise ValueError(f"no answer token to score: the target's answers to the {len(answers)} question turns are "
                         "empty; raise --max-new or check the questions")
    pooled = summarize(pooled_agg, sum(p["_runs"] for p in per.values()))
    for p in per.values():
        del p["_agg"], p["_runs"]
    return {"depth": depth, "subtasks": per, "all": pooled}


def trained_depth(path: str | Path) -> int:
    """The ``ttt`` a draft directory was trained with (7 when unknown)."""
    rec = Path(path) / TRAINING
    if rec.is_file():
        try:
            return int(json.loads(rec.read_text())["settings"]["train"]["ttt"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{rec} is corrupt ({type(err).__name__}: {err}); pass --depth, or retrain the draft "
                             "with the same `elsi train-draft` command") from err
    return 7
