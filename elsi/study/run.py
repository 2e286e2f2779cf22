"""``elsi study``: train one draft per layer set and seed on the same data, benchmark each, summarise.

Step by step (STUDY_DIR layout in docs/INTERFACES.md):
1. Target features, once, for the union of every set's layers (``elsi.draft.features``).
2. The baseline: plain decoding and transformers ``generate`` on the study's questions, once per machine
   (``bench/baseline.json``; ``bench/baseline-<id>.json`` on each other machine the study goes on on, so that
   every draft's speed-up is against plain decoding timed where the draft was).
3. Per set and each of its seeds (plan.json): train the draft (``drafts/<set>-s<seed>/``), then
   benchmark it with speculative decoding only (``bench/<set>-s<seed>.json``) at the temperatures
   decoded live (``--live-seeds``: those seeds only), and (``--exact-questions-per-subtask``) its exact τ
   at temperature 0 on the target's cached greedy answers for every tree size (``exact/<set>-s<seed>.json``;
   ``elsi.specbench.exact``).
4. ``--vllm-sets``: vLLM serves those sets' drafts (every seed) as chains of ``--vllm-spec-tokens``
   at temperature 0, next to elsi's chain on the same questions (``vllm/<set>-s<seed>.json``; a file
   made with other settings is redone).
5. ``study.json`` and ``study.md`` (``elsi.study.summary``).

Resumable: a draft whose ``training.json`` says complete and a benchmark file that exists are
reused; an interrupted draft resumes from its checkpoint; an interrupted live benchmark resumes at the question it
was on (``<benchmark file>.progress``, ``elsi.specbench.runner.AnswerProgress``); an interrupted exact τ starts over.
Every file is written whole (temporary file, then rename). Before each draft with work still to do, ``Hooks.pace``
hears how long the drafts' work left takes at the pace of what this machine has finished (``elsi.study.pace``).
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from elsi import runtime
from elsi.data.conversations import Dataset
from elsi.decode.drafters import load_drafter
from elsi.decode.tree import TreeConfig
from elsi.draft.cache import FeatureStore
from elsi.draft.checkpoint import TRAINING, WEIGHTS
from elsi.draft.features import FeatureConfig, build_features
from elsi.draft.features import Progress as FeatureProgress
from elsi.draft.train import TrainConfig, matmul_dtype, train_draft
from elsi.draft.train import Progress as TrainProgress
from elsi.engines.vllm import VllmBenchConfig, require_float32, run_vllm_bench
from elsi.io import RunError, read_json, write_json, write_text
from elsi.models.load import Target
from elsi.report.study import STUDY_JSON, load_study, study_markdown
from elsi.specbench.runner import Answer, progress_path, run_bench
from elsi.study import compat
from elsi.study.pace import PARTS, time_left
from elsi.study.plan import PLAN, LayerSet, StudyConfig, StudyPlan, write_plan
from elsi.study.summary import summarize_study

DRAFTS = "drafts"
BENCH = "bench"
BASELINE = "baseline.json"
STUDY_MD = "study.md"
FEATURES = "features"
VLLM = "vllm"
EXACT = "exact"


@dataclass
class Hooks:
    """Callbacks for progress (the CLI draws bars with them); every one is optional."""

    step: Callable[[int, int, str], None] | None = None  # (step i, of n, what it does)
    features: Callable[[FeatureProgress], None] | None = None
    train: Callable[[TrainProgress], None] | None = None
    bench: Callable[[Answer, int, int, bool], None] | None = None  # (last answer, questions done, total, kept)
    vllm: Callable[[str, int, int], None] | None = None  # (run, e.g. "vllm_spec k=1", questions done, total)
    exact: Callable[[str, int, int], None] | None = None  # (what, e.g. "exact τ", answer turns done, total)
    pace: Callable[[str], None] | None = None  # the drafts' work left at this machine's pace (``pace.time_left``)


def draft_dir(study_dir: str | Path, s: LayerSet, seed: int) -> Path:
    return Path(study_dir) / DRAFTS / f"{s.slug}-s{seed}"


def baseline_paths(study_dir: str | Path) -> list[Path]:
    """The study's baselines: bench/baseline.json (the first machine's) first, then the other machines'."""
    d = Path(study_dir) / BENCH
    return [p for p in [d / BASELINE, *sorted(d.glob(f"{Path(BASELINE).stem}-*.json"))] if p.is_file()]


