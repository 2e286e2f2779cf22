"""Draft training: soft cross-entropy against the target, training-time test unrolled ``ttt`` steps.

Step by step (Li et al., "EAGLE-3", 2025, with this project's choices from docs/design.md):
1. Features: one target forward per sample, cached (``elsi.draft.features``).
2. Vocabulary: the ``draft_vocab`` most frequent target greedy tokens of the training split
   (``elsi.draft.vocab``); a position whose target argmax is outside it is masked.
3. Loss of one batch: ``unroll`` the draft ``ttt`` steps; step j is scored against the
   target's distribution on the draft vocabulary at the position j+1 ahead, weight 0.8^j.
   That distribution is EAGLE3's softmax over ``target_logits[..., t2d]``: the softmax of
   the V_draft logits of the target's head rows at the draft ids (``LabelHead``, computed
   once per batch from the cached LM-head inputs), i.e. the full softmax restricted to the
   draft vocabulary and renormalised.
4. AdamW, linear warm-up then cosine decay, gradient-norm clip; stop at ``epochs``,
   ``max_steps`` or ``time_budget``, whichever comes first; checkpoint to resume.

Checkpoints (``resume/checkpoint.safetensors``, out of the way of engines that load every
``*.safetensors`` of a draft directory): the draft's and the optimizer's tensors, with the
step, data position, curves, optimizer hyper-parameters and settings as JSON in the header,
and the file's checksum (``elsi.collect.store.save_tensors``); no pickle. Written every
``checkpoint_every``, at the end, and when the loop is interrupted (Ctrl-C / SIGINT: the
current step finishes, the checkpoint is written, then KeyboardInterrupt propagates). A run
with no scored training or held-out position is an error before any step.

Data parallel: under torchrun the draft is wrapped in DistributedDataParallel and each rank
takes a share of every step's batch (``train_draft``); the result equals one process's.

Determinism: with a fixed ``max_steps`` (and a time budget that does not bind) two runs with
the same seed give the same weights. With a binding time budget the cosine schedule follows
elapsed time, so the step count (and the result) depends on the machine's speed.
"""

from __future__ import annotations

import json
import math
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from elsi.collect.collector import dist_info
from elsi.collect.store import RunError, load_tensors, lock, save_tensors
from elsi.config import opt, settings_diff
from elsi.draft.features import FeatureStore, split_samples
from elsi.draft.model import Eagle3Draft, config_for_target, init_weights
from elsi.draft.vocab import build_vocab, target_to_draft
from elsi.models import adapters
from elsi.models.compiled import compiled
from elsi.models.load import Target

# In a subdirectory: vLLM and SGLang load every *.safetensors file at the top of a draft directory.
CHECKPOINT = "resume/checkpoint.safetensors"
LEGACY_CHECKPOINT = "checkpoint.pt"  # pickle, written by older elsi versions: never loaded
CHECKPOINT_FORMAT = 1
TRAINING = "training.json"


