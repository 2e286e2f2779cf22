"""Draft training: soft cross-entropy against the target, training-time test unrolled ``ttt`` steps.

Step by step (Li et al., "EAGLE-3", 2025, with this project's choices from docs/design.md):
1. Data (``_split``): the target's features, cached (``elsi.draft.features``); a seeded train / held-out
   split, and the draft vocabulary: the ``draft_vocab`` most frequent target greedy tokens of the training
   split (``elsi.draft.vocab``); a position whose target argmax is outside it is masked.
2. The draft and its optimizer (``_build``), resumed from a checkpoint where one fits (``_resume``).
3. The loop (``_train_loop``), one ``_step`` at a time: the loss of a batch (``elsi.draft.loss.ttt_loss``)
   unrolls the draft ``ttt`` steps; step j is scored against the target's distribution on the draft
   vocabulary at the position j+1 ahead, weight 0.8^j. AdamW, linear warm-up then cosine decay,
   gradient-norm clip (``Schedule``); stop at ``epochs``, ``max_steps`` or ``time_budget``, whichever
   comes first. Where training stands is a ``TrainState``, which checkpoints save.
4. Held-out figures, then the draft and its record (``_record``).

Checkpoints (``elsi.draft.resume``): written every ``checkpoint_every``, at the end, and when the loop is
interrupted (Ctrl-C / SIGINT: the current step finishes, the checkpoint is written, then
KeyboardInterrupt propagates). A run with no scored training or held-out position is an error before
any step.

Data parallel: under torchrun the draft is wrapped in DistributedDataParallel and each rank
takes a share of every step's batch (``train_draft``); the result equals one process's.

Determinism: with a fixed ``max_steps`` (and a time budget that does not bind) two runs with
the same seed give the same weights. With a binding time budget the cosine schedule follows
elapsed time, so the step count (and the result) depends on the machine's speed.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from elsi import runtime
from elsi.config import added_settings, at_least, opt, result_settings, settings_diff
from elsi.draft.cache import FeatureStore
from elsi.draft.checkpoint import TRAINING
from elsi.draft.compat import checkpoint_matmul_dtype, refuse_pickled_checkpoint
from elsi.draft.evaluate import evaluate_store
from elsi.draft.features import parse_layers
from elsi.draft.init import feature_scale, init_layer_from_target, resolve_layer_init, target_head_rows
from elsi.draft.loss import Batch, LabelHead, make_batch, scored, scored_counts, ttt_loss
from elsi.draft.model import Eagle3Draft, config_for_target, init_weights
from elsi.draft.resume import CHECKPOINT, Interrupt, load_checkpoint, restore_checkpoint, save_checkpoint
from elsi.draft.vocab import build_vocab
from elsi.io import lock
from elsi.models.compiled import compiled
from elsi.models.load import Target


def parse_duration(text: str) -> float:
    """'20m', '90s', '1.5h', '1200' (seconds), '' or '0' (no limit -> inf) -> seconds."""
    text = str(text).strip().lower()
    if text in ("", "0", "none"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([smh]?)", text)
    if not m:
        raise ValueError(f"bad duration {text!r}: use e.g. 90s, 20m, 1.5h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass(frozen=True)
class TrainConfig:
    """Draft model and its training."""

    layers: str = opt(help="target hidden-state ids the draft reads, e.g. 2,15,27 (docs/design.md numbering)")
    out: str = opt(help="output directory of the draft (model.safetensors, config.json, training.json)",
                   affects_result=False)
    draft_vocab: int = opt(8192, "draft vocabulary: the most frequent target tokens of the training data")
    ttt: int = opt(1, "training-time-test unroll depth (step i weighted 0.8^i); 1 = depth-1 only; EAGLE3 uses 7")
    lr: float = opt(1e-3, "peak learning rate of AdamW")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(10, "linear warm-up steps")
    epochs: float = opt(4.0, "passes over the training split (fractions allowed)")
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = no limit)")
    time_budget: str = opt("20m", "wall-clock limit of the training loop, e.g. 20m, 90s (features not counted)")
    batch_size: int = opt(1, "conversations per optimizer step (padded to the longest; 1 = no padding, most steps)")
    grad_clip: float = opt(0.5, "gradient-norm clip")
    heldout: float = opt(0.05, "fraction of the conversations held out")
    loss_on: str = opt("reply", "positions scored in training and held-out figures: 'reply' (predictions of "
                                "assistant-reply tokens, what decoding drafts) or 'all'", choices=("reply", "all"))
    fc_norm: bool = opt(False, "RMS-normalise each target state before fc (EAGLE-3.1 fc_norm: vLLM, SGLang, "
                               "SpecForge and speculators load it)")
    aux_scale: bool = opt(False, "train fc on target states scaled to unit RMS per feature (folded into fc when "
                                "saved: same EAGLE3 format); off = raw states")
    head_init: str = opt("random", "initial LM head: 'target' (the target's head rows of the draft vocabulary, "
                                   "final-norm scale folded in) or 'random'", choices=("target", "random"))
    train_dtype: str = opt("auto", "precision of the draft's matrix products in training: bfloat16 (autocast; "
                                   "float32 master weights, optimizer and loss), float32, or auto (bfloat16 where "
                                   "the device multiplies it natively)", choices=("auto", "float32", "bfloat16"))
    train_compile: bool = opt(False, "torch.compile the draft's unrolled forward (and backward) in training (the "
                                     "first step compiles)", affects_result=False)
    layer_init: str = opt("auto", "initial midlayer: 'target' (the target's last decoder layer: its attention "
                                  "read the state half of the draft's [embedding ; state] input, its MLP and norms "
                                  "copied; Llama-type layers), 'random', or auto (target where the target's layer is "
                                  "of the draft's Llama type, random elsewhere)", choices=("auto", "target", "random"),
                          added="random")
    freeze_head: bool = opt(False, "keep the LM head at its initial weights")
    eval_every: str = opt("2m", "held-out check (on up to 16 held-out conversations) every this long",
                          affects_result=False)
    checkpoint_every: str = opt("2m", "checkpoint for resuming every this long", affects_result=False)
    restart: bool = opt(False, "ignore an existing checkpoint in --out and start over", affects_result=False)

    def __post_init__(self) -> None:
        at_least(self, ttt=1, batch_size=1)
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.aux_scale and self.fc_norm:
            raise ValueError("aux_scale and fc_norm both rescale fc's inputs; choose one")
        if self.train_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"train_dtype must be auto, float32 or bfloat16, got {self.train_dtype!r}")
        if self.loss_on not in ("reply", "all"):
            raise ValueError(f"loss_on must be 'reply' or 'all', got {self.loss_on!r}")
        if self.head_init not in ("target", "random"):
            raise ValueError(f"head_init must be 'target' or 'random', got {self.head_init!r}")
        if self.layer_init not in ("auto", "target", "random"):
            raise ValueError(f"layer_init must be auto, 'target' or 'random', got {self.layer_init!r}")
        if self.freeze_head and self.head_init == "random":
            raise ValueError("freeze_head with head_init='random' would keep a random head; use head_init='target'")
        for name in ("time_budget", "eval_every", "checkpoint_every"):
            parse_duration(getattr(self, name))


@dataclass
class Progress:
    step: int
    epoch: float
    elapsed_s: float
    tokens: int  # scored training positions so far (depth 1)
    loss: float  # recent weighted TTT loss
    acc: float  # recent depth-1 top-1 match
    lr: float
    heldout_acc: float | None = None
    note: str = ""
    step_loss: float = math.nan  # weighted TTT loss of this step's (global) batch
    total_steps: int = 0  # steps at which training stops unless the time budget ends it first (0: not known yet)
    info: str = ""  # a line for the user (what ends training), not an event: callbacks that only track steps skip it


@dataclass
class TrainState:
    """Where training stands: what a checkpoint's JSON header holds (``asdict``: these keys, in this order)."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the pass over the training split under way (0-based; it seeds that pass's order)
    pos: int = 0  # conversations of that pass's order consumed
    elapsed: float = 0.0  # seconds of training (held-out checks excluded)
    tokens: int = 0  # scored depth-1 training positions so far
    curve: list[dict] = field(default_factory=list)  # at step 1 and every 10th: step, elapsed_s, tokens, lr, loss, acc
    heldout_curve: list[dict] = field(default_factory=list)  # at each held-out check: step, elapsed_s, match, loss
    matmul_dtype: str = "float32"  # the precision of the draft's matrix products ("float32" or "bfloat16")

    def note(self, **kw) -> Progress:
        """A progress event that reports no step: ``note=`` (resumed, a warning) or ``info=`` (what ends training)."""
        return Progress(self.step, self.epoch, self.elapsed, self.tokens, math.nan, math.nan, 0.0, **kw)


