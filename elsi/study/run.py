"""``elsi study``: train one draft per layer set and seed on the same data, benchmark each, summarise.

Step by step (STUDY_DIR layout in docs/INTERFACES.md):
1. Target features, once, for the union of every set's layers (``elsi.draft.features``).
2. The baseline: plain decoding and transformers ``generate`` on the study's questions, once per machine
   (``bench/baseline.json``; ``bench/baseline-<id>.json`` on each other machine the study goes on on, so that
   every draft's speed-up is against plain decoding timed where the draft was).
3. Per set and each of its seeds (plan.json): train the draft (``drafts/<set>-s<seed>/``), then
   benchmark it with speculative decoding only (``bench/<set>-s<seed>.json``) at the temperatures
   decoded live, and (``--exact-questions-per-subtask``) its exact τ at temperature 0 on the target's
   cached greedy answers for every tree size (``exact/<set>-s<seed>.json``; ``elsi.specbench.exact``).
4. ``--vllm-sets``: vLLM serves those sets' drafts (every seed) as chains of ``--vllm-spec-tokens``
   at temperature 0, next to elsi's chain on the same questions (``vllm/<set>-s<seed>.json``; a file
   made with other settings is redone).
5. ``study.json`` and ``study.md`` (``elsi.study.summary``).

Resumable: a draft whose ``training.json`` says complete and a benchmark file that exists are
reused; an interrupted draft resumes from its checkpoint; an interrupted benchmark starts over.
Every file is written whole (temporary file, then rename).
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from elsi.collect.store import RunError, read_json, write_json
from elsi.data.conversations import Dataset
from elsi.decode.drafters import load_drafter
from elsi.decode.tree import TreeConfig
from elsi.draft.features import MANIFEST as FEATURE_MANIFEST
from elsi.draft.features import FeatureConfig, FeatureStore, build_features
from elsi.draft.features import Progress as FeatureProgress
from elsi.draft.train import TRAINING, TrainConfig, matmul_dtype, train_draft
from elsi.draft.train import Progress as TrainProgress
from elsi.engines.vllm import VllmBenchConfig, progress_path, require_float32, run_vllm_bench
from elsi.models import adapters
from elsi.models.load import Target
from elsi.report.study import study_markdown
from elsi.specbench.runner import Answer, machine_info, machine_label, run_bench, timing_key
from elsi.study.plan import PLAN, LayerSet, StudyConfig, layer_sets, plan_seeds, write_plan
from elsi.study.summary import summarize_study

DRAFTS = "drafts"
BENCH = "bench"
BASELINE = "baseline.json"
STUDY_JSON = "study.json"
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
    bench: Callable[[Answer, int, int], None] | None = None  # (last answer, questions done, total)
    vllm: Callable[[str, int, int], None] | None = None  # (run, e.g. "vllm_spec k=1", questions done, total)
    exact: Callable[[str, int, int], None] | None = None  # (what, e.g. "exact τ", answer turns done, total)


def draft_dir(study_dir: str | Path, s: LayerSet, seed: int) -> Path:
    return Path(study_dir) / DRAFTS / f"{s.slug}-s{seed}"


def baseline_paths(study_dir: str | Path) -> list[Path]:
    """The study's baselines: bench/baseline.json (the first machine's) first, then the other machines'."""
    d = Path(study_dir) / BENCH
    return [p for p in [d / BASELINE, *sorted(d.glob(f"{Path(BASELINE).stem}-*.json"))] if p.is_file()]


def baseline_path(study_dir: str | Path, machine: dict) -> Path:
    """Where the baseline timed on ``machine`` is or goes: the one of the same ``timing_key``; else
    bench/baseline.json when there is none yet, bench/baseline-<id>.json when the study began elsewhere."""
    key = timing_key(machine)
    for p in baseline_paths(study_dir):
        rec = _readable(p)
        if rec is not None and timing_key(rec.get("machine")) == key:
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


