"""The per-engine checks of a draft's layer set, and config fragments (``elsi export --layers``).

The draft directory's own format, the engine-facing keys of its ``config.json`` and the drafts other
tools write, is the draft stage's (``elsi.draft.checkpoint``; older elsi drafts: ``elsi.draft.compat``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from elsi.draft.checkpoint import engine_keys
from elsi.engines.rules import ENGINES, EngineLoadError, engine_feed

FORMATS = ("vllm", "sglang", "specforge", "dflash")  # config fragments (``elsi export --layers``)
DEFAULT_M = {"dflash": 5}  # layer count a format's drafts use by default (EAGLE-3's: 3)


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


__all__ = ["DEFAULT_M", "FORMATS", "check_exportable", "check_for_engine", "count_problems", "engine_problems",
           "export_fragment", "warn_engines"]
