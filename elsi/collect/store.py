"""The run directory: manifest, resumable shards and the merged Gram tensor.

Layout of ``RUN_DIR``::

    manifest.json          settings, model facts, progress and (when complete) counts
    shards/shard-NNNNN.safetensors   finished samples, written atomically while collecting
    grams.safetensors      merged result (written last; the shards are then removed)
    analysis.json          statistics computed from grams.safetensors

``grams.safetensors`` holds, for the filtered (``rho``) and unfiltered (``*_unfiltered``)
positions:
- ``grams`` (num_blocks, N+1, B(B+1)/2) float32: packed upper triangles of G[b, l];
- ``block_sample`` (num_blocks,) int64: the index (in ``manifest["samples"]``) of each block's sample;
- ``block_sum`` (N+1, B, d) float64: the sum over blocks of the normalised states
  (the ``mean-block`` aggregate's Gram is formed from it).

Integrity: every safetensors file elsi writes (Gram tensor, shards, draft-training
checkpoints) carries in its header a SHA-256 of its tensors (names, dtypes, shapes and
bytes) and of its JSON metadata (``tensors_digest``); reading it back recomputes the
digest, so a flipped byte anywhere in the file is an error naming the file, never a
silently different answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
GRAMS = "grams.safetensors"
VARIANTS = ("", "_unfiltered")  # filtered by rho, and rho = 0
DIGEST = "elsi_sha256"  # safetensors metadata key of the file's own checksum


class RunError(ValueError):
    """A run directory that cannot be used as asked."""


INTEGRITY = "integrity"  # JSON key of a file's own checksum: {"sha256", "rebuild"}


def json_digest(obj: dict) -> str:
    """SHA-256 of ``obj`` less its ``integrity`` entry, in a canonical form (sorted keys, no spaces)."""
    body = {k: v for k, v in obj.items() if k != INTEGRITY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_json(path: Path, obj: dict, rebuild: str | None = None) -> None:
    """Write JSON atomically (temporary file, then rename). With ``rebuild`` (what remakes the file, for the
    error message) the file carries its own checksum, which ``read_json`` checks."""
    if rebuild is not None:
        obj = {**{k: v for k, v in obj.items() if k != INTEGRITY},
               INTEGRITY: {"sha256": json_digest(obj), "rebuild": rebuild}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, fix: str = "remove it or use another --out") -> dict:
    """A JSON object from ``path``, checked against its own checksum when it has one; RunError naming the
    file and ``fix`` (or the remedy the file records) when it is damaged."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RunError(f"{path} is corrupt ({err.msg} at char {err.pos}); {fix}") from err
    except UnicodeDecodeError as err:
        raise RunError(f"{path} is corrupt (not UTF-8 text); {fix}") from err
    if not isinstance(obj, dict):
        raise RunError(f"{path} is corrupt (a JSON {type(obj).__name__}, not an object); {fix}")
    seal = obj.get(INTEGRITY)
    if isinstance(seal, dict) and "sha256" in seal and seal["sha256"] != json_digest(obj):
        raise RunError(f"{path} is corrupt: its contents do not match the checksum written with it; "
                       f"{seal.get('rebuild') or fix}")
    return obj


def analyze_command(run_dir: Path, settings: dict) -> str:
    """The ``elsi analyze`` command that (re)builds ``run_dir`` with ``settings`` (a manifest's)."""
    args = ["elsi", "analyze"]
    for key in ("model", "data", "samples", "max_tokens", "seed", "rho", "block", "normalize"):
        if key in settings:
            args += ["--" + key.replace("_", "-"), str(settings[key])]
    return shlex.join([*args, "--out", str(run_dir)])


def tensors_digest(tensors: dict[str, torch.Tensor], meta_text: str) -> str:
    """SHA-256 of ``meta_text`` and of every tensor's name, dtype, shape and bytes (sorted by name)."""
    h = hashlib.sha256(meta_text.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"\n{name}:{t.dtype}:{list(t.shape)}\n".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> str:
    """safetensors write, atomic, with the checksum of its contents in the header; returns the checksum."""
    tmp = path.with_name(path.name + ".tmp")
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"elsi": json.dumps(metadata)} if metadata is not None else {}
    digest = tensors_digest(tensors, meta.get("elsi", ""))
    save_file(tensors, str(tmp), metadata={**meta, DIGEST: digest})
    os.replace(tmp, path)
    return digest


def _check_digest(path: Path, tensors: dict[str, torch.Tensor], meta: dict, fix: str) -> None:
    """RunError naming ``path`` when its contents do not match the checksum in its header."""
    want = meta.get(DIGEST)
    if want is None:
        warnings.warn(f"{path} has no checksum (written by an older elsi): its contents are not verified", stacklevel=3)
        return
    got = tensors_digest(tensors, meta.get("elsi", ""))
    if got != want:
        raise RunError(f"{path} is corrupt: its contents do not match the checksum written with it "
                       f"(sha256 {want[:12]}… recorded, {got[:12]}… now); {fix}")