def _features_dtype(study_dir: Path, rec: dict) -> str | None:
    """The target's dtype in the feature pass a finished draft trained on: its record's, else its feature
    cache's, else the copy of that cache's features.json kept beside the study's records (``bench/study_results.sh``)."""
    data = rec.get("data", {})
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


def precision_differences(study_dir: str | Path, plan: dict, feature_dtype: str | None, mm_dtype: str) -> list[str]:
    """The study's finished drafts whose precision differs from what this run would train the others in:
    ``--dtype`` and ``--train-dtype auto`` resolve per machine (bf16 where it is native), so the same plan.json
    resumed on another machine could mix precisions, and the sets' τ would then differ by precision, not by
    layers. ``feature_dtype`` (None: not checked): the target's dtype in this run's feature pass;
    ``mm_dtype``: the dtype of this run's training matmuls. Each entry: "<draft>: <what> <recorded>"."""
    d, out = Path(study_dir), []
    for s in layer_sets(plan):
        for seed in plan_seeds(plan)[s.name]:
            path = draft_dir(d, s, seed)
            rec = _readable(path / TRAINING)
            if rec is None or rec.get("status") != "complete":
                continue  # a begun draft's checkpoint is checked by train_draft itself
            what = []
            mm = rec.get("train_matmul_dtype", "float32")
            if mm != mm_dtype:
                what.append(f"{mm} matmuls")
            fd = _features_dtype(d, rec)
            if feature_dtype is not None and fd is not None and fd != feature_dtype:
                what.append(f"features from the target in {fd}")
            if what:
                out.append(f"{path.name}: " + ", ".join(what))
    return out


def check_precision(study_dir: str | Path, plan: dict, feature_dtype: str | None, train_dtype: str,
                    device: torch.device) -> str:
    """Raise ValueError naming the finished drafts of ``plan`` in ``study_dir`` that were trained in another precision
    than this run would train the rest in on ``device`` (``--train-dtype`` ``train_dtype``, the feature pass's target
    in ``feature_dtype``; see ``precision_differences``) -> the precision this run trains in, as words."""
    mm_dtype = str(matmul_dtype(train_dtype, device)[0]).removeprefix("torch.")
    here = f"{mm_dtype} matmuls, features from the target in {feature_dtype}; {adapters.fast_bf16(device)[1]}"
    mixed = precision_differences(study_dir, plan, feature_dtype, mm_dtype)
    if mixed:
        raise ValueError(
            f"{study_dir}: {len(mixed)} finished draft(s) were trained otherwise than this run would train the rest "
            f"({here}): " + "; ".join(mixed) + ". A study that mixes precisions compares them, not layer sets: pass "
            "the recorded precisions (--train-dtype, --dtype; emulated bf16 is several times slower than float32), "
            "or --restart")
    return here


def clear_study(study_dir: str | Path) -> None:
    """Remove what a study wrote (plan, drafts, benchmarks, results, report); the feature cache stays."""
    d = Path(study_dir)
    for name in (DRAFTS, BENCH, VLLM, EXACT, "report"):
        if (d / name).is_dir():
            shutil.rmtree(d / name)
    for name in (PLAN, STUDY_JSON, STUDY_MD):
        (d / name).unlink(missing_ok=True)


def prepare_study(study_dir: str | Path, plan: dict, restart: bool = False) -> Path:
    """Start (``restart``: start over) or continue the study in ``study_dir``; writes plan.json.

    Raises ValueError naming every setting that differs from the existing plan.json.
    """
    if restart:
        clear_study(study_dir)
    return write_plan(study_dir, plan)


def feature_config(fcfg: FeatureConfig, plan: dict, study_dir: str | Path) -> FeatureConfig:
    """The feature cache of the study: every set's layers, in STUDY_DIR/features unless --features-dir."""
    return replace(fcfg, cache_layers=",".join(map(str, plan["cache_layers"])),
                   features_dir=fcfg.features_dir or str(Path(study_dir) / FEATURES))


