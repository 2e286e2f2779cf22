"""The target's forward that gives a draft its features: states at the draft's layers, LM-head inputs and
greedy labels, for the feature cache (``elsi.draft.features``) and for evaluation on Spec-Bench answers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from elsi.models.load import Target


def greedy_tokens(hidden: torch.Tensor, head: torch.nn.Module, chunk: int = 4096) -> torch.Tensor:
    """The target's greedy token after each row of ``hidden`` (..., d), the input of its LM head ``head``:
    the first maximal index of the logits, as ``head(hidden).argmax(-1)`` gives it, computed over vocabulary
    chunks of ``chunk`` rows of the head, so that the (tokens, V) logits are never stored (its speed-up:
    docs/training.md). A logit soft-cap (tanh) is monotonic: no change."""
    w, b = head.weight, head.bias  # (V, d), (V,) or None
    best = idx = None
    for a in range(0, w.shape[0], chunk):
        v, i = F.linear(hidden, w[a:a + chunk], None if b is None else b[a:a + chunk]).max(-1)  # (...,)
        if best is None:
            best, idx = v, i
        else:  # strictly greater: a tie keeps the earlier chunk's (smaller) index
            upd = v > best
            best, idx = torch.where(upd, v, best), torch.where(upd, i + a, idx)
    return idx


@torch.no_grad()
def target_features(target: Target, batch: Sequence[list[int]], layers: Sequence[int],
                    forward: Callable | None = None):
    """One target forward on a batch of token lists -> per sample (argmax (T,), final (T, d), states (T, L, d)).
    ``forward``: the target's decoder to call (``target.adapter.decoder(target.model)`` compiled,
    ``elsi.models.compiled``; default: that decoder)."""
    device = target.device
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)  # (B, W) right-padded
    mask = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    for k, seq in enumerate(batch):
        ids[k, : len(seq)] = torch.tensor(seq, device=device)
        mask[k, : len(seq)] = 1
    decoder = target.adapter.decoder(target.model) if forward is None else forward  # no logits: see greedy_tokens
    hs = decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    final = hs[-1]  # (B, W, d): LM-head input (after the final norm); hs has N+1 of (B, W, d)
    states = torch.stack([hs[l] for l in layers], dim=2)  # (B, W, L, d)
    argmax = greedy_tokens(final, target.model.get_output_embeddings())  # (B, W)
    res = []
    for k, seq in enumerate(batch):
        t = len(seq)
        res.append((argmax[k, :t].cpu(), final[k, :t].float().cpu(), states[k, :t].float().cpu()))
    return res


__all__ = ["greedy_tokens", "target_features"]
