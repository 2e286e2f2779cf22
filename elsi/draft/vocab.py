"""Draft vocabulary: the most frequent target tokens, with EAGLE3's ``d2t``/``t2d`` maps.

``d2t`` (V_draft,) int64: target id = draft id + d2t[draft id] (draft ids are the chosen
target ids in increasing order). ``t2d`` (V_target,) bool: whether a target id is in the
draft vocabulary. A target id t inside it has draft id ``t2d[:t].sum()``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def token_counts(sequences: Iterable[torch.Tensor | list[int]], vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id over ``sequences`` -> (V_target,) int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).flatten()  # (T,)
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token id out of range 0..{vocab_size - 1}: min {int(ids.min())}, max {int(ids.max())}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def top_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids of ``counts`` (V_target,), ties to the lower id, sorted -> (size,)."""
    v = counts.numel()
    if not 1 <= size <= v:
        raise ValueError(f"draft vocabulary size must be in 1..{v}, got {size}")
    # A stable sort on -count keeps ties in id order.
    order = torch.sort(-counts.to(torch.long), stable=True).indices  # (V_target,)
    return torch.sort(order[:size]).values  # (size,)


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids of the draft vocabulary (V_draft,) -> (d2t (V_draft,) int64, t2d (V_target,) bool)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    ids_sorted = torch.sort(ids).values
    if ids.numel() == 0 or ids_sorted[0] < 0 or ids_sorted[-1] >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be non-empty and in 0..{vocab_size - 1}")
    if torch.unique(ids_sorted).numel() != ids.numel():
        raise ValueError("draft vocabulary ids repeat a token")
    d2t = ids_sorted - torch.arange(ids_sorted.numel())  # (V_draft,)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids_sorted] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft ids (any shape) -> target ids."""
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Target ids (any shape) -> draft ids; -1 where the token is outside the draft vocabulary."""
    index = torch.cumsum(t2d.to(torch.long), 0) - 1  # (V_target,): draft id of each in-vocab target id
    out = index[target_ids]
    return torch.where(t2d[target_ids], out, torch.full_like(out, -1))


def build_vocab(sequences: Iterable[torch.Tensor | list[int]], vocab_size: int, size: int):
    """(ids (V_draft,), d2t, t2d, counts) for the ``size`` most frequent tokens of ``sequences``."""
    counts = token_counts(sequences, vocab_size)
    ids = top_tokens(counts, min(size, vocab_size))
    d2t, t2d = vocab_maps(ids, vocab_size)
    return ids, d2t, t2d, counts
