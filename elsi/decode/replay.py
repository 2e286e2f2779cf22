"""Exact acceptance at temperature 0 without a decoding loop: the engine's tree steps, replayed.

At temperature 0 a step of ``elsi.decode.engine.generate`` with root at sequence position r
(the root x_r is the last token the target chose) does only this:

1. the draft's root logits are its teacher-forced logits at row r - 1 (rows 0..r-1 pair the
   target's states g_0..g_{r-1} with x_1..x_r; the commits rebuild exactly these rows);
2. ``build_tree`` grows the EAGLE-2 tree: depth-1 candidates from the root logits, then at
   each depth d the top_k frontier is fed to the draft (attending to rows 0..r-1 and to its
   tree ancestors, position r - 1 + d, the parent's ``hidden_out`` as its state);
3. every candidate is reranked by cumulative log-probability and the ``tree_nodes`` best kept;
4. ``greedy_walk`` accepts the longest kept path equal to the target's greedy continuation
   x_{r+1}, x_{r+2}, ..., plus the target's own next token (cut at EOS or the length limit).

So given the target's greedy answer (prompt + answer tokens) and its states at the draft's
layers from one forward over them, the accepted length at *every* root position follows
from one teacher-forced draft pass plus ``depth - 1`` batched expansions, computed here for
many roots at once. Every tree shape with the same ``top_k`` shares the expansions (the frontier
depends neither on ``tree_nodes`` nor on how much deeper the expansion goes), made as deep as the
deepest of them can keep (``TreeConfig.kept_depth``); only the rerank's depth limit and size differ.

The numbers equal the live engine's step for step up to float rounding (batched products round
differently), which can flip a near tie between two candidates; tests/test_exact_tau.py
bounds such steps on the real SmolLM2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elsi.decode.tree import TreeConfig


@dataclass
class Replay:
    """Accepted lengths of one answer under one tree shape.

    ``accepted[i]``: the tokens the engine's step with root at answer position i would add
    (accepted drafts + the target's own token, cut at the answer's end), for the roots
    i = 0 .. A - 2 (answer position 0 is the prefill's token; the last token is no root).
    """

    tree: TreeConfig
    accepted: list[int]  # (A - 1,) per root position

    def walk(self) -> list[int]:
        """The steps live decoding takes: from root 0, jump by each step's accepted length."""
        steps, i = [], 0
        while i < len(self.accepted):
            steps.append(self.accepted[i])
            i += self.accepted[i]
        return steps


@dataclass
class _Candidates:
    """The EAGLE-2 candidates of R roots in ``build_tree``'s order (root = candidate 0).

    C = 1 + k + (depth - 1)·k² candidates (fewer when the draft vocabulary is under k)."""

    tokens: torch.Tensor  # (R, C) target token ids (column 0: unused)
    parent: torch.Tensor  # (R, C) parent candidate id (-1 for the root)
    scores: torch.Tensor  # (R, C) cumulative draft log-probability (root 0)
    depth: torch.Tensor  # (C,) depth of each candidate


def check_tree(tree: TreeConfig) -> TreeConfig:
    """A tree shape the live engine supports (``TreeConfig`` validates), or a ValueError naming it."""
    if not isinstance(tree, TreeConfig):
        raise ValueError(f"a tree shape must be a TreeConfig(tree_nodes, depth, top_k), got {tree!r}")
    return TreeConfig(tree.tree_nodes, tree.depth, tree.top_k)


@torch.inference_mode()
def replay_answer(draft, features: torch.Tensor, tokens: Sequence[int], prompt_len: int,
                  trees: Sequence[TreeConfig], max_new_tokens: int, chunk: int = 32) -> list[Replay]:
    """The accepted length at every root position of one greedy answer, for each tree in ``trees``.

    draft: an ``elsi.draft.Eagle3Draft`` (eval mode). features (L, m·d_t): the target's states at
    ``draft.layer_ids`` for every position of ``tokens`` (prompt + answer, length L), in the dtype
    the live engine would hand them. ``prompt_len`` P: tokens before the answer (P >= 1, L > P).
    ``max_new_tokens``: the engine's limit for this answer (it caps the tree depth near the end,
    as ``generate`` does). ``chunk``: roots expanded together.
    """
    L, P = len(tokens), prompt_len
    if not 1 <= P < L:
        raise ValueError(f"prompt length {P} must be in 1..{L - 1} for a sequence of {L} tokens")
    if features.shape[0] != L:
        raise ValueError(f"features have {features.shape[0]} rows for {L} tokens")
    trees = [check_tree(t) for t in trees]
    A = L - P
    if A < 2:
        return [Replay(t, []) for t in trees]
    device = draft.fc.weight.device
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=device)  # (L,)
    # Step 1: one teacher-forced draft pass.
    cache, roots, root_logits, root_hidden = teacher_forced(draft, features, ids, P)
    # Tokens the walk may accept after root r: x_{r+1} .. x_{r+depth}, -1 past the answer's end.
    deepest = max(t.kept_depth for t in trees)
    ahead = torch.full((A - 1, deepest), -1, dtype=torch.long, device=device)  # (A-1, depth)
    for j in range(1, deepest + 1):
        n = max(0, min(A - 1, L - j - P))
        ahead[:n, j - 1] = ids[P + j: P + j + n]
    remaining = (L - 1 - roots)  # (A-1,) answer tokens after each root
    # The engine's depth cap: max_new_tokens - len(new) - 1, len(new) = r - P + 1 at root r.
    cap = max_new_tokens - (roots - P + 1) - 1  # (A-1,)
    # The candidates down to depth d do not depend on how much deeper the expansion goes, so the trees of one
    # top_k share one expansion, as deep as the deepest of them can keep (TreeConfig.kept_depth).
    groups: dict[int, list[int]] = {}  # top_k -> indices of the trees that share expansions
    for i, t in enumerate(trees):
        groups.setdefault(t.top_k, []).append(i)
    results = torch.ones(len(trees), A - 1, dtype=torch.long)  # (trees, A-1); a root no tree can extend adds 1
    for top_k, members in groups.items():
        # A root whose next greedy token is not among its depth-1 candidates accepts no draft in any tree.
        live = _first_hit(draft, root_logits, ahead[:, 0], top_k).nonzero().flatten()  # (R_live,)
        depth = max(trees[i].kept_depth for i in members)
        for a in range(0, live.numel(), chunk):
            sl = live[a: a + chunk]
            # Steps 2-3: the candidates of build_tree for these roots.
            cand = _candidates(draft, cache, root_logits[sl], root_hidden[sl], roots[sl], depth, top_k)
            for i in members:
                t = trees[i]
                acc = _accept(cand, t.tree_nodes, torch.clamp(cap[sl], max=t.kept_depth), ahead[sl, : t.kept_depth])
                results[i, sl.cpu()] = acc.cpu()
    results = torch.minimum(results, remaining.cpu())  # Step 4, cut at the answer's end
    return [Replay(t, results[i].tolist()) for i, t in enumerate(trees)]