@dataclass(frozen=True)
class Schedule:
    """When training stops, checks the held-out split and checkpoints, and its learning rate."""

    total_steps: int  # the steps of --epochs, capped by --max-steps
    budget: float  # seconds of training (inf: no limit)
    eval_every: float  # seconds between held-out checks (inf: none)
    checkpoint_every: float  # seconds between checkpoints
    step_based: bool  # the cosine follows the steps alone (--max-steps, or no time budget)

    @classmethod
    def of(cls, cfg: TrainConfig, train_size: int) -> Schedule:
        budget = parse_duration(cfg.time_budget)
        total = math.ceil(cfg.epochs * math.ceil(train_size / cfg.batch_size))
        if cfg.max_steps:
            total = min(total, cfg.max_steps)
        return cls(total, budget, parse_duration(cfg.eval_every), parse_duration(cfg.checkpoint_every),
                   bool(cfg.max_steps) or math.isinf(budget))

    def running(self, state: TrainState) -> bool:
        return state.step < self.total_steps and state.elapsed < self.budget

    def lr(self, cfg: TrainConfig, state: TrainState) -> float:
        """The learning rate of the step after ``state``: warm-up, then cosine over the steps or the time budget,
        whichever is further along."""
        progress = state.step / self.total_steps if self.step_based else max(state.step / self.total_steps,
                                                                             state.elapsed / self.budget)
        return cfg.lr * lr_factor(state.step, progress, cfg.warmup_steps)


