"""Exact τ at temperature 0 on Spec-Bench, from the target's cached greedy answers (no decoding loop).

For every answer turn: one target forward over prompt + answer gives the states at the draft's
layers (kept on disk at every layer once per model, ``elsi.specbench.states``, so later drafts of the
model skip it); ``elsi.decode.replay.replay_answer`` gives the
accepted length the engine would have at every root position, for each tree shape. Reported as
live decoding counts it (walk each answer from its first token, jumping by each step's accepted
length: the steps decoding takes), pooled per subtask and over all with Spec-Bench's rule (accepted
tokens over steps), per question, and as a second statistic the mean accepted length over every
root position ("all positions", which does not depend on where earlier steps ended).

``greedy_flips`` counts answer positions where the one-pass forward's argmax differs from the
cached answer's next token: near ties that the batched generation rounded the other way. Live
decoding would follow the other branch there; at zero every number here is what the engine gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from elsi.config import like, opt
from elsi.decode.replay import check_tree, replay_answer
from elsi.decode.tree import TreeConfig
from elsi.specbench.answers import answers_digest
from elsi.specbench.states import AnswerStates
from elsi.text import num


@dataclass(frozen=True)
class ExactConfig:
    """The exact τ at temperature 0 (no decoding loop) and the tree shapes it is computed for."""

    exact: bool = opt(True, "the exact τ at temperature 0 of lossless tree decoding, from the target's cached "
                            "greedy answers without a decoding loop, for each --tree-nodes")
    tree_nodes: list[int] = like(TreeConfig, "tree_nodes", default=[1, 30, 60],
                                 help_suffix=" (one exact τ per size; 1 = one drafted token)")
    tree_depth: int = like(TreeConfig, "depth")
    top_k: int = like(TreeConfig, "top_k")
    keep_states: bool = opt(True, "keep the target's states at every layer over the answers on disk "
                                  "($ELSI_CACHE/spec_bench_states; its size: docs/decoding.md), "
                                  "so that every later draft of the model, any layer set, skips the target's forward")

    def __post_init__(self) -> None:
        if not self.tree_nodes:
            raise ValueError("--tree-nodes is empty: give at least one tree size")
        self.trees()  # validates

    def trees(self) -> list[TreeConfig]:
        return [TreeConfig(n, self.tree_depth, self.top_k) for n in self.tree_nodes]


def check_answers_fit(draft, answers: list[dict]) -> None:
    """ValueError when an answer holds a token beyond the draft's target vocabulary (answers of another model)."""
    n_vocab = int(draft.t2d.numel())
    top = max((max(a["prompt"] + a["answer"]) for a in answers if a["answer"]), default=-1)
    if top >= n_vocab:
        raise ValueError(f"an answer holds token id {top}, beyond the draft's target vocabulary of {n_vocab}: "
                         "the answers were made by another model than the draft's target")


@torch.inference_mode()
def exact_tau(target, draft, answers: list[dict], trees: Sequence[TreeConfig], max_new_tokens: int,
              on_progress: Callable[[int, int], None] | None = None, states: AnswerStates | None = None) -> dict:
    """τ at temperature 0 of ``draft`` on ``answers`` (``elsi.specbench.answers.greedy_answers``) for each
    tree shape -> {"trees": [per shape: {"tree", "overall", "subtasks", "questions"}], "greedy_flips",
    "answer_tokens", "answer_turns", "answers_digest" (``answers_digest``), "target_forwards", "seconds"}.

    ``max_new_tokens``: the per-turn limit the answers were made with (it caps the last steps' trees).
    ``states``: where the target's states come from (default: ``AnswerStates(target)``, the disk cache,
    filled where it misses); ``target_forwards`` counts the turns the target had to run.
    """
    trees = [check_tree(t) for t in trees]
    if not trees:
        raise ValueError("no tree shape to evaluate")
    if not answers:
        raise ValueError("no answers to evaluate on")
    check_answers_fit(draft, answers)
    draft.eval()
    states = states if states is not None else AnswerStates(target)
    t0 = time.perf_counter()
    layers = list(draft.layer_ids)
    # per shape, per question id: [steps, accepted in those steps, sum over all roots, roots]
    counts = [dict() for _ in trees]
    subtask_of: dict[int, str] = {}
    flips = tokens = 0
    for n, a in enumerate(answers):
        qid = int(a["question_id"])
        subtask_of[qid] = a["subtask"]
        seq = list(a["prompt"]) + list(a["answer"])
        P = len(a["prompt"])
        if len(a["answer"]) >= 1:
            flipped, feats = states.states(seq, P, layers)  # (L, m·d)
            flips += flipped
            tokens += len(a["answer"])
            reps = replay_answer(draft, feats, seq, P, trees, max_new_tokens)
        else:
            reps = []
        for c, rep in zip(counts, reps):
            steps = rep.walk()
            row = c.setdefault(qid, [0, 0, 0, 0])
            row[0] += len(steps)
            row[1] += sum(steps)
            row[2] += sum(rep.accepted)
            row[3] += len(rep.accepted)
        if on_progress:
            on_progress(n + 1, len(answers))
    out = []
    for t, c in zip(trees, counts):
        per_q = [{"question_id": q, "subtask": subtask_of[q], "steps": r[0], "accepted": r[1],
                  "positions": r[3], "accepted_all_positions": r[2]} for q, r in sorted(c.items())]
        subs = {s: _pool([p for p in per_q if p["subtask"] == s]) for s in dict.fromkeys(subtask_of.values())}
        out.append({"tree": {"tree_nodes": t.tree_nodes, "depth": t.depth, "top_k": t.top_k},
                    "overall": _pool(per_q), "subtasks": subs, "questions": per_q})
    return {"trees": out, "greedy_flips": flips, "answer_tokens": tokens, "answer_turns": len(answers),
            "answers_digest": answers_digest(answers), "target_forwards": states.computed,
            "seconds": time.perf_counter() - t0}


def _pool(rows: list[dict]) -> dict:
    """Spec-Bench's pooling: accepted tokens over steps; the all-positions mean likewise pooled."""
    steps = sum(r["steps"] for r in rows)
    pos = sum(r["positions"] for r in rows)
    return {"questions": len(rows), "steps": steps, "accepted": sum(r["accepted"] for r in rows),
            "tau": sum(r["accepted"] for r in rows) / steps if steps else None,
            "positions": pos,
            "tau_all_positions": sum(r["accepted_all_positions"] for r in rows) / pos if pos else None}



def exact_rows(res: dict) -> tuple[list[str], list[list]]:
    """``exact_tau``'s result as a table: per tree shape, τ pooled and per subtask, and the all-positions mean."""
    subs = list(dict.fromkeys(s for t in res["trees"] for s in t["subtasks"]))
    header = ["nodes", "depth", "top-k", "τ", "τ all positions", "steps"] + [f"τ {s}" for s in subs]
    f = lambda x: num(x, 3, missing="-")  # noqa: E731
    rows = [[t["tree"]["tree_nodes"], t["tree"]["depth"], t["tree"]["top_k"], f(t["overall"]["tau"]),
             f(t["overall"]["tau_all_positions"]), t["overall"]["steps"]]
            + [f(t["subtasks"].get(s, {}).get("tau")) for s in subs] for t in res["trees"]]
    return header, rows
