"""Target model classes elsi adds to vLLM, so that it serves EAGLE-3 drafts for them.

Runs inside vLLM's own virtual environment (like ``vllm_worker``, which loads this file by its path
and calls ``register()`` before it builds the ``vllm.LLM``); it imports nothing from elsi.

vLLM 0.32 gives EAGLE-3 drafts to targets whose model class has the ``SupportsEagle3`` interface;
its ``Gemma3ForCausalLM`` has not. ``Gemma3ForCausalLMEagle3`` is vLLM's own class with it:

1. The decoder keeps the residual stream at the ids vLLM sets (``set_aux_hidden_state_layers``),
   in vLLM's numbering, which is Hugging Face's ``hidden_states`` index: id l is the input of
   decoder layer l (id 0 the scaled embedding), id N the last layer's output before the final
   norm, as ``LlamaModel`` keeps them (``EagleModelMixin._maybe_add_hidden_state``).
2. Gemma scales its token embeddings by sqrt(hidden_size) inside ``Gemma3Model.embed_input_ids``,
   but vLLM hands an EAGLE draft the target's ``embed_tokens`` module itself, whose output is
   unscaled: a draft trained on Hugging Face's (scaled) embeddings would read them 25x too small
   (sqrt(640) for Gemma-3-270M). Here the module scales, as Hugging Face's
   ``Gemma3TextScaledWordEmbedding`` does, and ``embed_input_ids`` no longer scales again: the target
   computes what it computed before, the draft reads the embeddings it was trained on.

Pipeline parallelism is not supported with auxiliary states (a clear error); everything else is
vLLM's own code.
"""

from __future__ import annotations

from itertools import islice

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM, Gemma3Model
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3

class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """vLLM's embedding, times ``normalizer`` (a 0-dim tensor: the product keeps the weight's dtype, as
    ``Gemma3Model.embed_input_ids`` computes it)."""

    normalizer: torch.Tensor

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return super().forward(input_) * self.normalizer


class Gemma3ModelEagle3(Gemma3Model, EagleModelMixin):
    """``Gemma3Model`` that also returns the residual stream at ``aux_hidden_state_layers``."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # already scaled (ScaledVocabParallelEmbedding)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if not self.aux_hidden_state_layers:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if get_pp_group().world_size > 1:
            raise NotImplementedError("EAGLE-3 on Gemma-3 (elsi's vLLM class): pipeline parallelism is not supported")
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)  # (T, d)
        residual = None
        aux: list[torch.Tensor] = []
        self._maybe_add_hidden_state(aux, 0, hidden_states, residual)
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
            hidden_states, residual = layer(positions, hidden_states, residual, **kwargs)
            self._maybe_add_hidden_state(aux, idx + 1, hidden_states, residual)  # stream = hidden + residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return (hidden_states, aux) if aux else hidden_states


class Gemma3ForCausalLMEagle3(Gemma3ForCausalLM, SupportsEagle3):
    """vLLM's ``Gemma3ForCausalLM``, built as vLLM builds it, then given the two changes above."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        inner = self.model
        inner.__class__ = Gemma3ModelEagle3  # a subclass with no state of its own
        inner.embed_tokens.__class__ = ScaledVocabParallelEmbedding
        inner.embed_tokens.normalizer = inner.normalizer  # the buffer embed_input_ids multiplied by


CLASSES = {"Gemma3ForCausalLM": Gemma3ForCausalLMEagle3}  # architecture -> the class register() serves it with


def register() -> None:
    """Serve each of ``CLASSES`` with its class in this process's vLLM (before ``vllm.LLM`` is built)."""
    from vllm import ModelRegistry

    for arch, cls in CLASSES.items():
        ModelRegistry.register_model(arch, cls)
