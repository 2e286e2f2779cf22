"""The engine-facing keys of a draft's ``config.json``, and reading drafts written by other tools.

elsi writes the layer set once per numbering (``elsi.engines.rules`` cites each engine's code):
the top-level ``eagle_aux_hidden_state_layer_ids`` in vLLM's (= elsi's ids) and
``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang/SpecForge's (id - 1), with
``"fc_norm": true`` and ``fc_norm.{i}.weight`` tensors where the draft normalises each state.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

from elsi.engines.rules import ENGINES, EngineLoadError, default_ids, eagle_config_ids, engine_feed

FORMATS = ("vllm", "sglang", "specforge", "dflash")  # config fragments (``elsi export --layers``)
DEFAULT_M = {"dflash": 5}  # layer count a format's drafts use by default (EAGLE-3's: 3)


def engine_keys(layer_ids: Sequence[int], fc_norm: bool = False) -> dict:
    """The keys of ``config.json`` that vLLM, SGLang and SpecForge read for the layer set."""
    ids = [int(i) for i in layer_ids]
    return {
        "eagle_aux_hidden_state_layer_ids": ids,  # vLLM: HF hidden_states index (input of layer i)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],  # SGLang/SpecForge: output of layer i
                         "use_aux_hidden_state": True},
        "fc_norm": bool(fc_norm),
    }


def count_problems(m: int) -> dict[str, str]:
    """Engine -> why an EAGLE-3 draft over m layers may not load there (engines absent from the dict load it).

    SpecForge: an error (it trains and exports exactly 3); speculators: an error (vLLM builds a speculators
    checkpoint's ``fc`` for 3 states: ``elsi.engines.rules``); vLLM: a warning (0.32 sizes ``fc`` from the
    config, builds that hard-code 3 x hidden do not load other counts); SGLang: any.
    """
    if m == 3:
        return {}
    vllm = (f"vLLM 0.32 sizes fc from the config, but vLLM builds that hard-code fc as 3 x hidden do not load "
            f"{m} layers")
    return {"specforge": f"SpecForge trains and exports exactly 3 aux layers, not {m}",
            "speculators": f"vLLM builds a speculators checkpoint's fc for 3 states (no num_aux_hidden_states or "
                           f"eagle_config reaches it), not {m}",
            "vllm": vllm, "vllm-v1": vllm}


def engine_problems(layer_ids: Sequence[int], num_layers: int, fc_norm: bool = False,
                    family: str = "") -> dict[str, str]:
    """Engine -> why it would not feed the draft exactly the HF hidden states ``layer_ids`` it was trained on.

    Applies each engine's rule (``elsi.engines.rules``) to the keys elsi writes, for a target of HF
    ``model_type`` ``family`` ("" = any other). The layer count alone is ``count_problems``' business
    (SpecForge's 3-layer rule is reported by both).
    """
    ids = tuple(int(i) for i in layer_ids)
    cfg = engine_keys(ids, fc_norm)
    out = {}
    for engine in ENGINES:
        try:
            fed = engine_feed(engine, cfg, num_layers, family)
        except EngineLoadError as err:
            out[engine] = str(err)
            continue
        if fed != ids:
            why = f"it feeds hidden_states {['pre-norm h_N' if f is None else f for f in fed]} to a draft trained on {list(ids)}"
            if num_layers in ids:
                why += f" (no engine captures the final, normed h_{num_layers})"
            if list(ids) != sorted(ids):
                why += " (engines concatenate the states in layer order)"
            out[engine] = why
    return out


def check_for_engine(layer_ids: Sequence[int], num_layers: int, engine: str) -> None:
    """ValueError where ``engine`` cannot serve a draft over ``layer_ids`` as trained; a warning where
    only some of its releases can (vLLM and a count other than 3). ``engine``: one of ``rules.CHECKED``
    ("speculators": vLLM serving the draft's speculators checkpoint, which reads the top-level ids as vLLM does)."""
    problem = engine_problems(layer_ids, num_layers).get("vllm" if engine == "speculators" else engine)
    count = count_problems(len(layer_ids)).get(engine)
    if problem is None and engine in ("specforge", "speculators"):
        problem = count
    if problem is not None:
        raise ValueError(f"{engine} cannot serve a draft over layers {list(layer_ids)} of an N = {num_layers} "
                         f"target: {problem}")
    if count is not None:
        warnings.warn(count, stacklevel=2)


def warn_engines(layer_ids: Sequence[int], num_layers: int) -> dict[str, str]:
    """One warning per engine that would not serve the layer set as trained (or only in some
    releases); returns engine -> reason."""
    problems = {**count_problems(len(layer_ids)), **engine_problems(layer_ids, num_layers)}
    for engine, why in problems.items():
        warnings.warn(f"layers {list(layer_ids)}: {engine}: {why}", stacklevel=2)
    return problems


def check_exportable(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Sorted, distinct ids in 1..N-1 or a ValueError naming the bad ones."""
    ids = tuple(sorted(int(i) for i in layers))
    if len(set(ids)) != len(ids):
        raise ValueError(f"repeated layer ids in {list(layers)}")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise ValueError(
            f"layer id(s) {bad} cannot be exported for N = {num_layers}: runtimes capture hidden states "
            f"h_1..h_{num_layers - 1} (h_0 is the embedding output, which SGLang cannot name; h_{num_layers} "
            "comes after the final norm, which no aux-hidden-state hook sees)"
        )
    return ids


def export_fragment(layers: Sequence[int], num_layers: int, fmt: str, model: str = "", family: str = "") -> dict:
    """The config fragment for ``fmt`` with a note naming the numbering it uses.

    SpecForge takes exactly three layers (an error otherwise); other counts warn, naming vLLM. ``dflash``:
    ``dflash_config.target_layer_ids`` in DFlash's numbering (a layer's output = elsi id - 1), which vLLM,
    SGLang and SpecForge read for DFlash-style drafts (any count). ``family``: the target's HF ``model_type``;
    a DeepSeek/GLM target whose SGLang takes the SGLang-numbered ids unshifted warns.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    ids = check_exportable(layers, num_layers)
    source = (f"elsi ids {list(ids)} (HF output_hidden_states numbering) of {model or 'the target'} "
              f"with N = {num_layers}")
    if fmt == "dflash":
        return {"dflash_config": {"target_layer_ids": [i - 1 for i in ids]},
                "_elsi_note": f"DFlash numbering = elsi id - 1 (output of decoder layer i; vLLM and SGLang add 1); "
                              f"{source}"}
    if fmt == "sglang" and family:
        why = engine_problems(ids, num_layers, family=family).get("sglang")
        if why:
            warnings.warn(f"SGLang on a {family} target: {why}", stacklevel=2)
    problems = count_problems(len(ids))
    if fmt == "specforge" and "specforge" in problems:
        raise ValueError(f"--format specforge: {problems['specforge']} (got layers {list(ids)})")
    if "vllm" in problems:
        warnings.warn(f"{len(ids)} layers: {problems['vllm']}; SpecForge needs exactly 3", stacklevel=2)
    keys = engine_keys(ids)
    if fmt == "vllm":
        return {"eagle_aux_hidden_state_layer_ids": keys["eagle_aux_hidden_state_layer_ids"],
                "_elsi_note": f"vLLM numbering = elsi ids (input of decoder layer i); {source}"}
    return {"eagle_config": keys["eagle_config"],
            "_elsi_note": f"{fmt} numbering = elsi id - 1 (output of decoder layer i); {source}"}


def stale_eagle_config(obj: dict) -> bool:
    """True for a ``config.json`` written by elsi before SGLang/SpecForge ids were shifted by one:
    its ``eagle_config`` list repeats the vLLM ids, so SGLang would capture every layer one too deep."""
    if "elsi" not in obj:
        return False
    top = obj.get("eagle_aux_hidden_state_layer_ids")
    lst = (obj.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return bool(top) and lst is not None and list(lst) != [int(i) - 1 for i in top]


def split_fc_norm(tensors: dict) -> dict:
    """Tensors with an older elsi's single (m, d_t) ``fc_norm`` split into EAGLE-3.1's ``fc_norm.{i}.weight``."""
    if "fc_norm" not in tensors:
        return dict(tensors)
    out = {k: v for k, v in tensors.items() if k != "fc_norm"}
    out.update({f"fc_norm.{i}.weight": w.contiguous() for i, w in enumerate(tensors["fc_norm"])})
    return out


def upgrade_draft(path: str | Path) -> list[str]:
    """Rewrite an elsi draft directory written before the engine fix, in place: ``eagle_config`` in
    SGLang/SpecForge numbering, ``"fc_norm"`` at the top level, ``fc_norm.{i}.weight`` tensors.
    Returns what changed (empty: already current)."""
    import json

    from safetensors.torch import load_file, save_file

    path = Path(path)
    cfg_path, w_path = path / "config.json", path / "model.safetensors"
    if not cfg_path.is_file() or not w_path.is_file():
        raise FileNotFoundError(f"{path} is not a draft directory (needs config.json and model.safetensors)")
    obj = json.loads(cfg_path.read_text())
    if "elsi" not in obj:
        raise ValueError(f"{cfg_path} has no 'elsi' block: only drafts elsi wrote can be upgraded")
    own = obj["elsi"]["draft_config"]
    keys = engine_keys(own["layer_ids"], own.get("fc_norm", False))
    changed = [k for k in keys if obj.get(k) != keys[k]]
    tensors = load_file(str(w_path))
    if "fc_norm" in tensors:
        save_file(split_fc_norm(tensors), str(w_path))
        changed.append("fc_norm tensors")
    if changed:
        obj.update(keys)
        obj["elsi"]["sglang_layer_ids"] = [int(i) - 1 for i in own["layer_ids"]]
        cfg_path.write_text(json.dumps(obj, indent=1))
    return changed


# ---- drafts written by other tools (SpecForge, EAGLE, speculators) ----
_LLAMA_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


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
    return default_ids(num_layers)


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


__all__ = ["DEFAULT_M", "FORMATS", "check_exportable", "check_for_engine", "count_problems", "engine_keys",
           "engine_problems", "export_fragment", "foreign_draft_config", "foreign_layer_ids", "foreign_weight_name",
           "split_fc_norm", "stale_eagle_config", "upgrade_draft", "warn_engines"]
