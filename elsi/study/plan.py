"""A study's plan: the layer sets it compares, selected on a finished analysis, and its settings.

Set specs (``--sets``):
- ``eagle2``, ``eagle3``: the fixed baselines ([N] and [2, N//2, N-3]);
- ``METHOD:M``: ``elsi.select`` method METHOD (elsi, elsi-c, exhaustive, low-entropy, uniform)
  at size M, e.g. ``elsi:3``;
- ``layers:IDS``: an explicit set, e.g. ``layers:5,18,27`` (docs/design.md numbering).

Every set's entropy is the score ``elsi select`` reports for it (same scorer and aggregate).
The sets named in ``--multi-seed-sets`` get every ``--seeds``; the others the first seed only
(no ``--multi-seed-sets``: every set gets every seed).
``plan.json`` records the sets, each with its seeds, and every setting that shapes a draft or a
benchmark; a rerun with other settings is an error naming the difference.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from elsi.io import read_json, write_json
from elsi.config import like, opt, result_settings, settings_diff
from elsi.data.conversations import data_identity
from elsi.data.spec_bench import SUBTASKS
from elsi.draft.features import FeatureConfig
from elsi.draft.train import TrainConfig, parse_duration
from elsi.select.run import SelectConfig, Selector
from elsi.select.search import METHODS
from elsi.specbench.runner import BenchConfig
from elsi.stats.analysis import parse_layers
from elsi.study import compat

PLAN = "plan.json"
FORMAT = 1
DEFAULT_SETS = ["eagle2", "eagle3", "elsi:1", "elsi:2", "elsi:3", "elsi-c:3", "low-entropy:3", "uniform:3"]
FIXED_M = {"eagle2": 1, "eagle3": 3}  # baselines whose size is part of their definition
SET_HELP = ("eagle2, eagle3, METHOD:M with METHOD one of " + ", ".join(m for m in METHODS if m not in FIXED_M)
            + " (e.g. elsi:3), or layers:IDS (e.g. layers:5,18,27)")


@dataclass(frozen=True)
class StudyConfig:
    """Which layer sets a study compares, and how each draft is trained and benchmarked."""

    out: str = opt(help="study directory: plan.json, features/, drafts/, bench/, study.json, study.md, report/")
    run: str = opt("", "run directory of a finished `elsi analyze` the sets are selected on (default: runs/<model>)")
    sets: list[str] = opt(DEFAULT_SETS, f"layer sets to compare: {SET_HELP}")
    seeds: list[int] = opt([0], "draft seeds (initialisation, held-out split, batch order): one draft per set and "
                                "seed (but see --multi-seed-sets), all on the same data (--seed chooses the data)")
    multi_seed_sets: list[str] = opt([], "layer sets (as written in --sets) that get every --seeds; the others get "
                                         "the first --other-seeds of them (none given: every set gets every seed)")
    other_seeds: int = opt(1, "with --multi-seed-sets: how many of the first --seeds the other sets get")
    train_budget: str = like(TrainConfig, "time_budget", help_suffix=", per draft")
    subtasks: list[str] = like(BenchConfig, "subtasks")
    questions_per_subtask: int = like(BenchConfig, "questions_per_subtask", default=10)
    max_new_tokens: int = like(BenchConfig, "max_new_tokens", default=128)
    temperature: list[float] = like(BenchConfig, "temperature", default=[0.0, 1.0])
    top_p: float = like(BenchConfig, "top_p")
    tree_nodes: list[int] = like(BenchConfig, "tree_nodes", default=[30, 60])
    depth: int = like(BenchConfig, "depth")
    top_k: int = like(BenchConfig, "top_k")
    warmup: int = like(BenchConfig, "warmup")
    bench_seed: int = like(BenchConfig, "seed", help_suffix=" (the same for every draft: paired comparisons)")
    live_seeds: list[int] = opt([], "decode the live temperatures (--temperature, but 0 where the exact evaluator "
                                    "gives it) for these of --seeds only (none given: every seed): the exact τ "
                                    "covers every draft, live decoding (minutes per question) the paired seeds that "
                                    "fit the time; the conditions with a live temperature are then over those "
                                    "seeds alone")
    bootstrap: int = opt(1000, "bootstrap resamples of the Spec-Bench questions for the intervals (0 = none)")
    exact_questions_per_subtask: int = opt(80, "temperature 0: τ from the exact evaluator (the target's cached "
                                               "greedy answers, no decoding loop: elsi.specbench.exact) on this "
                                               "many questions per subtask (80 = all of Spec-Bench), for every "
                                               "--tree-nodes, in place of live decoding; 0 = temperature 0 decoded "
                                               "live on --questions-per-subtask like the other temperatures")
    vllm_sets: list[str] = opt([], "layer sets (as written in --sets) whose drafts vLLM serves too, every seed: "
                                   "chains of --vllm-spec-tokens at temperature 0 on the same questions, τ next to "
                                   "elsi's chain (needs vLLM's environment: make vllm; the target in float32)")
    vllm_spec_tokens: list[int] = opt([1], "vLLM num_speculative_tokens k for --vllm-sets")
    restart: bool = opt(False, "delete this study's plan, drafts, benchmarks and results and start over")
    check: bool = opt(False, "only check that the study in --out can go on here, before the analysis it selects on "
                             "exists: its settings but the analysis's and its finished drafts' precision against "
                             "this machine's; exit 0, or an error naming what differs")
    so_far: bool = opt(False, "only summarize the drafts of the study in --out finished so far (so-far.json, "
                              "so-far.md beside its plan.json): nothing trained or loaded, safe beside the running "
                              "study; the other options are not read but --bootstrap")

    def __post_init__(self) -> None:
        if not self.sets:
            raise ValueError("--sets is empty: give at least one layer set")
        if not self.seeds:
            raise ValueError("--seeds is empty: give at least one seed")
        for flag, values in (("--seeds", self.seeds), ("--multi-seed-sets", self.multi_seed_sets),
                             ("--vllm-sets", self.vllm_sets), ("--live-seeds", self.live_seeds)):
            dup = sorted({x for x in values if values.count(x) > 1})
            if dup:
                raise ValueError(f"{flag} repeats {dup}")
        if not self.vllm_spec_tokens or any(k < 1 for k in self.vllm_spec_tokens):
            raise ValueError(f"--vllm-spec-tokens must be >= 1, got {self.vllm_spec_tokens}")
        if not 1 <= self.other_seeds <= len(self.seeds):
            raise ValueError(f"--other-seeds must be in 1..{len(self.seeds)} (the number of --seeds), got {self.other_seeds}")
        if self.check and self.so_far:
            raise ValueError("--check and --so-far: give one")
        unknown = [sd for sd in self.live_seeds if sd not in self.seeds]
        if unknown:
            raise ValueError(f"--live-seeds {unknown}: not among --seeds {self.seeds}")
        if self.bootstrap < 0:
            raise ValueError(f"bootstrap must be >= 0, got {self.bootstrap}")
        if not 0 <= self.exact_questions_per_subtask <= 80:
            raise ValueError(f"--exact-questions-per-subtask must be in 0..80 (Spec-Bench has 80 per subtask), "
                             f"got {self.exact_questions_per_subtask}")
        parse_duration(self.train_budget)
        bad = [s for s in self.subtasks if s != "all" and s not in SUBTASKS]
        if bad:
            raise ValueError(f"unknown Spec-Bench subtask(s) {bad}; known: {', '.join(SUBTASKS)} or all")
        self.bench_config("", baseline=True)  # validates the benchmark settings

    @property
    def live_temperatures(self) -> list[float]:
        """The temperatures decoded live: all but 0 when the exact evaluator gives temperature 0."""
        return [t for t in self.temperature if not (self.exact_questions_per_subtask and t == 0)]

    def exact_settings(self) -> dict | None:
        """plan.json's ``exact``: what the exact τ of a draft depends on (None: no exact step)."""
        if not self.exact_questions_per_subtask:
            return None
        return {"questions_per_subtask": self.exact_questions_per_subtask, "max_new_tokens": self.max_new_tokens,
                "tree_nodes": list(self.tree_nodes), "depth": self.depth, "top_k": self.top_k,
                "subtasks": list(self.subtasks)}

    def bench_config(self, model: str, draft: str = "", baseline: bool = False) -> BenchConfig:
        """The benchmark of one draft (speculative decoding only) or, ``baseline``, of plain decoding
        and transformers generate (timed once per study)."""
        return BenchConfig(model=model, draft="" if baseline else draft, subtasks=list(self.subtasks),
                           questions_per_subtask=self.questions_per_subtask, max_new_tokens=self.max_new_tokens,
                           temperature=list(self.temperature), top_p=self.top_p, tree_nodes=list(self.tree_nodes),
                           depth=self.depth, top_k=self.top_k, hf_generate=baseline, plain=baseline,
                           warmup=self.warmup, seed=self.bench_seed)


