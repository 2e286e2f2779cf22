"""What a study reads from the files of older elsi versions: one function per older layout.

A study goes on from the files a former run left (plan.json, drafts/*/training.json, the feature cache's
features.json); each function below says which files, of which older layout, it reads, and what they mean
now. The plan and the run (``elsi.study.plan``, ``elsi.study.run``) read older files only through these.
"""

from __future__ import annotations

from pathlib import Path

from elsi.data.conversations import data_identity
from elsi.draft.cache import MANIFEST as FEATURE_MANIFEST
from elsi.draft.train import with_added_settings
from elsi.io import RunError, read_json


def set_seeds(entry: dict, seeds: list[int]) -> list[int]:
    """A set's seeds from its plan.json entry; ``seeds``: the plan's ``--seeds``.

    Reads plan.json from before ``--multi-seed-sets``, whose sets have no ``seeds``: every set got every seed."""
    return list(entry.get("seeds", seeds))


def vllm_entry(plan: dict) -> dict:
    """plan.json's ``vllm`` (the sets vLLM serves, the chain lengths).

    Reads plan.json from before ``--vllm-sets``, which has no ``vllm``: vLLM served no set."""
    return plan.get("vllm", {"sets": [], "spec_tokens": []})


def data_by_content(settings: dict) -> dict:
    """A plan.json's ``settings`` with ``features.data`` as the data's identity.

    Reads plan.json from before data was identified by content, whose ``features.data`` is a path: that file's
    identity now (a path that no longer exists stays as it is, and differs)."""
    data = settings.get("features", {}).get("data")
    if not isinstance(data, str) or data == "sharegpt" or data.startswith("sha256:"):
        return settings
    try:
        ident = data_identity(data)
    except (OSError, ValueError):
        return settings
    return {**settings, "features": {**settings["features"], "data": ident}}


def train_settings(settings: dict) -> dict:
    """A plan.json's ``settings`` with every training setting added since it was written, at the value it was
    made with (``elsi.draft.train.with_added_settings``).

    Reads plan.json from before such a setting existed (e.g. ``layer_init``), whose ``train`` lacks it."""
    if "train" not in settings:
        return settings
    return {**settings, "train": with_added_settings(settings["train"])}


def with_exact(settings: dict, exact: dict | None) -> dict:
    """plan.json's ``settings`` with ``exact`` (the exact evaluator's settings) only where it is on.

    Keeps plan.json from before the exact evaluator (no ``exact``) matching a run that has it off."""
    return settings if exact is None else {**settings, "exact": exact}


def with_live_seeds(bench: dict, live_seeds: list[int]) -> dict:
    """plan.json's ``settings.bench`` with ``live_seeds`` only where it limits the seeds decoded live (given).

    Keeps plan.json from before ``--live-seeds`` (no ``live_seeds``: every seed decoded live) matching a run that
    decodes every seed."""
    return {**bench, "live_seeds": sorted(live_seeds)} if live_seeds else bench


def matmul_dtype(training: dict) -> str:
    """The dtype of a finished draft's training matmuls, from its training.json.

    Reads training.json from before ``--train-dtype``, which has no ``train_matmul_dtype``: float32."""
    return training.get("train_matmul_dtype", "float32")


def features_dtype(study_dir: Path, training: dict) -> str | None:
    """The target's dtype in the feature pass a finished draft trained on (None: no record says).

    - training.json records it (``data.features_dtype``);
    - training.json from before that field: its feature cache's features.json (``data.features_dir``), else the
      copy of that features.json kept beside the study's records (``bench/study_results.sh``'s layout, which copies
      no feature cache);
    - features.json from before ``--dtype`` was recorded (no ``settings.dtype``): float32."""
    data = training.get("data", {})
    if data.get("features_dtype"):
        return data["features_dtype"]
    cache = [Path(data["features_dir"]) / FEATURE_MANIFEST] if data.get("features_dir") else []
    for man in cache + [study_dir / FEATURE_MANIFEST]:
        if man.is_file():
            try:
                return read_json(man).get("settings", {}).get("dtype", "float32")
            except RunError:
                continue
    return None


__all__ = ["data_by_content", "features_dtype", "matmul_dtype", "set_seeds", "train_settings", "vllm_entry",
           "with_exact", "with_live_seeds"]
