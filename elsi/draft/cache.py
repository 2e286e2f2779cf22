"""The feature cache on disk: its files, their fp16 encoding, reading (``FeatureStore``) and writing a shard.

Per token position t, a cache holds (what ``elsi.draft.features`` computes):
- ``ids``: the token x_t (int32);
- ``argmax``: the target's greedy next token at t over its full vocabulary (int32);
- ``final``: the input of the target's LM head at t, (d,) float16, from which the soft labels
  on any draft vocabulary are recomputed (``elsi.draft.loss.LabelHead``: only the V_draft
  rows of the target's head, once per batch);
- ``states``: the hidden states at the cached layer ids, (L, d) float16;
- ``mask``: whether the token belongs to an assistant reply (uint8); training and held-out
  figures score the predictions of reply tokens only, as at decoding time.

Storage: shards of ``.npy`` files (``shardKKKKK.NAME.npy``) read by memory map, and ``features.json``
listing the samples (written after each shard: resumable).

The fp16 codec: float16 ends at 65504, and some targets' residual streams go beyond it (Gemma-3's
massive activations reach ~1e5): each shard stores every layer of ``states`` (and ``final``) divided by
a power of two 2^e, the smallest that brings its largest magnitude under that limit (exact:
fp16's relative precision is kept), and ``features.json`` records the exponents
(``scales``: shard -> {"states": [e per layer], "final": e}); ``FeatureStore.sample``
multiplies them back, in float32 where an exponent is not 0. A non-finite target state is an error.

Integrity: ``features.json`` records every ``.npy`` file's size and SHA-256 when it is written. Opening a
cache checks every size (cheap); each file's hash is checked the first time this process reads
it (the mask files at the start of training, the others on first use), so a many-GB cache is
hashed once per process, spread over the first epoch, not at every open.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from elsi.draft.compat import cache_dtype, cache_files, cache_scales
from elsi.io import file_sha256, read_json, write_json

MANIFEST = "features.json"
FORMAT = 2
ARRAYS = ("ids", "argmax", "final", "states", "mask")
FP16_MAX = 65504.0


def rebuild_hint(path: Path) -> str:
    """What to do about a damaged cache in ``path``."""
    return f"delete {path} (or choose another --features-dir) and rerun the same command to rebuild it"


# ---- the fp16 codec ----
def fp16_exponents(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The smallest e >= 0 with max |x| / 2^e <= FP16_MAX, per index of ``axis`` (None: one for all).
    ``x``: float32 (T, L, d) or (T, d). Raises ValueError on a non-finite value."""
    red = tuple(i for i in range(x.ndim) if i != axis) if axis is not None else None
    peak = np.abs(x).max(axis=red) if x.size else np.zeros(x.shape[axis] if axis is not None else ())
    if not np.all(np.isfinite(peak)):
        raise ValueError("the target produced a non-finite hidden state (inf or NaN): check the model and --dtype")
    e = np.ceil(np.log2(np.maximum(peak, FP16_MAX) / FP16_MAX)).astype(np.int64)  # 0 where it fits
    return e + (np.ldexp(peak, -e) > FP16_MAX)  # rounding at the boundary


def to_fp16(x: np.ndarray, exps: np.ndarray, axis: int | None = None) -> np.ndarray:
    """``x`` / 2^exps (broadcast along ``axis``) in float16: exact scaling, no overflow."""
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = -1
    return np.ldexp(x, -np.asarray(exps).reshape(shape)).astype(np.float16)


