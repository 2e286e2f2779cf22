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

The checksums and the lock every writer takes are the project-wide ``elsi.io``'s.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from elsi.io import load_tensors, save_tensors

MANIFEST = "manifest.json"
GRAMS = "grams.safetensors"
VARIANTS = ("", "_unfiltered")  # filtered by rho, and rho = 0


def analyze_command(run_dir: Path, settings: dict) -> str:
    """The ``elsi analyze`` command that (re)builds ``run_dir`` with ``settings`` (a manifest's)."""
    args = ["elsi", "analyze"]
    for key in ("model", "data", "samples", "max_tokens", "seed", "rho", "block", "normalize"):
        if key in settings:
            args += ["--" + key.replace("_", "-"), str(settings[key])]
    return shlex.join([*args, "--out", str(run_dir)])


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
