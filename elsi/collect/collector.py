"""``elsi analyze``'s collection stage: one forward per sample -> Gram tensor on disk.

Resumable: finished samples are written to shards atomically; a Ctrl-C writes the
pending samples first; a kill loses at most the samples since the last shard. Running
the same command again continues from the shards and never counts a sample twice; running
it twice at once is refused (the run directory's lock, ``elsi.io.lock``).
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from elsi.collect.grams import NORMALIZE, block_grams, blocks_of, filter_positions, kept_count, token_entropy
from elsi.collect.store import GRAMS, MANIFEST, VARIANTS, ShardStore, analyze_command
from elsi.data import Dataset, Sample, data_fingerprint, iter_tokenized
from elsi.config import opt
from elsi.io import RunError, lock, read_json, save_tensors, verify_tensors, write_json
from elsi.models import DEFAULT_MODEL, Target
from elsi.runtime import barrier, dist_info


@dataclass(frozen=True)
class CollectConfig:
    """Settings that define the collected Gram tensor (a run directory holds one)."""

    model: str = opt(DEFAULT_MODEL, "target: alias (smollm2-135m, gemma3-270m), HF directory, .gguf file or hub id")
    data: str = opt("sharegpt", "calibration data: sharegpt, or a .json/.jsonl file (ShareGPT, messages or text)")
    samples: int = opt(200, "samples to use (each with at least one full block)")
    max_tokens: int = opt(1024, "tokens per sample (longer samples are cut)")
    seed: int = opt(0, "seed of the order in which samples are drawn")
    rho: float = opt(0.3, "token-entropy filter: fraction of lowest-entropy positions dropped per sample")
    block: int = opt(32, "tokens per block (B)")
    normalize: str = opt("center-l2", "per block and layer: centre and L2-normalise rows, or none", choices=NORMALIZE)

    def __post_init__(self):
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.block < 4:
            raise ValueError(f"block must be >= 4, got {self.block}")
        if self.max_tokens < self.block + 1:
            raise ValueError(f"max_tokens must exceed block ({self.block}), got {self.max_tokens}")
        if not 0.0 <= self.rho < 1.0:
            raise ValueError(f"rho must be in [0, 1), got {self.rho}")
        if self.normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}, got {self.normalize!r}")


@dataclass
class Progress:
    """What the CLI's progress bar shows after each sample."""

    samples_done: int
    samples_total: int
    tokens_seen: int  # tokens forwarded in this invocation
    elapsed_s: float
    resumed: int = 0  # samples found finished on disk


