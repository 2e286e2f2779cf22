"""Offline draft evaluation: held-out figures on the feature cache (``evaluate_store``, during and after
training) and teacher-forced figures on Spec-Bench (``evaluate_draft``, ``elsi eval-draft``); both score
batches with ``elsi.draft.loss.Tally``.

Spec-Bench, step by step:
Step 1: the target's greedy answers to each question (every turn), cached per target and settings
(``elsi.specbench.answers``; the CLI reads them and passes them in).
Step 2: one target forward over prompt + answer gives the features at the draft's layers.
Step 3: the draft is unrolled ``depth`` steps teacher-forced on that answer; at depth j a
position counts when the token j ahead is an answer token. Reported per subtask and pooled:
top-1 match with the target's greedy token per depth, and the expected acceptance length of
a chain of ``depth`` drafts (accepted drafts + the target's own token), both as measured
(leading run of matches) and as the product formula 1 + Σ_k Π_{j<=k} p_j.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from elsi.config import at_least, opt
from elsi.data.spec_bench import SUBTASKS
from elsi.draft.cache import FeatureStore
from elsi.draft.checkpoint import TRAINING
from elsi.draft.forward import target_features
from elsi.draft.loss import LabelHead, Tally, make_batch, scored
from elsi.draft.model import Eagle3Draft
from elsi.models.load import Target


@dataclass(frozen=True)
class EvalConfig:
    """Offline evaluation of a trained draft on Spec-Bench."""

    draft: str = opt(help="draft directory written by `elsi train-draft`")
    model: str = opt("smollm2-135m", "target model: alias, HF directory, .gguf file or hub id")
    subtasks: str = opt("all", f"comma-separated Spec-Bench subtasks or 'all' ({', '.join(SUBTASKS)})")
    questions: int = opt(10, "questions per subtask (80: all of Spec-Bench)")
    max_new: int = opt(128, "most tokens the target writes per answer (per turn)")
    depth: int = opt(0, "unroll depth of the teacher-forced match rates (0 = the draft's training ttt)")
    gen_batch: int = opt(16, "questions answered together")
    answers: str = opt("", "the target's answers file (default: the cache entry of these settings under "
                           "$ELSI_CACHE/spec_bench_answers, made when missing)")
    out: str = opt("", "also write the results JSON here")
    json: bool = opt(False, "print JSON")

    def __post_init__(self) -> None:
        at_least(self, questions=1, depth=0, max_new=1, gen_batch=1)


def subtask_list(spec: str) -> list[str]:
    return list(SUBTASKS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]


@torch.no_grad()
def evaluate_store(draft: Eagle3Draft, target: Target, store: FeatureStore, indices: Sequence[int],
                   vocab_ids: torch.Tensor, steps: int, batch_size: int, device: torch.device,
                   loss_on: str = "reply") -> dict:
    """Held-out figures on ``indices`` of the feature cache: loss and top-1 match with the target's greedy token
    per depth, over the positions ``loss_on`` names ('reply' or 'all'), in float32 (as the engine drafts)."""
    layer_pos = store.layer_index(draft.layer_ids)
    tally = Tally(steps)
    was = draft.training
    draft.eval()
    label_head = LabelHead.build(target, vocab_ids, device)
    for a in range(0, len(indices), batch_size):
        samples = [store.sample(i, layer_pos) for i in indices[a: a + batch_size]]
        tally.score(draft, make_batch(target, samples, vocab_ids, draft.t2d, device, label_head=label_head,
                                      score=scored(samples, loss_on)))
    draft.train(was)
    return tally.summary()


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
    tallies: list[Tally] = []
    for sub in dict.fromkeys(a["subtask"] for a in answers):
        rows = [a for a in answers if a["subtask"] == sub and len(a["answer"]) > 0]
        tally = Tally(depth)
        for k in range(0, len(rows), batch_size):
            part = rows[k: k + batch_size]
            seqs = [a["prompt"] + a["answer"] for a in part]
            if max(max(s) for s in seqs) >= n_vocab:
                raise ValueError(f"token id beyond the draft's target vocabulary ({n_vocab})")
            samples, score = _answer_samples(target, draft, part, seqs)
            tally.score(draft, make_batch(target, samples, vocab_ids, draft.t2d, device, score=score,
                                          label_head=label_head))
        per[sub] = {**tally.summary(), "sequences": len(rows), "answer_tokens": sum(len(a["answer"]) for a in rows)}
        tallies.append(tally)
    pooled = Tally.pooled(tallies, depth)
    if pooled.agg[0]["scored"] == 0:
        raise ValueError(f"no answer token to score: the target's answers to the {len(answers)} question turns are "
                         "empty; raise --max-new or check the questions")
    return {"depth": depth, "subtasks": per, "all": pooled.summary()}


def _answer_samples(target: Target, draft: Eagle3Draft, part: list[dict],
                    seqs: list[list[int]]) -> tuple[list[dict], list[torch.Tensor]]:
    """Step 2: feature samples (``make_batch``'s input) of prompt + answer ``seqs``, and their scored positions."""
    samples, score = [], []
    for a, seq, (am, fin, st) in zip(part, seqs, target_features(target, seqs, draft.layer_ids)):
        samples.append({"ids": torch.tensor(seq), "argmax": am, "final": fin, "aux": st.flatten(1)})
        # (T,): the target's prediction at position p counts when token p+1 is an answer token.
        m = torch.zeros(len(seq), dtype=torch.bool)
        m[len(a["prompt"]) - 1: len(seq) - 1] = True
        score.append(m)
    return samples, score


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
