"""From one forward pass to per-block Gram matrices (docs/design.md, "Statistics").

Step 1  token entropy H_t of the target's next-token distribution (natural log);
Step 2  token-entropy filter: drop the floor(rho * n) lowest-entropy positions;
Step 3  blocks of ``block`` consecutive kept positions (the remainder is dropped);
Step 4  per block and layer: centre rows, L2-normalise rows (``center-l2``) or keep raw;
Step 5  G[b, l] = Z Z^T, stored packed (upper triangle) in float32.
"""

from __future__ import annotations

import functools
import math

import torch

NORMALIZE = ("center-l2", "none")


def token_entropy(logits: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) per row. logits: (T, V) -> (T,) float32.

    Small chunks keep the working set in cache (256-row chunks cost ~15% of a forward,
    32-row ones ~5%). One exp pass per chunk: with m = max x, e = exp(x - m), s = sum e:
    H = log Z - E_p[x] = m + log s - (e . x) / s.
    """
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for s in range(0, logits.shape[0], chunk):
        x = logits[s : s + chunk].float()  # (c, V)
        m = x.amax(dim=-1, keepdim=True)  # (c, 1)
        e = torch.exp(x - m)  # (c, V)
        tot = e.sum(-1)  # (c,)
        out[s : s + chunk] = m.squeeze(-1) + torch.log(tot) - (e * x).sum(-1) / tot
    return out


def filter_positions(entropy: torch.Tensor, rho: float) -> torch.Tensor:
    """Positions kept by the token-entropy filter, in order.

    ``entropy``: (T,) with entropy[0] belonging to position 0 (BOS), which is never used.
    Of the n = T - 1 usable positions, the floor(rho * n) with the lowest entropy are
    dropped, ties broken by position (earlier dropped first). Returns (n - floor(rho*n),)
    int64 positions in increasing order.
    """
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"rho must be in [0, 1), got {rho}")
    usable = entropy[1:].double().cpu()  # (n,)
    n = usable.numel()
    drop = math.floor(rho * n)
    order = torch.sort(usable, stable=True).indices  # ascending entropy, ties by position
    keep = torch.ones(n, dtype=torch.bool)
    keep[order[:drop]] = False
    return torch.nonzero(keep).squeeze(-1) + 1  # back to positions in the sequence


def kept_count(num_tokens: int, rho: float) -> int:
    """How many positions the filter keeps in a sample of ``num_tokens`` tokens."""
    n = max(num_tokens - 1, 0)
    return n - math.floor(rho * n)


def blocks_of(positions: torch.Tensor, block: int) -> torch.Tensor:
    """Non-overlapping blocks of consecutive kept positions: (nb, block); remainder dropped."""
    nb = positions.numel() // block
    return positions[: nb * block].reshape(nb, block)


def normalize_blocks(z: torch.Tensor, mode: str) -> torch.Tensor:
    """z: (..., B, d) -> same shape and dtype, per block: centre rows then L2-normalise rows."""
    if mode == "none":
        return z
    if mode != "center-l2":
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {mode!r}")
    z = z - z.mean(dim=-2, keepdim=True)  # subtract the block's mean row
    norm = z.norm(dim=-1, keepdim=True)  # (..., B, 1)
    return z / norm.clamp_min(1e-12)


def triu_index(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of the packed upper triangle of a block×block matrix."""
    return tuple(torch.triu_indices(block, block))  # type: ignore[return-value]


def pack(g: torch.Tensor) -> torch.Tensor:
    """(..., B, B) symmetric -> (..., B(B+1)/2) upper triangle."""
    i, j = triu_index(g.shape[-1])
    return g[..., i, j]


@functools.lru_cache(maxsize=8)
def _unpack_index(block: int) -> torch.Tensor:
    """(B*B,) position in the packed upper triangle of each entry (i, j) of a B×B matrix."""
    i, j = triu_index(block)
    where = torch.empty(block, block, dtype=torch.int64)
    where[i, j] = torch.arange(i.numel())
    where[j, i] = torch.arange(i.numel())
    return where.reshape(-1)


def unpack(p: torch.Tensor, block: int) -> torch.Tensor:
    """(..., B(B+1)/2) -> (..., B, B) symmetric (one gather)."""
    idx = _unpack_index(block).to(p.device)
    return p.index_select(-1, idx).reshape(*p.shape[:-1], block, block)


def diag_index(block: int) -> torch.Tensor:
    """Positions of the diagonal inside the packed upper triangle."""
    i, j = triu_index(block)
    return torch.nonzero(i == j).squeeze(-1)


def block_grams(hidden: list[torch.Tensor], blocks: torch.Tensor, normalize: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gram matrices and the normalised block sums of one sample.

    hidden: the L = N + 1 hidden states of the sample, each (T, d) (on any device; the
            Gram is formed there and only the packed B×B result moves to the host).
    blocks: (nb, B) positions.
    Returns ``grams`` (nb, L, P) float32 packed (P = B(B+1)/2) and ``block_sum``
    (L, B, d) float64, the sum over this sample's blocks of the normalised states
    (for the ``mean-block`` aggregate).
    """
    nb, bsz = blocks.shape
    d = hidden[0].shape[-1]
    grams = torch.empty(nb, len(hidden), bsz * (bsz + 1) // 2, dtype=torch.float32)  # (nb, L, P)
    sums = torch.zeros(len(hidden), bsz, d, dtype=torch.float64)  # (L, B, d)
    if nb == 0:
        return grams, sums
    for layer, h in enumerate(hidden):
        z = h[blocks.to(h.device).reshape(-1)].reshape(nb, bsz, d).float()  # (nb, B, d)
        z = normalize_blocks(z, normalize)  # float32: G is stored as float32 and used in float64
        grams[:, layer] = pack(z @ z.transpose(-1, -2)).cpu()  # (nb, P)
        sums[layer] = z.sum(0, dtype=torch.float64).cpu()
    return grams, sums
