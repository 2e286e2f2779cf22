"""An elsi draft as a speculators checkpoint (the format vLLM's ``speculators`` library writes).

Equivalent to ``speculators convert DRAFT --algorithm eagle3 --verifier MODEL_DIR --algorithm-kwargs
'{"eagle_aux_hidden_state_layer_ids": [...]}'`` (speculators 0.9, ``Eagle3Converter``), without its
dependencies: the decoder layer's tensors move from ``midlayer.*`` to ``layers.0.*``, the others
keep their names, and ``config.json`` holds ``speculators_config``, the layer's Llama config and
the layer ids in vLLM's numbering. Without that id list speculators writes ``null`` and vLLM
silently captures its default layers (2, N//2, N-3): here it is always carried over.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from elsi.draft.compat import split_fc_norm

SPECULATORS_VERSION = "0.9.0"  # the release whose format this writes (checked by tests/test_vllm.py)


def speculators_name(name: str) -> str:
    """elsi/EAGLE tensor name -> speculators'."""
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def speculators_config(draft_config: dict, verifier: str, verifier_architectures: list[str],
                       verifier_max_positions: int) -> dict:
    """``config.json`` of the speculators checkpoint for an elsi draft's ``config.json``."""
    from transformers import LlamaConfig

    c = draft_config
    rope = c.get("rope_scaling") or {"rope_type": "default"}
    layer = LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], hidden_act=c["hidden_act"],
        max_position_embeddings=max(int(c["max_position_embeddings"]), int(verifier_max_positions)),
        rms_norm_eps=c["rms_norm_eps"], attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        rope_parameters={**dict(rope), "rope_theta": float(c["rope_theta"])}, dtype="float32",
    ).to_diff_dict()
    layer.pop("transformers_version", None)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": c["draft_vocab_size"],
        "target_hidden_size": c["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(c["eagle_aux_hidden_state_layer_ids"]),
        "embed_requires_grad": False,
        "fc_norm": bool(c.get("fc_norm", False)),
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def export_speculators(draft_dir: str | Path, out_dir: str | Path, verifier: str | Path) -> Path:
    """Write ``out_dir`` (config.json + model.safetensors) from elsi's draft in ``draft_dir``.

    ``verifier``: the target's Hugging Face directory (its config names the architecture and the
    context length); it is recorded as the verifier's ``name_or_path``.
    """
    draft_dir, out_dir, verifier = Path(draft_dir), Path(out_dir), Path(verifier)
    cfg_path = draft_dir / "config.json"
    if not cfg_path.is_file() or not (draft_dir / "model.safetensors").is_file():
        raise FileNotFoundError(f"{draft_dir} is not a draft directory (needs config.json and model.safetensors)")
    draft_config = json.loads(cfg_path.read_text())
    if "elsi" not in draft_config:
        raise ValueError(f"{cfg_path} has no 'elsi' block: export drafts that elsi trained "
                         "(other tools' drafts: use `speculators convert`)")
    vcfg_path = verifier / "config.json"
    if not vcfg_path.is_file():
        raise FileNotFoundError(f"verifier {verifier} has no config.json (a Hugging Face model directory is needed)")
    vcfg = json.loads(vcfg_path.read_text())
    vtext = vcfg.get("text_config") or vcfg
    config = speculators_config(draft_config, str(verifier), vcfg.get("architectures") or ["LlamaForCausalLM"],
                                int(vtext.get("max_position_embeddings", 4096)))
    tensors = {speculators_name(k): v for k, v in split_fc_norm(load_file(str(draft_dir / "model.safetensors"))).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


__all__ = ["SPECULATORS_VERSION", "export_speculators", "speculators_config", "speculators_name"]