def load_tensors(path: Path, fix: str = "delete it to recompute that part") -> tuple[dict[str, torch.Tensor], dict | None]:
    """safetensors read, checked against the checksum in its header; RunError naming the file and ``fix``."""
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # safetensors raises several types on damaged files
        raise RunError(f"{path} is corrupt or truncated ({err}); {fix}") from err
    _check_digest(path, tensors, meta, fix)
    try:
        extra = json.loads(meta["elsi"]) if "elsi" in meta else None
    except json.JSONDecodeError as err:
        raise RunError(f"{path} is corrupt (its metadata is not JSON); {fix}") from err
    return tensors, extra


def verify_tensors(path: Path, fix: str = "delete it to recompute that part") -> str | None:
    """Check a safetensors file against its checksum without keeping it in memory (one tensor at a
    time); return the checksum (None for an older file without one). RunError naming the file otherwise."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            want = meta.get(DIGEST)
            if want is None:
                return None
            h = hashlib.sha256(meta.get("elsi", "").encode())
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h.update(f"\n{name}:{t.dtype}:{list(t.shape)}\n".encode())
                if t.numel():
                    h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                del t
    except Exception as err:  # safetensors raises several types on damaged files
        raise RunError(f"{path} is corrupt or truncated ({err}); {fix}") from err
    if h.hexdigest() != want:
        raise RunError(f"{path} is corrupt: its contents do not match the checksum written with it "
                       f"(sha256 {want[:12]}… recorded, {h.hexdigest()[:12]}… now); {fix}")
    return want


def tensors_checksum(path: Path) -> str | None:
    """The checksum recorded in a safetensors file's header (not verified; None without one)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(DIGEST)
    except Exception:  # noqa: BLE001 - a damaged header: no checksum to report
        return None


class ShardStore:
    """Append-only shards of finished samples; each shard is one atomic file.

    Each process (rank) writes its own folder ``shards/rank-R``; reading and merging
    look at every rank's shards, so a run can be resumed with another number of
    processes. Every sample record holds its ``position`` in the run's sample order,
    and the merge follows that order: a run made by several processes equals the
    single-process run.
    """

    def __init__(self, run_dir: Path, rank: int = 0):
        self.root = run_dir / "shards"
        self.dir = self.root / f"rank-{rank}"

    def shards(self) -> list[Path]:
        """Every rank's shards."""
        return sorted(self.root.glob("rank-*/shard-*.safetensors")) if self.root.exists() else []

    def done(self) -> list[dict]:
        """Per-sample records of every finished sample, in the run's sample order."""
        out = []
        for path in self.shards():
            _, meta = load_tensors(path)
            out.extend(meta["samples"])
        return sorted(out, key=lambda r: r["position"])

    def write(self, records: list[dict], parts: dict[str, list[torch.Tensor]], sums: dict[str, torch.Tensor]) -> Path:
        """Write one shard: ``records`` (one per sample), its blocks' Grams and block sums."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"shard-{len(list(self.dir.glob('shard-*.safetensors'))):05d}.safetensors"
        tensors = {}
        for v in VARIANTS:
            tensors["grams" + v] = torch.cat(parts["grams" + v])
            tensors["block_local" + v] = torch.cat(parts["block_local" + v])
            tensors["block_sum" + v] = sums["block_sum" + v]
        save_tensors(path, tensors, {"samples": records})
        return path

    def merge(self) -> dict[str, torch.Tensor]:
        """All shards as one tensor dict, blocks in sample order, run-wide ``block_sample``."""
        per_sample: dict[int, dict[str, torch.Tensor]] = {}  # position -> that sample's grams
        sums: dict[str, torch.Tensor] = {}
        for path in self.shards():
            t, meta = load_tensors(path)
            for local, rec in enumerate(meta["samples"]):
                per_sample[rec["position"]] = {v: t["grams" + v][t["block_local" + v] == local] for v in VARIANTS}
            for v in VARIANTS:
                key = "block_sum" + v
                sums[key] = t[key] if key not in sums else sums[key] + t[key]
        order = sorted(per_sample)
        merged = {}
        for v in VARIANTS:
            grams = [per_sample[p][v] for p in order]  # each (nb_s, N+1, P)
            merged["grams" + v] = torch.cat(grams)
            merged["block_sample" + v] = torch.cat(
                [torch.full((g.shape[0],), i, dtype=torch.int64) for i, g in enumerate(grams)])
        merged.update(sums)
        return merged

    def remove(self) -> None:
        for path in self.shards():
            path.unlink()
        for d in sorted(self.root.glob("rank-*")):
            d.rmdir()
        self.root.rmdir()