def teacher_forced(draft, features: torch.Tensor, ids: torch.Tensor, prompt_len: int):
    """The draft's rows 0..L-2 (g_i with x_{i+1} at position i) in one pass, as the engine's commits build them.

    features (L, m·d_t), ids (L,) -> (the draft's cache of those rows, roots (A-1,) = positions P..L-2,
    root logits (A-1, V_d) = rows r - 1, root hidden_out (A-1, d)).
    """
    from elsi.draft.model import DraftCache

    L, P = ids.shape[0], prompt_len
    device = ids.device
    cache = DraftCache()
    g = draft.fuse(features[: L - 1].to(device)[None])  # (1, L-1, d)
    pos = torch.arange(L - 1, device=device)[None]  # (1, L-1)
    logits, out = draft(ids[1:][None], g, pos, cache=cache, logits_to_keep=L - P)  # (1, L-P, V_d), (1, L-1, d)
    roots = torch.arange(P, L - 1, device=device)  # (A-1,) root positions r; row r - 1 holds its logits
    return cache, roots, logits[0, : L - P - 1], out[0, P - 1: L - 2]


def _first_hit(draft, root_logits: torch.Tensor, nxt: torch.Tensor, top_k: int) -> torch.Tensor:
    """(R,) bool: the target's next token ``nxt`` (R,) is among the root's depth-1 candidates (the top_k of its
    logits, chosen as ``_candidates`` chooses them)."""
    top = torch.log_softmax(root_logits.float(), dim=-1).topk(min(top_k, root_logits.shape[-1]), dim=-1).indices
    return ((top + draft.d2t[top]) == nxt[:, None]).any(dim=-1)


