"""Targets: resolving ``--model``, loading, and the per-family adapters."""

from elsi.models.adapters import REGISTRY, Adapter, adapter_for, plain_template
from elsi.models.load import (
    ALIASES,
    DEFAULT_MODEL,
    Target,
    cache_dir,
    load_target,
    model_num_layers,
    model_shape,
    resolve_model,
)

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "REGISTRY",
    "Adapter",
    "Target",
    "adapter_for",
    "cache_dir",
    "load_target",
    "model_num_layers",
    "model_shape",
    "plain_template",
    "resolve_model",
]
