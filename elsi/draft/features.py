"""Target features for draft training, computed once and cached on disk.

One target forward per sample (``elsi.draft.forward``) gives, per token position, the token, the
target's greedy next token, the input of its LM head and its hidden states at the cached layers;
``elsi.draft.cache`` stores them (fp16 shards and ``features.json``) and reads them back. With
``--regenerate`` the target first writes the assistant turns itself (``elsi.draft.regenerate``).

The cache directory is keyed by model, data and settings (max tokens, seed, regeneration),
not by the number of samples: a longer run extends it and a shorter one reads its prefix.
Several processes share a cache: one builds or extends it under its lock (``elsi.io.lock``)
while another that needs it waits, then reads what was built; a finished cache is read without a lock.
It stores the union of layers it was built with (``FeatureConfig.cache_layers``); asking a
layer it does not hold is a clear error.

The data is part of the key by content (``data_identity``: its SHA-256), not by path, and the
cache records the data's size and hash: an edited file is other data.

Building a cache, shard by shard (``_extend_features``):
1. the next samples of the data's seeded order (``_Samples``), answered by the target with ``--regenerate``;
2. one target forward per sample (or batch) -> the shard's features (``_forward_shard``), written (``write_shard``);
3. the shard recorded in ``features.json``, the commit point: a crash loses at most a shard.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np

from elsi.config import opt
from elsi.data.conversations import Dataset, Sample, assistant_mask, data_identity, iter_tokenized
from elsi.draft.cache import FORMAT, MANIFEST, FeatureStore, write_manifest, write_shard
from elsi.draft.compat import feature_key_extras, same_data
from elsi.draft.forward import target_features
from elsi.draft.regenerate import regenerate_tokenized
from elsi.io import lock
from elsi.models.compiled import compiled
from elsi.models.load import Target, cache_dir
from elsi.runtime import dist_info
from elsi.stats.analysis import parse_layers as analysis_layers

REGEN_SHARD_BATCHES = 4  # regeneration batches per feature shard (see _extend_features)


@dataclass(frozen=True)
class FeatureConfig:
    """Training data: conversations and the target's features on them."""

    model: str = opt("smollm2-135m", "target model: alias, HF directory, .gguf file or hub id")
    data: str = opt("sharegpt", "conversations: 'sharegpt', a ShareGPT .json or a .jsonl file")
    samples: int = opt(4800, "number of conversations (train + held-out)")
    max_tokens: int = opt(1024, "tokens per conversation (longer ones are cut)")
    seed: int = opt(0, "seed of the sample order; train-draft also draws the held-out split and the draft's "
                            "initialisation from it (elsi study: from --seeds)")
    regenerate: bool = opt(False, "let the target write the assistant turns itself (greedy), as EAGLE3 does")
    regen_max_new: int = opt(256, "with --regenerate: most new tokens per assistant turn")
    regen_turns: int = opt(0, "with --regenerate: keep only the first this many turns, each answered by the target "
                              "(0 = all; 1 = one prompt and its answer, the cheapest)")
    regen_batch: int = opt(32, "with --regenerate: conversations generated together")
    cache_layers: str = opt("", "layer ids to cache (default: --layers); give the union to reuse the cache for several "
                                "drafts", affects_result=False)
    features_dir: str = opt("", "feature cache directory (default: $ELSI_CACHE/draft_features/<key>)",
                            affects_result=False)
    forward_batch: int = opt(1, "samples per target forward when computing features", affects_result=False)
    compile: bool = opt(False, "torch.compile the target's forward for the feature pass (the first forward "
                               "compiles)", affects_result=False)

    def __post_init__(self) -> None:
        if self.samples < 2:
            raise ValueError(f"samples must be >= 2 (train + held-out), got {self.samples}")
        if self.max_tokens < 4:
            raise ValueError(f"max_tokens must be >= 4, got {self.max_tokens}")

    def key(self, target_source: str, dtype: str = "float32") -> str:
        """Cache key: what determines the features, except the sample count and layers (``dtype``: the
        target's weights, which the features are computed in)."""
        what = {"format": FORMAT, "model": target_source, "data": data_identity(self.data), "max_tokens": self.max_tokens,
                "seed": self.seed, "regenerate": self.regenerate,
                "regen_max_new": self.regen_max_new if self.regenerate else None,
                **feature_key_extras(dtype, self.regenerate, self.regen_turns)}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def parse_layers(spec: str | Sequence[int], num_layers: int) -> tuple[int, ...]:
    """'2,15,27' (ranges 'a-b' allowed) -> sorted ids, each checked against 0..N (``stats.analysis.parse_layers``)."""
    return tuple(sorted(analysis_layers(spec, num_layers)))


