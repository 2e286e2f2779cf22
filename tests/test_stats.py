"""Entropy and CKA from Grams against naive formulas and published test vectors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from elsi.collect.grams import normalize_blocks, pack, unpack
from elsi.stats.analysis import GramRun
from elsi.stats.cka import cka_from_hsic, hsic_matrix, linear_cka
from elsi.stats.entropy import kernel_entropy
from elsi.stats.transitions import compartments, find_boundaries, transition_scores


def naive_entropy_of_states(zs: list[np.ndarray]) -> float:
    """Entropy of the concatenation [Z_l / ||Z_l||_F] via singular values (no Gram)."""
    cat = np.concatenate([z / np.linalg.norm(z) for z in zs], axis=1)  # (B, sum d)
    s2 = np.linalg.svd(cat, compute_uv=False) ** 2
    p = s2 / s2.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def test_gram_sum_entropy_equals_concatenated_states():
    rng = np.random.default_rng(0)
    zs = [rng.standard_normal((32, d)) @ rng.standard_normal((d, d)) for d in (16, 48, 24)]
    norm = [normalize_blocks(torch.tensor(z)[None], "center-l2")[0].numpy() for z in zs]
    k = sum(torch.tensor(z @ z.T) / np.trace(z @ z.T) for z in norm)
    got = float(kernel_entropy(k[None])[0])
    assert got == pytest.approx(naive_entropy_of_states(norm), abs=1e-10)


def test_run_entropy_matches_naive_per_block_and_sample(tiny_run):
    run = GramRun(tiny_run)
    layers = (2, 5, 7)
    k = run.set_kernels(layers)  # (nb, B, B)
    per_block = []
    for b in range(run.num_blocks):
        ev = np.linalg.eigvalsh(k[b].numpy())
        p = np.clip(ev, 0, None) / np.clip(ev, 0, None).sum()
        p = p[p > 0]
        per_block.append(-(p * np.log(p)).sum())
    per_block = np.array(per_block)
    samples = run.block_sample.numpy()
    per_sample = [per_block[samples == s].mean() for s in np.unique(samples)]
    st = run.entropy(layers)
    assert st.mean == pytest.approx(np.mean(per_sample), abs=1e-12)
    assert st.std == pytest.approx(np.std(per_sample), abs=1e-12)
    assert st.normalized == pytest.approx(np.mean(per_sample) / math.log(run.block), abs=1e-12)


def test_linear_cka_published_vector():
    np.random.seed(1337)
    x = np.random.randn(100, 10)
    y = np.random.randn(100, 10) + x
    assert linear_cka(torch.tensor(x), torch.tensor(y), "biased") == pytest.approx(0.5576133, abs=1e-7)
    assert linear_cka(torch.tensor(x), torch.tensor(y), "debiased") == pytest.approx(0.5134565, abs=1e-7)


def _center_unbiased(gram: np.ndarray) -> np.ndarray:
    """Kornblith et al.'s unbiased centring (a different route to the U-statistic HSIC)."""
    n = gram.shape[0]
    g = gram.copy()
    np.fill_diagonal(g, 0)
    means = g.sum(0) / (n - 2)
    means -= means.sum() / (2 * (n - 1))
    g -= means[:, None]
    g -= means[None, :]
    np.fill_diagonal(g, 0)
    return g


def test_minibatch_cka_matches_naive_reference():
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((16, 5)) for _ in range(4)]
    ys = [x @ rng.standard_normal((5, 7)) + 0.5 * rng.standard_normal((16, 7)) for x in xs]
    kx = [x @ x.T for x in xs]
    ky = [y @ y.T for y in ys]
    num = sum((_center_unbiased(a) * _center_unbiased(b)).sum() for a, b in zip(kx, ky))
    da = sum((_center_unbiased(a) ** 2).sum() for a in kx)
    db = sum((_center_unbiased(b) ** 2).sum() for b in ky)
    ref = num / math.sqrt(da * db)
    kernels = torch.tensor(np.stack([np.stack([a, b]) for a, b in zip(kx, ky)]))  # (nb, 2, n, n)
    assert cka_from_hsic(hsic_matrix(kernels, "debiased"), [0], [1]) == pytest.approx(ref, abs=1e-10)


def test_set_cka_is_cka_of_summed_kernels(tiny_run):
    run = GramRun(tiny_run)
    ka = run.set_kernels((1, 3))[:, None]  # (nb, 1, B, B)
    kb = run.set_kernels((6,))[:, None]
    direct = cka_from_hsic(hsic_matrix(torch.cat([ka, kb], 1)), [0], [1])
    assert run.cka((1, 3), (6,)) == pytest.approx(direct, abs=1e-10)
    assert run.cka((4,), (4,)) == pytest.approx(1.0, abs=1e-12)


def test_pack_roundtrip():
    a = torch.randn(3, 5, 5, dtype=torch.float64)
    sym = a + a.transpose(-1, -2)
    assert torch.equal(unpack(pack(sym), 5), sym)


def test_boundaries_and_compartments():
    t = np.array([0.9, 0.1, 0.12, 0.1, 0.5, 0.1, 0.1, 0.11, 0.6])
    b = find_boundaries(t, 0.1)
    assert b == [0, 4, 8]  # the first and last can be boundaries
    assert compartments(b, len(t) + 1) == [[0, 0], [1, 4], [5, 8], [9, 9]]
    assert find_boundaries(np.ones(5)) == []
    cka = np.eye(4) + 0.5 * (1 - np.eye(4))
    assert transition_scores(cka).tolist() == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="prominence"):
        find_boundaries(t, 1.5)
