"""How long the rest of a study takes at this machine's pace, from the records of the work it has finished.

A draft's work is up to three parts (``PARTS``): its training (``training.json``: ``train_seconds``), its live
benchmark (its answers' ``time_s``, summed) and its exact τ (``exact/<draft>.json``: ``seconds``). Each part's pace
is the median of its finished records made on a machine whose timings compare with this one's
(``elsi.runtime.timing_key``; the median, so that one draft slowed by other jobs on the cores, or stopped for a
while, does not set the pace of all); records from elsewhere, or older than their ``machine`` field, are not
counted. The estimate is the parts still to do, each at its pace: the work a part has already done before an
interruption is counted again, and the steps outside the drafts (the features, the baseline, vLLM) are not counted.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

from elsi.runtime import timing_key

PARTS = ("training", "live benchmark", "exact τ")


def record_seconds(part: str, rec: dict | None) -> float | None:
    """The seconds a finished record of ``part`` took (None: no record, or none that says)."""
    if not rec:
        return None
    if part == "training":
        return rec.get("train_seconds") if rec.get("status") == "complete" else None
    if part == "live benchmark":
        answers = rec.get("answers") or []
        return sum(a.get("time_s", 0.0) for a in answers) if answers else None
    if part == "exact τ":
        return rec.get("seconds")
    raise ValueError(f"unknown part of a draft's work: {part!r} (one of {', '.join(PARTS)})")


def paces(done: Mapping[str, Iterable[dict | None]], machine: dict) -> dict[str, tuple[float, int]]:
    """Per part, (median seconds, how many records) over ``done[part]``'s finished records timed on a machine like
    ``machine``; a part without any is left out."""
    key, out = timing_key(machine), {}
    for part, recs in done.items():
        secs = [s for r in recs if r and r.get("machine") and timing_key(r["machine"]) == key
                and (s := record_seconds(part, r)) is not None]
        if secs:
            out[part] = (statistics.median(secs), len(secs))
    return out


def duration(seconds: float) -> str:
    """``seconds`` in words a person reads: "0.4 s", "45 s", "14 min", "9 h 05 min"."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def time_left(left: Mapping[str, int], done: Mapping[str, Iterable[dict | None]], machine: dict,
              where: str = "here") -> str:
    """The rest of the drafts' work in words -> "" when none is left or no part has a pace here yet.

    ``left``: per part, how many drafts still need it (the one under way included); ``done``: per part, the
    records finished so far (``record_seconds``); ``machine``: the one whose pace counts
    (``elsi.runtime.machine_info``), named ``where`` in the text.
    """
    todo = {p: n for p, n in left.items() if n}
    pace = paces(done, machine)
    known = [p for p in PARTS if p in todo and p in pace]
    if not known:
        return ""
    total = sum(todo[p] * pace[p][0] for p in known)
    each = ", ".join(f"{todo[p]} × {p} at ~{duration(pace[p][0])} ({pace[p][1]} timed {where})" for p in known)
    unknown = [p for p in PARTS if p in todo and p not in pace]
    if unknown:
        return (f"at least {duration(total)} of the drafts' work left: {each}; "
                f"{' and '.join(unknown)} not timed {where} yet ({', '.join(str(todo[p]) for p in unknown)} left)")
    return f"about {duration(total)} of the drafts' work left: {each}"