@dataclass(frozen=True)
class LayerSet:
    """One compared set: its spec, how it was chosen, its layers and its entropy."""

    name: str  # the spec, normalised: "eagle3", "elsi:3", "layers:5,18,27"
    method: str  # selection method, or "layers" for an explicit set
    m: int  # number of layers
    layers: tuple[int, ...]  # sorted hidden-state ids
    entropy: float  # nats, the score `elsi select` reports
    entropy_normalized: float  # entropy / log(block)

    @property
    def slug(self) -> str:
        """File-safe name: ``elsi:3`` -> ``elsi-3``, ``layers:5,18,27`` -> ``layers-5-18-27``."""
        return set_slug(self.name)

    def to_json(self) -> dict:
        return {**asdict(self), "layers": list(self.layers), "slug": self.slug}

    @classmethod
    def from_json(cls, entry: dict) -> LayerSet:
        """A set of plan.json's ``sets`` (its ``slug`` and ``seeds`` are left to the caller)."""
        return cls(entry["name"], entry["method"], entry["m"], tuple(entry["layers"]), entry["entropy"],
                   entry["entropy_normalized"])


def set_slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


@dataclass(frozen=True)
class StudyPlan:
    """plan.json, parsed once (``from_json``; ``to_json`` gives back the dict ``make_plan`` writes, key for key):
    the compared sets, each with its seeds, and every setting a rerun must match."""

    model: str  # the target the drafts are trained for (--model)
    num_layers: int  # N of the analysis the sets were selected on
    sets: list[LayerSet]  # the compared sets, in --sets order
    draft_seeds: dict[str, list[int]]  # each set's seeds (one draft per seed), by set name
    seeds: list[int]  # --seeds
    settings: dict  # what every draft and benchmark depends on (``plan_settings``): a rerun must match it
    vllm_sets: list[str] = field(default_factory=list)  # names of the sets vLLM serves too (every seed)
    vllm_spec_tokens: list[int] = field(default_factory=list)  # vLLM's chain lengths k for them
    run_model: str | None = None  # the model the analysis's manifest names (None: no manifest)
    block: int | None = None  # the analysis's block size B
    format: int = FORMAT  # plan.json's layout version

    @property
    def cache_layers(self) -> list[int]:
        """Every set's layers, sorted: the layers of the study's one feature cache."""
        return sorted({l for s in self.sets for l in s.layers})

    @property
    def drafts(self) -> list[tuple[LayerSet, int]]:
        """Every (set, seed) draft, set by set (the summary's order)."""
        return [(s, seed) for s in self.sets for seed in self.draft_seeds[s.name]]

    def seed_major(self) -> list[tuple[LayerSet, int]]:
        """Every (set, seed) draft, the k-th seed of every set before any set's (k+1)-th (the training order: a
        study stopped part way already holds paired seeds)."""
        deepest = max((len(v) for v in self.draft_seeds.values()), default=0)
        return [(s, self.draft_seeds[s.name][k]) for k in range(deepest) for s in self.sets
                if k < len(self.draft_seeds[s.name])]

    @property
    def served(self) -> list[LayerSet]:
        """The sets vLLM serves, in the sets' order."""
        return [s for s in self.sets if s.name in self.vllm_sets]

    @property
    def live_seeds(self) -> dict[str, list[int]]:
        """Each set's seeds decoded live, by name: those of ``--live-seeds`` it has (every one where that is not
        given), none where the plan decodes no temperature live."""
        return decoded_live(self.draft_seeds, bool(live_temperatures(self.settings)),
                            self.settings.get("bench", {}).get("live_seeds"))

    @property
    def exact(self) -> dict | None:
        """The exact evaluator's settings (``StudyConfig.exact_settings``; None: temperature 0 is decoded live)."""
        return self.settings.get("exact")

    def set_entries(self) -> list[dict]:
        """plan.json's ``sets``: each set's ``LayerSet.to_json`` with its ``seeds``."""
        return [{**s.to_json(), "seeds": list(self.draft_seeds[s.name])} for s in self.sets]

    def to_json(self) -> dict:
        return {"format": self.format, "model": self.model, "run_model": self.run_model,
                "num_layers": self.num_layers, "block": self.block, "sets": self.set_entries(),
                "seeds": list(self.seeds), "cache_layers": self.cache_layers,
                "vllm": {"sets": list(self.vllm_sets), "spec_tokens": list(self.vllm_spec_tokens)},
                "settings": self.settings}

    @classmethod
    def from_json(cls, plan: dict) -> StudyPlan:
        """plan.json's dict, of this layout or an older one (``elsi.study.compat``)."""
        vllm = compat.vllm_entry(plan)
        return cls(model=plan["model"], num_layers=plan["num_layers"],
                   sets=[LayerSet.from_json(s) for s in plan["sets"]],
                   draft_seeds={s["name"]: compat.set_seeds(s, plan["seeds"]) for s in plan["sets"]},
                   seeds=list(plan["seeds"]), settings=plan["settings"], vllm_sets=list(vllm["sets"]),
                   vllm_spec_tokens=list(vllm["spec_tokens"]), run_model=plan.get("run_model"),
                   block=plan.get("block"), format=plan.get("format", FORMAT))