@dataclass
class Split:
    """Step 1: a run's training data, deterministic functions of the data and the seed."""

    n: int  # conversations used (training + held-out)
    train: list[int]  # indices of the training conversations in the cache
    held: list[int]  # indices of the held-out ones
    vocab_ids: torch.Tensor  # (V_draft,) target ids of the draft vocabulary, increasing
    d2t: torch.Tensor  # (V_draft,) int64 draft id -> target id offset
    t2d: torch.Tensor  # (V_target,) bool: in the draft vocabulary
    coverage: float  # share of the training split's target greedy tokens inside the draft vocabulary


@dataclass
class Trainee:
    """Step 2: the draft and what trains it. Only the draft's and the optimizer's state are saved."""

    draft: Eagle3Draft
    optimizer: torch.optim.Optimizer
    label_head: LabelHead  # the soft labels' head, in ``mm_dtype``
    mm_dtype: torch.dtype  # the draft's matrix products in training (bf16 autocast or float32)
    warning: str | None  # why bf16 was asked for and not used
    layer_init: str  # --layer-init as resolved for this target
    unroll: Callable | None = None  # ``draft.unroll``, compiled with --train-compile (``_wrap``)
    ddp: torch.nn.Module | None = None  # DistributedDataParallel over ``_TTTLoss`` (several processes)

    @property
    def mm_name(self) -> str:
        return str(self.mm_dtype).removeprefix("torch.")


@dataclass
class _Run:
    """What every part of one process's training reads; none of it changes during training."""

    target: Target
    store: FeatureStore
    cfg: TrainConfig
    seed: int
    device: torch.device
    rank: int
    world: int
    out: Path  # the draft directory
    layers: tuple[int, ...]  # the target's hidden-state ids the draft reads
    layer_pos: list[int]  # their positions in the cache's layer axis
    settings: dict  # what a checkpoint must have been written with (``_settings_key``)
    on_progress: Callable[[Progress], None] | None

    def tell(self, progress: Progress) -> None:
        if self.on_progress:
            self.on_progress(progress)


def lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to 0 over ``progress`` in [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def split_samples(n: int, heldout_frac: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, held-out) indices of n samples; at least one held-out sample."""
    if not 0 < heldout_frac < 1:
        raise ValueError(f"heldout fraction must be in (0, 1), got {heldout_frac}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    k = max(1, math.ceil(n * heldout_frac))
    return sorted(perm[k:]), sorted(perm[:k])


def scored_positions(store: FeatureStore, indices: Sequence[int], loss_on: str) -> int:
    """How many depth-1 predictions of ``indices`` training and held-out figures score (``make_batch``'s ``valid``)."""
    return sum(store.scored_count(i, loss_on) for i in indices)


def stop_rule(cfg: TrainConfig, total_steps: int, budget: float) -> str:
    """What ends training, in words: the step count (--max-steps or --epochs) or the time budget, whichever
    comes first (a progress bar over the budget's seconds alone reads 0/1200s while --max-steps ends the run)."""
    by = "--max-steps" if cfg.max_steps and cfg.max_steps == total_steps else f"{cfg.epochs:g} epochs"
    steps = f"{total_steps} steps ({by})"
    if math.isinf(budget):
        return f"training ends after {steps}"
    return f"training ends after {steps} or {cfg.time_budget} of training, whichever comes first"


def matmul_dtype(choice: str, device: torch.device) -> tuple[torch.dtype, str | None]:
    """The dtype of the draft's training matmuls for ``--train-dtype`` on ``device``, and a warning
    when bfloat16 was asked for where it would be emulated (several times slower than float32)."""
    fast, why = runtime.fast_bf16(device)  # looked up when called (tests stand in for the CPU's flags)
    if choice == "float32" or (choice == "auto" and not fast):
        return torch.float32, None
    if not fast:
        return torch.float32, (f"--train-dtype bfloat16: {why}, so bf16 products would be emulated, several times "
                               "slower than float32; training in float32 instead")
    return torch.bfloat16, None


def with_added_settings(train: dict) -> dict:
    """A record's training settings (a checkpoint's, a study's plan.json) with the settings added since it was
    written filled in where absent: each with the value that does what the record's run did (``added=``)."""
    return {**added_settings(TrainConfig), **train}


def _settings_key(cfg: TrainConfig, feature_settings: dict, samples: int) -> dict:
    """What a checkpoint must have been written with: every training setting that changes the result."""
    return {"train": result_settings(cfg), "features": feature_settings, "samples": samples}


def train_draft(target: Target, store: FeatureStore, cfg: TrainConfig, seed: int, device: torch.device,
                samples: int | None = None, on_progress: Callable[[Progress], None] | None = None) -> dict:
    """Train (or resume) a draft on cached features and write it to ``cfg.out``. Returns training.json's dict.

    Under torch.distributed (torchrun) with W processes the draft is wrapped in
    DistributedDataParallel: every step's batch of ``cfg.batch_size`` conversations comes from
    the same seeded order on every rank, rank r takes conversations r, r+W, ... of it, and
    the loss is normalised by the global count of scored positions, so the gradients, the
    logged figures and the weights are those of one process with the same batch (up to
    floating-point summation order). Rank 0's clock decides the time budget, evaluation and
    checkpoints; rank 0 alone evaluates and writes, the other ranks wait at a barrier. Another
    process writing ``cfg.out`` is an error (``lock``: rank 0 holds the draft directory's lock).
    """
    rank, world = runtime.dist_info()
    with lock(cfg.out, "the draft directory") if rank == 0 else nullcontext():
        return _train_draft(target, store, cfg, seed, device, samples, on_progress, rank, world)


def _train_draft(target: Target, store: FeatureStore, cfg: TrainConfig, seed: int, device: torch.device,
                 samples: int | None, on_progress: Callable[[Progress], None] | None, rank: int, world: int) -> dict:
    """``train_draft`` in process ``rank`` of ``world``, rank 0 holding the draft directory's lock. Steps as in the
    module's docstring."""
    if world > 1 and cfg.batch_size < world:
        raise ValueError(f"batch_size {cfg.batch_size} is smaller than the world size {world}: every process "
                         f"needs a share of each step's batch; use a batch size of at least {world}")
    layers = parse_layers(cfg.layers, target.num_layers)
    layer_pos = store.layer_index(layers)
    n = min(len(store), samples or len(store))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(target, store, cfg, seed, device, rank, world, out, layers, layer_pos,
               _settings_key(cfg, store.manifest["settings"], n), on_progress)
    data = _split(run, n)  # Step 1
    model = _build(run, data)  # Step 2
    state = _resume(run, model)
    _wrap(run, model)
    sched = Schedule.of(cfg, len(data.train))
    _announce(run, model, state, sched)
    _train_loop(run, data, model, sched, state)  # Step 3
    if rank != 0:  # rank 0 evaluates and writes; the others return its record
        _barrier(world)
        return json.loads((out / TRAINING).read_text())
    save_checkpoint(out / CHECKPOINT, model.draft, model.optimizer, run.settings, asdict(state))
    record = _record(run, data, model, state)  # Step 4
    _barrier(world)
    return record


def _split(run: _Run, n: int) -> Split:
    """Step 1: the train / held-out split of the first ``n`` conversations, checked to score something, and the
    draft vocabulary of the training split."""
    cfg, store = run.cfg, run.store
    train_idx, held_idx = split_samples(n, cfg.heldout, run.seed)
    if len(held_idx) == 1 and run.rank == 0:
        held_tokens = sum(store.samples[i]["length"] for i in held_idx)
        warnings.warn(f"the held-out split is one conversation ({held_tokens} tokens: {n} conversations x --heldout "
                      f"{cfg.heldout}, rounded up): every held-out figure rests on it alone; raise --samples or "
                      "--heldout for a held-out set that measures something", stacklevel=3)
    max_tokens = store.manifest["settings"].get("max_tokens")
    for what, idx in (("training", train_idx), ("held-out", held_idx)):
        if scored_positions(store, idx, cfg.loss_on) == 0:
            why = (f"none of its {len(idx)} conversations has an assistant-reply token within --max-tokens "
                   f"{max_tokens} (--loss-on reply)" if cfg.loss_on == "reply" else
                   f"its {len(idx)} conversations have fewer than 2 tokens each")
            raise ValueError(f"the {what} split has no position to score: {why}; raise --max-tokens, use data with "
                             "shorter prompts, or pass --loss-on all")
    vocab_size = int(run.target.adapter.embed_tokens(run.target.model).weight.shape[0])
    vocab_ids, d2t, t2d, counts = build_vocab((store.argmax(i) for i in train_idx), vocab_size, cfg.draft_vocab)
    coverage = float(counts[vocab_ids].sum()) / max(1, int(counts.sum()))
    return Split(n, train_idx, held_idx, vocab_ids, d2t, t2d, coverage)


def _build(run: _Run, data: Split) -> Trainee:
    """Step 2: the draft, initialised as the options ask (seeded), and its optimizer."""
    target, cfg = run.target, run.cfg
    dcfg = config_for_target(target, run.layers, draft_vocab_size=len(data.vocab_ids), fc_norm=cfg.fc_norm)
    draft = Eagle3Draft(dcfg, target.adapter.embed_tokens(target.model))
    init_weights(draft, torch.Generator().manual_seed(run.seed))
    draft.set_vocab(data.d2t, data.t2d)
    layer_init = resolve_layer_init(cfg.layer_init, target)
    if layer_init == "target":
        init_layer_from_target(draft, target)
    if cfg.head_init == "target":
        with torch.no_grad():
            draft.lm_head.weight.copy_(target_head_rows(target, data.vocab_ids))
    draft.lm_head.weight.requires_grad_(not cfg.freeze_head)
    if cfg.aux_scale:
        draft.set_aux_scale(feature_scale(run.store, data.train, run.layer_pos))
    draft.to(run.device).train()
    mm_dtype, warning = matmul_dtype(cfg.train_dtype, run.device)
    label_head = LabelHead.build(target, data.vocab_ids, run.device, mm_dtype)  # training's soft labels
    # The fused kernel (CPU and CUDA): one pass over all weights instead of a loop per tensor; on
    # a CPU the optimizer step is a visible share of a one-conversation step.
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr,
                                  betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                  fused=run.device.type in ("cpu", "cuda") or None)
    return Trainee(draft, optimizer, label_head, mm_dtype, warning, layer_init)


def _resume(run: _Run, model: Trainee) -> TrainState:
    """A fresh state, or (without --restart) the checkpoint's in the draft directory, loaded into the draft and
    its optimizer once it is checked to be of this run's settings and precision."""
    cfg, mm_name = run.cfg, model.mm_name
    ck = run.out / CHECKPOINT
    refuse_pickled_checkpoint(run.out, cfg.restart, run.rank, ck)
    if cfg.restart or not ck.is_file():
        return TrainState(matmul_dtype=mm_name)
    tensors, saved = load_checkpoint(ck)
    diffs = settings_diff({**saved["settings"], "train": with_added_settings(saved["settings"]["train"])},
                          run.settings, "the checkpoint")
    if diffs:
        raise ValueError(f"{ck} was written with other settings: " + "; ".join(diffs) + "; pass the same "
                         "options to finish it, --restart to start over, or choose another --out")
    had = checkpoint_matmul_dtype(saved["state"], mm_name)
    if had != mm_name:  # --train-dtype auto resolves per machine: the same settings, another precision
        raise ValueError(f"{ck} was trained with {had} matmuls, this run would go on in {mm_name} "
                         f"(--train-dtype {cfg.train_dtype}; {runtime.fast_bf16(run.device)[1]}): pass --train-dtype "
                         f"{had} to finish it alike, or --restart to start over")
    restore_checkpoint(tensors, saved["optimizer"], model.draft, model.optimizer)
    state = TrainState(**{**saved["state"], "matmul_dtype": had})
    run.tell(state.note(note=f"resumed from {ck} at step {state.step}"))
    return state


def _wrap(run: _Run, model: Trainee) -> None:
    """The draft's unroll compiled (--train-compile), and under several processes the training step wrapped in
    DistributedDataParallel (every rank holds the same initial or checkpointed weights by now)."""
    model.unroll = compiled(model.draft.unroll, run.cfg.train_compile, run.device, "--train-compile")
    if run.world > 1:
        model.ddp = torch.nn.parallel.DistributedDataParallel(
            _TTTLoss(model.draft, run.cfg.ttt, model.unroll),
            device_ids=[run.device] if run.device.type == "cuda" else None)


def _announce(run: _Run, model: Trainee, state: TrainState, sched: Schedule) -> None:
    """Rank 0's notes before the first step: a precision warning, compilation, and (a fresh start: a resumed run
    said so already) what ends training."""
    if run.rank != 0:
        return
    if model.warning:
        run.tell(state.note(note=f"warning: {model.warning}"))
    if run.cfg.train_compile:
        run.tell(state.note(note="compiling the draft's training step (in the first step)"))
    if state.step == 0:
        run.tell(state.note(info=stop_rule(run.cfg, sched.total_steps, sched.budget), total_steps=sched.total_steps))


class _Clock:
    """Seconds of training: wall time since a start that each held-out check moves forward by its own time."""

    def __init__(self, elapsed: float) -> None:
        self.restart(elapsed)

    def restart(self, elapsed: float) -> None:
        self.t_start = time.perf_counter() - elapsed

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start


def _order(data: Split, seed: int, epoch: int) -> list[int]:
    """The training conversations in pass ``epoch``'s order (the same on every rank)."""
    perm = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return [data.train[i] for i in perm.tolist()]


def _train_loop(run: _Run, data: Split, model: Trainee, sched: Schedule, state: TrainState) -> None:
    """Step 3: optimizer steps until the schedule ends, with held-out checks and checkpoints on the way.

    Ctrl-C (``Interrupt``, or a KeyboardInterrupt raised by the progress callback) lets the step finish,
    writes the checkpoint, then raises KeyboardInterrupt; under DDP every rank stops after the same step.
    """
    cfg = run.cfg
    clock = _Clock(state.elapsed)
    last_eval = last_ck = state.elapsed
    recent: deque[tuple[float, int, int]] = deque(maxlen=20)  # the last steps' (loss, correct, scored)
    perm = _order(data, run.seed, state.epoch)
    with Interrupt() as interrupt:
        while sched.running(state):
            if state.pos >= len(perm):
                state.epoch += 1
                state.pos = 0
                perm = _order(data, run.seed, state.epoch)
            idx = perm[state.pos: state.pos + cfg.batch_size]
            state.pos += len(idx)
            lr = sched.lr(cfg, state)
            loss, stats = _step(run, data, model, idx, lr, state.step)
            state.step += 1
            figures, state.elapsed, ranks_stop = _step_figures(run, loss, stats, clock.elapsed(), interrupt)
            state.tokens += figures[2]
            recent.append(figures)
            r_loss = sum(r[0] for r in recent) / len(recent)
            r_acc = sum(r[1] for r in recent) / max(1, sum(r[2] for r in recent))
            if state.step % 10 == 0 or state.step == 1:
                state.curve.append({"step": state.step, "elapsed_s": round(state.elapsed, 2), "tokens": state.tokens,
                                    "lr": lr, "loss": r_loss, "acc": r_acc})
            held = None
            if state.elapsed - last_eval >= sched.eval_every:
                held = _heldout_check(run, data, model, state)
                last_eval = state.elapsed
                clock.restart(state.elapsed)  # evaluation time is not training time
            if state.elapsed - last_ck >= sched.checkpoint_every:
                _checkpoint(run, model, state)
                last_ck = state.elapsed
            try:
                run.tell(Progress(state.step, state.epoch + state.pos / len(perm), state.elapsed, state.tokens, r_loss,
                                  r_acc, lr, held["match"][0] if held else None, step_loss=figures[0]))
            except KeyboardInterrupt:  # Ctrl-C outside the handler (or raised by the caller): the same
                interrupt.requested = True
            stop = ranks_stop if model.ddp is not None else interrupt.requested
            if stop:
                _checkpoint(run, model, state)
                raise KeyboardInterrupt


def _step(run: _Run, data: Split, model: Trainee, idx: list[int], lr: float, step: int) -> tuple[torch.Tensor, list]:
    """One optimizer step at learning rate ``lr`` on the conversations ``idx`` (this process's share of them);
    returns the loss (this process's share of the batch's) and ``ttt_loss``'s statistics of its share.

    bf16 autocast covers the draft's forward (and so its backward), and the soft labels' head product is bf16 too
    (``Trainee.label_head``); weights, AdamW and the loss (log-softmax and argmax in float32, ``ttt_loss``) stay
    float32; held-out figures are computed in float32, the precision the engine drafts in.
    """
    cfg, rank, world = run.cfg, run.rank, run.world
    mine = idx[rank::world]  # this process's share of the step's batch (all of it with one process)
    samples = [run.store.sample(i, run.layer_pos) for i in mine or idx[:1]]
    score = scored(samples, cfg.loss_on)
    if not mine:  # an epoch's last batch, smaller than W: a fully masked stand-in keeps DDP in step
        score = [torch.zeros_like(s["ids"], dtype=torch.bool) for s in samples]
    batch = make_batch(run.target, samples, data.vocab_ids, data.t2d, run.device, label_head=model.label_head,
                       score=score)
    for group in model.optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=model.mm_dtype == torch.bfloat16):
        if model.ddp is None:
            loss, stats, _ = ttt_loss(model.draft, batch, cfg.ttt, unroll=model.unroll)
        else:  # this rank's share of the global loss: per-step sums over the global batch's scored counts
            counts = scored_counts(batch, cfg.ttt)  # (ttt,)
            dist.all_reduce(counts)
            loss, stats, _ = model.ddp(batch, counts)
    if not torch.isfinite(loss.detach()):  # before the step: the weights and the last checkpoint stay clean
        raise ValueError(f"the training loss is {float(loss.detach())} at step {step + 1}: a non-finite "
                         f"target feature or label in {run.store.path}, or a learning rate too high ({lr:g}); "
                         "nothing of this step was applied")
    model.optimizer.zero_grad(set_to_none=True)
    (loss * world).backward()  # DDP averages the W ranks' gradients: x W makes them the global batch's
    torch.nn.utils.clip_grad_norm_([p for p in model.draft.parameters() if p.requires_grad], cfg.grad_clip)
    model.optimizer.step()
    return loss, stats