def baseline_path(study_dir: str | Path, machine: dict) -> Path:
    """Where the baseline timed on ``machine`` is or goes: the one of the same ``timing_key``; else
    bench/baseline.json when there is none yet, bench/baseline-<id>.json when the study began elsewhere."""
    key = runtime.timing_key(machine)
    for p in baseline_paths(study_dir):
        rec = _readable(p)
        if rec is not None and runtime.timing_key(rec.get("machine")) == key:
            return p
    first = Path(study_dir) / BENCH / BASELINE
    if _readable(first) is None:
        return first
    return first.with_name(f"{first.stem}-{hashlib.sha256(key.encode()).hexdigest()[:8]}.json")


def bench_path(study_dir: str | Path, s: LayerSet, seed: int) -> Path:
    return Path(study_dir) / BENCH / f"{s.slug}-s{seed}.json"


def _readable(path: Path) -> dict | None:
    """A JSON object file, or None when it is missing or damaged (the work that writes it is then redone)."""
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except RunError as err:
        warnings.warn(f"{err}: redoing the work that writes it")
        return None


def draft_complete(path: Path) -> bool:
    rec = _readable(path / TRAINING)
    return rec is not None and rec.get("status") == "complete"


def precision_differences(study_dir: str | Path, plan: StudyPlan, feature_dtype: str | None, mm_dtype: str) -> list[str]:
    """The study's finished drafts whose precision differs from what this run would train the others in:
    ``--dtype`` and ``--train-dtype auto`` resolve per machine (bf16 where it is native), so the same plan.json
    resumed on another machine could mix precisions, and the sets' τ would then differ by precision, not by
    layers. ``feature_dtype`` (None: not checked): the target's dtype in this run's feature pass;
    ``mm_dtype``: the dtype of this run's training matmuls. Each entry: "<draft>: <what> <recorded>"."""
    d, out = Path(study_dir), []
    for s, seed in plan.drafts:
        path = draft_dir(d, s, seed)
        rec = _readable(path / TRAINING)
        if rec is None or rec.get("status") != "complete":
            continue  # a begun draft's checkpoint is checked by train_draft itself
        what = []
        mm = compat.matmul_dtype(rec)
        if mm != mm_dtype:
            what.append(f"{mm} matmuls")
        fd = compat.features_dtype(d, rec)
        if feature_dtype is not None and fd is not None and fd != feature_dtype:
            what.append(f"features from the target in {fd}")
        if what:
            out.append(f"{path.name}: " + ", ".join(what))
    return out


def check_precision(study_dir: str | Path, plan: StudyPlan, feature_dtype: str | None, train_dtype: str,
                    device: torch.device) -> str:
    """Raise ValueError naming the finished drafts of ``plan`` in ``study_dir`` that were trained in another precision
    than this run would train the rest in on ``device`` (``--train-dtype`` ``train_dtype``, the feature pass's target
    in ``feature_dtype``; see ``precision_differences``) -> the precision this run trains in, as words."""
    mm_dtype = str(matmul_dtype(train_dtype, device)[0]).removeprefix("torch.")
    here = f"{mm_dtype} matmuls, features from the target in {feature_dtype}; {runtime.fast_bf16(device)[1]}"
    mixed = precision_differences(study_dir, plan, feature_dtype, mm_dtype)
    if mixed:
        raise ValueError(
            f"{study_dir}: {len(mixed)} finished draft(s) were trained otherwise than this run would train the rest "
            f"({here}): " + "; ".join(mixed) + ". A study that mixes precisions compares them, not layer sets: pass "
            "the recorded precisions (--train-dtype, --dtype; emulated bf16 is several times slower than float32), "
            "or --restart")
    return here


