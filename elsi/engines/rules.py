"""How each serving or training engine reads an EAGLE3 draft's ``config.json`` (from their code).

elsi's layer ids index Hugging Face ``hidden_states`` (docs/design.md): ``h_0`` = embeddings, ``h_l`` =
output of decoder layer l-1 = input of decoder layer l, ``h_N`` = the final, *normed* state. Each
function below encodes one engine's rule and returns, per input slot of the draft's ``fc``, the
``hidden_states`` index the engine feeds it (``None`` where what it feeds has no HF index: vLLM's id
N is the last layer's output *before* the final norm), in the order the engine concatenates them.

- vLLM 0.32 (``vllm/v1/worker/gpu_model_runner.py``: ``_get_eagle3_aux_layers_from_config``;
  ``vllm/model_executor/models/llama.py``: ``_maybe_add_hidden_state``): the target reads the
  top-level ``eagle_aux_hidden_state_layer_ids`` (if absent: ``eagle_config``'s list, *unshifted*;
  if absent too: (2, N//2, N-3)); id 0 is the embedding output, id k >= 1 the residual stream after
  layer k-1, so k < N is ``h_k`` and k = N the un-normed last output. States are appended in
  layer order. ``fc`` has ``num_aux_hidden_states`` (or ``len(eagle_config list)``, or 3) slots
  (``llama_eagle3.py``); upstream vLLM builds that size ``fc`` as 3 x hidden load only 3 layers.
- SGLang 0.5 (``sglang/srt/models/llama.py``: ``set_eagle3_layers_to_capture``;
  ``.../spec_aux_hidden_state.py``): reads only ``eagle_config.eagle_aux_hidden_state_layer_ids``
  and captures the *input* of layer j+1 for each id j (= ``h_{j+1}``); no list: layers
  (2, N//2, N-3) are captured as they are. Layer inputs exist for 0..N-1 only. ``fc`` as vLLM's.
- SpecForge 0.2 (``specforge/algorithms/model_providers.py``: ``resolve_eagle_capture_layers``):
  ``eagle_config``'s list (or its default [1, N//2-1, N-4]) in SGLang's numbering, exactly three
  ids, captured through SGLang (``h_{j+1}``); ``fc`` is 3 x hidden.
"""

from __future__ import annotations

ENGINES = ("vllm", "sglang", "specforge")


class EngineLoadError(ValueError):
    """The engine would refuse the draft or fail on the shape of its ``fc``."""


def default_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default layer set (2, N//2, N-3), in HF ``hidden_states`` numbering."""
    return (2, num_layers // 2, num_layers - 3)


def eagle_config_ids(config: dict) -> list[int] | None:
    """``eagle_config.eagle_aux_hidden_state_layer_ids`` of a config, or None."""
    lst = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(lst) if lst else None


def _fc_slots(config: dict) -> int:
    """Input slots of ``fc`` as vLLM and SGLang size it: num_aux_hidden_states, the list's length, or 3."""
    n = config.get("num_aux_hidden_states")
    if n is None:
        lst = eagle_config_ids(config)
        n = len(lst) if lst else 3
    return int(n)


def _fit(engine: str, fed: list[int | None], slots: int) -> tuple[int | None, ...]:
    if len(fed) != slots:
        raise EngineLoadError(f"{engine} would capture {len(fed)} state(s) for an fc of {slots} input slots")
    return tuple(fed)


def vllm_feed(config: dict, num_layers: int) -> tuple[int | None, ...]:
    """HF ``hidden_states`` ids vLLM feeds the draft's ``fc``, slot by slot."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle_config_ids(config) or list(default_ids(num_layers))
    captured = sorted({int(k) for k in ids if 0 <= int(k) <= num_layers})  # the hook fires once per layer, in order
    return _fit("vLLM", [k if k < num_layers else None for k in captured], _fc_slots(config))


def sglang_feed(config: dict, num_layers: int) -> tuple[int | None, ...]:
    """HF ``hidden_states`` ids SGLang feeds the draft's ``fc``, slot by slot."""
    lst = eagle_config_ids(config)
    inputs_of = [j + 1 for j in lst] if lst else list(default_ids(num_layers))  # layers whose input is captured
    captured = sorted({i for i in inputs_of if 0 <= i < num_layers})
    return _fit("SGLang", captured, _fc_slots(config))


def specforge_feed(config: dict, num_layers: int) -> tuple[int | None, ...]:
    """HF ``hidden_states`` ids SpecForge trains the draft's ``fc`` on (captured through SGLang)."""
    lst = eagle_config_ids(config) or [1, num_layers // 2 - 1, num_layers - 4]
    if len(lst) != 3 or any(j < 0 for j in lst):
        raise EngineLoadError(f"SpecForge needs exactly three non-negative layer ids, got {lst}")
    return _fit("SpecForge", sorted({j + 1 for j in lst if j + 1 < num_layers}), 3)


FEEDS = {"vllm": vllm_feed, "sglang": sglang_feed, "specforge": specforge_feed}


def engine_feed(engine: str, config: dict, num_layers: int) -> tuple[int | None, ...]:
    """What ``engine`` feeds a draft with this ``config.json`` on an N-layer target."""
    if engine not in FEEDS:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return FEEDS[engine](config, num_layers)


__all__ = ["ENGINES", "EngineLoadError", "default_ids", "eagle_config_ids", "engine_feed", "sglang_feed", "specforge_feed", "vllm_feed"]