def _step_figures(run: _Run, loss: torch.Tensor, stats: list[dict], elapsed: float,
                  interrupt: Interrupt) -> tuple[tuple[float, int, int], float, bool]:
    """The step's (loss, depth-1 correct, scored) of the global batch, the training seconds by rank 0's clock
    (``elapsed``: this process's), and whether any rank was interrupted (DDP; one process: False, its own
    ``interrupt`` is read after the progress callback)."""
    figures = [float(loss.detach()), stats[0]["correct"], stats[0]["scored"]]
    if run.world == 1:
        return (figures[0], figures[1], figures[2]), elapsed, False
    figures += [elapsed if run.rank == 0 else 0.0, 1.0 if interrupt.requested else 0.0]
    total = torch.tensor(figures, dtype=torch.float64, device=run.device)
    dist.all_reduce(total)
    return (total[0].item(), round(total[1].item()), round(total[2].item())), total[3].item(), total[4].item() > 0


def _heldout_check(run: _Run, data: Split, model: Trainee, state: TrainState) -> dict | None:
    """Rank 0's held-out figures on up to 16 held-out conversations (depths up to 3), added to the state's curve;
    every rank waits for them."""
    held = None
    if run.rank == 0:
        held = evaluate_store(model.draft, run.target, run.store, data.held[:16], data.vocab_ids, min(run.cfg.ttt, 3),
                              run.cfg.batch_size, run.device, run.cfg.loss_on)
        state.heldout_curve.append({"step": state.step, "elapsed_s": round(state.elapsed, 2),
                                    "match": held["match"], "loss": held["loss"]})
    _barrier(run.world)
    return held


