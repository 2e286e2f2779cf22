"""Files written by older elsi versions that the draft stage still reads: one function per branch.

| branch | the files it reads | what older versions wrote |
|---|---|---|
| ``stale_eagle_config`` | a draft's ``config.json`` | ``eagle_config``'s ids in vLLM's numbering, not SGLang's (id - 1) |
| ``split_fc_norm``, ``upgrade_draft`` | a draft's ``config.json`` and ``model.safetensors`` | the above, and one (m, d_t) ``fc_norm`` tensor |
| ``refuse_pickled_checkpoint`` | ``<out>/checkpoint.pt`` | a training checkpoint saved with pickle |
| ``checkpoint_matmul_dtype`` | ``<out>/resume/checkpoint.safetensors`` (its JSON header) | no ``state.matmul_dtype`` |
| ``cache_files``, ``cache_scales``, ``cache_dtype`` | a feature cache's ``features.json`` | no file checksums, no fp16 scales, float32 targets only |
| ``same_data`` | a feature cache's ``features.json`` (``settings.data_fingerprint``) | no data fingerprint |
| ``feature_key_extras`` | nothing: it names a feature cache's directory | no dtype or ``regen_turns`` in the key |

Training settings added after checkpoints and studies were written are declared where the setting is
(``TrainConfig``'s fields with ``added=``, ``elsi.config.added_settings``), and read by
``elsi.draft.train.with_added_settings``.
"""

from __future__ import annotations

import json
from pathlib import Path

from elsi.draft.checkpoint import CONFIG, WEIGHTS, engine_keys

LEGACY_CHECKPOINT = "checkpoint.pt"  # pickle, written by older elsi versions: never loaded


# ---- draft directories ----
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
    from safetensors.torch import load_file, save_file

    path = Path(path)
    cfg_path, w_path = path / CONFIG, path / WEIGHTS
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


# ---- training checkpoints ----
def refuse_pickled_checkpoint(out: Path, restart: bool, rank: int, checkpoint: Path) -> None:
    """An older elsi's pickled ``out/checkpoint.pt``: deleted by ``--restart`` (rank 0), else an error where no
    current ``checkpoint`` stands beside it (unpickling can run code, so it is never loaded)."""
    legacy = out / LEGACY_CHECKPOINT
    if restart and rank == 0:
        legacy.unlink(missing_ok=True)
    elif legacy.is_file() and not checkpoint.is_file():
        raise ValueError(f"{legacy} is a checkpoint of an older elsi, saved with pickle, which elsi does not load "
                         "(unpickling can run code): pass --restart to start this draft over (it deletes the file)")


def checkpoint_matmul_dtype(state: dict, now: str) -> str:
    """The matmul precision a checkpoint's ``state`` was trained in; one written before it was kept is taken to
    be ``now``'s (this run's)."""
    return state.get("matmul_dtype", now)


# ---- feature caches (features.json) ----
def cache_files(manifest: dict) -> dict[str, dict]:
    """File name -> {"size", "sha256"}; caches written before checksums were kept record none."""
    return manifest.get("files", {})


def cache_scales(manifest: dict) -> dict[str, dict]:
    """Shard -> the power-of-two exponents its fp16 arrays were divided by; older caches (and shards that needed
    none) record none."""
    return manifest.get("scales", {})


def cache_dtype(manifest: dict) -> str:
    """The target's dtype in the forward that computed the features; caches from before it was kept: float32."""
    return manifest["settings"].get("dtype", "float32")


def same_data(recorded: dict | None, fingerprint: dict) -> bool:
    """Whether a cache's recorded data fingerprint (size, sha256) fits the data's; a cache built before fingerprints
    were recorded (None), or data without one, is taken to fit."""
    return recorded is None or not fingerprint or recorded == fingerprint


def feature_key_extras(dtype: str, regenerate: bool, regen_turns: int) -> dict:
    """The parts of a feature cache's key added after caches were built, each left out at the value those were
    built with (float32, all turns), so that their key, and so their directory, stays theirs."""
    extra: dict = {}
    if dtype != "float32":
        extra["dtype"] = dtype
    if regenerate and regen_turns:
        extra["regen_turns"] = regen_turns
    return extra


__all__ = ["LEGACY_CHECKPOINT", "cache_dtype", "cache_files", "cache_scales", "checkpoint_matmul_dtype",
           "feature_key_extras", "refuse_pickled_checkpoint", "same_data", "split_fc_norm",
           "stale_eagle_config", "upgrade_draft"]