def parse_duration(text: str) -> float:
    """'20m', '90s', '1.5h', '1200' (seconds), '' or '0' (no limit -> inf) -> seconds."""
    text = str(text).strip().lower()
    if text in ("", "0", "none"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([smh]?)", text)
    if not m:
        raise ValueError(f"bad duration {text!r}: use e.g. 90s, 20m, 1.5h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass(frozen=True)
class TrainConfig:
    """Draft model and its training."""

    layers: str = opt(help="target hidden-state ids the draft reads, e.g. 2,15,27 (docs/design.md numbering)")
    out: str = opt(help="output directory of the draft (model.safetensors, config.json, training.json)")
    draft_vocab: int = opt(8192, "draft vocabulary: the most frequent target tokens of the training data")
    ttt: int = opt(1, "training-time-test unroll depth (step i weighted 0.8^i); 1 = depth-1 only, the best use of "
                      "a CPU budget; EAGLE3 uses 7 (each step costs about one more depth-1 pass)")
    lr: float = opt(1e-3, "peak learning rate of AdamW (1e-3 beat 3e-3 on held-out match with one conversation "
                          "per step: bench/results/recipe.json)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(10, "linear warm-up steps")
    epochs: float = opt(4.0, "passes over the training split (fractions allowed)")
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = no limit)")
    time_budget: str = opt("20m", "wall-clock limit of the training loop, e.g. 20m, 90s (features not counted)")
    batch_size: int = opt(1, "conversations per optimizer step (padded to the longest; 1 = no padding, most steps)")
    grad_clip: float = opt(0.5, "gradient-norm clip")
    heldout: float = opt(0.05, "fraction of the conversations held out")
    loss_on: str = opt("reply", "positions scored in training and held-out figures: 'reply' (predictions of "
                                "assistant-reply tokens, what decoding drafts) or 'all'", choices=("reply", "all"))
    fc_norm: bool = opt(False, "RMS-normalise each target state before fc (EAGLE-3.1 fc_norm: vLLM, SGLang, "
                               "SpecForge and speculators load it)")
    aux_scale: bool = opt(False, "train fc on target states scaled to unit RMS per feature (folded into fc when "
                                "saved: same EAGLE3 format); off = raw states")
    head_init: str = opt("random", "initial LM head: 'target' (the target's head rows of the draft vocabulary, "
                                   "final-norm scale folded in) or 'random'", choices=("target", "random"))
    train_dtype: str = opt("auto", "precision of the draft's matrix products in training: bfloat16 (autocast; "
                                   "float32 master weights, optimizer and loss), float32, or auto (bfloat16 where "
                                   "the device multiplies it natively: AMX/AVX512-BF16 CPUs, CUDA >= sm80)",
                           choices=("auto", "float32", "bfloat16"))
    train_compile: bool = opt(False, "torch.compile the draft's unrolled forward (and backward) in training (the "
                                     "first step compiles; measured: bench/results/bf16_train_compile.json)")
    layer_init: str = opt("auto", "initial midlayer: 'target' (the target's last decoder layer: its attention "
                                  "read the state half of the draft's [embedding ; state] input, its MLP and norms "
                                  "copied; Llama-type layers), 'random', or auto (target where the target's layer is "
                                  "of the draft's Llama type, random elsewhere; measured: bench/results/"
                                  "layer_init_1500.json)", choices=("auto", "target", "random"))
    freeze_head: bool = opt(False, "keep the LM head at its initial weights (saves a third of its compute)")
    eval_every: str = opt("2m", "held-out check (on up to 16 held-out conversations) every this long")
    checkpoint_every: str = opt("2m", "checkpoint for resuming every this long")
    restart: bool = opt(False, "ignore an existing checkpoint in --out and start over")

    def __post_init__(self) -> None:
        if self.ttt < 1:
            raise ValueError(f"ttt must be >= 1, got {self.ttt}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.aux_scale and self.fc_norm:
            raise ValueError("aux_scale and fc_norm both rescale fc's inputs; choose one")
        if self.train_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"train_dtype must be auto, float32 or bfloat16, got {self.train_dtype!r}")
        if self.loss_on not in ("reply", "all"):
            raise ValueError(f"loss_on must be 'reply' or 'all', got {self.loss_on!r}")
        if self.head_init not in ("target", "random"):
            raise ValueError(f"head_init must be 'target' or 'random', got {self.head_init!r}")
        if self.layer_init not in ("auto", "target", "random"):
            raise ValueError(f"layer_init must be auto, 'target' or 'random', got {self.layer_init!r}")
        if self.freeze_head and self.head_init == "random":
            raise ValueError("freeze_head with head_init='random' would keep a random head; use head_init='target'")
        for name in ("time_budget", "eval_every", "checkpoint_every"):
            parse_duration(getattr(self, name))


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
    softcap: float | None  # the target's final logit soft-capping, if any

    @classmethod
    def build(cls, target: Target, vocab_ids: torch.Tensor, device: torch.device,
              dtype: torch.dtype = torch.float32) -> LabelHead:
        """``dtype``: of the head product (bfloat16 in bf16 training: float32 accumulation, logits rounded to
        bf16 before a float32 softmax); held-out figures use float32."""
        head = target.model.get_output_embeddings()
        ids = vocab_ids.to(head.weight.device)
        bias = getattr(head, "bias", None)
        cap = getattr(target.model.config.get_text_config(), "final_logit_softcapping", None)
        return cls(weight=head.weight.detach()[ids].to(device, dtype),  # (V_draft, d)
                   bias=None if bias is None else bias.detach()[ids].float().to(device), softcap=cap or None)

    @torch.no_grad()
    def probs(self, final: torch.Tensor) -> torch.Tensor:
        """final (..., d) LM-head inputs -> the target's distribution on the draft vocabulary (..., V_draft)."""
        logits = (final.to(self.weight.dtype) @ self.weight.T).float()  # (..., V_draft)
        if self.bias is not None:
            logits = logits + self.bias
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.softmax(logits, dim=-1)


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


@torch.no_grad()
def feature_scale(store: FeatureStore, indices: Sequence[int], layer_pos: Sequence[int],
                  max_tokens: int = 16384) -> torch.Tensor:
    """1 / RMS of each input feature of fc over the first ``max_tokens`` tokens of ``indices`` -> (m·d_t,).

    Features that never move (RMS below 1e-3) keep scale 1.
    """
    sq, n = None, 0
    for i in indices:
        aux = store.sample(i, layer_pos)["aux"].float()  # (T, m·d_t)
        sq = aux.pow(2).sum(0) if sq is None else sq + aux.pow(2).sum(0)
        n += aux.shape[0]
        if n >= max_tokens:
            break
    rms = (sq / max(1, n)).sqrt()  # (m·d_t,)
    return torch.where(rms > 1e-3, 1.0 / rms, torch.ones_like(rms))


LLAMA_LAYER = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
               "mlp.up_proj.weight", "mlp.down_proj.weight",
               *(f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))}