@dataclass
class Progress:
    samples_done: int
    samples_total: int
    tokens: int
    elapsed_s: float
    stage: str  # "regenerate N/M" (prompts of the shard answered) | "forward" | "compiling the forward" (the first)


def features_dir_for(cfg: FeatureConfig, target: Target) -> Path:
    if cfg.features_dir:
        return Path(cfg.features_dir)
    return cache_dir() / "draft_features" / cfg.key(target.source, target.dtype_name)


def build_features(target: Target, dataset: Dataset, cfg: FeatureConfig, layers: Sequence[int],
                   on_progress: Callable[[Progress], None] | None = None, shard_samples: int = 32) -> FeatureStore:
    """Compute (or extend, or reuse) the feature cache for ``cfg`` and return it.

    ``layers``: the draft's layers; the cache holds ``cfg.cache_layers`` (default ``layers``),
    which must include them. An existing cache must hold them too.
    Under torch.distributed (torchrun) rank 0 builds the cache alone while the other ranks
    wait at a barrier, then every rank opens it. The wait is on a CPU (gloo) group with a
    one-day timeout, so that a long build does not trip the default group's (NCCL: 10 min).
    """
    rank, world = dist_info()
    if world == 1:
        return _build_features(target, dataset, cfg, layers, on_progress, shard_samples)
    import torch.distributed as dist

    wait = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    if rank == 0:
        try:
            return _build_features(target, dataset, cfg, layers, on_progress, shard_samples)
        finally:
            dist.barrier(group=wait)  # on failure too, so that no rank waits a day for it
    dist.barrier(group=wait)
    store = FeatureStore(features_dir_for(cfg, target))
    store.layer_index(layers)
    return store


def _build_features(target: Target, dataset: Dataset, cfg: FeatureConfig, layers: Sequence[int],
                    on_progress: Callable[[Progress], None] | None, shard_samples: int) -> FeatureStore:
    """``build_features`` in one process. A finished cache is read without a lock (readers are never blocked);
    one to build or extend is written under its lock (``elsi.io.lock``): a second process that
    needs the same cache waits for the first, then reads what it built rather than building it again."""
    path = features_dir_for(cfg, target)
    store = _usable_cache(path, target, dataset, cfg, layers)
    if store is not None:
        return store
    with lock(path, "the feature cache", wait=True):
        return _extend_features(target, dataset, cfg, layers, on_progress, shard_samples)


def _finished(manifest: dict, cfg: FeatureConfig) -> bool:
    """Whether a cache holds ``cfg.samples`` samples, or all the data has."""
    return manifest.get("complete_for", 0) >= cfg.samples or bool(manifest.get("exhausted"))


def _usable_cache(path: Path, target: Target, dataset: Dataset, cfg: FeatureConfig,
                  layers: Sequence[int]) -> FeatureStore | None:
    """The cache in ``path`` when it is finished for ``cfg`` and fits it, else None (``_extend_features`` then
    builds it, or says what does not fit)."""
    if not (path / MANIFEST).is_file():
        return None
    store = FeatureStore(path)
    need = set(layers) | set(parse_layers(cfg.cache_layers or list(layers), target.num_layers))
    fits = (need <= set(store.layers) and store.dtype == target.dtype_name
            and same_data(store.manifest["settings"].get("data_fingerprint"), dataset.fingerprint))
    return store if fits and _finished(store.manifest, cfg) else None


