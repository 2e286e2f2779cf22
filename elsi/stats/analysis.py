"""A finished run's Gram tensor and every statistic computed from it.

Nothing here touches a model or hidden states: entropy of any layer set, CKA of any
two layers or sets, transitions and the whole ``analysis.json`` come from G alone.
"""

from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from elsi.collect.grams import diag_index, unpack
from elsi.config import opt
from elsi.collect.store import GRAMS, MANIFEST, analyze_command
from elsi.io import RunError, load_tensors, read_json, tensors_checksum, write_json
from elsi.stats.cka import CKA_ESTIMATORS, cka_from_hsic, cka_matrix, hsic_matrix
from elsi.stats.entropy import EntropyStat, aggregate_blocks, entropy_of_eigenvalues, kernel_entropy
from elsi.stats.transitions import compartments, find_boundaries, transition_scores

ANALYSIS = "analysis.json"
AGGREGATES = ("block-entropy", "mean-block")


@dataclass(frozen=True)
class AnalysisConfig:
    """Settings of the statistics computed from G (they need no new forward pass)."""

    cka: str = opt("debiased", "HSIC estimator of the minibatch linear CKA", choices=CKA_ESTIMATORS)
    aggregate: str = opt("block-entropy", "entropy summary over blocks and samples", choices=AGGREGATES)
    prominence: float = opt(0.1, "transition boundaries: peak prominence relative to the range of T")

    def __post_init__(self):
        if self.cka not in CKA_ESTIMATORS:
            raise ValueError(f"cka must be one of {CKA_ESTIMATORS}, got {self.cka!r}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")
        if not 0.0 <= self.prominence <= 1.0:
            raise ValueError(f"prominence must be in [0, 1], got {self.prominence}")


def parse_layers(text: str | list[int] | tuple[int, ...], num_layers: int, lowest: int = 0) -> tuple[int, ...]:
    """Layer ids from "2,15,27" (ranges "1-30" allowed), checked against 0..N.

    Raises ValueError naming the bad value: out of range, repeated or empty.
    """
    if isinstance(text, str):
        ids: list[int] = []
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            m = re.fullmatch(r"(-?\d+)(?:-(-?\d+))?", part)
            if m is None:
                raise ValueError(f"bad layer id {part!r} in {text!r}: {part!r} is not an id or a range a-b "
                                 "(use e.g. 2,15,27 or 10-12)")
            lo = int(m.group(1))
            ids.extend(range(lo, int(m.group(2)) + 1) if m.group(2) is not None else [lo])
    else:
        ids = [int(x) for x in text]
    if not ids:
        raise ValueError(f"empty layer list {text!r}")
    bad = [i for i in ids if not lowest <= i <= num_layers]
    if bad:
        raise ValueError(f"layer id(s) {bad} out of range {lowest}..{num_layers} (N = {num_layers} decoder layers)")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"layer id(s) {dup} repeated in {text!r}")
    return tuple(ids)