def check_live_weights(study_dir: str | Path, plan: StudyPlan, live: dict[str, list[int]]) -> None:
    """Raise ValueError naming the trained drafts of ``plan`` that are to be decoded live (``live``: each set's seeds
    decoded live, by name) but have neither their live benchmark nor their weights here: their records came from
    another machine (``bench/study_results.sh`` keeps no weights), so nothing can decode them."""
    d = Path(study_dir)
    missing = [(s, seed) for s, seed in plan.drafts if seed in live.get(s.name, [])
               and draft_complete(draft_dir(d, s, seed)) and not (draft_dir(d, s, seed) / WEIGHTS).is_file()
               and _readable(bench_path(d, s, seed)) is None]
    if missing:
        here = sorted({sd for v in live.values() for sd in v} - {seed for _, seed in missing})
        names = ", ".join(draft_dir(d, s, seed).name for s, seed in missing)
        raise ValueError(f"{len(missing)} draft(s) to decode live have no weights in {d} (trained on another machine; "
                         f"their records alone came here): {names}. Decode live only "
                         f"seeds whose drafts are all here (--live-seeds {' '.join(map(str, here)) or '…'}), or "
                         "retrain them (--restart)")


def clear_study(study_dir: str | Path) -> None:
    """Remove what a study wrote (plan, drafts, benchmarks, results, report); the feature cache stays."""
    d = Path(study_dir)
    for name in (DRAFTS, BENCH, VLLM, EXACT, "report"):
        if (d / name).is_dir():
            shutil.rmtree(d / name)
    for name in (PLAN, STUDY_JSON, STUDY_MD):
        (d / name).unlink(missing_ok=True)


def prepare_study(study_dir: str | Path, plan: StudyPlan, restart: bool = False) -> Path:
    """Start (``restart``: start over) or continue the study in ``study_dir``; writes plan.json.

    Raises ValueError naming every setting that differs from the existing plan.json.
    """
    if restart:
        clear_study(study_dir)
    return write_plan(study_dir, plan)


def feature_config(fcfg: FeatureConfig, plan: StudyPlan, study_dir: str | Path) -> FeatureConfig:
    """The feature cache of the study: every set's layers, in STUDY_DIR/features unless --features-dir."""
    return replace(fcfg, cache_layers=",".join(map(str, plan.cache_layers)),
                   features_dir=fcfg.features_dir or str(Path(study_dir) / FEATURES))


def study_features(target: Target | Callable[[], Target], dataset: Dataset, fc: FeatureConfig,
                   layers: list[int], on_progress: Callable[[FeatureProgress], None] | None) -> FeatureStore:
    """The study's feature cache, built or finished (or only checked, when complete) by ``target``, or by the
    target a loader returns, which is let go afterwards."""
    return build_features(target() if callable(target) else target, dataset, fc, layers, on_progress=on_progress)


def _bench_record(res: dict, **extra) -> dict:
    from elsi.collect.collector import package_versions

    return {**extra, "versions": package_versions(), "machine": runtime.machine_info(), **res}


@dataclass(frozen=True)
class StudyRun:
    """What every step of one ``run_study`` call shares."""

    target: Target  # the plan's model: it decodes and gives the drafts' labels
    plan: StudyPlan  # the study's plan.json (``prepare_study`` wrote it)
    cfg: StudyConfig  # the study's settings; ``cfg.out`` is the study directory
    fcfg: FeatureConfig  # the feature pass (its cache's layers and directory: ``feature_config``)
    tcfg: TrainConfig  # the training template: each draft uses it with its own layers, out and cfg.train_budget
    device: torch.device  # where the drafts train
    hooks: Hooks = field(default_factory=Hooks)  # progress callbacks

    @property
    def study_dir(self) -> Path:
        return Path(self.cfg.out)

    @property
    def per_draft(self) -> int:
        """Steps per draft: its training, then its live benchmark and its exact τ where the study has them."""
        return 1 + bool(self.cfg.live_temperatures) + bool(self.cfg.exact_settings())

    @property
    def steps(self) -> int:
        """Steps in all: the features, the baseline, every draft's, one per draft vLLM serves, the summary."""
        served = sum(len(self.plan.draft_seeds[s.name]) for s in self.plan.served)
        return 3 + len(self.plan.drafts) * self.per_draft + served

    def say(self, i: int, text: str) -> None:
        """Step ``i`` (of ``steps``) begins: ``text`` says what it does."""
        if self.hooks.step is not None:
            self.hooks.step(i, self.steps, text)


