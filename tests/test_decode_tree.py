"""EAGLE-2 tree construction, tree masks and position ids."""

from __future__ import annotations

import math

import pytest
import torch

from elsi.decode.tree import TreeConfig, additive_mask, attention_masks, build_tree, make_tree


def _table_expand(table: torch.Tensor, calls: list):
    """expand() of a drafter whose logits depend only on the token: table (V, V)."""

    def expand(tokens, parents, tree_mask, depth):
        calls.append((tokens.clone(), parents.clone(), tree_mask.clone(), depth))
        return table[tokens]

    return expand


def test_tree_config_validates():
    with pytest.raises(ValueError, match="tree_nodes"):
        TreeConfig(tree_nodes=0)
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        TreeConfig(depth=0)
    with pytest.raises(ValueError, match="top_k"):
        TreeConfig(top_k=-1)


def test_chain_with_top_k_1():
    v = 10
    table = torch.full((v, v), -5.0)
    table[torch.arange(v), (torch.arange(v) + 1) % v] = 5.0  # next = token + 1
    calls = []
    t = build_tree(3, table[3], _table_expand(table, calls), TreeConfig(tree_nodes=8, depth=5, top_k=1))
    assert t.tokens.tolist() == [3, 4, 5, 6, 7, 8]
    assert t.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    assert t.depth.tolist() == [0, 1, 2, 3, 4, 5]
    assert len(calls) == 4  # depth - 1 draft passes after the root's logits
    assert [c[3] for c in calls] == [1, 2, 3, 4]
    assert torch.equal(t.ancestors, torch.ones(6, 6, dtype=torch.bool).tril())
    assert t.children == [[1], [2], [3], [4], [5], []]


def test_eagle2_expansion_and_rerank_match_a_brute_force():
    """Every kept node is among the best `tree_nodes` candidates of an explicit enumeration."""
    g = torch.Generator().manual_seed(0)
    v, k, depth, n = 12, 3, 4, 11
    table = torch.randn(v, v, generator=g) * 2
    logp = torch.log_softmax(table, -1)
    calls = []
    t = build_tree(0, table[0], _table_expand(table, calls), TreeConfig(tree_nodes=n, depth=depth, top_k=k))
    # Brute force: candidates = children (top-k) of the top-k frontier of each depth.
    cands = []  # (score, path tokens)
    frontier = [(0.0, (0,))]
    for d in range(1, depth + 1):
        children = []
        for s, path in frontier:
            vals, idx = logp[path[-1]].topk(k)
            children += [(s + float(a), path + (int(b),)) for a, b in zip(vals, idx)]
        cands += children
        frontier = sorted(children, key=lambda c: -c[0])[:k]
    best = sorted(cands, key=lambda c: -c[0])[:n]
    paths = set()
    for i in range(1, t.size):  # path of every node, root token first
        p, node = [], i
        while node >= 0:
            p.append(int(t.tokens[node]))
            node = int(t.parents[node])
        paths.add(tuple(reversed(p)))
    assert paths == {c[1] for c in best}
    assert t.size == n + 1
    for i in range(1, t.size):
        assert t.scores[i] <= t.scores[t.parents[i]] + 1e-6
        assert t.depth[i] == t.depth[t.parents[i]] + 1
        assert t.parents[i] < i
    # Each draft pass fed the top-k frontier; masks: fed ancestors + self.
    assert [c[0].shape[0] for c in calls] == [k] * (depth - 1)
    assert calls[0][1].tolist() == [-1] * k and torch.equal(calls[0][2], torch.eye(k, dtype=torch.bool))
    for tokens, parents, mask, d in calls[1:]:
        f = mask.shape[1] - k
        assert torch.equal(mask[:, f:], torch.eye(k, dtype=torch.bool))
        assert mask[torch.arange(k), parents].all()  # sees its parent row
        assert int(mask[:, :f].sum(1).max()) == d - 1  # and its d-1 fed ancestors


