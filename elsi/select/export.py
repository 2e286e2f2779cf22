"""Draft-config fragments that carry a layer set into vLLM, SGLang and SpecForge.

elsi's ids are Hugging Face ``output_hidden_states`` ids: h_l is the input of decoder
layer l (the output of layer l-1). vLLM collects the *input* of decoder layer i for each
id i in ``eagle_aux_hidden_state_layer_ids`` (its aux-hidden-state hook runs before each
layer), so its numbering is elsi's. SGLang and SpecForge collect the *output* of layer i,
so they get id - 1. Neither can capture h_N (after the last layer and the final norm),
so id N is refused, as is id 0 in SGLang/SpecForge numbering (-1).
"""

from __future__ import annotations

import warnings

FORMATS = ("vllm", "sglang", "specforge")


def check_exportable(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Sorted, distinct ids in 1..N-1 or a ValueError naming the bad ones."""
    ids = tuple(sorted(layers))
    if len(set(ids)) != len(ids):
        raise ValueError(f"repeated layer ids in {list(layers)}")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise ValueError(
            f"layer id(s) {bad} cannot be exported for N = {num_layers}: runtimes capture hidden states "
            f"h_1..h_{num_layers - 1} (h_0 is the embedding output; h_{num_layers} comes after the final norm, "
            "which no aux-hidden-state hook sees)"
        )
    return ids


def export_fragment(layers: tuple[int, ...], num_layers: int, fmt: str, model: str = "") -> dict:
    """The config fragment for ``fmt`` with a note naming the numbering it uses."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    ids = check_exportable(layers, num_layers)
    if len(ids) != 3:
        warnings.warn(
            f"{len(ids)} layers: some runtimes (and their fused-weight shapes) hard-code 3 aux layers; "
            "check that yours accepts this count",
            stacklevel=2,
        )
    source = f"elsi ids {list(ids)} (HF output_hidden_states numbering) of {model or 'the target'} with N = {num_layers}"
    if fmt == "vllm":
        return {
            "eagle_aux_hidden_state_layer_ids": list(ids),
            "_elsi_note": f"vLLM numbering = elsi ids (input of decoder layer i); {source}",
        }
    return {
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "use_aux_hidden_state": True,
        },
        "_elsi_note": f"{fmt} numbering = elsi id - 1 (output of decoder layer i); {source}",
    }
