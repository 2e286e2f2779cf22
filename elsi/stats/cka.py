"""Linear CKA from Gram matrices, minibatch estimator (docs/design.md, "Statistics").

CKA(K, L) = sum_b HSIC(K_b, L_b) / sqrt(sum_b HSIC(K_b, K_b) * sum_b HSIC(L_b, L_b)).

Both HSIC estimators are bilinear in (K, L), so the matrix
``hsic[l, m] = sum_b HSIC(K_{b,l}, K_{b,m})`` over single layers gives the CKA of any
two layer *sets* (whose kernel is the sum of the layers' kernels) by summing entries:
CKA(S, T) = sum_{S x T} hsic / sqrt(sum_{S x S} hsic * sum_{T x T} hsic).

- biased HSIC:   tr(K H L H) / (n - 1)^2, H the centring matrix;
- unbiased HSIC (Song et al. 2012), K~ and L~ with zeroed diagonals:
  [tr(K~ L~) + 1'K~1 * 1'L~1 / ((n-1)(n-2)) - 2/(n-2) * 1'K~L~1] / (n (n-3)).
"""

from __future__ import annotations

import torch

CKA_ESTIMATORS = ("debiased", "biased")


def hsic_matrix(kernels: torch.Tensor, estimator: str = "debiased") -> torch.Tensor:
    """Pairwise HSIC summed over blocks.

    kernels: (nb, L, n, n) symmetric kernels of L layers on nb blocks.
    Returns (L, L) float64 with entry [l, m] = sum_b HSIC(K_{b,l}, K_{b,m}).
    """
    if estimator not in CKA_ESTIMATORS:
        raise ValueError(f"cka must be one of {CKA_ESTIMATORS}, got {estimator!r}")
    nb, num_l, n, _ = kernels.shape
    k = kernels.double()
    if estimator == "biased":
        kc = k - k.mean(-1, keepdim=True)  # K H
        kc = kc - kc.mean(-2, keepdim=True)  # H K H
        flat = kc.reshape(nb, num_l, n * n).transpose(0, 1).reshape(num_l, -1)  # (L, nb*n*n)
        return flat @ flat.T / (n - 1) ** 2
    if n < 4:
        raise ValueError(f"the debiased HSIC needs blocks of at least 4 tokens, got {n}")
    kt = k * (1 - torch.eye(n, dtype=k.dtype))  # (nb, L, n, n) zero diagonal
    flat = kt.reshape(nb, num_l, n * n).transpose(0, 1).reshape(num_l, -1)  # (L, nb*n*n)
    term_tr = flat @ flat.T  # sum_b tr(K~ L~) (symmetric kernels)
    rows = kt.sum(-1)  # (nb, L, n) row sums K~1
    tot = rows.sum(-1)  # (nb, L) 1'K~1
    term_sum = tot.T @ tot / ((n - 1) * (n - 2))  # sum_b 1'K~1 1'L~1 / ((n-1)(n-2))
    r = rows.transpose(0, 1).reshape(num_l, -1)  # (L, nb*n)
    term_rows = 2.0 / (n - 2) * (r @ r.T)  # sum_b 2/(n-2) (K~1).(L~1)
    return (term_tr + term_sum - term_rows) / (n * (n - 3))


def cka_from_hsic(hsic: torch.Tensor, set_a: list[int] | tuple[int, ...], set_b: list[int] | tuple[int, ...]) -> float:
    """CKA of two layer sets (indices into ``hsic``)."""
    a = torch.as_tensor(list(set_a))
    b = torch.as_tensor(list(set_b))
    num = hsic[a][:, b].sum()
    den = torch.sqrt(hsic[a][:, a].sum() * hsic[b][:, b].sum())
    return float(num / den) if den > 0 else float("nan")


def cka_matrix(hsic: torch.Tensor) -> torch.Tensor:
    """(L, L) CKA between single layers from their HSIC matrix."""
    d = torch.sqrt(torch.diagonal(hsic).clamp_min(0))
    return hsic / torch.outer(d, d).clamp_min(1e-300)


def linear_cka(x: torch.Tensor, y: torch.Tensor, estimator: str = "debiased") -> float:
    """CKA of two representations x: (n, d1), y: (n, d2) as one block."""
    kx = (x.double() @ x.double().T)[None, None]
    ky = (y.double() @ y.double().T)[None, None]
    return cka_from_hsic(hsic_matrix(torch.cat([kx, ky], 1), estimator), [0], [1])
