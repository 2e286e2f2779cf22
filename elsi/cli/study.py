"""``elsi study``: one draft per layer set and seed, benchmarked on Spec-Bench; study.json, study.md and the report."""

from __future__ import annotations

import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from elsi.cli.analyze import run_dir_for
from elsi.cli.common import Command, Runtime, check_inputs
from elsi.config import opt
from elsi.data import load_dataset
from elsi.draft.features import FeatureConfig
from elsi.draft.train import TrainConfig, parse_duration
from elsi.models import load_target
from elsi.report import build_report
from elsi.report.study import condition_table, spearman_line
from elsi.study import PLAN, Hooks, StudyConfig, make_plan, prepare_study, run_study
from elsi.study.plan import decoded_live, load_plan, require_same_settings
from elsi.study.run import StudyRun, check_live_weights, check_precision, draft_complete, draft_dir
from elsi.study.summary import claims_condition
from elsi.text import md_table


class _Bars:
    """tqdm bars on stderr for the study's stages (one at a time)."""

    def __init__(self, fcfg: FeatureConfig, cfg: StudyConfig, tcfg: TrainConfig) -> None:
        self.fcfg, self.cfg = fcfg, cfg
        budget = parse_duration(cfg.train_budget)
        self.by_steps = budget == float("inf")  # no time limit: count optimizer steps (of max_steps, if set)
        self.train_total = (tcfg.max_steps or None) if self.by_steps else int(budget)
        self.bar: tqdm | None = None
        self.held: float | None = None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def step(self, i: int, n: int, text: str) -> None:
        self.close()
        self.held = None
        tqdm.write(f"step {i}/{n}: {text}", file=sys.stderr)

    def pace(self, text: str) -> None:
        tqdm.write(f"  {text}", file=sys.stderr)

    def features(self, p) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.fcfg.samples, desc="target features", unit="sample", file=sys.stderr,
                            dynamic_ncols=True)
        self.bar.n = p.samples_done
        self.bar.set_postfix_str(f"{p.stage}, {p.tokens / max(p.elapsed_s, 1e-9):.0f} tok/s", refresh=True)

    def train(self, p) -> None:
        if self.bar is None:
            unit = "step" if self.by_steps else "s"
            self.bar = tqdm(total=self.train_total, desc="train", unit=unit, file=sys.stderr, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} " + unit + " [{postfix}]")
        if p.note or p.info:
            self.bar.write(p.note or p.info, file=sys.stderr)
            return
        if p.heldout_acc is not None:
            self.held = p.heldout_acc
        done = p.step if self.by_steps else p.elapsed_s
        self.bar.n = min(done, self.bar.total or done)
        h = f" held {self.held:.3f}" if self.held is not None else ""
        self.bar.set_postfix_str(f"step {p.step} loss {p.loss:.3f} acc {p.acc:.3f}{h} "
                                 f"{p.tokens / max(p.elapsed_s, 1e-9):.0f} tok/s", refresh=True)

    def vllm(self, what: str, done: int, total: int, unit: str = "question") -> None:
        if self.bar is None or self.bar.desc != what:
            self.close()
            self.bar = tqdm(total=total, desc=what, unit=unit, file=sys.stderr, dynamic_ncols=True)
        self.bar.n = done
        self.bar.refresh()

    def exact(self, what: str, done: int, total: int) -> None:
        self.vllm(what, done, total, unit="turn")  # the target's answers, then the exact τ, per answer turn

    def bench(self, a, done: int, total: int, kept: bool) -> None:
        # told once a question is done, so the rate counts from the first question reported, and again from the
        # last one kept from an interrupted run (those take no time)
        if self.bar is None:
            self.bar = tqdm(total=total, initial=done, desc="Spec-Bench", unit="question", file=sys.stderr,
                            dynamic_ncols=True)
        elif kept:
            self.bar.reset(total)
            self.bar.initial = done
        self.bar.n = done
        self.bar.set_postfix_str(f"{a.subtask} q{a.question_id} T={a.temperature:g} {a.tokens_per_s:.1f} tok/s",
                                 refresh=True)