def run_study(run: StudyRun, dataset: Dataset, command: str = "",
              features_target: Target | Callable[[], Target] | None = None, feature_dtype: str | None = None) -> dict:
    """Run (or continue) the study planned in ``run.plan`` (see ``prepare_study``) -> study.json's dict.

    ``dataset``: the conversations the drafts train on. ``features_target``: the same model as ``run.target`` in
    the precision of the feature pass (e.g. bf16, the bulk forwards' dtype, beside a float32 ``target`` for
    decoding), or a function that loads it (the loaded copy is let go after the feature step); default
    ``run.target``. ``feature_dtype``: that copy's dtype when ``features_target`` is a function (else read from
    it). ``command``: recorded in study.json and study.md.

    Raises ValueError, before any work, when the target is not the analysis's model or finished drafts were trained
    in another precision than this run would train the rest in (``precision_differences``).
    """
    plan, study_dir = run.plan, run.study_dir
    if run.target.num_layers != plan.num_layers:
        raise ValueError(f"the target has N = {run.target.num_layers} layers, the analysis in {plan.settings['run']} "
                         f"N = {plan.num_layers}: analyze this model first (--run)")
    if feature_dtype is None and not callable(features_target):
        feature_dtype = (features_target or run.target).dtype_name
    check_precision(study_dir, plan, feature_dtype, run.tcfg.train_dtype, run.device)
    check_live_weights(study_dir, plan, plan.live_seeds)
    (study_dir / BENCH).mkdir(parents=True, exist_ok=True)
    if run.cfg.exact_settings():
        (study_dir / EXACT).mkdir(exist_ok=True)
    if plan.vllm_sets:
        (study_dir / VLLM).mkdir(exist_ok=True)

    # Step 1: the target's features for every set's layers, once.
    store = features_step(run, dataset, features_target or run.target)
    # Step 2: the baseline (plain decoding and transformers generate), once per machine.
    baseline_step(run)
    # Step 3: one draft per set and each of its seeds, then its benchmarks; seed by seed (every set's first
    # seed, then every set's second, ...), so that a study stopped part way already holds paired seeds.
    benches: dict[tuple[str, int], dict] = {}
    trained: dict[tuple[str, int], dict] = {}  # each draft's training.json
    for k, (s, seed) in enumerate(plan.seed_major()):
        benches[(s.name, seed)], trained[(s.name, seed)] = draft_steps(run, store, s, seed, 3 + k * run.per_draft)
    order = [(s.name, seed) for s, seed in plan.drafts]  # the summary reads them set by set
    benches, trained = {k: benches[k] for k in order}, {k: trained[k] for k in order}
    # Step 4: vLLM serves the --vllm-sets drafts (chains), next to elsi's chain on the same questions.
    vllm = vllm_steps(run, 3 + len(order) * run.per_draft)
    # Step 5: the summary.
    run.say(run.steps, f"summary: {STUDY_JSON}, {STUDY_MD}")
    return write_summary(study_dir, plan, benches, [read_json(p) for p in baseline_paths(study_dir)],
                         run.cfg.bootstrap, command, vllm, trained)


def features_step(run: StudyRun, dataset: Dataset, target: Target | Callable[[], Target]) -> FeatureStore | None:
    """Step 1: the study's feature cache (``study_features``), by ``target`` or the target it loads; None when every
    draft of the plan is trained already (a finished study, or finished drafts' records copied from another
    machine: ``bench/study_results.sh``), which then needs no features."""
    fc = feature_config(run.fcfg, run.plan, run.study_dir)
    if all(draft_complete(draft_dir(run.study_dir, s, seed)) for s, seed in run.plan.drafts):
        run.say(1, f"target features: none needed (every draft is trained; the cache is {fc.features_dir})")
        return None
    run.say(1, f"target features for layers {run.plan.cache_layers} in {fc.features_dir}")
    return study_features(target, dataset, fc, run.plan.cache_layers, run.hooks.features)


