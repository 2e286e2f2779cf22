"""Target features for draft training, computed once and cached on disk.

One target forward per sample gives, per token position t:
- ``ids``: the token x_t (int32);
- ``argmax``: the target's greedy next token at t over its full vocabulary (int32);
- ``final``: the input of the target's LM head at t, (d,) float16, from which the soft labels
  on any draft vocabulary are recomputed (``elsi.draft.train.LabelHead``: only the V_draft
  rows of the target's head, once per batch);
- ``states``: the hidden states at the cached layer ids, (L, d) float16;
- ``mask``: whether the token belongs to an assistant reply (uint8); training and held-out
  figures score the predictions of reply tokens only, as at decoding time.

float16 ends at 65504, and some targets' residual streams go beyond it (Gemma-3's massive
activations reach ~1e5): each shard stores every layer of ``states`` (and ``final``) divided by
a power of two 2^e, the smallest that brings its largest magnitude under that limit (exact:
fp16's relative precision is kept), and ``features.json`` records the exponents
(``scales``: shard -> {"states": [e per layer], "final": e}); ``FeatureStore.sample``
multiplies them back, in float32 where an exponent is not 0. A non-finite target state is an error.

The cache directory is keyed by model, data and settings (max tokens, seed, regeneration),
not by the number of samples: a longer run extends it and a shorter one reads its prefix.
Several processes share a cache: one builds or extends it under its lock (``elsi.collect.store.lock``)
while another that needs it waits, then reads what was built; a finished cache is read without a lock.
It stores the union of layers it was built with (``FeatureConfig.cache_layers``); asking a
layer it does not hold is a clear error. Storage: shards of ``.npy`` files read by memory
map, and ``features.json`` listing the samples (written after each shard: resumable).

The data is part of the key by content (``data_identity``: its SHA-256), not by path, and the
cache records the data's size and hash: an edited file is other data. Integrity:
``features.json`` records every ``.npy`` file's size and SHA-256 when it is written. Opening a
cache checks every size (cheap); each file's hash is checked the first time this process reads
it (the mask files at the start of training, the others on first use), so a many-GB cache is
hashed once per process, spread over the first epoch, not at every open.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from elsi.collect.collector import dist_info
from elsi.collect.store import lock
from elsi.config import opt
from elsi.data.conversations import (Dataset, Sample, assistant_mask, data_identity, iter_tokenized, render,
                                     tokenize)
from elsi.models.compiled import compiled
from elsi.models.load import Target, cache_dir
from elsi.stats.analysis import parse_layers as analysis_layers

MANIFEST = "features.json"
FORMAT = 2
REGEN_SHARD_BATCHES = 4  # regeneration batches per feature shard (see _build_features)


@dataclass(frozen=True)
class FeatureConfig:
    """Training data: conversations and the target's features on them."""

    model: str = opt("smollm2-135m", "target model: alias, HF directory, .gguf file or hub id")
    data: str = opt("sharegpt", "conversations: 'sharegpt', a ShareGPT .json or a .jsonl file")
    samples: int = opt(4800, "number of conversations (train + held-out); ~4M tokens of ShareGPT at 1024, about "
                             "what 20 minutes of bf16 training at ttt 1 on 2 AMX CPU cores go through (1.1 epochs)")
    max_tokens: int = opt(1024, "tokens per conversation (longer ones are cut)")
    seed: int = opt(0, "seed of the sample order; train-draft also draws the held-out split and the draft's "
                            "initialisation from it (elsi study: from --seeds)")
    regenerate: bool = opt(False, "let the target write the assistant turns itself (greedy), as EAGLE3 does")
    regen_max_new: int = opt(256, "with --regenerate: most new tokens per assistant turn")
    regen_turns: int = opt(0, "with --regenerate: keep only the first this many turns, each answered by the target "
                              "(0 = all; 1 = one prompt and its answer, the cheapest on a CPU)")
    regen_batch: int = opt(32, "with --regenerate: conversations generated together")
    cache_layers: str = opt("", "layer ids to cache (default: --layers); give the union to reuse the cache for several drafts")
    features_dir: str = opt("", "feature cache directory (default: $ELSI_CACHE/draft_features/<key>)")
    forward_batch: int = opt(1, "samples per target forward when computing features")
    compile: bool = opt(False, "torch.compile the target's forward for the feature pass (the first forward "
                               "compiles; measured: bench/results/bf16_compile.json)")

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
                "regen_max_new": self.regen_max_new if self.regenerate else None}
        if dtype != "float32":  # absent for float32, so the caches built before keep their key
            what["dtype"] = dtype
        if self.regenerate and self.regen_turns:  # absent for 0, so caches of all turns keep their key
            what["regen_turns"] = self.regen_turns
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