def parse_set(spec: str, num_layers: int) -> tuple[str, str, int | tuple[int, ...]]:
    """A ``--sets`` entry -> (normalised name, method, m or explicit layers). Raises ValueError naming it."""
    text = spec.strip().lower()
    method, sep, arg = text.partition(":")
    if method == "layers":
        try:
            layers = tuple(sorted(parse_layers(arg, num_layers)))
        except ValueError as err:
            raise ValueError(f"--sets {spec!r}: {err}") from None
        return f"layers:{','.join(map(str, layers))}", "layers", layers
    if method not in METHODS:
        raise ValueError(f"--sets {spec!r}: unknown set; use {SET_HELP}")
    if method in FIXED_M:
        if sep and arg != str(FIXED_M[method]):
            raise ValueError(f"--sets {spec!r}: {method} has {FIXED_M[method]} layer(s) by definition; write {method}")
        return method, method, FIXED_M[method]
    if not sep or not re.fullmatch(r"\d+", arg):
        raise ValueError(f"--sets {spec!r}: {method} needs a size, e.g. {method}:3")
    return f"{method}:{int(arg)}", method, int(arg)


def resolve_sets(specs: list[str], selector: Selector) -> list[LayerSet]:
    """Parse every spec and select (or score) its layers on the selector's run."""
    n = selector.run.num_layers
    out: list[LayerSet] = []
    for spec in specs:
        name, method, arg = parse_set(spec, n)
        try:
            if method == "layers":
                layers = selector.run.check(arg)
                entropy = set_entropy(selector, layers)
            else:
                sel = selector.select(method, arg)
                layers, entropy = tuple(sel.layers), sel.entropy
        except ValueError as err:
            raise ValueError(f"--sets {spec!r}: {err}") from None
        out.append(LayerSet(name, method, len(layers), tuple(sorted(layers)), float(entropy),
                            float(entropy) / math.log(selector.run.block)))
    names = [s.name for s in out]
    slugs = [s.slug for s in out]
    dup = sorted({x for x in names if names.count(x) > 1} | {x for x in slugs if slugs.count(x) > 1})
    if dup:
        raise ValueError(f"--sets names {dup} more than once")
    return out