class GramRun:
    """The Gram tensor of one finished run (filtered by rho, or ``unfiltered``)."""

    def __init__(self, run_dir: str | Path, unfiltered: bool = False):
        self.dir = Path(run_dir)
        if not (self.dir / MANIFEST).exists():
            raise RunError(f"{self.dir} is not an elsi run directory (no {MANIFEST}); run `elsi analyze --out {self.dir}`")
        self.manifest = read_json(self.dir / MANIFEST, fix=f"delete {self.dir} (or use another --out) and run "
                                                             "`elsi analyze` again")
        status = self.manifest.get("status")
        if status != "complete":
            why = f" ({self.manifest['error']})" if status == "failed" and self.manifest.get("error") else ""
            raise RunError(f"{self.dir}: collection is not finished{why}; rerun the same `elsi analyze` command to "
                           "continue it")
        rebuild = f"rebuild it with `{analyze_command(self.dir, self.manifest.get('settings', {}))}` (collects the run again)"
        if not (self.dir / GRAMS).exists():
            raise RunError(f"{self.dir / GRAMS} is missing; {rebuild}")
        tensors, _ = load_tensors(self.dir / GRAMS, fix=rebuild)  # checked against its checksum
        on_disk = tensors_checksum(self.dir / GRAMS)
        self.grams_sha256: str | None = self.manifest.get("grams_sha256") or on_disk  # (older runs: no record)
        if self.grams_sha256 != on_disk:
            raise RunError(f"{self.dir / GRAMS} is not the Gram tensor manifest.json records (another run's file?); "
                           f"{rebuild}")
        v = "_unfiltered" if unfiltered else ""
        self.unfiltered = unfiltered
        self.num_layers: int = int(self.manifest["num_layers"])  # N
        self.block: int = int(self.manifest["settings"]["block"])  # B
        self.packed = tensors["grams" + v]  # (nb, N+1, P) float32
        self.block_sample = tensors["block_sample" + v]  # (nb,) int64
        self.block_sum = tensors["block_sum" + v]  # (N+1, B, d) float64
        self.num_samples = len(self.manifest["samples"])
        self._hsic: dict[str, torch.Tensor] = {}
        if self.packed.shape[1] != self.num_layers + 1:
            raise RunError(f"{self.dir / GRAMS}: {self.packed.shape[1]} layers stored, manifest says N = {self.num_layers}")

    @property
    def num_blocks(self) -> int:
        return int(self.packed.shape[0])

    @functools.cached_property
    def normalized(self) -> torch.Tensor:
        """(nb, N+1, P) float64: G[b, l] / tr G[b, l] (packed)."""
        g = self.packed.double()
        tr = g[..., diag_index(self.block)].sum(-1, keepdim=True)  # (nb, N+1, 1)
        return g / tr.clamp_min(1e-300)

    def check(self, layers) -> tuple[int, ...]:
        return parse_layers(layers, self.num_layers)

    @functools.cached_property
    def layer_kernels(self) -> torch.Tensor:
        """(N+1, nb, B, B) float64: G[b, l] / tr G[b, l] unpacked, contiguous per layer (cached)."""
        return unpack(self.normalized.transpose(0, 1).contiguous(), self.block)

    def _layer_kernels(self, blocks: torch.Tensor | None) -> torch.Tensor:
        """``layer_kernels``, or those of a block subset: (N+1, nb, B, B)."""
        if blocks is None:
            return self.layer_kernels
        return unpack(self.normalized[blocks].transpose(0, 1).contiguous(), self.block)

    def set_kernels(self, layers, blocks: torch.Tensor | None = None) -> torch.Tensor:
        """K_b = sum_{l in S} G[b,l]/tr G[b,l]: (nb, B, B) float64 (optionally a block subset)."""
        return self._layer_kernels(blocks)[list(self.check(layers))].sum(0)

    def block_entropies(self, sets: list, blocks: torch.Tensor | None = None, batch_bytes: float = 4e8) -> torch.Tensor:
        """Entropy of every set on every block: (len(sets), nb) float64."""
        u = self._layer_kernels(blocks)  # (N+1, nb, B, B), built once per call
        nb = u.shape[1]
        per = max(1, int(batch_bytes // max(nb * self.block * self.block * 8, 1)))
        out = []
        for s in range(0, len(sets), per):
            chunk = [self.check(layers) for layers in sets[s : s + per]]
            k = u.new_empty(len(chunk), *u.shape[1:])  # (sets, nb, B, B)
            for i, layers in enumerate(chunk):
                k[i] = u[layers[0]]
                for l in layers[1:]:
                    k[i] += u[l]  # same order of additions as set_kernels' sum
            out.append(kernel_entropy(k))  # (sets, nb)
        return torch.cat(out)

    def aggregate(self, block_values: torch.Tensor, blocks: torch.Tensor | None = None) -> EntropyStat:
        """Per-block values of one set -> mean over samples of per-sample means."""
        bs = self.block_sample if blocks is None else self.block_sample[blocks]
        return aggregate_blocks(block_values, bs, self.num_samples, self.block)

    def entropy(self, layers) -> EntropyStat:
        """Block-entropy statistic of one layer set."""
        return self.aggregate(self.block_entropies([layers])[0])

    def entropies(self, sets: list) -> list[EntropyStat]:
        return [self.aggregate(v) for v in self.block_entropies(sets)]

    @functools.cached_property
    def mean_block_grams(self) -> torch.Tensor:
        """(N+1, B, B): Gram of each layer's mean normalised block, divided by its trace."""
        m = self.block_sum / max(self.num_blocks, 1)  # (N+1, B, d) mean block
        g = m @ m.transpose(-1, -2)  # (N+1, B, B)
        tr = torch.diagonal(g, dim1=-2, dim2=-1).sum(-1)  # (N+1,)
        return g / tr.clamp_min(1e-300)[:, None, None]

    def mean_block_entropy(self, sets: list) -> list[float]:
        """``mean-block`` aggregate: entropy of each set's mean-block kernel (nats)."""
        k = torch.stack([self.mean_block_grams[list(self.check(s))].sum(0) for s in sets])  # (sets, B, B)
        return entropy_of_eigenvalues(torch.linalg.eigvalsh(k)).tolist()

    def hsic(self, estimator: str = "debiased", chunk: int = 256) -> torch.Tensor:
        """(N+1, N+1) HSIC between the normalised layer kernels, summed over blocks (cached)."""
        if estimator in self._hsic:
            return self._hsic[estimator]
        total = torch.zeros(self.num_layers + 1, self.num_layers + 1, dtype=torch.float64)
        for s in range(0, self.num_blocks, chunk):
            k = unpack(self.normalized[s : s + chunk], self.block)  # (c, N+1, B, B)
            total += hsic_matrix(k, estimator)
        self._hsic[estimator] = total
        return total

    def cka(self, set_a, set_b, estimator: str = "debiased") -> float:
        """CKA of two layer sets (a set's kernel is the sum of its normalised Grams)."""
        return cka_from_hsic(self.hsic(estimator), self.check(set_a), self.check(set_b))


def layer_profile(run: GramRun, pool: list[int], aggregate: str) -> dict:
    """Per-layer entropy (mean, std, normalised) of every pool id."""
    log_b = math.log(run.block)
    if aggregate == "mean-block":
        vals = run.mean_block_entropy([[l] for l in pool])
        return {
            "layer_entropy": vals,
            "layer_entropy_std": [None] * len(pool),
            "layer_entropy_normalized": [v / log_b for v in vals],
        }
    stats = run.entropies([[l] for l in pool])
    return {
        "layer_entropy": [s.mean for s in stats],
        "layer_entropy_std": [s.std for s in stats],
        "layer_entropy_normalized": [s.normalized for s in stats],
    }


def geometry(run: GramRun, cfg: AnalysisConfig) -> dict:
    """CKA over ids 0..N, transitions, boundaries and compartments."""
    cka = cka_matrix(run.hsic(cfg.cka)).numpy()
    t = transition_scores(cka)
    bounds = find_boundaries(t, cfg.prominence)
    return {
        "cka": cka.round(6).tolist(),
        "transition": t.round(6).tolist(),
        "boundaries": bounds,
        "compartments": compartments(bounds, run.num_layers + 1),
    }


def pair_entropy(run: GramRun, pool: list[int], aggregate: str) -> list[list[float]]:
    """|pool| x |pool| entropy of every pair (diagonal = singletons)."""
    pairs = [[a] if i == j else [a, b] for i, a in enumerate(pool) for j, b in enumerate(pool) if j >= i]
    if aggregate == "mean-block":
        vals = run.mean_block_entropy(pairs)
    else:
        vals = [s.mean for s in run.entropies(pairs)]
    mat = np.zeros((len(pool), len(pool)))
    it = iter(vals)
    for i in range(len(pool)):
        for j in range(i, len(pool)):
            mat[i, j] = mat[j, i] = next(it)
    return mat.tolist()


def analyze_run(run_dir: str | Path, cfg: AnalysisConfig) -> dict:
    """Compute ``analysis.json`` of a finished run (filtered and unfiltered) and write it."""
    t0 = time.perf_counter()
    run = GramRun(run_dir)
    n = run.num_layers
    pool = list(range(1, n + 1))
    out: dict = {
        "model": run.manifest["model"],
        "num_layers": n,
        "hidden_size": run.manifest["hidden_size"],
        "layer_ids": run.manifest["layer_ids"],
        "layers": pool,
        "entropy_units": "nats; *_normalized = divided by log(block)",
    }
    out.update(layer_profile(run, pool, cfg.aggregate))
    out["layer_entropy_mean_block"] = run.mean_block_entropy([[l] for l in pool])
    out["layer0_entropy"] = run.entropy([0]).mean
    out["pair_entropy"] = pair_entropy(run, pool, cfg.aggregate)
    out.update(geometry(run, cfg))
    unf = GramRun(run_dir, unfiltered=True)
    out["unfiltered"] = {**layer_profile(unf, pool, cfg.aggregate), **geometry(unf, cfg)}
    out["settings"] = {**run.manifest["settings"], **asdict(cfg)}
    out["grams_sha256"] = run.grams_sha256  # the Gram tensor these statistics come from
    out["counts"] = run.manifest["counts"]
    out["elapsed_s"] = round(time.perf_counter() - t0, 2)
    again = f"rerun `{analyze_command(Path(run_dir), run.manifest['settings'])}` (it recomputes {ANALYSIS} from the Gram tensor)"
    write_json(Path(run_dir) / ANALYSIS, out, rebuild=again)
    return out