def test_max_depth_zero_gives_root_only():
    table = torch.zeros(4, 4)
    t = build_tree(2, table[2], _table_expand(table, []), TreeConfig(), max_depth=0)
    assert t.tokens.tolist() == [2] and t.children == [[]] and t.internal() == []


def test_tree_mask_and_positions():
    # root(0) -> 1 -> 3 ; root -> 2
    t = make_tree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]))
    expect = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(t.ancestors, expect)
    prefix = 3
    pos = prefix + t.depth  # (4,)
    assert pos.tolist() == [3, 4, 4, 5]
    m = additive_mask(t.ancestors, prefix, pos, pos, torch.float32)
    assert m.shape == (1, 1, 4, 7)
    visible = m[0, 0] == 0
    assert visible[:, :prefix].all()
    assert torch.equal(visible[:, prefix:], expect)
    assert m[0, 0, 0, 4] == torch.finfo(torch.float32).min


def test_sliding_window_mask_is_banded():
    t = make_tree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2]))
    prefix, window = 6, 4
    pos = prefix + t.depth  # positions 6, 7, 8
    masks = attention_masks(t.ancestors, prefix, pos, pos, torch.float32,
                            ["sliding_attention", "full_attention"], window)
    full, sw = masks["full_attention"][0, 0] == 0, masks["sliding_attention"][0, 0] == 0
    assert full.shape == sw.shape == (3, 9)
    key_pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    for q in range(3):
        qp = int(pos[q])
        assert torch.equal(sw[q], full[q] & (qp - key_pos < window))
    assert sw[2].tolist() == [False] * 5 + [True] * 4  # position 8 sees 5..8
    assert not isinstance(attention_masks(t.ancestors, prefix, pos, pos, torch.float32, ["full_attention"], None),
                          dict)


def test_scores_are_cumulative_log_probs():
    table = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 1.0], [1.0, 2.0, 0.0]])
    t = build_tree(0, table[0], _table_expand(table, []), TreeConfig(tree_nodes=4, depth=2, top_k=2))
    lp = torch.log_softmax(table, -1)
    for i in range(1, t.size):
        par = int(t.parents[i])
        expect = float(lp[int(t.tokens[par]), int(t.tokens[i])]) + float(t.scores[par])
        assert math.isclose(float(t.scores[i]), expect, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("tree_nodes", [1, 2, 3, 5])
def test_trees_smaller_than_their_depth_skip_the_passes_that_could_not_be_kept(tree_nodes):
    """A tree of N < depth nodes equals the full expansion's rerank (ties included) with N - 1 draft passes."""
    g = torch.Generator().manual_seed(tree_nodes)
    v, k, depth = 12, 3, 6
    table = (torch.randn(v, v, generator=g) * 2).round()  # integer logits: ties in the cumulative scores
    table[:, 5] = 30.0  # a near-certain next token: scores that stay level (log-prob 0.0 in float32) along a path
    capped_calls, full_calls = [], []
    cfg = TreeConfig(tree_nodes=tree_nodes, depth=depth, top_k=k)
    capped = build_tree(0, table[0], _table_expand(table, capped_calls), cfg)
    # The reference: the whole depth expanded, reranked to N nodes (the same candidates and stable rerank).
    wide = build_tree(0, table[0], _table_expand(table, full_calls), TreeConfig(tree_nodes=k ** 2 * depth,
                                                                                 depth=depth, top_k=k))
    order = torch.sort(wide.scores[1:], descending=True, stable=True).indices[:tree_nodes] + 1
    keep = torch.cat([torch.zeros(1, dtype=torch.long), order.sort().values])
    assert len(full_calls) == depth - 1 and len(capped_calls) == tree_nodes - 1
    assert capped.tokens.tolist() == wide.tokens[keep].tolist()
    assert capped.depth.tolist() == wide.depth[keep].tolist()
    assert torch.equal(capped.scores, wide.scores[keep])
    node_of = {int(c): i for i, c in enumerate(keep)}
    assert capped.parents.tolist() == [-1] + [node_of[int(wide.parents[c])] for c in keep[1:]]