def study_features(target: Target | Callable[[], Target], dataset: Dataset, fc: FeatureConfig,
                   layers: list[int], on_progress: Callable[[FeatureProgress], None] | None) -> FeatureStore:
    """The study's feature cache, built or finished (or only checked, when complete) by ``target``, or by the
    target a loader returns, which is let go afterwards."""
    return build_features(target() if callable(target) else target, dataset, fc, layers, on_progress=on_progress)


def _bench_record(res: dict, **extra) -> dict:
    from elsi.collect.collector import package_versions

    return {**extra, "versions": package_versions(), "machine": machine_info(), **res}


def run_study(target: Target, dataset: Dataset, plan: dict, cfg: StudyConfig, fcfg: FeatureConfig,
              tcfg: TrainConfig, device: torch.device, hooks: Hooks | None = None, command: str = "",
              features_target: Target | Callable[[], Target] | None = None, feature_dtype: str | None = None) -> dict:
    """Run (or continue) the study planned in ``plan`` (see ``prepare_study``) -> study.json's dict.

    ``tcfg`` is the training template: every set's draft uses it with its own layers and out
    directory and ``cfg.train_budget``. ``target`` must be the plan's model; it decodes and gives the
    drafts' labels. ``features_target``: the same model in the precision of the feature pass (e.g. bf16,
    the bulk forwards' dtype, beside a float32 ``target`` for decoding), or a function that loads it
    (the loaded copy is let go after the feature step); default ``target``. ``feature_dtype``: that copy's dtype
    when ``features_target`` is a function (else read from it). ``command``: recorded in study.json and study.md.

    Raises ValueError, before any work, when finished drafts were trained in another precision than this run
    would train the rest in (``precision_differences``).
    """
    hooks = hooks or Hooks()
    say = hooks.step or (lambda i, n, text: None)
    study_dir = Path(cfg.out)
    if target.num_layers != plan["num_layers"]:
        raise ValueError(f"the target has N = {target.num_layers} layers, the analysis in {plan['settings']['run']} "
                         f"N = {plan['num_layers']}: analyze this model first (--run)")
    if feature_dtype is None and not callable(features_target):
        feature_dtype = (features_target or target).dtype_name
    check_precision(study_dir, plan, feature_dtype, tcfg.train_dtype, device)
    sets, seeds = layer_sets(plan), plan_seeds(plan)
    served = plan.get("vllm", {}).get("sets", [])
    live = cfg.live_temperatures
    exact = cfg.exact_settings()
    n = 3 + sum((1 + bool(live) + bool(exact) + (s.name in served)) * len(seeds[s.name]) for s in sets)
    (study_dir / BENCH).mkdir(parents=True, exist_ok=True)
    if exact:
        (study_dir / EXACT).mkdir(exist_ok=True)
    if served:
        (study_dir / VLLM).mkdir(exist_ok=True)

    # Step 1: the target's features for every set's layers, once.
    fc = feature_config(fcfg, plan, study_dir)
    say(1, n, f"target features for layers {plan['cache_layers']} in {fc.features_dir}")
    store = study_features(features_target or target, dataset, fc, plan["cache_layers"], hooks.features)

    # Step 2: the baseline (plain decoding and transformers generate), once per machine.
    here = machine_info()
    base_path = baseline_path(study_dir, here)
    if not live:
        say(2, n, "baseline: none (no temperature is decoded live, so nothing is timed)")
    elif _readable(base_path) is not None:
        say(2, n, f"baseline: plain decoding and transformers generate (done: {base_path})")
    else:
        again = "" if base_path.name == BASELINE else (f", timed again on this machine ({machine_label(here)}) for "
                                                        f"the drafts benchmarked here ({base_path})")
        say(2, n, "baseline: plain decoding and transformers generate" + again)
        res = run_bench(target, None, live_bench(cfg, fcfg.model, baseline=True), on_answer=hooks.bench)
        write_json(base_path, _bench_record(res, set=None, seed=None, draft=None))

    # Step 3: one draft per set and each of its seeds, then its benchmark; seed by seed (every set's first
    # seed, then every set's second, ...), so that a study stopped part way already holds paired seeds.
    i = 2
    benches: dict[tuple[str, int], dict] = {}
    trained: dict[tuple[str, int], dict] = {}  # each draft's training.json
    for s, seed in seed_major(sets, seeds):
        out = draft_dir(study_dir, s, seed)
        i += 1
        what = f"{s.name} {list(s.layers)} seed {seed}"
        if draft_complete(out):
            say(i, n, f"training {what} (done: {out})")
        else:
            say(i, n, f"training {what}")
            t = replace(tcfg, layers=",".join(map(str, s.layers)), out=str(out), time_budget=cfg.train_budget,
                        restart=False)
            train_draft(target, store, t, seed, device, samples=fcfg.samples, on_progress=hooks.train)
        rec = {"answers": []}
        if live:
            path = bench_path(study_dir, s, seed)
            i += 1
            if _readable(path) is not None:
                say(i, n, f"benchmarking {what} (done: {path})")
            else:
                say(i, n, f"benchmarking {what}")
                drafter, info = load_drafter(str(out), target)
                res = run_bench(target, drafter, live_bench(cfg, fcfg.model, draft=str(out)),
                                on_answer=hooks.bench)
                write_json(path, _bench_record(res, set=s.name, seed=seed, draft=info))
            rec = read_json(path)
        if exact:
            i += 1
            rec = {**rec, "answers": rec["answers"] + exact_answers(
                exact_step(target, str(out), s, seed, cfg, study_dir, lambda text: say(i, n, text), hooks))}
        benches[(s.name, seed)] = rec
        trained[(s.name, seed)] = read_json(out / TRAINING)
    order = [(s.name, seed) for s in sets for seed in seeds[s.name]]  # the summary reads them set by set
    benches, trained = {k: benches[k] for k in order}, {k: trained[k] for k in order}

    # Step 4: vLLM serves the --vllm-sets drafts (chains), next to elsi's chain on the same questions.
    vllm = {}
    want = vllm_settings(cfg, fcfg.model)
    for s in sets:
        if s.name not in served:
            continue
        for seed in seeds[s.name]:
            path = vllm_path(study_dir, s, seed)
            i += 1
            rec = _readable(path)
            if rec is not None and rec.get("study_settings") == want:
                say(i, n, f"vLLM serves {s.name} seed {seed} (done: {path})")
            else:
                say(i, n, f"vLLM serves {s.name} seed {seed}: chains of k = {cfg.vllm_spec_tokens}")
                progress = progress_path(path)
                rec = run_vllm_step(target, str(draft_dir(study_dir, s, seed)), cfg, fcfg.model, hooks, progress)
                write_json(path, _bench_record(rec, set=s.name, seed=seed, study_settings=want))
                progress.unlink(missing_ok=True)
            vllm[(s.name, seed)] = rec

    # Step 5: the summary.
    say(n, n, f"summary: {STUDY_JSON}, {STUDY_MD}")
    return write_summary(study_dir, plan, benches, [read_json(p) for p in baseline_paths(study_dir)], cfg.bootstrap,
                         command, vllm, trained)


