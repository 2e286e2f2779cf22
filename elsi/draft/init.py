"""A draft's initial weights from its target: the LM head's rows, the midlayer, and fc's input scale.

- ``--head-init target``: ``target_head_rows``, the target's head on the draft vocabulary with its final
  norm's scale folded in, so that the draft's head starts equal to the target's.
- ``--layer-init target`` (``auto``: where the target's layer is of the draft's type, ``resolve_layer_init``):
  ``init_layer_from_target``, the draft's midlayer from the target's last decoder layer.
- ``--aux-scale``: ``feature_scale``, 1 / RMS of each input feature of fc on the training data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from elsi.draft.cache import FeatureStore
from elsi.draft.model import Eagle3Draft
from elsi.models.load import Target


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


__all__ = ["LLAMA_LAYER", "feature_scale", "init_layer_from_target", "layer_type_mismatch", "resolve_layer_init",
           "target_head_rows"]
