"""Spec-Bench questions (480, Apache-2.0), shipped in ``elsi/data/spec_bench/``.

See ``spec_bench/SOURCE.md`` for provenance and ``LICENSE-spec-bench`` for the licence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    subtask: str  # one of SUBTASKS
    turns: tuple[str, ...]


def subtask_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def load_questions(subtasks: tuple[str, ...] | list[str] | None = None, per_subtask: int | None = None) -> list[Question]:
    """Questions in file order, optionally filtered to ``subtasks`` and cut to ``per_subtask`` each."""
    wanted = tuple(SUBTASKS if subtasks in (None, "all", ["all"], ("all",)) else subtasks)
    bad = [s for s in wanted if s not in SUBTASKS]
    if bad:
        raise ValueError(f"unknown Spec-Bench subtask(s) {bad}; known: {', '.join(SUBTASKS)}")
    text = resources.files("elsi.data").joinpath("spec_bench", "question.jsonl").read_text(encoding="utf-8")
    taken: dict[str, int] = {}
    out = []
    for line in text.splitlines():
        rec = json.loads(line)
        sub = subtask_of(rec["category"])
        if sub not in wanted or (per_subtask is not None and taken.get(sub, 0) >= per_subtask):
            continue
        taken[sub] = taken.get(sub, 0) + 1
        out.append(Question(int(rec["question_id"]), rec["category"], sub, tuple(rec["turns"])))
    return out
