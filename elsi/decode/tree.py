"""EAGLE-2 dynamic draft trees, their attention masks and position ids.

Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (2024):
expand the ``top_k`` best nodes of each depth (by cumulative draft log-probability), keep
every child of an expanded node as a candidate, then rerank all candidates and keep the
``tree_nodes`` best. Because a child's score never exceeds its parent's, the kept set is
closed under ancestors (ties are broken in candidate order, parents first).

Tree layout (``n = 1 + number of drafted nodes``): node 0 is the *root*, the last token the
target has chosen and that is not in its KV cache yet; nodes 1..n-1 are drafted tokens in
candidate order (depth by depth), so a parent always has a smaller index than its children
and indices increase along every root-to-leaf path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from elsi.config import at_least, opt


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the EAGLE-2 draft tree."""

    tree_nodes: int = opt(60, "drafted tokens per step (the tree after reranking, root excluded)")
    depth: int = opt(6, "most drafted tokens on one path (draft passes per step: depth - 1 after the root's)")
    top_k: int = opt(10, "children per expanded node and nodes expanded per depth (1 = chain drafting)")

    def __post_init__(self) -> None:
        at_least(self, tree_nodes=1, depth=1, top_k=1)

    @property
    def kept_depth(self) -> int:
        """The deepest level the tree can keep: a node deeper than ``tree_nodes`` has at least ``tree_nodes``
        ancestors that rank before it (scores never rise along a path, ties keep parents first), so the
        rerank never keeps it."""
        return min(self.depth, self.tree_nodes)


@dataclass
class Tree:
    """A draft tree of ``n`` nodes (node 0 = root). All tensors on the root logits' device."""

    tokens: torch.Tensor  # (n,) int64 token id of each node
    parents: torch.Tensor  # (n,) int64 parent node, -1 for the root
    depth: torch.Tensor  # (n,) int64 edges from the root (root 0): position id = cache length + depth
    scores: torch.Tensor  # (n,) float32 cumulative draft log-probability (root 0)
    ancestors: torch.Tensor  # (n, n) bool: [i, j] = node j is node i or one of its ancestors
    children: list[list[int]]  # children of each node, best draft score first

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def internal(self) -> list[int]:
        """Nodes with at least one child (root included when it has children)."""
        return [i for i, c in enumerate(self.children) if c]


# expand(tokens (k,), parents (k,), tree_mask (k, F + k), depth) -> logits (k, V_d) over the
# drafter's vocabulary (column c is target token ``token_ids[c]``, or c itself without a map):
# ``parents`` index the rows fed by earlier calls since the last commit (-1 = the root),
# F of them; tree_mask row i says which of the F + k fed rows (new rows last) token i sees.
ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def root_only(root: int, device: torch.device) -> Tree:
    """The tree of a step that drafts nothing: the target only verifies its own token."""
    return Tree(
        tokens=torch.tensor([root], dtype=torch.long, device=device),
        parents=torch.tensor([-1], dtype=torch.long, device=device),
        depth=torch.zeros(1, dtype=torch.long, device=device),
        scores=torch.zeros(1, device=device),
        ancestors=torch.ones(1, 1, dtype=torch.bool, device=device),
        children=[[]],
    )


