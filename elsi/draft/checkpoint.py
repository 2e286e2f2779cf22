"""A draft directory's format as engines read it: file names, the engine-facing keys of ``config.json``,
and the configs and tensor names of drafts written by other tools.

elsi writes the layer set once per numbering (``elsi.engines.rules`` cites each engine's code):
the top-level ``eagle_aux_hidden_state_layer_ids`` in vLLM's (= elsi's ids) and
``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang/SpecForge's (id - 1), with
``"fc_norm": true`` and ``fc_norm.{i}.weight`` tensors where the draft normalises each state.
Drafts that older elsi versions wrote are read and upgraded by ``elsi.draft.compat``.
"""

from __future__ import annotations

from collections.abc import Sequence

WEIGHTS = "model.safetensors"  # the draft's tensors (EAGLE3 names, no embeddings)
CONFIG = "config.json"  # ``DraftConfig.to_json``: what engines read, and elsi's own block
TRAINING = "training.json"  # ``elsi train-draft``'s record: settings, curves, held-out figures


def engine_keys(layer_ids: Sequence[int], fc_norm: bool = False) -> dict:
    """The keys of ``config.json`` that vLLM, SGLang and SpecForge read for the layer set."""
    ids = [int(i) for i in layer_ids]
    return {
        "eagle_aux_hidden_state_layer_ids": ids,  # vLLM: HF hidden_states index (input of layer i)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],  # SGLang/SpecForge: output of layer i
                         "use_aux_hidden_state": True},
        "fc_norm": bool(fc_norm),
    }


# ---- drafts written by other tools (SpecForge, EAGLE, speculators) ----
_LLAMA_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def eagle_config_ids(config: dict) -> list[int] | None:
    """``eagle_config.eagle_aux_hidden_state_layer_ids`` of a config (SGLang/SpecForge numbering), or None."""
    lst = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(lst) if lst else None


def eagle3_default_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default layer set (2, N//2, N-3), in HF ``hidden_states`` numbering."""
    return (2, num_layers // 2, num_layers - 3)


def foreign_layer_ids(obj: dict, num_layers: int) -> tuple[int, ...]:
    """elsi ids of a draft config without an ``elsi`` block, as the tool that trained it captured them.

    speculators and vLLM-style configs: the top-level list (vLLM numbering); SpecForge/SGLang:
    ``eagle_config``'s list + 1; neither: EAGLE-3's default (2, N//2, N-3).
    """
    if obj.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) for i in obj["eagle_aux_hidden_state_layer_ids"])
    lst = eagle_config_ids(obj)
    if lst:
        return tuple(int(j) + 1 for j in lst)
    return eagle3_default_ids(num_layers)


def foreign_draft_config(obj: dict, num_layers: int, target_hidden_size: int) -> dict:
    """``DraftConfig`` fields from a foreign draft's standard keys, or a ValueError naming the missing ones.

    ``obj``: the parsed ``config.json``; speculators checkpoints keep the layer's fields under
    ``transformer_layer_config``. ``num_layers``/``target_hidden_size``: the target it will serve.
    """
    layer = dict(obj.get("transformer_layer_config") or obj)
    missing = [k for k in _LLAMA_KEYS if k not in layer]
    if missing:
        raise ValueError(f"draft config has no {missing}: it is neither an elsi draft nor an EAGLE3 "
                         "(SpecForge, EAGLE, speculators) config")
    heads = int(layer["num_attention_heads"])
    rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(layer.get("rope_theta", 10000.0))}
    if layer.get("rope_scaling"):
        rope = {**dict(layer["rope_scaling"]), "rope_theta": float(layer.get("rope_theta", 10000.0))}
    return {
        "layer_ids": foreign_layer_ids(obj, num_layers),
        "target_num_layers": num_layers,
        "target_hidden_size": int(obj.get("target_hidden_size") or target_hidden_size),
        "hidden_size": int(layer["hidden_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(layer.get("num_key_value_heads") or heads),
        "head_dim": int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
        "intermediate_size": int(layer["intermediate_size"]),
        "vocab_size": int(layer["vocab_size"]),
        "draft_vocab_size": int(obj.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer["vocab_size"]),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "hidden_act": str(layer.get("hidden_act", "silu")),
        "rope_parameters": dict(rope),
        "max_position_embeddings": int(layer.get("max_position_embeddings", 8192)),
        "fc_norm": bool(obj.get("fc_norm", False)),
    }


def foreign_weight_name(name: str) -> str | None:
    """A foreign checkpoint's tensor name -> elsi's (None: a tensor elsi does not keep).

    speculators stores the decoder layer as ``layers.0.*`` (EAGLE/SpecForge: ``midlayer.*``);
    SGLang's legacy per-layer norms ``aux_norm_{low,mid,high}`` are ``fc_norm.{0,1,2}``; the
    token embeddings are the target's (elsi reads them from the target, never from the draft).
    """
    if name.startswith("embed_tokens."):
        return None
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    for i, legacy in enumerate(("aux_norm_low", "aux_norm_mid", "aux_norm_high")):
        if name.startswith(legacy + "."):
            return f"fc_norm.{i}." + name[len(legacy) + 1:]
    return name


__all__ = ["CONFIG", "TRAINING", "WEIGHTS", "eagle3_default_ids", "eagle_config_ids", "engine_keys",
           "foreign_draft_config", "foreign_layer_ids", "foreign_weight_name"]
