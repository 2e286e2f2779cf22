"""Transitions and compartments from the CKA of adjacent layers (docs/design.md, "Statistics").

T_l = 1 - CKA(l, l+1) for l = 0..N-1: how much the representation changes from h_l to
h_{l+1}. Boundaries are the peaks of T (scipy.signal.find_peaks) with a prominence of
at least ``prominence`` times the range of T; T is padded at both ends with its minimum
so that the first and the last layer can be boundaries. A boundary at l splits l from
l+1; compartments are the runs of ids 0..N between boundaries.
"""

from __future__ import annotations

import numpy as np
from scipy.signal import find_peaks


def transition_scores(cka: np.ndarray) -> np.ndarray:
    """cka: (N+1, N+1) -> T: (N,) with T[l] = 1 - CKA(l, l+1)."""
    idx = np.arange(cka.shape[0] - 1)
    return 1.0 - cka[idx, idx + 1]


def find_boundaries(t: np.ndarray, prominence: float = 0.1) -> list[int]:
    """Ids l at which T peaks (boundaries between l and l+1)."""
    if not 0.0 <= prominence <= 1.0:
        raise ValueError(f"prominence must be in [0, 1], got {prominence}")
    t = np.asarray(t, dtype=np.float64)
    span = float(np.nanmax(t) - np.nanmin(t)) if t.size else 0.0
    if t.size == 0 or span == 0.0:
        return []
    padded = np.concatenate([[np.nanmin(t)], t, [np.nanmin(t)]])
    peaks, _ = find_peaks(padded, prominence=prominence * span)
    return [int(p - 1) for p in peaks]


def compartments(boundaries: list[int], num_ids: int) -> list[list[int]]:
    """Runs of ids 0..num_ids-1 split after each boundary: [[first, last], ...]."""
    out, start = [], 0
    for b in sorted(boundaries):
        if b + 1 > num_ids - 1:
            break
        out.append([start, b])
        start = b + 1
    out.append([start, num_ids - 1])
    return out
