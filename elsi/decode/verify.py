"""Acceptance of a draft tree: greedy (temperature 0) and lossless sampling (temperature > 0).

Both walk the tree from the root. At each node the target's distribution p for the next
token is compared with the node's children; the walk ends at a node where no child is
accepted, and the target's own token there (the *bonus* token) is appended.

Sampling uses the recursive rejection rule of SpecInfer (Miao et al., 2024) and EAGLE
(Li et al., 2024): try the children in order; accept child x with probability
min(1, p(x) / q_x(x)), where q_x is the distribution x was proposed from; on rejection
set p <- norm(max(p - q_x, 0)) and go on; if every child is rejected, draw the bonus token
from the last p. An EAGLE-2 tree proposes each child deterministically (the draft's top-k),
so q_x is the point mass on x: x is accepted with probability p(x) and rejecting it sets
p(x) to 0 and renormalises. The output is then distributed exactly as p, whatever the draft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from elsi.decode.tree import Tree

# logits_of(node) -> the target's logits (V,) for the token after ``node``'s path.
LogitsFn = Callable[[int], torch.Tensor]


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distribution: softmax(logits / temperature), then nucleus ``top_p``.

    logits (..., V) -> probabilities (..., V) float32. Nucleus: keep the most probable tokens
    until their mass reaches ``top_p`` (the token that crosses it included, at least one kept),
    renormalise; as Hugging Face's ``TopPLogitsWarper`` up to ties.
    """
    if temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    p = torch.softmax(logits.float() / temperature, dim=-1)  # (..., V)
    if top_p >= 1.0:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)  # (..., V)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the strictly more probable tokens
    keep_sorted = before < top_p  # (..., V); the first token always kept (before = 0)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    p = p * keep
    return p / p.sum(dim=-1, keepdim=True)


def choose(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The target's own next token from logits (V,): argmax at temperature 0, else a sample."""
    if temperature <= 0:
        return int(logits.argmax())
    return draw(sampling_probs(logits, temperature, top_p), generator)


def draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from the probabilities p (V,), by inverse CDF: the first token whose cumulative
    mass exceeds u·total, u uniform on [0, 1); a token of zero probability is never drawn.

    The same distribution as ``torch.multinomial(p, 1)``, one draw per step of sampled decoding, at a fraction of
    its CPU cost: 11x less on SmolLM2's 49k vocabulary, 2.9x on Gemma-3's 262k (``bench/sample_draw.py``).
    """
    c = p.double().cumsum(0)  # (V,) float64, so that the running sum keeps each float32 probability
    u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device) * c[-1]
    # the first i with c[i] > u·total: c[i] > c[i - 1], so p[i] > 0
    i = int(torch.searchsorted(c, u.reshape(1), right=True))
    if i >= p.shape[0]:  # u·total rounded up to the total: the last token with mass
        i = int(torch.nonzero(p > 0).max())
    return i


def greedy_walk(tree: Tree, logits_of: LogitsFn) -> tuple[list[int], int]:
    """Temperature 0: follow the child equal to the target's argmax while there is one.

    Returns (path: accepted nodes from the root, root included; bonus token).
    """
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        y = int(logits_of(node).argmax())
        nxt = next((c for c in tree.children[node] if tokens[c] == y), None)
        if nxt is None:
            return path, y
        path.append(nxt)


def rejection_step(p: torch.Tensor, token: int, q: torch.Tensor | None, generator: torch.Generator | None
                   ) -> tuple[bool, torch.Tensor]:
    """One try of the recursive rejection rule for candidate ``token``.

    p (V,): the current target distribution; q (V,): the distribution ``token`` was drawn
    from, or None for a deterministic proposal (point mass). Returns (accepted, p) where p is
    unchanged when accepted and the residual norm(max(p - q, 0)) when rejected.
    """
    u = float(torch.rand((), generator=generator, device=p.device))
    px = float(p[token])
    if q is None:
        rest = 1.0 - px  # mass left after removing the point mass (p sums to 1)
        if u < px or rest <= 0.0:
            return True, p
        p = p.clone()
        p[token] = 0.0
        return False, p / p.sum()
    qx = float(q[token])
    if qx <= 0.0:
        raise ValueError(f"token {token} has probability {qx} under the proposal it was drawn from")
    if u < min(1.0, px / qx):
        return True, p
    resid = (p - q).clamp(min=0.0)
    total = float(resid.sum())
    if total <= 0.0:  # p <= q everywhere means p == q: rejection has probability 0
        return True, p
    return False, resid / total


def sampling_walk(tree: Tree, logits_of: LogitsFn, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> tuple[list[int], int]:
    """Temperature > 0: recursive rejection sampling down the tree (children proposed
    deterministically, see the module docstring). Returns (path from the root, bonus token)."""
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        p = sampling_probs(logits_of(node), temperature, top_p)  # (V,)
        nxt = None
        for c in tree.children[node]:
            accepted, p = rejection_step(p, tokens[c], None, generator)
            if accepted:
                nxt = c
                break
        if nxt is None:
            return path, draw(p, generator)
        path.append(nxt)