def _tree_attention(q: torch.Tensor, k_pre: torch.Tensor, v_pre: torch.Tensor, seen: torch.Tensor,
                    fed_k: torch.Tensor, fed_v: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """The draft's attention for R roots' tree rows, in float32 -> (R, H, T, hd) in q's dtype.

    q (R, H, T, hd); the shared prefix k_pre/v_pre (1, KVH, P, hd), of which root r sees ``seen[r]`` (R, P);
    each root's own fed tree rows fed_k/fed_v (R, KVH, F, hd), of which query t sees ``anc[r, t]`` (R, T, F).
    Every root reads the same prefix keys: one product over all roots' queries, no per-root copy of them.
    """
    R, H, T, hd = q.shape
    KVH, P, Fn = k_pre.shape[1], k_pre.shape[2], fed_k.shape[2]
    G = H // KVH  # query heads per key/value head (head h reads kv head h // G)
    qg = q.float().reshape(R, KVH, G * T, hd)  # rows (g, t)
    scale = 1.0 / math.sqrt(hd)
    # The prefix part stays in (KVH, R, G·T, P) layout, as the one product over all roots makes it.
    s_pre = qg.transpose(0, 1).reshape(KVH, R * G * T, hd) @ k_pre[0].float().transpose(-1, -2)  # (KVH, R·G·T, P)
    s_pre = s_pre.view(KVH, R, G * T, P).mul_(scale).masked_fill_(~seen[None, :, None], float("-inf"))
    tree_vis = anc[:, None, None].expand(R, 1, G, T, Fn).reshape(R, 1, G * T, Fn)
    s_tree = (qg @ fed_k.float().transpose(-1, -2)).mul_(scale).masked_fill_(~tree_vis, float("-inf"))  # (R, KVH, G·T, F)
    # softmax over [prefix ; tree] in two parts, no concatenated scores: one max, one sum
    top = torch.maximum(s_pre.amax(dim=-1, keepdim=True).transpose(0, 1), s_tree.amax(dim=-1, keepdim=True))
    e_pre = s_pre.sub_(top.transpose(0, 1)).exp_()  # (KVH, R, G·T, P); finite max: a row sees itself
    e_tree = s_tree.sub_(top).exp_()  # (R, KVH, G·T, F)
    z = e_pre.sum(dim=-1, keepdim=True).transpose(0, 1) + e_tree.sum(dim=-1, keepdim=True)  # (R, KVH, G·T, 1)
    out = (e_pre.view(KVH, R * G * T, P) @ v_pre[0].float()).view(KVH, R, G * T, hd).transpose(0, 1)
    out = (out + e_tree @ fed_v.float()) / z  # (R, KVH, G·T, hd)
    return out.reshape(R, H, T, hd).to(q.dtype)


def _candidates(draft, cache, root_logits: torch.Tensor, root_hidden: torch.Tensor, roots: torch.Tensor,
                depth: int, top_k: int) -> _Candidates:
    """``build_tree``'s Steps 1-4 for R roots at once. root_logits (R, V_d), root_hidden (R, d), roots (R,)."""
    R, V = root_logits.shape
    device = root_logits.device
    k = min(top_k, V)
    d2t = draft.d2t
    logp = torch.log_softmax(root_logits.float(), dim=-1)  # (R, V_d)
    top = logp.topk(k, dim=-1)  # (R, k)
    first = top.indices + d2t[top.indices]  # (R, k) target ids
    tokens = [torch.zeros(R, 1, dtype=torch.long, device=device), first]
    parent = [torch.full((R, 1), -1, dtype=torch.long, device=device),
              torch.zeros(R, k, dtype=torch.long, device=device)]
    scores = [torch.zeros(R, 1, device=device), top.values]
    depths = [torch.zeros(1, dtype=torch.long, device=device), torch.ones(k, dtype=torch.long, device=device)]
    n_cand = 1 + k
    front_cand = torch.arange(1, 1 + k, device=device).expand(R, k)  # (R, k) candidate ids of the frontier
    front_scores, front_tokens = top.values, first  # (R, k)
    front_parent_row = torch.full((R, k), -1, dtype=torch.long, device=device)  # (R, k) fed row of each parent
    fed_anc = torch.zeros(R, 0, 0, dtype=torch.bool, device=device)  # (R, F, F)
    fed_k = fed_v = None  # (R, KVH, F, hd) keys/values of the fed tree rows
    fed_hidden = root_hidden[:, None]  # (R, 1 + F, d): row 0 = the root's hidden_out
    prefix = int(roots.max())  # draft rows 0..max(r)-1 are the only ones any root sees
    k_pre, v_pre = cache.k[:, :, :prefix], cache.v[:, :, :prefix]  # (1, KVH, prefix, hd)
    seen = torch.arange(prefix, device=device)[None] < roots[:, None]  # (R, prefix): rows 0..r-1
    for d in range(1, depth):
        # Step 2: feed the frontier at depth d; each row sees rows 0..r-1, its fed ancestors and itself.
        f, kf = fed_anc.shape[1], front_cand.shape[1]
        new_anc = torch.zeros(R, kf, f + kf, dtype=torch.bool, device=device)  # (R, kf, F + kf)
        if f:
            has = front_parent_row >= 0  # (R, kf)
            rows = fed_anc.gather(1, front_parent_row.clamp(min=0)[..., None].expand(R, kf, f))  # (R, kf, F)
            new_anc[..., :f] = rows & has[..., None]
        new_anc[..., f:] = torch.eye(kf, dtype=torch.bool, device=device)
        hidden = fed_hidden.gather(1, (front_parent_row + 1)[..., None].expand(R, kf, fed_hidden.shape[-1]))  # (R, kf, d)
        pos = (roots - 1 + d)[:, None].expand(R, kf)  # (R, kf)
        emb = draft.embed(front_tokens)  # (R, kf, d)
        hidden = hidden.to(emb.dtype)
        cos, sin = draft.rotary(emb, pos)
        q, kk, vv = draft.midlayer.qkv(emb, hidden, cos, sin)  # (R, H, kf, hd), (R, KVH, kf, hd)
        fed_k = kk if fed_k is None else torch.cat([fed_k, kk], dim=2)  # (R, KVH, F + kf, hd)
        fed_v = vv if fed_v is None else torch.cat([fed_v, vv], dim=2)
        att = _tree_attention(q, k_pre, v_pre, seen, fed_k, fed_v, new_anc)  # (R, H, kf, hd)
        out = draft.midlayer.finish(att, hidden)  # (R, kf, d)
        logits = draft.head(out)  # (R, kf, V_d)
        grown = torch.zeros(R, f + kf, f + kf, dtype=torch.bool, device=device)
        grown[:, :f, :f] = fed_anc
        grown[:, f:] = new_anc
        fed_anc = grown
        fed_hidden = torch.cat([fed_hidden, out], dim=1)  # (R, 1 + F + kf, d)
        # Step 3: every child of an expanded node is a candidate, scored by cumulative log-prob.
        lp = torch.log_softmax(logits.float(), dim=-1)  # (R, kf, V_d)
        tk = lp.topk(k, dim=-1)  # (R, kf, k)
        cum = (front_scores[..., None] + tk.values).flatten(1)  # (R, kf*k)
        child = (tk.indices + d2t[tk.indices]).flatten(1)  # (R, kf*k) target ids
        tokens.append(child)
        parent.append(front_cand.repeat_interleave(k, dim=1))  # (R, kf*k)
        scores.append(cum)
        depths.append(torch.full((kf * k,), d + 1, dtype=torch.long, device=device))
        # Step 4: the top_k candidates of this depth become the next frontier.
        best = cum.topk(min(k, kf * k), dim=-1).indices  # (R, k) into the kf*k new candidates
        front_cand = n_cand + best
        front_scores = cum.gather(1, best)
        front_tokens = child.gather(1, best)
        front_parent_row = f + best // k
        n_cand += kf * k
    return _Candidates(torch.cat(tokens, 1), torch.cat(parent, 1), torch.cat(scores, 1), torch.cat(depths))


def _rerank(c: _Candidates, tree_nodes: int, max_depth: torch.Tensor) -> torch.Tensor:
    """``build_tree``'s Step 5 for R roots: which candidates the tree keeps (R, C), the root included.

    max_depth (R,): each root's tree depth (the engine's cap; <= 0: a root-only tree). Only candidates
    of depth <= max_depth compete; a stable sort lets the earlier candidate win a tie, as the engine's does.
    """
    R, C = c.scores.shape
    device = c.scores.device
    valid = c.depth[None, 1:] <= max_depth[:, None]  # (R, C-1)
    s = c.scores[:, 1:].masked_fill(~valid, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # (R, C-1)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(C - 1, device=device).expand(R, C - 1))
    kept = (rank < tree_nodes) & valid  # (R, C-1)
    return torch.cat([torch.ones(R, 1, dtype=torch.bool, device=device), kept], dim=1)  # (R, C)


def _accept(c: _Candidates, tree_nodes: int, max_depth: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
    """``build_tree``'s Step 5 and ``greedy_walk`` for R roots -> accepted drafts + 1 (R,).

    max_depth (R,): see ``_rerank``.
    ahead (R, depth): the target's greedy tokens after each root (-1 past the answer).
    """
    R = c.scores.shape[0]
    device = c.scores.device
    kept = _rerank(c, tree_nodes, max_depth)  # (R, C)
    # greedy_walk: from the root, the kept child whose token is the target's next one.
    cur = torch.zeros(R, dtype=torch.long, device=device)  # candidate id of the path's end
    alive = torch.ones(R, dtype=torch.bool, device=device)
    length = torch.ones(R, dtype=torch.long, device=device)  # accepted drafts + the target's token
    for j in range(1, ahead.shape[1] + 1):
        at = c.depth == j  # (C,)
        match = kept[:, at] & (c.parent[:, at] == cur[:, None]) & (c.tokens[:, at] == ahead[:, j - 1, None])
        found = match.any(dim=1) & alive & (ahead[:, j - 1] >= 0)  # (R,)
        idx = at.nonzero().flatten()[match.float().argmax(dim=1)]  # (R,) the match's candidate id
        cur = torch.where(found, idx, cur)
        length += found.long()
        alive &= found
    return length