def seed_major(sets: list[LayerSet], seeds: dict[str, list[int]]) -> list[tuple[LayerSet, int]]:
    """Every (set, seed) draft, the k-th seed of every set before any set's (k+1)-th."""
    deepest = max((len(v) for v in seeds.values()), default=0)
    return [(s, seeds[s.name][k]) for k in range(deepest) for s in sets if k < len(seeds[s.name])]


def live_bench(cfg: StudyConfig, model: str, draft: str = "", baseline: bool = False):
    """The benchmark a draft (or, ``baseline``, plain decoding) gets at the temperatures decoded live."""
    return replace(cfg.bench_config(model, draft=draft, baseline=baseline), temperature=cfg.live_temperatures)


def exact_path(study_dir: str | Path, s: LayerSet, seed: int) -> Path:
    return Path(study_dir) / EXACT / f"{s.slug}-s{seed}.json"


def exact_step(target: Target, draft_path: str, s: LayerSet, seed: int, cfg: StudyConfig, study_dir: Path,
               say: Callable[[str], None], hooks: Hooks) -> dict:
    """A draft's exact τ at temperature 0 (``exact/<set>-s<seed>.json``; one made with other settings is redone)."""
    from elsi.specbench.answers import greedy_answers
    from elsi.specbench.exact import exact_tau

    path = exact_path(study_dir, s, seed)
    want = cfg.exact_settings()
    rec = _readable(path)
    what = f"exact τ of {s.name} seed {seed} at temperature 0"
    if rec is not None and rec.get("study_settings") == want:
        say(f"{what} (done: {path})")
        return rec
    say(f"{what}: {want['questions_per_subtask']} questions per subtask, trees of {want['tree_nodes']} nodes")
    answers = greedy_answers(target, want["subtasks"], want["questions_per_subtask"], want["max_new_tokens"],
                             on_progress=hooks.exact and (lambda d, t: hooks.exact("target answers", d, t)))
    drafter, info = load_drafter(draft_path, target)
    trees = [TreeConfig(n, want["depth"], want["top_k"]) for n in want["tree_nodes"]]
    res = exact_tau(target, drafter.draft, answers, trees, want["max_new_tokens"],
                    on_progress=hooks.exact and (lambda d, t: hooks.exact("exact τ", d, t)))
    rec = _bench_record(res, set=s.name, seed=seed, draft=info, study_settings=want)
    write_json(path, rec)
    return rec


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


