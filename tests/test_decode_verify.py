"""Acceptance rules: greedy walk, nucleus probabilities, and the lossless rejection rule."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from elsi.decode.tree import make_tree
from elsi.decode.verify import choose, draw, greedy_walk, rejection_step, sampling_probs, sampling_walk


def test_sampling_probs_temperature_and_top_p_match_transformers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    for temp, top_p in [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (1.0, 0.01)]:
        ours = sampling_probs(logits, temp, top_p)
        x = TemperatureLogitsWarper(temp)(None, logits.clone())
        if top_p < 1:
            x = TopPLogitsWarper(top_p)(None, x)
        ref = torch.softmax(x, -1)
        assert torch.allclose(ours, ref, atol=1e-6), (temp, top_p)
    with pytest.raises(ValueError, match="temperature > 0, got 0"):
        sampling_probs(logits, 0.0)


def test_choose_greedy_and_sampled():
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert choose(logits, 0.0, 1.0, None) == 1
    g = torch.Generator().manual_seed(0)
    assert choose(logits, 1.0, 1e-3, g) == 1  # nucleus of one token


def test_draw_is_distributed_as_p_and_never_draws_a_token_without_mass(monkeypatch):
    """The inverse-CDF draw against the probabilities themselves (chi-square), zeros included; a uniform that
    rounds up to the total (u = 1) gives the last token with mass, not a zero one past it."""
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.0, 0.3, 0.0, 0.05, 0.25, 0.4, 0.0, 0.0])
    n = 20000
    counts = torch.zeros(len(p))
    for _ in range(n):
        counts[draw(p, g)] += 1
    assert counts[p == 0].sum() == 0
    keep = p > 0
    assert chisquare(counts[keep].numpy(), (p[keep] * n).numpy()).pvalue > 1e-3
    assert draw(torch.tensor([0.0, 0.0, 1.0]), g) == 2
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k) * 0 + 1.0)  # u = 1: the top end
    assert draw(p, g) == 5
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k) * 0)  # u = 0: the first token with mass
    assert draw(p, g) == 1


def _tree():
    # root(0): children 1 (token 4), 2 (token 5); node 1: child 3 (token 6)
    return make_tree(torch.tensor([9, 4, 5, 6]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]))


def _onehot_logits(table: dict[int, int], v: int = 10):
    def logits_of(node):
        x = torch.zeros(v)
        x[table[node]] = 10.0
        return x

    return logits_of


def rejection_chain(p, candidates, q, g) -> int:
    """One output token: try ``candidates`` in turn with ``rejection_step``; none accepted -> draw from the residual."""
    for c in candidates:
        ok, p = rejection_step(p, c, q, g)
        if ok:
            return c
    return int(torch.multinomial(p, 1, generator=g))


def test_greedy_walk_paths():
    t = _tree()
    assert greedy_walk(t, _onehot_logits({0: 4, 1: 6, 3: 2})) == ([0, 1, 3], 2)  # accept all, bonus at the leaf
    assert greedy_walk(t, _onehot_logits({0: 5, 2: 7})) == ([0, 2], 7)  # second child
    assert greedy_walk(t, _onehot_logits({0: 8})) == ([0], 8)  # reject all
    assert greedy_walk(t, _onehot_logits({0: 4, 1: 1})) == ([0, 1], 1)  # partial


def test_rejection_step_point_mass_is_lossless():
    """Trying candidates deterministically then sampling the residual draws exactly p."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.05, 0.3, 0.25, 0.1, 0.3])
    cands = [1, 4, 0]
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[rejection_chain(p, cands, None, g)] += 1
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3


def test_rejection_step_with_proposal_distribution_is_lossless():
    """SpecInfer's rule with candidates drawn i.i.d. from q: the output is distributed as p."""
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([0.5, 0.2, 0.2, 0.05, 0.05])
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        cands = (int(torch.multinomial(q, 1, generator=g)) for _k in range(2))  # drawn as the chain asks
        counts[rejection_chain(p, cands, q, g)] += 1
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3
    with pytest.raises(ValueError, match="token 0 has probability 0.0"):
        rejection_step(p, 0, torch.tensor([0.0, 1, 0, 0, 0]), g)


def test_sampling_walk_certain_paths():
    t = _tree()
    g = torch.Generator().manual_seed(0)
    # The target is certain: each walk accepts exactly its argmax chain.
    assert sampling_walk(t, _onehot_logits({0: 4, 1: 6, 3: 2}), 1.0, 1.0, g) == ([0, 1, 3], 2)
    assert sampling_walk(t, _onehot_logits({0: 5, 2: 3}), 1.0, 1.0, g) == ([0, 2], 3)
    assert sampling_walk(t, _onehot_logits({0: 8}), 1.0, 1.0, g) == ([0], 8)