def build_tree(root: int, root_logits: torch.Tensor, expand: ExpandFn, cfg: TreeConfig,
               max_depth: int | None = None, token_ids: torch.Tensor | None = None) -> Tree:
    """EAGLE-2 dynamic tree from the draft's logits for the root's child (``root_logits`` (V_d,)).

    ``token_ids`` (V_d,): the target token of each draft-vocabulary column (None: identity),
    so the top-k runs over the draft's own, smaller vocabulary. ``max_depth`` caps
    ``cfg.depth`` (e.g. near the end of ``max_new_tokens``); 0 gives a root-only tree.
    Calls ``expand`` ``depth - 1`` times with at most ``top_k`` rows each, where depth is also capped at
    ``cfg.kept_depth`` (no deeper node could survive the rerank). A one-node tree (one drafted token a step)
    therefore costs no draft pass beyond the root's, the same tree as a full expansion's.
    """
    device = root_logits.device
    depth = cfg.kept_depth
    if max_depth is not None:
        depth = min(depth, max_depth)
    if depth <= 0:
        return root_only(root, device)
    k = min(cfg.top_k, root_logits.shape[-1])
    # Candidate 0 is the root; the lists hold one tensor per depth.
    # Step 1: the root's children from the draft's root logits.
    to_target = (lambda i: i) if token_ids is None else (lambda i: token_ids[i])  # noqa: E731
    logp = torch.log_softmax(root_logits.float(), dim=-1)  # (V_d,)
    top = logp.topk(k)
    first = to_target(top.indices)  # (k,) target ids
    cand_tokens = [torch.tensor([root], device=device), first]  # (1,), (k,)
    cand_parent = [torch.tensor([-1], device=device), torch.zeros(k, dtype=torch.long, device=device)]
    cand_scores = [torch.zeros(1, device=device), top.values]
    cand_depth = [torch.zeros(1, dtype=torch.long, device=device), torch.ones(k, dtype=torch.long, device=device)]
    n_cand = 1 + k
    front_cand = torch.arange(1, 1 + k, device=device)  # (k,) candidate ids of the frontier
    front_scores = top.values  # (k,)
    front_tokens = first  # (k,)
    front_parent_row = torch.full((k,), -1, dtype=torch.long, device=device)  # (k,) fed row of each parent
    fed_anc = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (F, F) ancestors-or-self among fed rows
    for d in range(1, depth):
        # Step 2: feed the frontier (depth d) to the draft; each row sees its fed ancestors and itself.
        f, kf = fed_anc.shape[0], front_cand.shape[0]
        new_anc = torch.zeros(kf, f + kf, dtype=torch.bool, device=device)  # (kf, F + kf)
        if f:
            has_parent = front_parent_row >= 0  # (kf,)
            new_anc[has_parent, :f] = fed_anc[front_parent_row[has_parent]]
        new_anc[:, f:] = torch.eye(kf, dtype=torch.bool, device=device)
        logits = expand(front_tokens, front_parent_row, new_anc, d)  # (kf, V_d)
        grown = torch.zeros(f + kf, f + kf, dtype=torch.bool, device=device)  # (F + kf, F + kf)
        grown[:f, :f] = fed_anc
        grown[f:] = new_anc
        fed_anc = grown
        # Step 3: every child of an expanded node is a candidate, scored by cumulative log-prob.
        logp = torch.log_softmax(logits.float(), dim=-1)  # (kf, V_d)
        top = logp.topk(k, dim=-1)  # values, indices (kf, k)
        cum = front_scores[:, None] + top.values  # (kf, k)
        child_tokens = to_target(top.indices.flatten())  # (kf*k,) target ids
        cand_tokens.append(child_tokens)
        cand_parent.append(front_cand.repeat_interleave(k))  # (kf*k,)
        cand_scores.append(cum.flatten())
        cand_depth.append(torch.full((kf * k,), d + 1, dtype=torch.long, device=device))
        # Step 4: the top_k candidates of this depth become the next frontier.
        best = cum.flatten().topk(min(k, kf * k)).indices  # (k,) into the kf*k new candidates
        front_cand = n_cand + best
        front_scores = cum.flatten()[best]
        front_tokens = child_tokens[best]
        front_parent_row = f + best // k  # (k,) the fed row of each new frontier node's parent
        n_cand += kf * k
    # Step 5: rerank every candidate, keep the tree_nodes best (stable: parents before children).
    tokens = torch.cat(cand_tokens)  # (C,)
    parent = torch.cat(cand_parent)  # (C,)
    scores = torch.cat(cand_scores)  # (C,)
    depths = torch.cat(cand_depth)  # (C,)
    n_keep = min(cfg.tree_nodes, n_cand - 1)
    order = torch.sort(scores[1:], descending=True, stable=True).indices[:n_keep] + 1  # (N,)
    keep = torch.cat([torch.zeros(1, dtype=torch.long, device=device), order.sort().values])  # (n,) root first
    node_of = torch.full((n_cand,), -1, dtype=torch.long, device=device)  # (C,) candidate -> node
    node_of[keep] = torch.arange(keep.shape[0], device=device)
    parents = torch.where(parent[keep] >= 0, node_of[parent[keep].clamp(min=0)], -1)  # (n,)
    assert bool((parents[1:] >= 0).all()), "reranked tree is not closed under ancestors"
    return make_tree(tokens[keep], parents, depths[keep], scores[keep])