def run_vllm_step(target: Target, draft: str, cfg: StudyConfig, model: str, hooks: Hooks,
                  progress: Path | None = None) -> dict:
    """One draft served by vLLM and by elsi's chain, each --vllm-spec-tokens k, at temperature 0
    (``progress``: its finished configurations, kept across an interruption)."""
    require_float32(target.model.dtype, "--vllm-sets")
    bench = replace(cfg.bench_config(model, draft=draft), temperature=[0.0], hf_generate=False, plain=False)
    vcfg = VllmBenchConfig(engine="vllm", spec_tokens=list(cfg.vllm_spec_tokens), bootstrap=cfg.bootstrap)
    return run_vllm_bench(target, draft, bench, vcfg, threads=torch.get_num_threads(), on_answer=hooks.vllm,
                          plain=False, progress=progress)


def write_summary(study_dir: str | Path, plan: dict, benches: dict, baseline: dict | list[dict], bootstrap: int,
                  command: str = "", vllm: dict | None = None, trained: dict | None = None) -> dict:
    """study.json and study.md from the plan, the benchmarks, vLLM's runs and the drafts' training.json
    (each keyed (set name, seed)) and the baseline, or each machine's (``summarize_study``)."""
    study = {"command": command, **summarize_study(plan, benches, baseline, bootstrap, vllm=vllm, trained=trained)}
    write_json(Path(study_dir) / STUDY_JSON, study)
    md = Path(study_dir) / STUDY_MD
    tmp = md.with_name(md.name + ".tmp")
    tmp.write_text(study_markdown(study))
    tmp.replace(md)
    return study


def load_study(study_dir: str | Path) -> dict:
    """A finished study's study.json; FileNotFoundError naming the directory otherwise."""
    path = Path(study_dir) / STUDY_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{study_dir} has no {STUDY_JSON}: run `elsi study --out {study_dir}` first")
    return read_json(path, fix=f"rerun the same `elsi study --out {study_dir}` command (it rewrites {STUDY_JSON} from "
                               "the finished benchmarks)")


__all__ = ["BASELINE", "BENCH", "DRAFTS", "STUDY_JSON", "STUDY_MD", "Hooks", "baseline_path", "baseline_paths",
           "bench_path", "check_precision", "clear_study", "draft_dir", "draft_complete", "exact_path", "feature_config",
           "load_study",
           "prepare_study", "run_study", "write_summary"]
