"""``elsi study``: one draft per layer set and seed, benchmarked on Spec-Bench; study.json, study.md and the report."""

from __future__ import annotations

import shlex
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from elsi.cli.analyze import run_dir_for
from elsi.cli.common import Command, Runtime, check_inputs, table
from elsi.data import load_dataset
from elsi.draft.features import FeatureConfig
from elsi.draft.train import TrainConfig, parse_duration
from elsi.models import load_target
from elsi.report import build_report
from elsi.study import Hooks, StudyConfig, make_plan, prepare_study, run_study
from elsi.study.summary import condition_table, spearman_line


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
        if p.note:
            self.bar.write(p.note, file=sys.stderr)
            return
        if p.heldout_acc is not None:
            self.held = p.heldout_acc
        done = p.step if self.by_steps else p.elapsed_s
        self.bar.n = min(done, self.bar.total or done)
        h = f" held {self.held:.3f}" if self.held is not None else ""
        self.bar.set_postfix_str(f"step {p.step} loss {p.loss:.3f} acc {p.acc:.3f}{h} "
                                 f"{p.tokens / max(p.elapsed_s, 1e-9):.0f} tok/s", refresh=True)

    def bench(self, a, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=total, desc="Spec-Bench", unit="question", file=sys.stderr, dynamic_ncols=True)
        self.bar.n = done
        self.bar.set_postfix_str(f"{a.subtask} q{a.question_id} T={a.temperature:g} {a.tokens_per_s:.1f} tok/s",
                                 refresh=True)


def study(cfg: StudyConfig, fcfg: FeatureConfig, tcfg: TrainConfig, rt: Runtime) -> int:
    check_inputs(fcfg.model, fcfg.data)  # a bad --model or --data fails here, before anything loads
    device, dtype = rt.setup()
    run_dir = run_dir_for(cfg.run, fcfg.model)
    plan = make_plan(cfg, fcfg, tcfg, run_dir)  # selection first: a bad set is an error before the model loads
    if plan["run_model"] not in (None, fcfg.model):
        warnings.warn(f"the analysis in {run_dir} is of model {plan['run_model']!r}, the study trains drafts for "
                      f"{fcfg.model!r}")
    prepare_study(cfg.out, plan, cfg.restart)
    print(table([[s["name"], ",".join(map(str, s["layers"])), f"{s['entropy']:.4f}", ",".join(map(str, s["seeds"]))]
                 for s in plan["sets"]], ["set", "layers", "entropy (nats)", "seeds"]), file=sys.stderr)
    torch.manual_seed(fcfg.seed)  # the one global seed (HF internals); drafts get theirs injected
    target = load_target(fcfg.model, device, dtype, rt.trust_remote_code)
    dataset = load_dataset(fcfg.data)
    bars = _Bars(fcfg, cfg, tcfg)
    command = "elsi study " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else "elsi study"
    try:
        res = run_study(target, dataset, plan, cfg, fcfg, tcfg, device,
                        Hooks(step=bars.step, features=bars.features, train=bars.train, bench=bars.bench), command)
    finally:
        bars.close()
    pooled = res["conditions"][-1]
    print(f"{pooled['label']}:")
    header, rows = condition_table(pooled, res["subtasks"])
    print(table(rows, header))
    print(spearman_line(pooled))
    for line in res["verdict"]:
        print(f"- {line}")
    paths = build_report([run_dir], Path(cfg.out) / "report", command=command, study=cfg.out)
    out = Path(cfg.out)
    print(f"wrote {out / 'study.json'}, {out / 'study.md'} and {paths['index.html']}")
    return 0


COMMANDS = [
    Command("study", "train and benchmark one draft per layer set and seed (same data, budget and settings): "
                     "τ per subtask, against eagle3/eagle2, and its rank correlation with set entropy",
            (StudyConfig, FeatureConfig, TrainConfig, Runtime), study,
            skip={FeatureConfig: ("cache_layers",), TrainConfig: ("layers", "out", "time_budget", "restart")}),
]
