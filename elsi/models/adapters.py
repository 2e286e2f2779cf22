"""Model-family adapters: everything that differs between target architectures.

One adapter per family, behind a registry keyed by the Hugging Face class name
(``type(model).__name__``; GGUF loads carry no ``config.architectures``). An unknown
family raises a clear error that lists the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Plain template used when a tokenizer has no chat template (e.g. Gemma-3-270M base).
# Each turn is "<Role>: <text>\n\n"; a generation prompt ends with "Assistant:".
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


@dataclass(frozen=True)
class Adapter:
    """What elsi needs to know about one model family."""

    name: str  # family name, e.g. "llama"
    sliding_window_attr: str | None = None  # config attribute holding the window, if any
    logit_softcap_attr: str | None = None  # config attribute holding the final logit soft-cap, if any

    def decoder(self, model: nn.Module) -> nn.Module:
        """The base decoder (``model.model``) that holds embeddings, layers and norm."""
        return model.model

    def num_layers(self, model: nn.Module) -> int:
        return int(model.config.get_text_config().num_hidden_layers)

    def hidden_size(self, model: nn.Module) -> int:
        return int(model.config.get_text_config().hidden_size)

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        return self.decoder(model).embed_tokens

    def layer_types(self, model: nn.Module) -> list[str]:
        """Attention type per decoder layer ("full_attention" or "sliding_attention")."""
        cfg = model.config.get_text_config()
        types = getattr(cfg, "layer_types", None)
        return list(types) if types else ["full_attention"] * self.num_layers(model)

    def sliding_window(self, model: nn.Module) -> int | None:
        if self.sliding_window_attr is None:
            return None
        return getattr(model.config.get_text_config(), self.sliding_window_attr, None)

    def logit_softcap(self, model: nn.Module) -> float | None:
        """The cap c of the family's final logit soft-capping (``soft_cap``), or None (no capping)."""
        if self.logit_softcap_attr is None:
            return None
        return getattr(model.config.get_text_config(), self.logit_softcap_attr, None) or None


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final logit soft-capping, c * tanh(logits / c) (Gemma); ``logits`` (..., V) as they are where ``cap`` is None."""
    return torch.tanh(logits / cap) * cap if cap else logits


LLAMA = Adapter(name="llama")
GEMMA3 = Adapter(name="gemma3", sliding_window_attr="sliding_window", logit_softcap_attr="final_logit_softcapping")

# HF class name -> adapter. Llama-style families share one adapter: their decoders differ
# only inside HF's own modeling code, which elsi never copies.
REGISTRY: dict[str, Adapter] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "Gemma3ForCausalLM": GEMMA3,
}


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of ``model``'s family; a clear error for an unknown one."""
    name = type(model).__name__
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unsupported model class {name!r}; elsi knows: {known}")
    return REGISTRY[name]


def plain_template(messages: list[dict], add_generation_prompt: bool) -> str:
    """The documented fallback chat format for tokenizers without a chat template."""
    text = "".join(f"{PLAIN_ROLES[m['role']]}: {m['content']}\n\n" for m in messages)
    return text + ("Assistant:" if add_generation_prompt else "")