def make_tree(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
              scores: torch.Tensor | None = None) -> Tree:
    """A ``Tree`` from per-node tokens, parents and depths (all (n,); parents before children)."""
    n = tokens.shape[0]
    device = tokens.device
    anc = torch.eye(n, dtype=torch.bool, device=device)  # (n, n)
    for d in range(1, int(depth.max()) + 1 if n > 1 else 1):
        rows = (depth == d).nonzero().flatten()  # (r,) nodes at depth d
        anc[rows] |= anc[parents[rows]]
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents.tolist()[1:], start=1):
        children[p].append(i)
    if scores is None:
        scores = torch.zeros(n, device=device)
    return Tree(tokens=tokens, parents=parents, depth=depth, scores=scores, ancestors=anc, children=children)


def additive_mask(tree_mask: torch.Tensor, prefix_len: int, q_pos: torch.Tensor, k_tree_pos: torch.Tensor,
                  dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive attention mask of tree rows over a cache prefix plus the tree rows.

    tree_mask (q, K) bool: which of the K tree keys (rows already fed this step and the q new
    ones, in cache order) each query sees; the ``prefix_len`` cached tokens before them are
    always visible. q_pos (q,), k_tree_pos (K,): position ids. With ``window`` (sliding-window
    layers), a key at position p is visible only if q_pos - p < window (Hugging Face's rule).
    Returns (1, 1, q, prefix_len + K): 0 where visible, the dtype's minimum elsewhere.
    """
    q, kt = tree_mask.shape
    device = tree_mask.device
    visible = torch.ones(q, prefix_len + kt, dtype=torch.bool, device=device)  # (q, P + K)
    visible[:, prefix_len:] = tree_mask
    if window is not None:
        k_pos = torch.cat([torch.arange(prefix_len, device=device), k_tree_pos])  # (P + K,)
        visible &= (q_pos[:, None] - k_pos[None, :]) < window  # (q, P + K)
    mask = torch.zeros(q, prefix_len + kt, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]  # (1, 1, q, P + K)


def attention_masks(tree_mask: torch.Tensor, prefix_len: int, q_pos: torch.Tensor, k_tree_pos: torch.Tensor,
                    dtype: torch.dtype, layer_types: Sequence[str], window: int | None):
    """The mask argument of a Hugging Face decoder for tree rows (see ``additive_mask``).

    One 4D mask when every layer is full attention; for mixed models (Gemma-3) a dict
    ``{"full_attention": mask, "sliding_attention": banded mask}``. Caches are full length for
    every layer, so both masks span ``prefix_len + K`` keys.
    """
    full = additive_mask(tree_mask, prefix_len, q_pos, k_tree_pos, dtype)
    if "sliding_attention" not in layer_types:
        return full
    if window is None:
        raise ValueError("the model has sliding-attention layers but no sliding_window in its config")
    sliding = additive_mask(tree_mask, prefix_len, q_pos, k_tree_pos, dtype, window)
    return {"full_attention": full, "sliding_attention": sliding}