ARRAYS = ("ids", "argmax", "final", "states", "mask")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class FeatureStore:
    """Read access to a feature cache directory (memory-mapped shards, checked against features.json)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise FileNotFoundError(f"{self.path} holds no target features ({MANIFEST} missing)")
        self.rebuild = (f"delete {self.path} (or choose another --features-dir) and rerun the same command to "
                        "rebuild it")
        from elsi.collect.store import read_json

        self.manifest = read_json(self.path / MANIFEST, fix=self.rebuild)  # checked against its own checksum
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.path} holds features of format {self.manifest.get('format')}, this elsi reads "
                             f"format {FORMAT}: delete the directory (or choose another --features-dir) to rebuild it")
        self.layers: tuple[int, ...] = tuple(self.manifest["layers"])
        self.samples: list[dict] = self.manifest["samples"]
        self.files: dict[str, dict] = self.manifest.get("files", {})  # name -> {"size", "sha256"} (older: none)
        self.scales: dict[str, dict] = self.manifest.get("scales", {})  # shard -> power-of-two exponents (or none)
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
        """The target's dtype in the forward that computed these features (older caches: float32)."""
        return self.manifest["settings"].get("dtype", "float32")

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


def features_dir_for(cfg: FeatureConfig, target: Target) -> Path:
    if cfg.features_dir:
        return Path(cfg.features_dir)
    return cache_dir() / "draft_features" / cfg.key(target.source, target.dtype_name)


def _prompt_ids(sample: Sample, tok) -> list[int]:
    """Token ids of ``sample``'s conversation so far, rendered to be answered next (the generation prompt)."""
    text = render(sample, tok, add_generation_prompt=True)
    return tok(text, add_special_tokens=not getattr(tok, "chat_template", None))["input_ids"]


def first_prompt_tokens(sample: Sample, tok) -> int:
    """Length of the prompt that ``regenerate_batch`` answers first (system turns and the first user turn)."""
    if sample.text is not None:
        return 0
    head = [m for m in sample.messages if m[0] == "system"]
    first = next((m for m in sample.messages if m[0] == "user"), None)
    return len(_prompt_ids(Sample(sample.id, tuple(head + [first] if first else head)), tok))


def leaves_room(prompt_tokens: int, max_tokens: int) -> bool:
    """Whether a prompt of ``prompt_tokens`` tokens leaves room for at least one answer token in a conversation of
    ``max_tokens``; ``regenerate_batch`` answers only such prompts (the others end their conversation)."""
    return prompt_tokens < max_tokens - 1


def regenerate_sorted(target: Target, samples: Sequence[Sample], batch: int, max_tokens: int, max_new: int,
                      turns: int = 0, on_batch: Callable[[int], None] | None = None) -> list[Sample]:
    """``regenerate_batch`` over ``samples`` in batches of ``batch`` prompts of similar length (shortest
    first), returned in the given order. A batch is left-padded to its longest prompt and every decoding
    step attends over that width, so one long prompt among short ones would make the whole batch pay for
    it (bench/regen_speed.py measures the difference). ``on_batch(n)``: after each batch, n prompts answered."""
    order = sorted(range(len(samples)), key=lambda k: first_prompt_tokens(samples[k], target.tokenizer))
    out: list[Sample | None] = [None] * len(samples)
    for a in range(0, len(order), batch):
        ks = order[a: a + batch]
        for k, s in zip(ks, regenerate_batch(target, [samples[k] for k in ks], max_tokens, max_new, turns)):
            out[k] = s
        if on_batch:
            on_batch(a + len(ks))
    return out


