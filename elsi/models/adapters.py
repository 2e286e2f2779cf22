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


def resolve_device(device: str | None) -> torch.device:
    """``None``/"auto" -> CUDA when present, else CPU. Resolved once at the entry point."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def fast_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` multiplies bfloat16 matrices natively (and so faster than float32), and why.

    CUDA: compute capability >= 8 (Ampere and later). CPU: AMX tiles (``amx_bf16``) or AVX512-BF16;
    without them PyTorch emulates bf16 products in float32 arithmetic, several times slower.
    """
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
        return ok, f"CUDA device {torch.cuda.get_device_name(device) if ok else device}: native bf16 = {ok}"
    if device.type == "cpu":
        amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
        avx = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
        return amx or avx, f"CPU: AMX tiles {amx}, AVX512-BF16 {avx}"
    return False, f"{device.type}: bf16 speed unknown"