def baseline_step(run: StudyRun) -> None:
    """Step 2: plain decoding and transformers generate at the temperatures decoded live, timed once per machine
    (``baseline_path``); nothing when no temperature is decoded live."""
    here = runtime.machine_info()
    path = baseline_path(run.study_dir, here)
    if not run.cfg.live_temperatures:
        run.say(2, "baseline: none (no temperature is decoded live, so nothing is timed)")
    elif _readable(path) is not None:
        run.say(2, f"baseline: plain decoding and transformers generate (done: {path})")
    else:
        again = "" if path.name == BASELINE else (
            f", timed again on this machine ({runtime.machine_label(here)}) for the drafts benchmarked here ({path})")
        run.say(2, "baseline: plain decoding and transformers generate" + again)
        progress = progress_path(path)
        res = run_bench(run.target, None, live_bench(run.cfg, run.fcfg.model, baseline=True), on_answer=run.hooks.bench,
                        progress=progress)
        write_json(path, _bench_record(res, set=None, seed=None, draft=None))
        progress.unlink(missing_ok=True)


def draft_work(study_dir: str | Path, plan: StudyPlan, s: LayerSet, seed: int,
               read: Callable[[Path], dict | None] | None = None) -> dict[str, dict | None]:
    """The parts of a draft's work ``plan`` asks for (``pace.PARTS``: its training, its live benchmark where it
    decodes that seed live, its exact τ where it has one), each with its finished record in ``study_dir``, or None
    while it is still to do. ``read``: a record file, or None (default: missing or damaged, with a warning)."""
    read = read or _readable
    trained = read(draft_dir(study_dir, s, seed) / TRAINING)
    work = {"training": trained if trained is not None and trained.get("status") == "complete" else None}
    if seed in plan.live_seeds[s.name]:
        work["live benchmark"] = read(bench_path(study_dir, s, seed))
    if plan.exact:
        rec = read(exact_path(study_dir, s, seed))
        work["exact τ"] = rec if rec is not None and rec.get("study_settings") == plan.exact else None
    return work


def study_time_left(works: list[dict[str, dict | None]], machine: dict | None = None,
                    where: str = "here") -> tuple[str, dict | None]:
    """The drafts' work left (``works``: every draft's ``draft_work``, in the order the study does them) at the pace
    of what ``machine`` has finished (``pace.time_left``; default: the machine of the last finished record that names
    one, the machine the study last ran on) -> (the estimate, "" when none is left or nothing was timed there yet;
    the machine)."""
    if machine is None:
        named = [r["machine"] for w in works for r in w.values() if r is not None and r.get("machine")]
        machine = named[-1] if named else None
    if machine is None:
        return "", None
    left = {p: sum(p in w and w[p] is None for w in works) for p in PARTS}
    done = {p: [w[p] for w in works if w.get(p) is not None] for p in PARTS}
    return time_left(left, done, machine, where), machine


def tell_pace(run: StudyRun, s: LayerSet, seed: int) -> None:
    """As a draft's steps begin, when some of its work is still to do: the drafts' work left at this machine's pace
    (``study_time_left``) to ``run.hooks.pace``; nothing before an estimate can be made."""
    if run.hooks.pace is None:
        return
    order = run.plan.seed_major()
    works = [draft_work(run.study_dir, run.plan, t, sd) for t, sd in order]
    if all(r is not None for r in works[order.index((s, seed))].values()):
        return
    text, _ = study_time_left(works, runtime.machine_info())
    if text:
        run.hooks.pace(text)


def draft_steps(run: StudyRun, store: FeatureStore | None, s: LayerSet, seed: int, first: int) -> tuple[dict, dict]:
    """Step 3 for one draft, as steps ``first``, ``first`` + 1, ...: train it (or resume, or reuse it), then its live
    benchmark and its exact τ where the study has them -> (its answers as the summary reads them, training.json)."""
    out = draft_dir(run.study_dir, s, seed)
    what = f"{s.name} {list(s.layers)} seed {seed}"
    if draft_complete(out):
        run.say(first, f"training {what} (done: {out})")
        tell_pace(run, s, seed)
    else:
        assert store is not None, "features_step builds the features whenever a draft is not trained"
        run.say(first, f"training {what}")
        tell_pace(run, s, seed)
        t = replace(run.tcfg, layers=",".join(map(str, s.layers)), out=str(out), time_budget=run.cfg.train_budget,
                    restart=False)
        train_draft(run.target, store, t, seed, run.device, samples=run.fcfg.samples, on_progress=run.hooks.train)
    i, rec = first, {"answers": []}
    if run.cfg.live_temperatures:
        i += 1
        if seed in run.plan.live_seeds[s.name]:
            rec = bench_step(run, s, seed, lambda text: run.say(i, text))
        else:
            run.say(i, f"benchmarking {s.name} {list(s.layers)} seed {seed}: not decoded live (--live-seeds "
                       f"{' '.join(map(str, run.cfg.live_seeds))})")
    if run.cfg.exact_settings():
        i += 1
        exact = exact_step(run, s, seed, lambda text: run.say(i, text))
        rec = with_exact(rec, exact)
    return rec, read_json(out / TRAINING)