def named_sets(specs: list[str], sets: list[LayerSet], num_layers: int, flag: str) -> list[str]:
    """The normalised names of the ``sets`` that ``specs`` (as written in --sets) name, in the sets' order.
    Raises ValueError naming ``flag`` and every spec that is not one of ``sets``."""
    names = [s.name for s in sets]
    picked, bad = set(), []
    for spec in specs:
        try:
            name = parse_set(spec, num_layers)[0]
        except ValueError:
            name = None
        if name in names:
            picked.add(name)
        else:
            bad.append(spec)
    if bad:
        raise ValueError(f"{flag} {bad}: not in --sets ({', '.join(names)})")
    return [n for n in names if n in picked]


def set_seeds(specs: list[str], sets: list[LayerSet], seeds: list[int], num_layers: int,
              others: int = 1) -> dict[str, list[int]]:
    """Each set's seeds, by name: every seed for the sets ``specs`` names (or for all when ``specs`` is empty),
    the first ``others`` seeds for the others. Raises ValueError naming every spec that is not one of ``sets``."""
    multi = named_sets(specs, sets, num_layers, "--multi-seed-sets")
    return {s.name: list(seeds) if not specs or s.name in multi else list(seeds[:others]) for s in sets}


def vllm_plan(cfg: StudyConfig, sets: list[LayerSet], num_layers: int) -> dict:
    """plan.json's ``vllm`` (``StudyPlan.vllm_sets``, ``vllm_spec_tokens``): the sets vLLM serves (each a
    ValueError where vLLM cannot serve its layers as trained) and the chain lengths."""
    from elsi.engines import check_for_engine

    names = named_sets(cfg.vllm_sets, sets, num_layers, "--vllm-sets")
    for s in sets:
        if s.name in names:
            try:
                check_for_engine(s.layers, num_layers, "vllm")
            except ValueError as err:
                raise ValueError(f"--vllm-sets {s.name}: {err}") from None
    return {"sets": names, "spec_tokens": list(cfg.vllm_spec_tokens)}


