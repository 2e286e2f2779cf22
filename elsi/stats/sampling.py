"""Statistics over samples of results: means, rank correlation and the question bootstrap.

Used wherever results are compared across drafts, sets or engines (``elsi.study.summary``,
``elsi.engines.vllm``); the definitions they serve are in ``elsi/study/summary.py`` and docs/study.md.

- Spearman's ρ: Pearson's correlation of the average ranks (ties share the mean of their ranks).
- Bootstrap: questions resampled with replacement, each resample given as how often every question
  is drawn (``resample_weights``); a pooled τ per resample (``pooled_tau``); intervals are the 2.5
  and 97.5 percentiles of the finite resample values (``interval``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def mean(xs: Sequence[float]) -> float | None:
    """The mean of ``xs``, or None when it is empty."""
    return sum(xs) / len(xs) if xs else None


def rankdata(x: Sequence[float]) -> np.ndarray:
    """Ranks 1..n of ``x`` (n,); tied values get the average of the ranks they span."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sx = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sx[j + 1] == sx[i]:
            j += 1
        ranks[order[i: j + 1]] = (i + j) / 2 + 1  # positions i..j hold ranks i+1..j+1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's ρ: Pearson's correlation of the average ranks. NaN when x or y is constant."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs two sequences of one length, got {len(x)} and {len(y)}")
    rx, ry = rankdata(x), rankdata(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den > 0 else math.nan


def resample_weights(num_questions: int, resamples: int, seed: int = 0) -> np.ndarray:
    """How often each question is drawn in each bootstrap resample -> (resamples, num_questions) float64."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num_questions, size=(resamples, num_questions))  # (R, Q)
    w = np.zeros((resamples, num_questions))
    np.add.at(w, (np.arange(resamples)[:, None], idx), 1.0)  # (R, Q) counts
    return w


def pooled_tau(w: np.ndarray, acc: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Pooled τ of every resample: w (R, Q) counts, acc and steps (Q,) -> (R,); NaN where a resample has no step."""
    s = w @ steps  # (R,)
    return np.where(s > 0, (w @ acc) / np.where(s > 0, s, 1.0), np.nan)


def interval(values: np.ndarray) -> tuple[float | None, float | None]:
    """2.5 and 97.5 percentiles of the finite values; (None, None) when there are none."""
    v = values[np.isfinite(values)]
    if v.size == 0:
        return None, None
    lo, hi = np.percentile(v, [2.5, 97.5])
    return float(lo), float(hi)


__all__ = ["interval", "mean", "pooled_tau", "rankdata", "resample_weights", "spearman"]