# ---- reading ----
class FeatureStore:
    """Read access to a feature cache directory (memory-mapped shards, checked against features.json)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise FileNotFoundError(f"{self.path} holds no target features ({MANIFEST} missing)")
        self.rebuild = rebuild_hint(self.path)
        self.manifest = read_json(self.path / MANIFEST, fix=self.rebuild)  # checked against its own checksum
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.path} holds features of format {self.manifest.get('format')}, this elsi reads "
                             f"format {FORMAT}: delete the directory (or choose another --features-dir) to rebuild it")
        self.layers: tuple[int, ...] = tuple(self.manifest["layers"])
        self.samples: list[dict] = self.manifest["samples"]
        self.files: dict[str, dict] = cache_files(self.manifest)  # name -> {"size", "sha256"}
        self.scales: dict[str, dict] = cache_scales(self.manifest)  # shard -> power-of-two exponents
        self._arrays: dict[tuple[int, str], np.ndarray] = {}
        for name, rec in self.files.items():  # sizes: every file, at every open
            f = self.path / name
            size = f.stat().st_size if f.is_file() else None
            if size != rec["size"]:
                what = "is missing" if size is None else f"has {size} bytes, features.json records {rec['size']}"
                raise ValueError(f"feature cache file {f} {what} (truncated or damaged); {self.rebuild}")

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def dtype(self) -> str:
        """The target's dtype in the forward that computed these features."""
        return cache_dtype(self.manifest)

    @property
    def num_tokens(self) -> int:
        return sum(s["length"] for s in self.samples)

    def layer_index(self, layers: Sequence[int]) -> list[int]:
        """Positions of ``layers`` in the cached layer axis; a clear error for missing ones."""
        missing = [l for l in layers if l not in self.layers]
        if missing:
            want = sorted(set(self.layers) | set(layers))
            raise ValueError(
                f"the feature cache {self.path} holds layers {list(self.layers)}; layer(s) {missing} are not in it. "
                f"Delete it or choose another --features-dir, and cache the union with "
                f"--cache-layers {','.join(map(str, want))}")
        return [self.layers.index(l) for l in layers]

    def _array(self, k: int, name: str) -> np.ndarray:
        """Shard ``k``'s array ``name`` (memory-mapped), its hash checked on first use in this process."""
        if (k, name) not in self._arrays:
            fname = f"shard{k:05d}.{name}.npy"
            rec = self.files.get(fname)
            if rec is not None:
                got = file_sha256(self.path / fname)
                if got != rec["sha256"]:
                    raise ValueError(f"feature cache file {self.path / fname} is corrupt (sha256 {got[:12]}…, "
                                     f"features.json records {rec['sha256'][:12]}…); {self.rebuild}")
            try:
                self._arrays[(k, name)] = np.load(self.path / fname, mmap_mode="r")
            except (OSError, ValueError) as err:
                raise ValueError(f"feature cache file {self.path / fname} cannot be read ({err}); "
                                 f"{self.rebuild}") from err
        return self._arrays[(k, name)]

    def _shard(self, k: int) -> dict[str, np.ndarray]:
        return {name: self._array(k, name) for name in ARRAYS}

    def argmax(self, index: int) -> torch.Tensor:
        """The target's greedy next tokens of sample ``index`` (T,) int64."""
        s = self.samples[index]
        return torch.from_numpy(self._array(s["shard"], "argmax")[s["offset"]: s["offset"] + s["length"]].astype(np.int64))

    def scored_count(self, index: int, loss_on: str) -> int:
        """How many depth-1 predictions of sample ``index`` are scored: positions 1..T-1 of ``sample``'s
        ``reply`` (``loss_on='reply'``) or all T-1 of them (``'all'``)."""
        s = self.samples[index]
        if loss_on == "all":
            return max(0, s["length"] - 1)
        mask = self._array(s["shard"], "mask")[s["offset"]: s["offset"] + s["length"]].astype(bool)  # (T,)
        reply = np.concatenate([mask[1:], mask[-1:]])  # (T,) as in ``sample``
        return int(reply[1:].sum())

    def sample(self, index: int, layer_pos: Sequence[int]) -> dict[str, torch.Tensor]:
        """Sample ``index``: ids (T,) int64, argmax (T,) int64, final (T, d) and aux (T, m·d) fp16 (float32 in a
        shard stored scaled),
        reply (T,) bool: position t predicts a token of an assistant reply (t+1 is one; the last
        position copies its own flag)."""
        s = self.samples[index]
        sh = self._shard(s["shard"])
        a, b = s["offset"], s["offset"] + s["length"]
        states = np.array(sh["states"][a:b][:, layer_pos])  # (T, m, d) float16
        final = np.array(sh["final"][a:b])  # (T, d) float16
        scale = self.scales.get(str(s["shard"]))
        if scale is not None:  # stored / 2^e (see the module's docstring): back in float32
            states = np.ldexp(states.astype(np.float32), np.asarray(scale["states"])[layer_pos].reshape(1, -1, 1))
            final = np.ldexp(final.astype(np.float32), scale["final"])
        mask = torch.from_numpy(sh["mask"][a:b].astype(bool))  # (T,)
        reply = torch.cat([mask[1:], mask[-1:]])  # (T,)
        return {
            "ids": torch.from_numpy(sh["ids"][a:b].astype(np.int64)),  # (T,)
            "argmax": torch.from_numpy(sh["argmax"][a:b].astype(np.int64)),  # (T,)
            "final": torch.from_numpy(final),  # (T, d)
            "aux": torch.from_numpy(states).flatten(1),  # (T, m·d)
            "reply": reply,
        }


# ---- writing ----
def write_shard(path: Path, shard: int, parts: dict[str, list[np.ndarray]], man: dict) -> None:
    """Shard ``shard`` of the cache in ``path`` from per-sample ``parts`` (name -> arrays, ``ARRAYS``' order;
    ``states`` (T, L, d) and ``final`` (T, d) in float32), each file written atomically.

    Records in the manifest ``man`` (written by the caller, the commit point) each file's size and
    SHA-256 (``files``) and, where the shard needed any, its fp16 exponents (``scales``).
    """
    files = man.setdefault("files", {})
    arrays = {name: np.concatenate(arrs, axis=0) for name, arrs in parts.items()}
    exps = {"states": fp16_exponents(arrays["states"], axis=1), "final": fp16_exponents(arrays["final"])}
    arrays["states"] = to_fp16(arrays["states"], exps["states"], axis=1)  # (T, L, d)
    arrays["final"] = to_fp16(arrays["final"], exps["final"])  # (T, d)
    if exps["states"].any() or exps["final"]:
        man.setdefault("scales", {})[str(shard)] = {"states": exps["states"].tolist(), "final": int(exps["final"])}
    for name, arr in arrays.items():
        fname = f"shard{shard:05d}.{name}.npy"
        tmp = path / (fname + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path / fname)
        files[fname] = {"size": (path / fname).stat().st_size, "sha256": file_sha256(path / fname)}


def write_manifest(path: Path, man: dict) -> None:
    """``features.json`` of the cache in ``path``, atomically, with its own checksum (``elsi.io.write_json``)."""
    write_json(path / MANIFEST, man, rebuild=rebuild_hint(path))


__all__ = ["ARRAYS", "FORMAT", "FP16_MAX", "MANIFEST", "FeatureStore", "fp16_exponents", "to_fp16",
           "write_manifest", "write_shard"]