def set_entropy(selector: Selector, layers: tuple[int, ...]) -> float:
    """The entropy ``Selector.select`` reports for a set (same aggregate)."""
    if selector.cfg.aggregate == "mean-block":
        return selector.scorer.score([tuple(sorted(layers))])[0]
    return selector.run.entropy(layers).mean


def plan_settings(cfg: StudyConfig, fcfg: FeatureConfig, tcfg: TrainConfig, selector: Selector | None) -> dict:
    """Every setting that shapes a draft or a benchmark (what a rerun must match); ``selector`` None: all but the
    analysis's own ("run", "select"), for a check before the analysis exists."""
    # Options that do not change a result (``affects_result=False``) are left out; so are those a study sets per
    # draft (the layers, the budget: --train-budget), per benchmark (model, draft, the baseline's runs) or itself.
    features = result_settings(fcfg)
    features["data"] = data_identity(fcfg.data)  # by content: the same file elsewhere is the same data
    train = result_settings(tcfg, drop=("layers", "time_budget"))
    bench = result_settings(cfg.bench_config(fcfg.model, baseline=True),
                            drop=("model", "draft", "out", "hf_generate", "plain", "exact"))
    out = compat.with_exact({"features": features, "train": {**train, "time_budget": cfg.train_budget},
                             "bench": compat.with_live_seeds(bench, cfg.live_seeds)}, cfg.exact_settings())
    if selector is None:
        return out
    return {"run": str(selector.cfg.run), **out, "select": selector.settings()}


def make_plan(cfg: StudyConfig, fcfg: FeatureConfig, tcfg: TrainConfig, run_dir: str | Path) -> StudyPlan:
    """Select every set on the finished analysis in ``run_dir`` -> the plan."""
    selector = Selector(SelectConfig(run=str(Path(run_dir).resolve())))  # a clear error if the run is not finished
    sets = resolve_sets(cfg.sets, selector)
    seeds = set_seeds(cfg.multi_seed_sets, sets, cfg.seeds, selector.run.num_layers, cfg.other_seeds)
    vllm = vllm_plan(cfg, sets, selector.run.num_layers)
    man = Path(run_dir) / "manifest.json"
    return StudyPlan(model=fcfg.model, num_layers=selector.run.num_layers, sets=sets, draft_seeds=seeds,
                     seeds=list(cfg.seeds), settings=plan_settings(cfg, fcfg, tcfg, selector),
                     vllm_sets=vllm["sets"], vllm_spec_tokens=vllm["spec_tokens"],
                     run_model=read_json(man).get("model") if man.is_file() else None, block=selector.run.block)


def decoded_live(draft_seeds: dict[str, list[int]], live: bool, only: list[int] | None) -> dict[str, list[int]]:
    """Each set's seeds decoded live, by name (``draft_seeds``: each set's seeds): those in ``only`` (``--live-seeds``;
    empty or None: every seed), none where no temperature is decoded live (``live`` false)."""
    return {name: [sd for sd in seeds if live and (not only or sd in only)] for name, seeds in draft_seeds.items()}