def _checkpoint(run: _Run, model: Trainee, state: TrainState) -> None:
    """Rank 0 writes the checkpoint of ``state``; every rank waits for it."""
    if run.rank == 0:
        save_checkpoint(run.out / CHECKPOINT, model.draft, model.optimizer, run.settings, asdict(state))
    _barrier(run.world)


def _record(run: _Run, data: Split, model: Trainee, state: TrainState) -> dict:
    """Step 4: held-out figures of the final draft, then the draft and ``training.json`` (rank 0)."""
    cfg, store, draft = run.cfg, run.store, model.draft
    draft.fold_aux_scale()  # the weights that are saved are the ones evaluated
    final = evaluate_store(draft, run.target, store, data.held, data.vocab_ids, cfg.ttt, cfg.batch_size, run.device,
                           cfg.loss_on)
    draft.save_pretrained(run.out)
    record = {
        "status": "complete",
        "settings": run.settings,
        "layers": list(run.layers),
        "num_params": sum(p.numel() for p in draft.parameters()),
        "data": {"samples": data.n, "train_samples": len(data.train), "heldout_samples": len(data.held),
                 "train_tokens": sum(store.samples[i]["length"] for i in data.train),
                 "heldout_tokens": sum(store.samples[i]["length"] for i in data.held),
                 "features_dir": str(store.path), "features_dtype": store.dtype,
                 "draft_vocab_size": len(data.vocab_ids), "draft_vocab_coverage": data.coverage},
        "steps": state.step,
        "epochs": state.epoch + state.pos / max(1, len(data.train)),
        "train_seconds": state.elapsed,  # over every run of a resumed training
        "machine": runtime.machine_info(),  # where it finished (``elsi.runtime.timing_key``: whose seconds compare)
        "train_tokens_seen": state.tokens,
        "train_tokens_per_s": state.tokens / max(1e-9, state.elapsed),
        "train_matmul_dtype": model.mm_name,
        "train_compiled": cfg.train_compile,
        "layer_init": model.layer_init,  # --layer-init auto resolved for this target
        "curve": state.curve,
        "heldout_curve": state.heldout_curve,
        "heldout": final,
    }
    (run.out / TRAINING).write_text(json.dumps(record, indent=1))
    return record


class _TTTLoss(torch.nn.Module):
    """``ttt_loss`` as a module's forward, so that DistributedDataParallel can wrap the draft's training step."""

    def __init__(self, draft: Eagle3Draft, steps: int, unroll: Callable | None = None) -> None:
        super().__init__()
        self.draft = draft
        self.steps = steps
        self.unroll = unroll

    def forward(self, batch: Batch, denominators: torch.Tensor):
        return ttt_loss(self.draft, batch, self.steps, denominators=denominators, unroll=self.unroll)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


__all__ = ["Progress", "Schedule", "TrainConfig", "TrainState", "matmul_dtype", "parse_duration", "split_samples",
           "train_draft", "with_added_settings"]
