"""The draft's loss and figures, shared by training and evaluation.

Following Li et al., "EAGLE-3" (2025), with this project's choices from docs/design.md:
1. Soft labels (``LabelHead``): the target's distribution on the draft vocabulary, EAGLE3's softmax over
   ``target_logits[..., t2d]``: the softmax of the V_draft logits of the target's head rows at the draft
   ids, i.e. the full softmax restricted to the draft vocabulary and renormalised.
2. A batch (``make_batch``): feature samples padded to the longest, with the positions that are scored.
3. The loss (``ttt_loss``): the draft unrolled ``steps`` steps on its own outputs (training-time test);
   step j is scored against the soft labels at the position j+1 ahead, weight 0.8^j, with
   ``SoftCrossEntropy``.
4. Figures: per-depth top-1 match with the target's greedy token, and the accepted length of a greedy
   chain (``chain_runs``), summed over batches (``Tally``) and summarised (``summarize``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from elsi.draft.model import Eagle3Draft
from elsi.draft.vocab import target_to_draft
from elsi.models.adapters import soft_cap
from elsi.models.load import Target


@dataclass
class Batch:
    """A padded batch of R rows per sample: row i pairs g_i with x_{i+1}, T = longest length - 1."""

    aux: torch.Tensor  # (B, T, m·d) target states at the draft's layers, positions 0..T-1
    input_ids: torch.Tensor  # (B, T) x_1..x_T
    position_ids: torch.Tensor  # (B, T)
    probs: torch.Tensor  # (B, T, V_draft) target distribution on the draft vocabulary at positions 1..T
    argmax: torch.Tensor  # (B, T) target greedy token (target id) at positions 1..T
    valid: torch.Tensor  # (B, T) bool: position 1+i exists (and is scored)
    in_vocab: torch.Tensor  # (B, T) bool: the target's greedy token there is in the draft vocabulary
    want_draft: torch.Tensor  # (B, T) that token's draft id, -1 where it is outside the draft vocabulary


@dataclass
class LabelHead:
    """The target's LM head restricted to the draft vocabulary (EAGLE3's ``target_logits[..., t2d]``).

    Built once per training run; ``probs`` gives the soft labels: the target's distribution
    over the draft vocabulary, i.e. softmax over the V_draft selected logits (equal to the
    full-vocabulary softmax restricted to the draft ids and renormalised).
    """

    weight: torch.Tensor  # (V_draft, d) rows of the target's output embedding at the draft ids
    bias: torch.Tensor | None  # (V_draft,) or None
    softcap: float | None  # the target family's final logit soft-capping, if any (``Adapter.logit_softcap``)

    @classmethod
    def build(cls, target: Target, vocab_ids: torch.Tensor, device: torch.device,
              dtype: torch.dtype = torch.float32) -> LabelHead:
        """``dtype``: of the head product (bfloat16 in bf16 training: float32 accumulation, logits rounded to
        bf16 before a float32 softmax); held-out figures use float32."""
        head = target.model.get_output_embeddings()
        ids = vocab_ids.to(head.weight.device)
        bias = getattr(head, "bias", None)
        return cls(weight=head.weight.detach()[ids].to(device, dtype),  # (V_draft, d)
                   bias=None if bias is None else bias.detach()[ids].float().to(device),
                   softcap=target.adapter.logit_softcap(target.model))

    @torch.no_grad()
    def probs(self, final: torch.Tensor) -> torch.Tensor:
        """final (..., d) LM-head inputs -> the target's distribution on the draft vocabulary (..., V_draft)."""
        logits = (final.to(self.weight.dtype) @ self.weight.T).float()  # (..., V_draft)
        if self.bias is not None:
            logits = logits + self.bias
        return torch.softmax(soft_cap(logits, self.softcap), dim=-1)


def make_batch(target: Target, samples: Sequence[dict], vocab_ids: torch.Tensor, t2d: torch.Tensor,
               device: torch.device, score: Sequence[torch.Tensor] | None = None,
               label_head: LabelHead | None = None) -> Batch:
    """Pad feature samples (see ``FeatureStore.sample``) into a ``Batch`` on ``device``.

    ``score``: optional per-sample bool masks (T_k,) over positions: which positions count
    (e.g. ``FeatureStore.sample``'s ``reply``).
    ``label_head``: the restricted head for ``vocab_ids`` (built here when None; pass it to
    avoid gathering the V_draft rows of the target's head for every batch).
    """
    t = max(s["ids"].shape[0] for s in samples) - 1
    b = len(samples)
    md = samples[0]["aux"].shape[1]
    aux = torch.zeros(b, t, md)
    ids = torch.zeros(b, t, dtype=torch.long)
    argmax = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    final = torch.zeros(b, t, samples[0]["final"].shape[1])
    for k, s in enumerate(samples):
        n = s["ids"].shape[0] - 1
        aux[k, :n] = s["aux"][:n].float()  # states at positions 0..n-1
        ids[k, :n] = s["ids"][1:]  # tokens x_1..x_n
        argmax[k, :n] = s["argmax"][1:]  # target's prediction made at positions 1..n
        final[k, :n] = s["final"][1:].float()
        valid[k, :n] = True if score is None else score[k][1:]
    if label_head is None:
        label_head = LabelHead.build(target, vocab_ids, device)
    probs = label_head.probs(final.to(device))  # (B, T, V_draft)
    t2d = t2d.to(device)
    return Batch(aux=aux.to(device), input_ids=ids.to(device),
                 position_ids=torch.arange(t, device=device).expand(b, t), probs=probs,
                 argmax=argmax.to(device), valid=valid.to(device), in_vocab=t2d[argmax.to(device)],
                 want_draft=target_to_draft(argmax.to(device), t2d))