def _manifest(path: Path, target: Target, dataset: Dataset, cfg: FeatureConfig, layers: Sequence[int],
              want: tuple[int, ...]) -> tuple[dict, FeatureStore | None]:
    """The manifest to extend: the cache's own, checked against this run (data, dtype, layers), or a new one
    for the layers ``want``; with the cache itself where it is finished already (by another process)."""
    if not (path / MANIFEST).is_file():
        missing = [l for l in layers if l not in want]
        if missing:
            raise ValueError(f"--cache-layers {list(want)} must include the draft's layers; missing {missing}")
        return {"format": FORMAT, "settings": {"model": cfg.model, "source": target.source, "data": cfg.data,
                                               "max_tokens": cfg.max_tokens, "seed": cfg.seed,
                                               "regenerate": cfg.regenerate, "regen_max_new": cfg.regen_max_new,
                                               "regen_turns": cfg.regen_turns, "dtype": target.dtype_name,
                                               "data_fingerprint": dataset.fingerprint or None},
                "layers": list(want), "hidden_size": target.hidden_size, "num_layers": target.num_layers,
                "samples": [], "skipped": {}, "next_order": 0, "complete_for": 0, "seconds": 0.0}, None
    store = FeatureStore(path)
    recorded = store.manifest["settings"].get("data_fingerprint")
    if not same_data(recorded, dataset.fingerprint):
        raise ValueError(
            f"the feature cache {path} was built from other data ({recorded['size']} bytes, sha256 "
            f"{recorded['sha256'][:12]}…); --data {cfg.data} has {dataset.fingerprint['size']} bytes, sha256 "
            f"{dataset.fingerprint['sha256'][:12]}… (other or edited data): delete the cache or choose another "
            f"--features-dir")
    built = store.dtype
    if built != target.dtype_name:
        raise ValueError(f"the feature cache {path} was computed with the target in {built}, this run loads it in "
                         f"{target.dtype_name}: pass --dtype {built}, or choose another --features-dir")
    store.layer_index(layers)  # a clear error if the draft's layers are missing
    if cfg.cache_layers and set(want) - set(store.layers):
        store.layer_index(want)
    return store.manifest, store if _finished(store.manifest, cfg) else None


class _Samples:
    """The data's usable tokenized samples in the seeded order, after the first ``skip`` an earlier run consumed.

    ``position``: how many samples of the order were read (what a manifest records as ``next_order``);
    ``exhausted``: the data has no more. Samples the tokenizer refused or shorter than 4 tokens are counted
    in ``skipped`` (reason -> count).
    """

    def __init__(self, stream: Iterator[tuple[int, Sample, list[int] | str]], skip: int, skipped: dict) -> None:
        self.position = 0
        self.exhausted = False
        self._usable = self._filter(stream, skip, skipped)

    def _filter(self, stream, skip: int, skipped: dict) -> Iterator[tuple[int, Sample, list[int]]]:
        for idx, sample, ids in stream:
            self.position += 1
            if self.position <= skip:
                continue  # consumed by an earlier run
            if isinstance(ids, str) or len(ids) < 4:
                reason = ids if isinstance(ids, str) else "too_short"
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            yield idx, sample, ids

    def take(self, n: int) -> list[tuple[int, Sample, list[int]]]:
        """Up to ``n`` more samples (fewer, and ``exhausted``, at the end of the data)."""
        chunk = []
        for item in self._usable:
            chunk.append(item)
            if len(chunk) == n:
                return chunk
        self.exhausted = True
        return chunk


@dataclass
class _Pass:
    """One process's pass over a cache it builds or extends: what its steps share."""

    target: Target
    cfg: FeatureConfig
    path: Path
    man: dict  # the manifest being extended (written after each shard)
    forward: Callable  # the target's decoder, compiled with --compile
    on_progress: Callable[[Progress], None] | None
    t_begin: float = field(default_factory=time.perf_counter)
    t_shard: float = 0.0  # perf_counter() when the current shard's work began
    tokens: int = 0  # tokens of this pass's forwards

    def __post_init__(self) -> None:
        self.t_shard = self.t_begin

    def report(self, done: int, stage: str, tokens: int | None = None) -> None:
        if self.on_progress:
            self.on_progress(Progress(done, self.cfg.samples, self.tokens if tokens is None else tokens,
                                      time.perf_counter() - self.t_begin, stage))