@dataclass
class _Pending:
    """Finished samples not yet written to a shard of ``store``, and when the last shard was written."""

    store: ShardStore
    records: list[dict] = field(default_factory=list)  # one per sample
    parts: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # "grams"/"block_local" + variant -> per sample
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # "block_sum" + variant -> (N+1, B, d)
    last_flush: float = field(default_factory=time.perf_counter)

    def add(self, record: dict, grams: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One sample: its ``record`` and, per variant, its blocks' Grams (nb, N+1, P) and block sum (N+1, B, d)."""
        for v, (g, bsum) in grams.items():
            self.parts.setdefault("grams" + v, []).append(g)
            local = torch.full((g.shape[0],), len(self.records), dtype=torch.int64)  # (nb,) the sample in the shard
            self.parts.setdefault("block_local" + v, []).append(local)
            key = "block_sum" + v
            self.sums[key] = bsum if key not in self.sums else self.sums[key] + bsum
        self.records.append(record)

    def due(self, every: int, seconds: float) -> bool:
        """Whether a shard is due: ``every`` samples pending, or ``seconds`` since the last one."""
        return len(self.records) >= every or time.perf_counter() - self.last_flush > seconds

    def flush(self) -> None:
        """Write the pending samples (if any) as one shard."""
        if self.records:
            self.store.write(self.records, self.parts, self.sums)
            self.records.clear()
            self.parts.clear()
            self.sums.clear()
        self.last_flush = time.perf_counter()


def package_versions() -> dict[str, str]:
    out = {}
    for pkg in ("elsi", "torch", "transformers", "numpy", "safetensors"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_manifest(run_dir: Path, man: dict) -> None:
    """manifest.json, atomically, with its own checksum (and the command that rebuilds the run)."""
    write_json(run_dir / MANIFEST, man, rebuild=f"delete {run_dir} and rebuild the run with "
                                                f"`{analyze_command(run_dir, man.get('settings', {}))}`")


def read_manifest(run_dir: Path) -> dict:
    """``run_dir``'s manifest.json; RunError naming it when it is damaged."""
    return read_json(run_dir / MANIFEST, fix=f"delete {run_dir} (or use another --out) and run `elsi analyze` again")


def existing_run(run_dir: Path, cfg: CollectConfig, fingerprint: dict | None = None) -> dict | None:
    """The manifest of a run in ``run_dir`` (None if there is none); other settings are an error.

    The data is compared by content (``fingerprint``: {"size", "sha256"}, computed from
    ``cfg.data`` when not given), not by path: the same file elsewhere is the same run, an edited
    file is other data. A run that never finished a sample is not worth keeping: other settings
    then start it over (None).
    """
    path = run_dir / MANIFEST
    if not path.exists():
        return None
    man = read_manifest(run_dir)
    theirs = man.get("settings", {})
    mine = asdict(cfg)
    diff = [f"{k}: run has {theirs.get(k)!r}, asked {v!r}" for k, v in mine.items()
            if k != "data" and theirs.get(k) != v]
    recorded = man.get("data_fingerprint")
    if recorded is None:  # a run of an older elsi: its data is known by path only
        if theirs.get("data") != cfg.data:
            diff.append(f"data: run has {theirs.get('data')!r}, asked {cfg.data!r}")
    else:
        now = fingerprint or data_fingerprint(cfg.data)
        if now != recorded:
            diff.append(f"data: the run was collected from {theirs.get('data')!r} ({recorded['size']} bytes, sha256 "
                        f"{recorded['sha256'][:12]}…), --data {cfg.data!r} has {now['size']} bytes, sha256 "
                        f"{now['sha256'][:12]}… (other or edited data)")
    if diff:
        if man.get("status") != "complete" and not ShardStore(run_dir).shards():
            return None  # nothing finished under the old settings: nothing to lose
        raise RunError(f"{run_dir} holds a run with other settings ({'; '.join(diff)}); use another --out")
    return man


def grams_problem(run_dir: Path) -> str | None:
    """Why ``run_dir``'s finished Gram tensor cannot be used (missing, truncated, checksum mismatch), or None."""
    path = run_dir / GRAMS
    if not path.is_file():
        return f"{path} is missing"
    try:
        digest = verify_tensors(path, fix="collecting it again")
    except RunError as err:
        return str(err)
    man = read_manifest(run_dir)
    if digest is not None and man.get("grams_sha256") not in (None, digest):
        return f"{path} is not the Gram tensor manifest.json records (sha256 {digest[:12]}… on disk, " \
               f"{man['grams_sha256'][:12]}… recorded)"
    return None


def start_manifest(run_dir: Path, cfg: CollectConfig, target: Target, fingerprint: dict | None = None) -> dict:
    """Create the manifest of a new run (removing the remains of an unusable one: a damaged Gram tensor)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / GRAMS).unlink(missing_ok=True)
    man = {
        "status": "collecting",
        "model": cfg.model,
        "model_source": target.source,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "layer_ids": "Hugging Face output_hidden_states: 0 = embeddings, l = output of decoder layer l-1",
        "settings": asdict(cfg),
        "target_dtype": target.dtype_name,
        "data_fingerprint": fingerprint or data_fingerprint(cfg.data),
        "versions": package_versions(),
    }
    write_manifest(run_dir, man)
    return man


def _mark_failed(run_dir: Path, man: dict, err: BaseException) -> None:
    """After an error: a run with finished samples is marked failed (the same command resumes it);
    one without any is removed, so that nothing half-made stays behind."""
    if ShardStore(run_dir).shards():
        write_manifest(run_dir, {**man, "status": "failed", "error": f"{type(err).__name__}: {err}"})
        return
    (run_dir / MANIFEST).unlink(missing_ok=True)
    if (run_dir / "shards").is_dir():
        shutil.rmtree(run_dir / "shards")
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def _forward(target: Target, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward: logits (T, V) and the N+1 hidden states, each (T, d) on its own device
    (with ``--device-map auto`` the layers of one model live on several devices)."""
    x = torch.tensor([ids], device=target.device)  # (1, T)
    with torch.inference_mode():
        out = target.model(input_ids=x, output_hidden_states=True, use_cache=False)
    return out.logits[0], [h[0] for h in out.hidden_states]


def collect(
    target: Target,
    dataset: Dataset,
    cfg: CollectConfig,
    run_dir: Path,
    on_progress: Callable[[Progress], None] | None = None,
    flush_every: int = 16,
    flush_seconds: float = 60.0,
) -> dict:
    """Collect the Gram tensor of ``cfg`` into ``run_dir``; return the final manifest.

    A complete run is returned as is. Samples are drawn in the seed's order; a sample
    too short for one full block after filtering is skipped before any forward pass.
    Under torch.distributed, rank r forwards the samples at positions p with
    p % world == r and rank 0 merges every rank's shards in sample order, so the run
    equals the single-process one. Another process writing ``run_dir`` is an error (``lock``: rank 0
    holds the run directory's lock for every rank).
    """
    rank, world = dist_info()
    with lock(run_dir, "the run directory") if rank == 0 else nullcontext():
        return _collect(target, dataset, cfg, run_dir, on_progress, flush_every, flush_seconds, rank, world)


def _collect(target: Target, dataset: Dataset, cfg: CollectConfig, run_dir: Path,
             on_progress: Callable[[Progress], None] | None, flush_every: int, flush_seconds: float, rank: int,
             world: int) -> dict:
    """``collect`` in process ``rank`` of ``world``, rank 0 holding the run directory's lock.

    Step 1: rank 0 opens the run (``_open_run``), the others then read its manifest. Step 2: each rank forwards
    its samples into shards (``_collect_samples``). Step 3: rank 0 merges every rank's shards (``_finish``).
    """
    man = _open_run(target, cfg, run_dir, dataset.fingerprint or None) if rank == 0 else None
    barrier()
    if rank != 0:
        man = read_manifest(run_dir)  # rank 0 has checked it
    if man.get("status") == "complete":
        return man
    store = ShardStore(run_dir, rank)
    done = store.done()
    pending = _Pending(store)
    try:
        skipped = _collect_samples(target, dataset, cfg, pending, done, rank, world, on_progress, flush_every,
                                   flush_seconds)
    except KeyboardInterrupt:
        pending.flush()  # keep every finished sample
        raise
    except Exception as err:  # the shards written so far stay; the manifest says what failed
        if rank == 0:
            _mark_failed(run_dir, man, err)
        raise
    pending.flush()
    barrier()
    if rank == 0:
        try:
            man = _finish(run_dir, man, store, skipped, dict(dataset.skipped))
        except RunError as err:
            _mark_failed(run_dir, man, err)
            raise
    barrier()
    return man if rank == 0 else read_json(run_dir / MANIFEST)


def _open_run(target: Target, cfg: CollectConfig, run_dir: Path, fingerprint: dict | None) -> dict:
    """The manifest of the run in ``run_dir`` to finish (or, complete, to return), or of a new one where there is
    none or its Gram tensor is damaged; RunError where a partly collected run had the target in another dtype."""
    man = existing_run(run_dir, cfg, fingerprint)
    if man is not None and man.get("status") == "complete":
        problem = grams_problem(run_dir)
        if problem:  # the shards are gone once merged: the run is collected again
            warnings.warn(f"{problem}; collecting {run_dir} again")
            man = None
    if man is None:
        return start_manifest(run_dir, cfg, target, fingerprint)
    if man.get("status") != "complete":  # resuming: the samples still to come in the same precision
        had, now = man.get("target_dtype", "float32"), target.dtype_name
        if had != now:
            raise RunError(f"{run_dir} was partly collected with the target in {had}, this run has it in "
                           f"{now}: pass --dtype {had} to finish it (its samples are kept), or use another --out")
    return man


def _draw(dataset: Dataset, tokenizer, cfg: CollectConfig,
          skipped: Counter) -> Iterator[tuple[int, int, Sample, list[int]]]:
    """The run's ``cfg.samples`` usable samples in the seed's order -> (position among them, index in the data,
    sample, token ids); a sample drawn but not usable (no full block after filtering, a template error) is counted
    in ``skipped`` by reason, before any forward pass."""
    seen = 0
    for idx, sample, ids in iter_tokenized(dataset, tokenizer, cfg.max_tokens, cfg.seed):
        if seen >= cfg.samples:
            break
        if isinstance(ids, str):
            skipped[ids] += 1
            continue
        if kept_count(len(ids), cfg.rho) < cfg.block:
            skipped["too_short"] += 1
            continue
        position, seen = seen, seen + 1
        yield position, idx, sample, ids


def _sample_grams(target: Target, ids: list[int], cfg: CollectConfig
                  ) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """One sample's forward (docs/design.md, Statistics, steps 1-5) -> (its counts for the record: kept positions
    and blocks per variant, mean token entropy; variant -> (Grams (nb, N+1, P), block sum (N+1, B, d)))."""
    logits, hidden = _forward(target, ids)
    ent = token_entropy(logits)  # (T,)
    counts, grams = {}, {}
    for v, rho in zip(VARIANTS, (cfg.rho, 0.0)):
        pos = filter_positions(ent, rho)  # (kept,)
        blocks = blocks_of(pos, cfg.block)  # (nb, B)
        grams[v] = block_grams(hidden, blocks, cfg.normalize)
        counts["kept" + v] = int(pos.numel())
        counts["blocks" + v] = int(blocks.shape[0])
    counts["mean_token_entropy"] = float(ent[1:].mean())
    return counts, grams


def _collect_samples(target: Target, dataset: Dataset, cfg: CollectConfig, pending: _Pending, done: list[dict],
                     rank: int, world: int, on_progress: Callable[[Progress], None] | None, flush_every: int,
                     flush_seconds: float) -> Counter:
    """Forward the samples of rank ``rank`` not ``done`` yet, each added to ``pending``, written out as a shard
    every ``flush_every`` samples or ``flush_seconds`` -> the samples drawn but not used, by reason."""
    skipped: Counter = Counter()
    done_idx = {r["index"] for r in done}
    used, tokens_seen, t0 = len(done), 0, time.perf_counter()
    for position, idx, sample, ids in _draw(dataset, target.tokenizer, cfg, skipped):
        if idx in done_idx or position % world != rank:
            continue  # finished in an earlier invocation, or another rank's sample
        counts, grams = _sample_grams(target, ids, cfg)
        pending.add({"position": position, "index": idx, "id": sample.id, "tokens": len(ids), **counts}, grams)
        used += 1
        tokens_seen += len(ids)
        if pending.due(flush_every, flush_seconds):
            pending.flush()
        if on_progress:
            on_progress(Progress(used, cfg.samples, tokens_seen, time.perf_counter() - t0, len(done)))
    return skipped


def _finish(run_dir: Path, man: dict, store: ShardStore, skipped: Counter, unusable: dict) -> dict:
    """Merge the shards into grams.safetensors and complete the manifest."""
    records = store.done()
    if not records:
        raise RunError(f"no sample of {man['settings']['data']} has a full block of {man['settings']['block']} tokens")
    tensors = store.merge()
    man.pop("error", None)
    man.update(
        status="complete",
        grams_sha256=save_tensors(run_dir / GRAMS, tensors),
        samples=[{k: r[k] for k in ("index", "id", "tokens", "kept", "blocks", "blocks_unfiltered")} for r in records],
        counts={
            "samples_used": len(records),
            "samples_skipped": dict(skipped),
            "data_records_unusable": unusable,
            "tokens_seen": int(sum(r["tokens"] for r in records)),
            "tokens_kept": int(sum(r["kept"] for r in records)),
            "tokens_in_blocks": int(sum(r["blocks"] for r in records)) * man["settings"]["block"],
            "blocks": int(sum(r["blocks"] for r in records)),
            "blocks_unfiltered": int(sum(r["blocks_unfiltered"] for r in records)),
        },
    )
    if len(records) < man["settings"]["samples"]:
        man["counts"]["note"] = f"the data had only {len(records)} usable samples of {man['settings']['samples']} asked"
    write_manifest(run_dir, man)
    store.remove()
    return man