def scored(samples: Sequence[dict], loss_on: str) -> list[torch.Tensor] | None:
    """The per-sample position masks of ``loss_on``: reply positions, or None (all positions)."""
    return [s["reply"] for s in samples] if loss_on == "reply" else None


def _shift(x: torch.Tensor, j: int, fill) -> torch.Tensor:
    """x (B, T, ...) shifted left by j along T, padded with ``fill`` -> (B, T, ...)."""
    if j == 0:
        return x
    pad = torch.full_like(x[:, :j], fill)
    return torch.cat([x[:, j:], pad], dim=1)


def scored_counts(batch: Batch, steps: int) -> torch.Tensor:
    """Per unroll step j, the positions ``ttt_loss`` averages step j's loss over -> (steps,) int64."""
    inv = batch.in_vocab & batch.valid  # (B, T)
    return torch.stack([inv[:, j:].sum() for j in range(steps)])  # (steps,)


class SoftCrossEntropy(torch.autograd.Function):
    """Per row, -Σ_v p_v log softmax(z)_v = logsumexp(z) - Σ_v p_v z_v (the labels ``p`` sum to 1), in float32,
    and the row's top-1 index.

    The same value and gradient, softmax(z) - p, as ``-(p * F.log_softmax(z)).sum(-1)``, in fewer passes
    over the (rows, V_draft) tensors, which dominate a training step's non-matmul time: no log-probability
    tensor is kept, the backward is one chain of in-place ops, and the top-1 comes from the float32 copy
    the loss reads anyway (a bf16 argmax is several times slower). ``z`` may be bf16 (autocast): it is read
    in float32 (float64 stays float64) and its gradient returned in its own dtype.
    Returns (ce (...,) float32, top1 (...,) int64: ``z.argmax(-1)``, the first maximal index).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (..., V)
        top, top1 = z.max(-1)  # (...,)
        lse = (z - top.unsqueeze(-1)).exp_().sum(-1).log_().add_(top)  # (...,)
        with torch.autocast(z.device.type, enabled=False):  # einsum runs as bmm, which autocast would make bf16
            dot = torch.einsum("...v,...v->...", probs, z)  # (...,)
        ctx.save_for_backward(logits, probs, lse)
        ctx.mark_non_differentiable(top1)
        return lse - dot, top1

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _):
        logits, probs, lse = ctx.saved_tensors
        g = (logits.to(lse.dtype) - lse.unsqueeze(-1)).exp_().sub_(probs).mul_(grad.unsqueeze(-1))  # (..., V)
        return g.to(logits.dtype), None


def ttt_loss(draft: Eagle3Draft, batch: Batch, steps: int, decay: float = 0.8,
             denominators: torch.Tensor | None = None, unroll: Callable | None = None):
    """Weighted soft cross-entropy of the unrolled draft and per-step statistics.

    Step j, row i is scored at target position i+1+j (``probs``/``argmax`` shifted by j);
    it counts when that position is valid, and in the loss only when the target's greedy
    token there is in the draft vocabulary.
    ``denominators`` (steps,): what step j's summed cross-entropy is divided by (default: this
    batch's own ``scored_counts``; data-parallel training passes the counts of the global batch).
    Returns (loss, stats, outs): stats[j] = {"loss", "correct", "scored", "correct_in_vocab",
    "in_vocab"} (counts of this batch); outs = ``Eagle3Draft.unroll``'s output (``unroll``: that method
    compiled, ``elsi.models.compiled``).
    """
    g = draft.fuse(batch.aux)  # (B, T, d)
    outs = (draft.unroll if unroll is None else unroll)(g, batch.input_ids, batch.position_ids, steps)
    total = g.new_zeros(())
    stats = []
    t = batch.input_ids.shape[1]
    for j, (logits, _) in enumerate(outs):
        # Rows 0..T-1-j of step j are scored at target positions j+1..T: slices, not shifted copies.
        logits = logits[:, : t - j]  # (B, T-j, Vd)
        probs = batch.probs[:, j:]  # (B, T-j, Vd)
        valid = batch.valid[:, j:]  # (B, T-j)
        inv = batch.in_vocab[:, j:] & valid  # (B, T-j)
        ce, top1 = SoftCrossEntropy.apply(logits, probs)  # (B, T-j) float32, (B, T-j) draft ids
        n_in = inv.sum()
        denom = n_in if denominators is None else denominators[j]
        step_loss = (ce * inv).sum() / denom.clamp(min=1)
        total = total + decay**j * step_loss
        hit = (top1 == batch.want_draft[:, j:]) & valid  # (B, T-j): the draft's top-1 is the target's token
        stats.append({"loss": float(step_loss.detach()), "correct": int(hit.sum()), "scored": int(valid.sum()),
                      "correct_in_vocab": int((hit & inv).sum()), "in_vocab": int(n_in)})
    return total, stats, outs


def chain_runs(draft: Eagle3Draft, batch: Batch, outs: list) -> torch.Tensor:
    """Histogram (steps+1,) of accepted draft lengths of a greedy chain started at each valid row.

    Teacher forcing on the target's own greedy tokens makes depth j's inputs exactly those of
    chain drafting once depths 1..j-1 matched, so the leading run of matches is what a
    chain of ``steps`` drafts would get accepted.
    """
    steps = len(outs)
    alive = batch.valid.clone()  # (B, T)
    run = torch.zeros_like(batch.input_ids)  # (B, T)
    for j, (logits, _) in enumerate(outs):
        want = _shift(batch.argmax, j, -1)
        hit = (draft.to_target_ids(logits.argmax(-1)) == want) & _shift(batch.valid, j, False)
        alive &= hit
        run += alive.long()
    return torch.bincount(run[batch.valid], minlength=steps + 1)


_COUNTS = ("correct", "scored", "correct_in_vocab", "in_vocab")


@dataclass
class Tally:
    """``ttt_loss``'s per-step statistics and ``chain_runs``' histogram, summed over batches."""

    steps: int  # unroll depth
    agg: list[dict] = field(default_factory=list)  # per step: loss_sum (loss x in_vocab) and the ``_COUNTS``
    runs: torch.Tensor | None = None  # (steps+1,) int64 histogram of accepted chain lengths

    def __post_init__(self) -> None:
        if not self.agg:
            self.agg = [{"loss_sum": 0.0, **{k: 0 for k in _COUNTS}} for _ in range(self.steps)]
        if self.runs is None:
            self.runs = torch.zeros(self.steps + 1, dtype=torch.long)

    def score(self, draft: Eagle3Draft, batch: Batch) -> None:
        """Unroll ``draft`` on ``batch`` (``ttt_loss``) and add its figures."""
        _, stats, outs = ttt_loss(draft, batch, self.steps)
        for s, acc in zip(stats, self.agg):
            acc["loss_sum"] += s["loss"] * s["in_vocab"]
            for k in _COUNTS:
                acc[k] += s[k]
        self.runs += chain_runs(draft, batch, outs).cpu()  # the histogram stays on the CPU whatever the device

    @classmethod
    def pooled(cls, tallies: Sequence[Tally], steps: int) -> Tally:
        """The sums of ``tallies``, added in their order."""
        out = cls(steps)
        for t in tallies:
            for acc, add in zip(out.agg, t.agg):
                for k in acc:
                    acc[k] += add[k]
            out.runs += t.runs
        return out

    def summary(self) -> dict:
        return summarize(self.agg, self.runs)


def summarize(agg: list[dict], runs: torch.Tensor) -> dict:
    """Per-depth match rates and the expected chain acceptance length (drafts accepted + 1)."""
    match = [a["correct"] / max(1, a["scored"]) for a in agg]
    rates = {
        "depth": list(range(1, len(agg) + 1)),
        "match": match,
        "match_in_vocab": [a["correct_in_vocab"] / max(1, a["in_vocab"]) for a in agg],
        "loss": [a["loss_sum"] / max(1, a["in_vocab"]) for a in agg],
        "scored": [a["scored"] for a in agg],
        "in_vocab_rate": [a["in_vocab"] / max(1, a["scored"]) for a in agg],
    }
    total = int(runs.sum())
    prod, acc = 1.0, 1.0
    for p in match:
        prod *= p
        acc += prod
    rates["accept_length_chain"] = 1.0 + float((runs * torch.arange(runs.numel())).sum()) / max(1, total)
    rates["accept_length_product"] = acc
    rates["chain_histogram"] = runs.tolist()
    return rates


__all__ = ["Batch", "LabelHead", "SoftCrossEntropy", "Tally", "chain_runs", "make_batch", "scored", "scored_counts",
           "summarize", "ttt_loss"]