@torch.no_grad()
def regenerate_batch(target: Target, samples: Sequence[Sample], max_tokens: int, max_new: int,
                     turns: int = 0) -> list[Sample]:
    """The samples with every assistant turn rewritten by the target (greedy), turn by turn.

    A conversation stops growing once its prompt reaches ``max_tokens`` or after ``turns``
    user turns (0 = no limit); later turns are dropped.
    """
    tok, model, device = target.tokenizer, target.model, target.device
    convs: list[list[tuple[str, str]]] = [[m for m in s.messages if m[0] == "system"] for s in samples]
    users = [[c for r, c in s.messages if r == "user"] for s in samples]
    alive = [s.text is None for s in samples]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n_turns = max(len(u) for u in users)
    for turn in range(min(n_turns, turns) if turns else n_turns):
        rows, prompts = [], []
        for k, s in enumerate(samples):
            if not alive[k] or turn >= len(users[k]):
                continue
            convs[k].append(("user", users[k][turn]))
            ids = _prompt_ids(Sample(s.id, tuple(convs[k])), tok)
            if not leaves_room(len(ids), max_tokens):
                alive[k] = False
                continue
            rows.append(k)
            prompts.append(ids)
        if not rows:
            break
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (R, W) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (R, W)
        new = min(max_new, max_tokens - min(map(len, prompts)))
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             pad_token_id=pad)
        for k, p, seq in zip(rows, prompts, out[:, width:].tolist()):
            seq = seq[: max(1, max_tokens - len(p))]
            if tok.eos_token_id in seq:
                seq = seq[: seq.index(tok.eos_token_id)]
            convs[k].append(("assistant", tok.decode(seq, skip_special_tokens=True).strip() or "..."))
    return [Sample(s.id, tuple(c)) if s.text is None else s for s, c in zip(samples, convs)]


def greedy_tokens(hidden: torch.Tensor, head: torch.nn.Module, chunk: int = 4096) -> torch.Tensor:
    """The target's greedy token after each row of ``hidden`` (..., d), the input of its LM head ``head``:
    the first maximal index of the logits, as ``head(hidden).argmax(-1)`` gives it, computed over vocabulary
    chunks of ``chunk`` rows of the head, so that the (tokens, V) logits are never stored (the bf16 feature
    pass of SmolLM2 ran 28 % faster for it: bench/results/bf16_compile.json against bf16.json). A logit
    soft-cap (tanh) is monotonic: no change."""
    w, b = head.weight, head.bias  # (V, d), (V,) or None
    best = idx = None
    for a in range(0, w.shape[0], chunk):
        v, i = F.linear(hidden, w[a:a + chunk], None if b is None else b[a:a + chunk]).max(-1)  # (...,)
        if best is None:
            best, idx = v, i
        else:  # strictly greater: a tie keeps the earlier chunk's (smaller) index
            upd = v > best
            best, idx = torch.where(upd, v, best), torch.where(upd, i + a, idx)
    return idx


@torch.no_grad()
def target_features(target: Target, batch: Sequence[list[int]], layers: Sequence[int],
                    forward: Callable | None = None):
    """One target forward on a batch of token lists -> per sample (argmax (T,), final (T, d), states (T, L, d)).
    ``forward``: the target's decoder to call (``target.adapter.decoder(target.model)`` compiled,
    ``elsi.models.compiled``; default: that decoder)."""
    device = target.device
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)  # (B, W) right-padded
    mask = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    for k, seq in enumerate(batch):
        ids[k, : len(seq)] = torch.tensor(seq, device=device)
        mask[k, : len(seq)] = 1
    decoder = target.adapter.decoder(target.model) if forward is None else forward  # no logits: see greedy_tokens
    hs = decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    final = hs[-1]  # (B, W, d): LM-head input (after the final norm); hs has N+1 of (B, W, d)
    states = torch.stack([hs[l] for l in layers], dim=2)  # (B, W, L, d)
    argmax = greedy_tokens(final, target.model.get_output_embeddings())  # (B, W)
    res = []
    for k, seq in enumerate(batch):
        t = len(seq)
        res.append((argmax[k, :t].cpu(), final[k, :t].float().cpu(), states[k, :t].float().cpu()))
    return res