def bench_step(run: StudyRun, s: LayerSet, seed: int, say: Callable[[str], None]) -> dict:
    """A draft's benchmark at the temperatures decoded live (``bench/<set>-s<seed>.json``; one that exists is
    reused)."""
    path = bench_path(run.study_dir, s, seed)
    what = f"benchmarking {s.name} {list(s.layers)} seed {seed}"
    if _readable(path) is not None:
        say(f"{what} (done: {path})")
    else:
        progress = progress_path(path)
        say(what + (f" (going on from {progress})" if progress.is_file() else ""))
        out = str(draft_dir(run.study_dir, s, seed))
        drafter, info = load_drafter(out, run.target)
        res = run_bench(run.target, drafter, live_bench(run.cfg, run.fcfg.model, draft=out), on_answer=run.hooks.bench,
                        progress=progress)
        write_json(path, _bench_record(res, set=s.name, seed=seed, draft=info))
        progress.unlink(missing_ok=True)
    return read_json(path)


def vllm_steps(run: StudyRun, first: int) -> dict[tuple[str, int], dict]:
    """Step 4, as steps ``first``, ``first`` + 1, ...: every draft of the sets vLLM serves, served by vLLM and by
    elsi's chain (``vllm/<set>-s<seed>.json``; one made with other settings is redone) -> those files, by
    (set name, seed)."""
    vllm, want, i = {}, vllm_settings(run.cfg, run.fcfg.model), first
    for s in run.plan.served:
        for seed in run.plan.draft_seeds[s.name]:
            path = vllm_path(run.study_dir, s, seed)
            rec = _readable(path)
            if rec is not None and rec.get("study_settings") == want:
                run.say(i, f"vLLM serves {s.name} seed {seed} (done: {path})")
            else:
                run.say(i, f"vLLM serves {s.name} seed {seed}: chains of k = {run.cfg.vllm_spec_tokens}")
                progress = progress_path(path)
                rec = run_vllm_step(run, str(draft_dir(run.study_dir, s, seed)), progress)
                write_json(path, _bench_record(rec, set=s.name, seed=seed, study_settings=want))
                progress.unlink(missing_ok=True)
            vllm[(s.name, seed)] = rec
            i += 1
    return vllm


def live_bench(cfg: StudyConfig, model: str, draft: str = "", baseline: bool = False):
    """The benchmark a draft (or, ``baseline``, plain decoding) gets at the temperatures decoded live."""
    return replace(cfg.bench_config(model, draft=draft, baseline=baseline), temperature=cfg.live_temperatures)


def exact_path(study_dir: str | Path, s: LayerSet, seed: int) -> Path:
    return Path(study_dir) / EXACT / f"{s.slug}-s{seed}.json"


def exact_step(run: StudyRun, s: LayerSet, seed: int, say: Callable[[str], None]) -> dict:
    """A draft's exact τ at temperature 0 (``exact/<set>-s<seed>.json``; one made with other settings is redone)."""
    from elsi.specbench.answers import greedy_answers
    from elsi.specbench.exact import exact_tau

    path = exact_path(run.study_dir, s, seed)
    want = run.cfg.exact_settings()
    rec = _readable(path)
    what = f"exact τ of {s.name} seed {seed} at temperature 0"
    if rec is not None and rec.get("study_settings") == want:
        say(f"{what} (done: {path})")
        return rec
    say(f"{what}: {want['questions_per_subtask']} questions per subtask, trees of {want['tree_nodes']} nodes")
    hook = run.hooks.exact
    answers = greedy_answers(run.target, want["subtasks"], want["questions_per_subtask"], want["max_new_tokens"],
                             on_progress=hook and (lambda d, t: hook("target answers", d, t)))
    drafter, info = load_drafter(str(draft_dir(run.study_dir, s, seed)), run.target)
    trees = [TreeConfig(n, want["depth"], want["top_k"]) for n in want["tree_nodes"]]
    res = exact_tau(run.target, drafter.draft, answers, trees, want["max_new_tokens"],
                    on_progress=hook and (lambda d, t: hook("exact τ", d, t)))
    rec = _bench_record(res, set=s.name, seed=seed, draft=info, study_settings=want)
    write_json(path, rec)
    return rec