def layer_type_mismatch(target: Target) -> str | None:
    """Why the target's last decoder layer is not of the draft's own type (a Llama layer with a SiLU MLP, no
    biases, no q/k norms), or None when it is and ``--layer-init target`` can copy it."""
    layer = target.adapter.decoder(target.model).layers[-1]
    names = {n for n, _ in layer.named_parameters()}
    act = getattr(target.model.config.get_text_config(), "hidden_act", None)
    if names == LLAMA_LAYER and act == "silu":
        return None
    extra, missing = sorted(names - LLAMA_LAYER), sorted(LLAMA_LAYER - names)
    return (f"{type(layer).__name__} has activation {act!r}" + (f", parameters {extra} the draft's layer lacks"
            if extra else "") + (f", no {missing}" if missing else ""))


def resolve_layer_init(layer_init: str, target: Target) -> str:
    """``--layer-init auto`` -> 'target' where the target's last layer is of the draft's type, else 'random'."""
    if layer_init != "auto":
        return layer_init
    return "random" if layer_type_mismatch(target) else "target"


def init_layer_from_target(draft: Eagle3Draft, target: Target) -> None:
    """``--layer-init target``: the draft's midlayer from the target's last decoder layer (the one that turns
    the residual stream into what the LM head reads). q, k and v read the state half of the draft's
    [norm(embedding) ; norm(state)] input with the layer's projections (the embedding half keeps its random
    initialisation), and o_proj, the MLP and the norms are the layer's (its input norm as ``hidden_norm``).
    The layer must be of the draft's own type (``layer_type_mismatch``)."""
    why = layer_type_mismatch(target)
    if why:
        raise ValueError(f"--layer-init target needs a Llama-type decoder layer (the draft's own), but {why}: use "
                         "--layer-init random (or auto, which picks random for such targets)")
    layer = target.adapter.decoder(target.model).layers[-1]
    mid, d = draft.midlayer, draft.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):  # (out, 2d) <- (out, d) on the state half
            getattr(mid.self_attn, name).weight[:, d:].copy_(getattr(layer.self_attn, name).weight)
        mid.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
        mid.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)