def _extend_features(target: Target, dataset: Dataset, cfg: FeatureConfig, layers: Sequence[int],
                     on_progress: Callable[[Progress], None] | None, shard_samples: int) -> FeatureStore:
    """Build or extend the cache of ``cfg`` (or return it, finished meanwhile by another process), holding its lock.
    Steps as in the module's docstring."""
    want = parse_layers(cfg.cache_layers or list(layers), target.num_layers)
    path = features_dir_for(cfg, target)
    man, finished = _manifest(path, target, dataset, cfg, layers, want)
    if finished is not None:
        return finished
    path.mkdir(parents=True, exist_ok=True)
    done = len(man["samples"])
    run = _Pass(target, cfg, path, man, compiled(target.adapter.decoder(target.model), cfg.compile, target.device,
                                                 "--compile"), on_progress)
    # Regeneration sorts each shard's prompts by length into its batches: a shard of several batches lets
    # prompts of similar length meet (a crash loses at most one shard's answers).
    per_shard = max(shard_samples, REGEN_SHARD_BATCHES * cfg.regen_batch) if cfg.regenerate else shard_samples
    source = _Samples(iter_tokenized(dataset, target.tokenizer, cfg.max_tokens, cfg.seed), man["next_order"],
                      man["skipped"])
    while done < cfg.samples and not source.exhausted:
        # Step 1: one shard's samples (regenerated if asked).
        chunk = source.take(min(per_shard, cfg.samples - done))
        if not chunk:
            break
        if cfg.regenerate:
            chunk = _regenerated(run, chunk, done)
            if not chunk:
                man["next_order"] = source.position
                continue
        # Step 2: one target forward per sample (or batch) -> features of the shard.
        shard = len({s["shard"] for s in man["samples"]})
        parts, entries = _forward_shard(run, chunk, shard, done)
        write_shard(path, shard, parts, man)
        # Step 3: record the shard (the manifest is the commit point: a crash loses at most a shard).
        done = _commit(run, entries, source.position)
    if source.exhausted:
        man["exhausted"] = True
        write_manifest(path, man)
    if done == 0:
        raise ValueError(f"no usable sample in {cfg.data}")
    return FeatureStore(path)


def _regenerated(run: _Pass, chunk: list[tuple[int, Sample, list[int]]], done: int) -> list:
    """Step 1 with ``--regenerate``: the chunk answered by the target (``regenerate_tokenized``); conversations
    left without an answer are counted in the manifest's ``skipped`` as ``prompt_too_long``."""
    cfg = run.cfg
    of = len(chunk)
    run.report(done, f"regenerate 0/{of}")
    kept, dropped = regenerate_tokenized(run.target, chunk, cfg.regen_batch, cfg.max_tokens, cfg.regen_max_new,
                                         cfg.regen_turns, lambda n: run.report(done, f"regenerate {n}/{of}"))
    if dropped:
        skipped = run.man["skipped"]
        skipped["prompt_too_long"] = skipped.get("prompt_too_long", 0) + dropped
    return kept


def _forward_shard(run: _Pass, chunk: list[tuple[int, Sample, list[int]]], shard: int,
                   done: int) -> tuple[dict[str, list[np.ndarray]], list[dict]]:
    """Step 2: the features of ``chunk`` as per-sample arrays (``write_shard``'s ``parts``; ``final`` and ``states``
    in float32) and the manifest entries of its samples in shard ``shard``."""
    cfg, tok = run.cfg, run.target.tokenizer
    parts: dict[str, list[np.ndarray]] = {"ids": [], "argmax": [], "final": [], "states": [], "mask": []}
    entries: list[dict] = []
    offset = 0
    for a in range(0, len(chunk), cfg.forward_batch):
        sub = chunk[a: a + cfg.forward_batch]
        if cfg.compile and run.tokens == 0:  # the first call compiles: say why it is slow
            run.report(done, "compiling the forward", tokens=0)
        feats = target_features(run.target, [ids for _, _, ids in sub], run.man["layers"], run.forward)
        for (idx, sample, ids), (am, fin, st) in zip(sub, feats):
            parts["ids"].append(np.asarray(ids, dtype=np.int32))
            parts["argmax"].append(am.numpy().astype(np.int32))
            parts["final"].append(fin.numpy())  # float32 until the shard's exponents are known
            parts["states"].append(st.numpy())
            parts["mask"].append(np.asarray(assistant_mask(sample, tok, ids), dtype=np.uint8))
            entries.append({"index": idx, "id": sample.id, "shard": shard, "offset": offset, "length": len(ids)})
            offset += len(ids)
            run.tokens += len(ids)
        run.report(done + len(entries), "forward")
    return parts, entries


def _commit(run: _Pass, entries: list[dict], next_order: int) -> int:
    """Step 3: the shard's samples recorded and the manifest written; returns the samples the cache now holds."""
    man = run.man
    man["samples"].extend(entries)
    man["next_order"] = next_order
    done = len(man["samples"])
    man["complete_for"] = done
    man["seconds"] = man.get("seconds", 0.0) + (time.perf_counter() - run.t_shard)
    man["tokens"] = sum(s["length"] for s in man["samples"])
    run.t_shard = time.perf_counter()
    write_manifest(run.path, man)
    return done


__all__ = ["FeatureConfig", "Progress", "build_features", "features_dir_for", "parse_layers"]