def check_study(cfg: StudyConfig, fcfg: FeatureConfig, tcfg: TrainConfig, device: torch.device,
                feature_dtype: str) -> int:
    """``elsi study --check``: whether the study in ``cfg.out`` can go on here, before the analysis exists (what
    does not depend on it: settings, the precision of finished drafts); a difference raises ValueError."""
    path = Path(cfg.out) / PLAN
    if cfg.restart or not path.is_file():
        print(f"{cfg.out}: {'--restart' if cfg.restart else 'no ' + PLAN + ' yet'}: a new study, nothing to check")
        return 0
    require_same_settings(cfg.out, cfg, fcfg, tcfg)
    plan = load_plan(cfg.out)
    here = check_precision(cfg.out, plan, feature_dtype, tcfg.train_dtype, device)
    check_live_weights(cfg.out, plan, decoded_live(plan.draft_seeds, bool(cfg.live_temperatures), cfg.live_seeds))
    done = sum(draft_complete(draft_dir(cfg.out, s, seed)) for s, seed in plan.drafts)
    print(f"{cfg.out}: can go on here: the settings match {path} (the analysis's are checked once it exists) and "
          f"{done} finished draft(s) were trained as this run would train the rest ({here})")
    return 0


def _command() -> str:
    """This run's command line, as study.json records it."""
    return "elsi study " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else "elsi study"


def so_far(cfg: StudyConfig) -> int:
    """``elsi study --so-far``: the summary of the drafts finished so far (``elsi.study.sofar``)."""
    from elsi.study.sofar import SO_FAR_JSON, SO_FAR_MD, summary_so_far

    command = _command()
    res = summary_so_far(cfg.out, cfg.bootstrap, command)
    done = res["so_far"]
    print(f"{cfg.out}: {done['finished']} of {done['planned']} drafts finished"
          + (f"; at the pace of the machine it last ran on, {done['time_left']}" if done.get("time_left") else ""))
    pooled = claims_condition(res)
    print(f"{pooled['label']}:")
    print(md_table(*condition_table(pooled, res["subtasks"])))
    for line in res["verdict"]:
        print(f"- {line}")
    print(f"wrote {Path(cfg.out) / SO_FAR_JSON} and {Path(cfg.out) / SO_FAR_MD}")
    return 0


def study(cfg: StudyConfig, fcfg: FeatureConfig, tcfg: TrainConfig, rt: Runtime) -> int:
    if cfg.so_far:
        return so_far(cfg)
    check_inputs(fcfg.model, fcfg.data)  # a bad --model or --data fails here, before anything loads
    device, dtype = rt.setup()
    feature_dtype = rt.resolve_dtype(device, bulk=True)  # bf16 for the feature pass where native (auto)
    if cfg.check:
        return check_study(cfg, fcfg, tcfg, device, str(feature_dtype).removeprefix("torch."))
    run_dir = run_dir_for(cfg.run, fcfg.model)
    plan = make_plan(cfg, fcfg, tcfg, run_dir)  # selection first: a bad set is an error before the model loads
    if plan.run_model not in (None, fcfg.model):
        warnings.warn(f"the analysis in {run_dir} is of model {plan.run_model!r}, the study trains drafts for "
                      f"{fcfg.model!r}")
    if plan.vllm_sets:  # before hours of training: vLLM's environment and the precision it compares in
        from elsi.engines.vllm import check_vllm_eagle3, require_float32, vllm_python

        vllm_python()
        require_float32(dtype, "--vllm-sets")
    prepare_study(cfg.out, plan, cfg.restart)
    print(md_table(["set", "layers", "entropy (nats)", "seeds"],
                   [[s.name, ",".join(map(str, s.layers)), f"{s.entropy:.4f}",
                     ",".join(map(str, plan.draft_seeds[s.name]))] for s in plan.sets]), file=sys.stderr)
    torch.manual_seed(fcfg.seed)  # the one global seed (HF internals); drafts get theirs injected
    target = load_target(fcfg.model, device, dtype, rt.trust_remote_code)
    if plan.vllm_sets:
        check_vllm_eagle3(target.model)
    features_target = None if feature_dtype == dtype else (
        lambda: load_target(fcfg.model, device, feature_dtype, rt.trust_remote_code))
    dataset = load_dataset(fcfg.data)
    bars = _Bars(fcfg, cfg, tcfg)
    command = _command()
    try:
        hooks = Hooks(step=bars.step, features=bars.features, train=bars.train, bench=bars.bench, vllm=bars.vllm,
                      exact=bars.exact, pace=bars.pace)
        res = run_study(StudyRun(target, plan, cfg, fcfg, tcfg, device, hooks), dataset, command,
                        features_target, str(feature_dtype).removeprefix("torch."))
    finally:
        bars.close()
    pooled = claims_condition(res)  # temperature 0 pooled where the exact τ gives it, else every condition
    print(f"{pooled['label']}:")
    header, rows = condition_table(pooled, res["subtasks"])
    print(md_table(header, rows))
    print(spearman_line(pooled))
    for line in res["verdict"]:
        print(f"- {line}")
    paths = build_report([run_dir], Path(cfg.out) / "report", command=command, study=cfg.out)
    out = Path(cfg.out)
    print(f"wrote {out / 'study.json'}, {out / 'study.md'} and {paths['index.html']}")
    return 0