@torch.no_grad()
def target_head_rows(target: Target, vocab_ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head as a draft head over ``vocab_ids`` (V_draft,) -> weight (V_draft, d).

    The draft computes ``lm_head(norm(h))`` with a unit-weight RMSNorm; the target computes
    ``W (s * h / rms(h))`` with its final norm's scale s. Folding s into the rows makes the
    draft's head equal the target's head (restricted to the draft vocabulary) at initialisation.
    s is read off the norm module itself (so (1 + w) norms work too): a row e_k has rms
    1/sqrt(d), so norm(I) = sqrt(d)·diag(s) up to eps.
    """
    head = target.model.get_output_embeddings().weight  # (V_target, d)
    d = head.shape[1]
    norm = target.adapter.decoder(target.model).norm
    eye = torch.eye(d, device=head.device, dtype=head.dtype)  # (d, d)
    scale = torch.diagonal(norm(eye)).float() / math.sqrt(d)  # (d,)
    return head[vocab_ids.to(head.device)].float() * scale  # (V_draft, d)


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


def lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to 0 over ``progress`` in [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate_store(draft: Eagle3Draft, target: Target, store: FeatureStore, indices: Sequence[int],
                   vocab_ids: torch.Tensor, steps: int, batch_size: int, device: torch.device,
                   loss_on: str = "reply") -> dict:
    """Held-out figures on ``indices``: loss and top-1 match with the target's greedy token per depth,
    over the positions ``loss_on`` names ('reply' or 'all')."""
    layer_pos = store.layer_index(draft.layer_ids)
    agg = [{"loss_sum": 0.0, "correct": 0, "scored": 0, "correct_in_vocab": 0, "in_vocab": 0} for _ in range(steps)]
    runs = torch.zeros(steps + 1, dtype=torch.long)  # histogram of accepted chain lengths
    was = draft.training
    draft.eval()
    label_head = LabelHead.build(target, vocab_ids, device)
    for a in range(0, len(indices), batch_size):
        samples = [store.sample(i, layer_pos) for i in indices[a: a + batch_size]]
        batch = make_batch(target, samples, vocab_ids, draft.t2d, device, label_head=label_head,
                           score=scored(samples, loss_on))
        _, stats, outs = ttt_loss(draft, batch, steps)
        for s, acc in zip(stats, agg):
            acc["loss_sum"] += s["loss"] * s["in_vocab"]
            for k in ("correct", "scored", "correct_in_vocab", "in_vocab"):
                acc[k] += s[k]
        runs += chain_runs(draft, batch, outs)
    draft.train(was)
    return summarize(agg, runs)


def scored(samples: Sequence[dict], loss_on: str) -> list[torch.Tensor] | None:
    """The per-sample position masks of ``loss_on``: reply positions, or None (all positions)."""
    return [s["reply"] for s in samples] if loss_on == "reply" else None


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


@dataclass
class Progress:
    step: int
    epoch: float
    elapsed_s: float
    tokens: int  # scored training positions so far (depth 1)
    loss: float  # recent weighted TTT loss
    acc: float  # recent depth-1 top-1 match
    lr: float
    heldout_acc: float | None = None
    note: str = ""
    step_loss: float = math.nan  # weighted TTT loss of this step's (global) batch
    total_steps: int = 0  # steps at which training stops unless the time budget ends it first (0: not known yet)
    info: str = ""  # a line for the user (what ends training), not an event: callbacks that only track steps skip it


def stop_rule(cfg: TrainConfig, total_steps: int, budget: float) -> str:
    """What ends training, in words: the step count (--max-steps or --epochs) or the time budget, whichever
    comes first (a progress bar over the budget's seconds alone reads 0/1200s while --max-steps ends the run)."""
    by = "--max-steps" if cfg.max_steps and cfg.max_steps == total_steps else f"{cfg.epochs:g} epochs"
    steps = f"{total_steps} steps ({by})"
    if math.isinf(budget):
        return f"training ends after {steps}"
    return f"training ends after {steps} or {cfg.time_budget} of training, whichever comes first"


class _TTTLoss(torch.nn.Module):
    """``ttt_loss`` as a module's forward, so that DistributedDataParallel can wrap the draft's training step."""

    def __init__(self, draft: Eagle3Draft, steps: int, unroll: Callable | None = None) -> None:
        super().__init__()
        self.draft = draft
        self.steps = steps
        self.unroll = unroll

    def forward(self, batch: Batch, denominators: torch.Tensor):
        return ttt_loss(self.draft, batch, self.steps, denominators=denominators, unroll=self.unroll)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def checkpoint_tensors(draft: Eagle3Draft, opt_: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The draft's and the optimizer's state as flat tensors (``draft.NAME``, ``optimizer.PARAM.KEY``) and
    the optimizer's JSON part (param groups, non-tensor state values)."""
    tensors = {f"draft.{k}": v.detach() for k, v in draft.state_dict().items()}
    sd = opt_.state_dict()
    extra: dict[str, dict] = {}
    for pid, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"optimizer.{pid}.{key}"] = val.detach()
            else:
                extra.setdefault(str(pid), {})[key] = val
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "state_extra": extra}


def restore_checkpoint(tensors: dict[str, torch.Tensor], optim_json: dict, draft: Eagle3Draft,
                       opt_: torch.optim.Optimizer) -> None:
    """Load ``checkpoint_tensors``' output back into ``draft`` and ``opt_`` (same values, bit for bit)."""
    draft.load_state_dict({k[len("draft."):]: v for k, v in tensors.items() if k.startswith("draft.")}, strict=True)
    state: dict[int, dict] = {}
    for name, val in tensors.items():
        if name.startswith("optimizer."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = val
    for pid, extra in optim_json.get("state_extra", {}).items():
        state.setdefault(int(pid), {}).update(extra)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in optim_json["param_groups"]]
    opt_.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(path: Path, draft: Eagle3Draft, opt_: torch.optim.Optimizer, settings: dict, state: dict) -> None:
    """Write ``resume/checkpoint.safetensors`` atomically (tensors + JSON header + checksum)."""
    tensors, optim_json = checkpoint_tensors(draft, opt_)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors(path, tensors, {"format": CHECKPOINT_FORMAT, "settings": settings, "state": state,
                                 "optimizer": optim_json})


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and JSON header of a checkpoint, checked against its checksum; RunError (a ValueError) naming
    the file otherwise."""
    fix = "rerun the same command with --restart to start this draft over (or choose another --out)"
    tensors, meta = load_tensors(path, fix=fix)
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT or "state" not in meta:
        raise RunError(f"{path} is not an elsi training checkpoint of format {CHECKPOINT_FORMAT}; {fix}")
    return tensors, meta


class _Interrupt:
    """Turns SIGINT (Ctrl-C) or SIGTERM (``kill``; a job started in the background ignores SIGINT) during the
    training loop into a flag read at the end of each step, so that the checkpoint written on the way out is
    that of a finished step. A second signal interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def scored_positions(store: FeatureStore, indices: Sequence[int], loss_on: str) -> int:
    """How many depth-1 predictions of ``indices`` training and held-out figures score (``make_batch``'s ``valid``)."""
    return sum(store.scored_count(i, loss_on) for i in indices)


def matmul_dtype(choice: str, device: torch.device) -> tuple[torch.dtype, str | None]:
    """The dtype of the draft's training matmuls for ``--train-dtype`` on ``device``, and a warning
    when bfloat16 was asked for where it would be emulated (several times slower than float32)."""
    fast, why = adapters.fast_bf16(device)  # looked up when called (tests stand in for the CPU's flags)
    if choice == "float32" or (choice == "auto" and not fast):
        return torch.float32, None
    if not fast:
        return torch.float32, (f"--train-dtype bfloat16: {why}, so bf16 products would be emulated, several times "
                               "slower than float32; training in float32 instead")
    return torch.bfloat16, None


# Training settings added after drafts and checkpoints were written, each with the value that does what those did:
# a record without the key was made with that value (its checkpoint resumes, a study's plan.json still matches).
SETTINGS_ADDED = {"layer_init": "random"}


def with_added_settings(train: dict) -> dict:
    """A record's training settings with the keys added since (``SETTINGS_ADDED``) filled in where absent."""
    return {**SETTINGS_ADDED, **train}


def _settings_key(cfg: TrainConfig, feature_settings: dict, samples: int) -> dict:
    keep = {k: v for k, v in asdict(cfg).items()
            if k not in ("out", "restart", "eval_every", "checkpoint_every", "train_compile")}
    return {"train": keep, "features": feature_settings, "samples": samples}


def train_draft(target: Target, store: FeatureStore, cfg: TrainConfig, seed: int, device: torch.device,
                samples: int | None = None, on_progress: Callable[[Progress], None] | None = None) -> dict:
    """Train (or resume) a draft on cached features and write it to ``cfg.out``. Returns training.json's dict.

    Under torch.distributed (torchrun) with W processes the draft is wrapped in
    DistributedDataParallel: every step's batch of ``cfg.batch_size`` conversations comes from
    the same seeded order on every rank, rank r takes conversations r, r+W, ... of it, and
    the loss is normalised by the global count of scored positions, so the gradients, the
    logged figures and the weights are those of one process with the same batch (up to
    floating-point summation order). Rank 0's clock decides the time budget, evaluation and
    checkpoints; rank 0 alone evaluates and writes, the other ranks wait at a barrier. Another
    process writing ``cfg.out`` is an error (``lock``: rank 0 holds the draft directory's lock).
    """
    rank, world = dist_info()
    with lock(cfg.out, "the draft directory") if rank == 0 else nullcontext():
        return _train_draft(target, store, cfg, seed, device, samples, on_progress, rank, world)


def _train_draft(target: Target, store: FeatureStore, cfg: TrainConfig, seed: int, device: torch.device,
                 samples: int | None, on_progress: Callable[[Progress], None] | None, rank: int, world: int) -> dict:
    """``train_draft`` in process ``rank`` of ``world``, rank 0 holding the draft directory's lock."""
    from elsi.draft.features import parse_layers

    if world > 1 and cfg.batch_size < world:
        raise ValueError(f"batch_size {cfg.batch_size} is smaller than the world size {world}: every process "
                         f"needs a share of each step's batch; use a batch size of at least {world}")
    layers = parse_layers(cfg.layers, target.num_layers)
    layer_pos = store.layer_index(layers)
    n = min(len(store), samples or len(store))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings_key(cfg, store.manifest["settings"], n)

    # Step 1: split and vocabulary (both deterministic functions of the data and seed).
    train_idx, held_idx = split_samples(n, cfg.heldout, seed)
    if len(held_idx) == 1 and rank == 0:
        held_tokens = sum(store.samples[i]["length"] for i in held_idx)
        warnings.warn(f"the held-out split is one conversation ({held_tokens} tokens: {n} conversations x --heldout "
                      f"{cfg.heldout}, rounded up): every held-out figure rests on it alone; raise --samples or "
                      "--heldout for a held-out set that measures something", stacklevel=2)
    max_tokens = store.manifest["settings"].get("max_tokens")
    for what, idx in (("training", train_idx), ("held-out", held_idx)):
        if scored_positions(store, idx, cfg.loss_on) == 0:
            why = (f"none of its {len(idx)} conversations has an assistant-reply token within --max-tokens "
                   f"{max_tokens} (--loss-on reply)" if cfg.loss_on == "reply" else
                   f"its {len(idx)} conversations have fewer than 2 tokens each")
            raise ValueError(f"the {what} split has no position to score: {why}; raise --max-tokens, use data with "
                             "shorter prompts, or pass --loss-on all")
    vocab_size = int(target.adapter.embed_tokens(target.model).weight.shape[0])
    vocab_ids, d2t, t2d, counts = build_vocab(
        (store.argmax(i) for i in train_idx), vocab_size, cfg.draft_vocab)
    coverage = float(counts[vocab_ids].sum()) / max(1, int(counts.sum()))

    # Step 2: the draft, its optimizer, and any checkpoint to resume from.
    dcfg = config_for_target(target, layers, draft_vocab_size=len(vocab_ids), fc_norm=cfg.fc_norm)
    draft = Eagle3Draft(dcfg, target.adapter.embed_tokens(target.model))
    gen = torch.Generator().manual_seed(seed)
    init_weights(draft, gen)
    draft.set_vocab(d2t, t2d)
    layer_init = resolve_layer_init(cfg.layer_init, target)
    if layer_init == "target":
        init_layer_from_target(draft, target)
    if cfg.head_init == "target":
        with torch.no_grad():
            draft.lm_head.weight.copy_(target_head_rows(target, vocab_ids))
    draft.lm_head.weight.requires_grad_(not cfg.freeze_head)
    if cfg.aux_scale:
        draft.set_aux_scale(feature_scale(store, train_idx, layer_pos))
    draft.to(device).train()
    mm_dtype, warning = matmul_dtype(cfg.train_dtype, device)
    label_head = LabelHead.build(target, vocab_ids, device, mm_dtype)  # training's soft labels
    # The fused kernel (CPU and CUDA): one pass over all weights instead of a loop per tensor; on
    # a CPU the optimizer step is a visible share of a one-conversation step.
    opt_ = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr,
                             betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                             fused=device.type in ("cpu", "cuda") or None)
    mm_name = str(mm_dtype).removeprefix("torch.")
    state = {"step": 0, "epoch": 0, "pos": 0, "elapsed": 0.0, "tokens": 0, "curve": [], "heldout_curve": [],
             "matmul_dtype": mm_name}
    ck = out / CHECKPOINT
    legacy = out / LEGACY_CHECKPOINT
    if cfg.restart and rank == 0:
        legacy.unlink(missing_ok=True)
    elif legacy.is_file() and not ck.is_file():
        raise ValueError(f"{legacy} is a checkpoint of an older elsi, saved with pickle, which elsi does not load "
                         "(unpickling can run code): pass --restart to start this draft over (it deletes the file)")
    if ck.is_file() and not cfg.restart:
        tensors, saved = load_checkpoint(ck)
        diffs = settings_diff({**saved["settings"], "train": with_added_settings(saved["settings"]["train"])},
                              settings, "the checkpoint")
        if diffs:
            raise ValueError(f"{ck} was written with other settings: " + "; ".join(diffs) + "; pass the same "
                             "options to finish it, --restart to start over, or choose another --out")
        had = saved["state"].get("matmul_dtype", mm_name)  # absent in checkpoints written before it was kept
        if had != mm_name:  # --train-dtype auto resolves per machine: the same settings, another precision
            raise ValueError(f"{ck} was trained with {had} matmuls, this run would go on in {mm_name} "
                             f"(--train-dtype {cfg.train_dtype}; {adapters.fast_bf16(device)[1]}): pass --train-dtype {had} "
                             "to finish it alike, or --restart to start over")
        restore_checkpoint(tensors, saved["optimizer"], draft, opt_)
        state = saved["state"]
        if on_progress:
            on_progress(Progress(state["step"], state["epoch"], state["elapsed"], state["tokens"], math.nan,
                                 math.nan, 0.0, note=f"resumed from {ck} at step {state['step']}"))
    budget = parse_duration(cfg.time_budget)
    eval_every = parse_duration(cfg.eval_every)
    ck_every = parse_duration(cfg.checkpoint_every)
    steps_per_epoch = math.ceil(len(train_idx) / cfg.batch_size)
    total_steps = math.ceil(cfg.epochs * steps_per_epoch)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    step_based = bool(cfg.max_steps) or math.isinf(budget)
    probe = held_idx[:16]
    unroll = compiled(draft.unroll, cfg.train_compile, device, "--train-compile")
    ddp = None
    if world > 1:  # every rank loaded the same initial (or checkpointed) weights
        ddp = torch.nn.parallel.DistributedDataParallel(
            _TTTLoss(draft, cfg.ttt, unroll), device_ids=[device] if device.type == "cuda" else None)

    def order(epoch: int) -> list[int]:
        perm = torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        return [train_idx[i] for i in perm.tolist()]

    def checkpoint() -> None:
        save_checkpoint(ck, draft, opt_, settings, state)

    # Step 3: the loop. bf16 autocast covers the draft's forward (and so its backward), and the soft labels'
    # head product is bf16 too (``label_head``); weights, AdamW and the loss (log-softmax and argmax in float32,
    # ``ttt_loss``) stay float32; held-out figures are computed in float32, the precision the engine drafts in.
    if warning and on_progress and rank == 0:
        on_progress(Progress(state["step"], state["epoch"], state["elapsed"], state["tokens"], math.nan, math.nan,
                             0.0, note=f"warning: {warning}"))
    if cfg.train_compile and on_progress and rank == 0:
        on_progress(Progress(state["step"], state["epoch"], state["elapsed"], state["tokens"], math.nan, math.nan,
                             0.0, note="compiling the draft's training step (in the first step)"))
    if on_progress and rank == 0 and state["step"] == 0:  # a fresh start (a resumed run says so in its note)
        on_progress(Progress(state["step"], state["epoch"], state["elapsed"], state["tokens"], math.nan, math.nan,
                             0.0, info=stop_rule(cfg, total_steps, budget), total_steps=total_steps))
    t_start = time.perf_counter() - state["elapsed"]
    last_eval = last_ck = state["elapsed"]
    recent: list[tuple[float, int, int]] = []
    perm = order(state["epoch"])
    with _Interrupt() as interrupt:  # Ctrl-C: finish the step, write the checkpoint, then stop
        while state["step"] < total_steps and state["elapsed"] < budget:
            if state["pos"] >= len(perm):
                state["epoch"] += 1
                state["pos"] = 0
                perm = order(state["epoch"])
            idx = perm[state["pos"]: state["pos"] + cfg.batch_size]
            state["pos"] += len(idx)
            mine = idx[rank::world]  # this process's share of the step's batch (all of it with one process)
            samples_ = [store.sample(i, layer_pos) for i in mine or idx[:1]]
            score = scored(samples_, cfg.loss_on)
            if not mine:  # an epoch's last batch, smaller than W: a fully masked stand-in keeps DDP in step
                score = [torch.zeros_like(s["ids"], dtype=torch.bool) for s in samples_]
            batch = make_batch(target, samples_, vocab_ids, t2d, device, label_head=label_head, score=score)
            progress = state["step"] / total_steps if step_based else max(state["step"] / total_steps,
                                                                          state["elapsed"] / budget)
            lr = cfg.lr * lr_factor(state["step"], progress, cfg.warmup_steps)
            for group in opt_.param_groups:
                group["lr"] = lr
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mm_dtype == torch.bfloat16):
                if ddp is None:
                    loss, stats, _ = ttt_loss(draft, batch, cfg.ttt, unroll=unroll)
                else:  # this rank's share of the global loss: per-step sums over the global batch's scored counts
                    counts = scored_counts(batch, cfg.ttt)  # (ttt,)
                    dist.all_reduce(counts)
                    loss, stats, _ = ddp(batch, counts)
            if not torch.isfinite(loss.detach()):  # before the step: the weights and the last checkpoint stay clean
                raise ValueError(f"the training loss is {float(loss.detach())} at step {state['step'] + 1}: a non-finite "
                                 f"target feature or label in {store.path}, or a learning rate too high ({lr:g}); "
                                 "nothing of this step was applied")
            opt_.zero_grad(set_to_none=True)
            (loss * world).backward()  # DDP averages the W ranks' gradients: x W makes them the global batch's
            torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], cfg.grad_clip)
            opt_.step()
            state["step"] += 1
            figures = [float(loss.detach()), stats[0]["correct"], stats[0]["scored"]]
            if ddp is None:
                state["elapsed"] = time.perf_counter() - t_start
            else:  # the global batch's figures, rank 0's clock for every decision that follows, any rank's Ctrl-C
                figures.append(time.perf_counter() - t_start if rank == 0 else 0.0)
                figures.append(1.0 if interrupt.requested else 0.0)
                total = torch.tensor(figures, dtype=torch.float64, device=device)
                dist.all_reduce(total)
                figures = [total[0].item(), round(total[1].item()), round(total[2].item())]
                state["elapsed"] = total[3].item()
                stop = total[4].item() > 0  # every rank stops after the same step
            state["tokens"] += figures[2]
            recent = (recent + [tuple(figures)])[-20:]
            r_loss = sum(r[0] for r in recent) / len(recent)
            r_acc = sum(r[1] for r in recent) / max(1, sum(r[2] for r in recent))
            if state["step"] % 10 == 0 or state["step"] == 1:
                state["curve"].append({"step": state["step"], "elapsed_s": round(state["elapsed"], 2),
                                       "tokens": state["tokens"], "lr": lr, "loss": r_loss, "acc": r_acc})
            held = None
            if state["elapsed"] - last_eval >= eval_every:
                if rank == 0:
                    held = evaluate_store(draft, target, store, probe, vocab_ids, min(cfg.ttt, 3), cfg.batch_size,
                                          device, cfg.loss_on)
                    state["heldout_curve"].append({"step": state["step"], "elapsed_s": round(state["elapsed"], 2),
                                                   "match": held["match"], "loss": held["loss"]})
                _barrier(world)
                last_eval = state["elapsed"]
                t_start = time.perf_counter() - state["elapsed"]  # evaluation time is not training time
            if state["elapsed"] - last_ck >= ck_every:
                if rank == 0:
                    checkpoint()
                _barrier(world)
                last_ck = state["elapsed"]
            if on_progress:
                try:
                    on_progress(Progress(state["step"], state["epoch"] + state["pos"] / len(perm), state["elapsed"],
                                         state["tokens"], r_loss, r_acc, lr, held["match"][0] if held else None,
                                         step_loss=figures[0]))
                except KeyboardInterrupt:  # Ctrl-C outside the handler (or raised by the caller): the same
                    interrupt.requested = True
            if ddp is None:
                stop = interrupt.requested
            if stop:
                if rank == 0:
                    checkpoint()
                _barrier(world)
                raise KeyboardInterrupt
    if rank != 0:  # rank 0 evaluates and writes; the others return its record
        _barrier(world)
        return json.loads((out / TRAINING).read_text())
    checkpoint()

    # Step 4: held-out figures, then the draft and its record.
    draft.fold_aux_scale()  # the weights that are saved are the ones evaluated
    final = evaluate_store(draft, target, store, held_idx, vocab_ids, cfg.ttt, cfg.batch_size, device, cfg.loss_on)
    draft.save_pretrained(out)
    record = {
        "status": "complete",
        "settings": settings,
        "layers": list(layers),
        "num_params": sum(p.numel() for p in draft.parameters()),
        "data": {"samples": n, "train_samples": len(train_idx), "heldout_samples": len(held_idx),
                 "train_tokens": sum(store.samples[i]["length"] for i in train_idx),
                 "heldout_tokens": sum(store.samples[i]["length"] for i in held_idx),
                 "features_dir": str(store.path), "features_dtype": store.dtype, "draft_vocab_size": len(vocab_ids),
                 "draft_vocab_coverage": coverage},
        "steps": state["step"],
        "epochs": state["epoch"] + state["pos"] / max(1, len(perm)),
        "train_seconds": state["elapsed"],
        "train_tokens_seen": state["tokens"],
        "train_tokens_per_s": state["tokens"] / max(1e-9, state["elapsed"]),
        "train_matmul_dtype": mm_name,
        "train_compiled": cfg.train_compile,
        "layer_init": layer_init,  # --layer-init auto resolved for this target
        "curve": state["curve"],
        "heldout_curve": state["heldout_curve"],
        "heldout": final,
    }
    (out / TRAINING).write_text(json.dumps(record, indent=1))
    _barrier(world)
    return record
