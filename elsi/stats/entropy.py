"""Matrix entropy of layer sets from the Gram tensor (docs/design.md, "Statistics").

For a set S and block b: K = sum_{l in S} G[b,l] / tr G[b,l]; p = eig(K) / tr K with
negatives clipped to 0; H = -sum p log p (nats). Per-sample value = mean over its
blocks; the statistic = mean over samples, with the standard deviation across samples.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch


def batched_eigvalsh(k: torch.Tensor, workers: int | None = None) -> torch.Tensor:
    """Eigenvalues of a batch of symmetric matrices (..., B, B), split over threads.

    LAPACK releases the GIL, so chunks run in parallel on CPU (~1.8x on 2 cores).
    """
    workers = workers or max(torch.get_num_threads(), 1)
    flat = k.reshape(-1, k.shape[-2], k.shape[-1])
    if k.device.type != "cpu" or workers == 1 or flat.shape[0] < 64:
        return torch.linalg.eigvalsh(flat).reshape(*k.shape[:-1])
    with ThreadPoolExecutor(workers) as ex:
        parts = list(ex.map(torch.linalg.eigvalsh, flat.chunk(workers)))
    return torch.cat(parts).reshape(*k.shape[:-1])


def entropy_of_eigenvalues(ev: torch.Tensor) -> torch.Tensor:
    """ev: (..., B) eigenvalues -> (...,) entropy of p = clip(ev, 0) / sum (nats)."""
    ev = ev.clamp_min(0)
    p = ev / ev.sum(-1, keepdim=True).clamp_min(torch.finfo(ev.dtype).tiny)
    return -(torch.special.xlogy(p, p)).sum(-1)


def kernel_entropy(k: torch.Tensor) -> torch.Tensor:
    """Matrix entropy of each kernel in a batch. k: (..., B, B) -> (...)."""
    return entropy_of_eigenvalues(batched_eigvalsh(k))


@dataclass(frozen=True)
class EntropyStat:
    """Entropy of one layer set, aggregated over blocks and samples."""

    mean: float  # mean over samples of the per-sample mean over blocks (nats)
    std: float  # standard deviation across samples (population, ddof=0)
    normalized: float  # mean / log(B)
    per_sample: tuple[float, ...]


def aggregate_blocks(block_values: torch.Tensor, block_sample: torch.Tensor, num_samples: int, block: int) -> EntropyStat:
    """Per-block values (nb,) -> per-sample means -> mean and std over samples."""
    sums = torch.zeros(num_samples, dtype=torch.float64).index_add_(0, block_sample, block_values.double())
    counts = torch.bincount(block_sample, minlength=num_samples).double()
    has = counts > 0
    per_sample = sums[has] / counts[has]  # (samples with blocks,)
    mean = float(per_sample.mean())
    std = float(per_sample.std(correction=0)) if per_sample.numel() > 1 else 0.0
    return EntropyStat(mean, std, mean / math.log(block), tuple(per_sample.tolist()))