def live_temperatures(settings: dict) -> list[float]:
    """The temperatures a plan.json's ``settings`` decode live (``StudyConfig.live_temperatures``): all of
    ``bench.temperature`` but 0 where the exact evaluator gives it (``exact``)."""
    temps = settings.get("bench", {}).get("temperature", [])
    return [t for t in temps if not (settings.get("exact") and t == 0)]


def plan_differences(old: dict, new: dict) -> list[str]:
    """What a rerun changed that its finished drafts and benchmarks depend on (empty: it may continue); ``old``:
    plan.json as read (any layout), ``new``: this run's plan's JSON.

    Sets and seeds (a set's too) may be added or dropped, and so may seeds decoded live (``--live-seeds``); a set
    that keeps its name must keep its layers. A plan that decoded nothing live (temperature 0 from the exact
    evaluator only) may take on live settings: its drafts and exact τ do not depend on them, and the live
    benchmarks they add are made anew.
    """
    settings = compat.train_settings(compat.data_by_content(old.get("settings", {})))
    if not live_temperatures(settings) and "bench" in settings and "bench" in new["settings"]:
        settings = {**settings, "bench": new["settings"]["bench"]}
    diffs = settings_diff(_any_live_seeds(settings), _any_live_seeds(new["settings"]), "plan.json")
    if old.get("model") != new["model"]:
        diffs.append(f"model: {old.get('model')!r} in plan.json, {new['model']!r} now")
    before = {s["name"]: s["layers"] for s in old.get("sets", [])}
    for s in new["sets"]:
        if s["name"] in before and before[s["name"]] != s["layers"]:
            diffs.append(f"set {s['name']}: layers {before[s['name']]} in plan.json, {s['layers']} now "
                         "(the analysis changed)")
    return diffs


def _any_live_seeds(settings: dict) -> dict:
    """``settings`` without ``bench.live_seeds``: which seeds are decoded live may change between runs (a draft's
    live benchmark does not depend on it; more seeds add benchmarks, fewer leave some unread)."""
    if "live_seeds" not in settings.get("bench", {}):
        return settings
    return {**settings, "bench": {k: v for k, v in settings["bench"].items() if k != "live_seeds"}}


def _require_same(path: Path, diffs: list[str]) -> None:
    if diffs:
        raise ValueError(f"{path} was made with other settings: " + "; ".join(diffs)
                         + ". Pass --restart to start over, or choose another --out")


def require_same_settings(study_dir: str | Path, cfg: StudyConfig, fcfg: FeatureConfig, tcfg: TrainConfig) -> None:
    """Raise ValueError naming what ``settings_differences`` finds (nothing: no plan.json yet, or the same)."""
    _require_same(Path(study_dir) / PLAN, settings_differences(study_dir, cfg, fcfg, tcfg))


def settings_differences(study_dir: str | Path, cfg: StudyConfig, fcfg: FeatureConfig, tcfg: TrainConfig) -> list[str]:
    """What this run changes against STUDY_DIR/plan.json that does not depend on the analysis (model, features,
    training, benchmark): ``plan_differences`` before the analysis exists (empty: none, or no plan.json yet)."""
    path = Path(study_dir) / PLAN
    if not path.is_file():
        return []
    old = read_json(path)
    old = {**old, "settings": {k: v for k, v in old.get("settings", {}).items() if k not in ("run", "select")}}
    return plan_differences(old, {"model": fcfg.model, "sets": [], "settings": plan_settings(cfg, fcfg, tcfg, None)})


def write_plan(study_dir: str | Path, plan: StudyPlan, restart: bool = False) -> Path:
    """Check ``plan`` against STUDY_DIR/plan.json (unless ``restart``) and write it.

    Raises ValueError listing every difference that would make the finished work invalid.
    """
    path = Path(study_dir) / PLAN
    if path.is_file() and not restart:
        _require_same(path, plan_differences(read_json(path), plan.to_json()))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, plan.to_json())
    return path


def load_plan(study_dir: str | Path) -> StudyPlan:
    """STUDY_DIR/plan.json, of any layout."""
    return StudyPlan.from_json(read_json(Path(study_dir) / PLAN))


__all__ = ["DEFAULT_SETS", "PLAN", "LayerSet", "StudyConfig", "StudyPlan", "decoded_live", "load_plan", "make_plan",
           "parse_set", "live_temperatures", "plan_differences", "require_same_settings", "resolve_sets", "set_seeds", "set_slug",
           "settings_differences", "write_plan"]