@dataclass(frozen=True)
class CompareArgs:
    """Finished studies of several models, compared with each other and with the paper's claims."""

    studies: list[str] = opt(help="study directories (`elsi study --out`), one per model", positional=True, nargs="+")
    runs: list[str] = opt([], "the analyses the studies selected on, in the same order (default: each study's own "
                              "run, as its study.json records it)")
    out: str = opt("", "output folder for comparison.json, comparison.md and models_tau_entropy.png "
                       "(default: FIRST_STUDY/compare)")


def compare(args: CompareArgs) -> int:
    from elsi.io import write_json
    from elsi.report.figures import models_tau_entropy
    from elsi.study.compare import compare_studies, comparison_markdown, load_pair

    if args.runs and len(args.runs) != len(args.studies):
        raise ValueError(f"--runs gives {len(args.runs)} analyses for {len(args.studies)} studies: one per study")
    pairs = [load_pair(d, args.runs[i] if args.runs else None) for i, d in enumerate(args.studies)]
    cmp = compare_studies([p[0] for p in pairs], [p[1] for p in pairs])
    cmp["command"] = "elsi compare-studies " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    cmp["studies"] = list(args.studies)
    out = Path(args.out or Path(args.studies[0]) / "compare")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "comparison.json", cmp)
    md = comparison_markdown(cmp)
    (out / "comparison.md").write_text(md)
    models_tau_entropy([p[0] for p in pairs], out / "models_tau_entropy.png")
    print(md)
    print(f"wrote {out / 'comparison.json'}, {out / 'comparison.md'} and {out / 'models_tau_entropy.png'}")
    return 0


COMMANDS = [
    Command("study", "train and benchmark one draft per layer set and seed (same data, budget and settings): "
                     "τ per subtask, against eagle3/eagle2, and its rank correlation with set entropy",
            (StudyConfig, FeatureConfig, TrainConfig, Runtime), study,
            skip={FeatureConfig: ("cache_layers",), TrainConfig: ("layers", "out", "time_budget", "restart")},
            writes=lambda cfg, fcfg, tcfg, rt: [] if cfg.check else
            [(Path(cfg.out) / "so-far.json", "the study's summary so far")] if cfg.so_far else
            [(cfg.out, "the study directory")]),
    Command("compare-studies", "studies of several models side by side: CKA compartments, the selected sets' gains, "
                               "τ against entropy per model, and a verdict on each of the paper's claims",
            (CompareArgs,), compare),
]