FP16_MAX = 65504.0


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
    one to build or extend is written under its lock (``elsi.collect.store.lock``): a second process that
    needs the same cache waits for the first, then reads what it built rather than building it again."""
    path = features_dir_for(cfg, target)
    store = _usable_cache(path, target, dataset, cfg, layers)
    if store is not None:
        return store
    with lock(path, "the feature cache", wait=True):
        return _extend_features(target, dataset, cfg, layers, on_progress, shard_samples)


def _usable_cache(path: Path, target: Target, dataset: Dataset, cfg: FeatureConfig,
                  layers: Sequence[int]) -> FeatureStore | None:
    """The cache in ``path`` when it is finished for ``cfg`` and fits it, else None (``_extend_features`` then
    builds it, or says what does not fit)."""
    if not (path / MANIFEST).is_file():
        return None
    store = FeatureStore(path)
    need = set(layers) | set(parse_layers(cfg.cache_layers or list(layers), target.num_layers))
    recorded = store.manifest["settings"].get("data_fingerprint")
    fits = (need <= set(store.layers) and store.dtype == target.dtype_name
            and (recorded is None or not dataset.fingerprint or recorded == dataset.fingerprint))
    done = store.manifest.get("complete_for", 0) >= cfg.samples or store.manifest.get("exhausted")
    return store if fits and done else None


def _extend_features(target: Target, dataset: Dataset, cfg: FeatureConfig, layers: Sequence[int],
                     on_progress: Callable[[Progress], None] | None, shard_samples: int) -> FeatureStore:
    """Build or extend the cache of ``cfg`` (or return it, finished meanwhile by another process), holding its lock."""
    want = parse_layers(cfg.cache_layers or list(layers), target.num_layers)
    path = features_dir_for(cfg, target)
    if (path / MANIFEST).is_file():
        store = FeatureStore(path)
        recorded = store.manifest["settings"].get("data_fingerprint")
        if recorded is not None and dataset.fingerprint and recorded != dataset.fingerprint:
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
        if store.manifest.get("complete_for", 0) >= cfg.samples or store.manifest.get("exhausted"):
            return store
        man = store.manifest
    else:
        missing = [l for l in layers if l not in want]
        if missing:
            raise ValueError(f"--cache-layers {list(want)} must include the draft's layers; missing {missing}")
        man = {"format": FORMAT, "settings": {"model": cfg.model, "source": target.source, "data": cfg.data,
                                             "max_tokens": cfg.max_tokens, "seed": cfg.seed,
                                             "regenerate": cfg.regenerate, "regen_max_new": cfg.regen_max_new,
                                             "regen_turns": cfg.regen_turns, "dtype": target.dtype_name,
                                             "data_fingerprint": dataset.fingerprint or None},
               "layers": list(want), "hidden_size": target.hidden_size, "num_layers": target.num_layers,
               "samples": [], "skipped": {}, "next_order": 0, "complete_for": 0, "seconds": 0.0}
    path.mkdir(parents=True, exist_ok=True)
    cached_layers = man["layers"]
    done = len(man["samples"])
    forward = compiled(target.adapter.decoder(target.model), cfg.compile, target.device, "--compile")
    # Regeneration sorts each shard's prompts by length into its batches: a shard of several batches lets
    # prompts of similar length meet (a crash loses at most one shard's answers).
    per_shard = max(shard_samples, REGEN_SHARD_BATCHES * cfg.regen_batch) if cfg.regenerate else shard_samples
    t0 = t_begin = time.perf_counter()
    tokens = 0
    stream = iter_tokenized(dataset, target.tokenizer, cfg.max_tokens, cfg.seed)
    order_pos = 0
    exhausted = False

    def raw_samples():
        nonlocal order_pos
        for idx, sample, ids in stream:
            order_pos += 1
            if order_pos <= man["next_order"]:
                continue  # consumed by an earlier run
            if isinstance(ids, str) or len(ids) < 4:
                reason = ids if isinstance(ids, str) else "too_short"
                man["skipped"][reason] = man["skipped"].get(reason, 0) + 1
                continue
            yield idx, sample, ids

    source = raw_samples()
    while done < cfg.samples and not exhausted:
        # Step 1: gather one shard's samples (regenerated if asked).
        need = min(per_shard, cfg.samples - done)
        chunk: list[tuple[int, Sample, list[int]]] = []
        for item in source:
            chunk.append(item)
            if len(chunk) == need:
                break
        else:
            exhausted = True
        if not chunk:
            break
        if cfg.regenerate:
            def answered(n: int, of: int = len(chunk)) -> None:
                if on_progress:
                    on_progress(Progress(done, cfg.samples, tokens, time.perf_counter() - t_begin,
                                         f"regenerate {n}/{of}"))

            answered(0)
            regen = regenerate_sorted(target, [s for _, s, _ in chunk], cfg.regen_batch, cfg.max_tokens,
                                      cfg.regen_max_new, cfg.regen_turns, answered)
            kept = []
            for (i, _, _), s in zip(chunk, regen):
                if s.text is None and not any(role == "assistant" for role, _ in s.messages):
                    # Its first prompt left no room for an answer: nothing to score, a whole forward to pay.
                    man["skipped"]["prompt_too_long"] = man["skipped"].get("prompt_too_long", 0) + 1
                    continue
                kept.append((i, s, tokenize(s, target.tokenizer, cfg.max_tokens)))
            chunk = kept
            if not chunk:
                man["next_order"] = order_pos
                continue
        # Step 2: one target forward per sample (or batch) -> features of the shard.
        parts: dict[str, list[np.ndarray]] = {"ids": [], "argmax": [], "final": [], "states": [], "mask": []}
        entries = []
        offset = 0
        shard = len({s["shard"] for s in man["samples"]})
        for a in range(0, len(chunk), cfg.forward_batch):
            sub = chunk[a: a + cfg.forward_batch]
            if cfg.compile and tokens == 0 and on_progress:  # the first call compiles: say why it is slow
                on_progress(Progress(done, cfg.samples, 0, time.perf_counter() - t_begin, "compiling the forward"))
            feats = target_features(target, [ids for _, _, ids in sub], cached_layers, forward)
            for (idx, sample, ids), (am, fin, st) in zip(sub, feats):
                parts["ids"].append(np.asarray(ids, dtype=np.int32))
                parts["argmax"].append(am.numpy().astype(np.int32))
                parts["final"].append(fin.numpy())  # float32 until the shard's exponents are known
                parts["states"].append(st.numpy())
                parts["mask"].append(np.asarray(assistant_mask(sample, target.tokenizer, ids), dtype=np.uint8))
                entries.append({"index": idx, "id": sample.id, "shard": shard, "offset": offset, "length": len(ids)})
                offset += len(ids)
                tokens += len(ids)
            if on_progress:
                on_progress(Progress(done + len(entries), cfg.samples, tokens, time.perf_counter() - t_begin, "forward"))
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
        # Step 3: record the shard (the manifest is the commit point: a crash loses at most a shard).
        man["samples"].extend(entries)
        man["next_order"] = order_pos
        done = len(man["samples"])
        man["complete_for"] = done
        man["seconds"] = man.get("seconds", 0.0) + (time.perf_counter() - t0)
        man["tokens"] = sum(s["length"] for s in man["samples"])
        t0 = time.perf_counter()
        _write_json(path / MANIFEST, man)
    if exhausted:
        man["exhausted"] = True
        _write_json(path / MANIFEST, man)
    if done == 0:
        raise ValueError(f"no usable sample in {cfg.data}")
    return FeatureStore(path)


def _write_json(path: Path, obj: dict) -> None:
    """features.json, atomically, with its own checksum (``elsi.collect.store.write_json``)."""
    from elsi.collect.store import write_json

    write_json(path, obj, rebuild=f"delete {path.parent} (or choose another --features-dir) and rerun the same "
                                  "command to rebuild it")


def split_samples(n: int, heldout_frac: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, held-out) indices of n samples; at least one held-out sample."""
    if not 0 < heldout_frac < 1:
        raise ValueError(f"heldout fraction must be in (0, 1), got {heldout_frac}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    k = max(1, math.ceil(n * heldout_frac))
    return sorted(perm[k:]), sorted(perm[:k])