def with_exact(rec: dict, exact: dict) -> dict:
    """A draft's results as the summary reads them (``rec``: its live benchmark, or ``{"answers": []}``) with its exact
    τ's answers added and the answers that τ was computed on (``answers_digest``)."""
    return {**rec, "answers": rec["answers"] + exact_answers(exact), "answers_digest": exact.get("answers_digest")}


def exact_answers(rec: dict) -> list[dict]:
    """An exact record's questions as the summary reads a benchmark's answers (method "spec", temperature 0,
    ``exact`` true; no timing)."""
    return [{"question_id": q["question_id"], "subtask": q["subtask"], "method": "spec", "temperature": 0.0,
             "tree_nodes": t["tree"]["tree_nodes"], "new_tokens": q["accepted"], "time_s": 0.0, "steps": q["steps"],
             "accepted": q["accepted"], "profile": {}, "exact": True}
            for t in rec["trees"] for q in t["questions"]]


def vllm_path(study_dir: str | Path, s: LayerSet, seed: int) -> Path:
    return Path(study_dir) / VLLM / f"{s.slug}-s{seed}.json"


def vllm_settings(cfg: StudyConfig, model: str) -> dict:
    """What a vLLM file depends on (one made with other settings is redone)."""
    return {"model": model, "spec_tokens": list(cfg.vllm_spec_tokens), "bootstrap": cfg.bootstrap,
            "subtasks": list(cfg.subtasks), "questions_per_subtask": cfg.questions_per_subtask,
            "max_new_tokens": cfg.max_new_tokens, "seed": cfg.bench_seed}


def run_vllm_step(run: StudyRun, draft: str, progress: Path | None = None) -> dict:
    """One draft served by vLLM and by elsi's chain, each --vllm-spec-tokens k, at temperature 0
    (``progress``: its finished configurations, kept across an interruption)."""
    require_float32(run.target.model.dtype, "--vllm-sets")
    bench = replace(run.cfg.bench_config(run.fcfg.model, draft=draft), temperature=[0.0], hf_generate=False,
                    plain=False)
    vcfg = VllmBenchConfig(engine="vllm", spec_tokens=list(run.cfg.vllm_spec_tokens), bootstrap=run.cfg.bootstrap)
    return run_vllm_bench(run.target, draft, bench, vcfg, threads=torch.get_num_threads(), on_answer=run.hooks.vllm,
                          plain=False, progress=progress)


def write_summary(study_dir: str | Path, plan: StudyPlan, benches: dict, baseline: dict | list[dict], bootstrap: int,
                  command: str = "", vllm: dict | None = None, trained: dict | None = None) -> dict:
    """study.json and study.md from the plan, the benchmarks, vLLM's runs and the drafts' training.json
    (each keyed (set name, seed)) and the baseline, or each machine's (``summarize_study``)."""
    study = {"command": command, **summarize_study(plan, benches, baseline, bootstrap, vllm=vllm, trained=trained)}
    write_json(Path(study_dir) / STUDY_JSON, study)
    write_text(Path(study_dir) / STUDY_MD, study_markdown(study))
    return study


__all__ = ["BASELINE", "BENCH", "DRAFTS", "STUDY_JSON", "STUDY_MD", "Hooks", "StudyRun", "baseline_path",
           "baseline_paths", "bench_path", "check_live_weights", "check_precision", "clear_study", "draft_dir",
           "draft_complete", "draft_work", "exact_path", "feature_config", "load_study", "prepare_study", "run_study",
           "study_time_left", "with_exact", "write_summary"]
