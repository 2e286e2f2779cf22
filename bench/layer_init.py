"""--layer-init target against random, paired per seed (issue 15, deliverable 2): for each seed, two drafts
on the same feature cache, the same held-out split and the same sample order (both drawn from the seed),
the same step budget, one starting its midlayer from the target's last decoder layer. Writes the held-out
depth-1 match of each and their differences (seed-to-seed spread of the difference = its noise), and with
--eval-every the held-out probe by step; with --questions N also each draft's teacher-forced match on N
Spec-Bench questions per subtask (`elsi eval-draft`: the float32 target's own greedy answers, the text decoding
meets; the held-out split is ShareGPT's). Writes --out after each draft; run again, it keeps the drafts it has.

    .venv/bin/python bench/layer_init.py --features-dir runs/features-sg400-fp32 --samples 400 --steps 500 \\
        --seeds 1 2 --out bench/results/layer_init_avx2.json
    .venv/bin/python bench/layer_init.py --features-dir runs/features-sg1200-bf16 --samples 1200 --steps 1500 \\
        --seeds 0 1 --questions 5 --out bench/results/layer_init_1500.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from elsi.collect.collector import package_versions
from elsi.draft.cache import FeatureStore
from elsi.draft.train import TrainConfig, train_draft
from elsi.models import load_target
from elsi.runtime import machine_info
from train_draft import spec_bench  # bench/ is this script's folder, first on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--features-dir", required=True)
    ap.add_argument("--samples", type=int, required=True, help="conversations of the cache used (train + held-out)")
    ap.add_argument("--layers", default="2,15,27")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", default="0", help="held-out probe (16 conversations) every so long, e.g. 3m")
    ap.add_argument("--questions", type=int, default=0,
                    help="Spec-Bench questions per subtask for each draft's `elsi eval-draft` (0: none)")
    ap.add_argument("--runs", default="runs/layer-init", help="the drafts' directories")
    ap.add_argument("--out", default="bench/results/layer_init.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    store = FeatureStore(args.features_dir)
    target = load_target(args.model, "cpu", getattr(torch, store.dtype))  # the labels' precision = the features'
    device = torch.device("cpu")
    res = {"command": ".venv/bin/python bench/layer_init.py " + " ".join(sys.argv[1:]), "machine": machine_info(),
           "versions": package_versions(), "features_dir": args.features_dir, "samples": args.samples, "runs": []}
    out = Path(args.out)
    if out.is_file():  # resume: keep the drafts an interrupted run of the same command finished
        old = json.loads(out.read_text())
        if (old.get("command"), old.get("features_dir")) == (res["command"], res["features_dir"]):
            res["runs"] = old["runs"]
    for seed in args.seeds:
        for init in ("random", "target"):
            if any((r["seed"], r["layer_init"]) == (seed, init) for r in res["runs"]):
                print(f"seed {seed} {init}: have it in {out}", file=sys.stderr)
                continue
            cfg = TrainConfig(layers=args.layers, out=f"{args.runs}/{init}-s{seed}", lr=args.lr, ttt=1,
                              max_steps=args.steps, time_budget="0", eval_every=args.eval_every, layer_init=init,
                              restart=True)
            load = os.getloadavg()
            rec = train_draft(target, store, cfg, seed, device, samples=args.samples)
            res["runs"].append({"seed": seed, "layer_init": init, "heldout_depth1_match": rec["heldout"]["match"][0],
                                "heldout_tokens": rec["data"]["heldout_tokens"], "steps": rec["steps"],
                                "train_tokens_per_s": rec["train_tokens_per_s"], "train_match_last":
                                rec["curve"][-1]["acc"] if rec["curve"] else None, "load_before": load,
                                "probe_curve": [(c["step"], c["match"][0]) for c in rec["heldout_curve"]],
                                "settings": asdict(cfg)})
            if args.questions:
                res["runs"][-1].update(spec_bench(args.model, cfg.out, args.questions, args.threads))
            out.write_text(json.dumps(res, indent=1) + "\n")  # each finished draft at once
            print(f"seed {seed} {init}: held-out depth-1 {rec['heldout']['match'][0]:.4f}", file=sys.stderr)
    figures = ["heldout_depth1_match"] + (["spec_bench_depth1_match"] if args.questions else [])
    res["target_minus_random"] = {}
    for fig in figures:
        by = {(r["seed"], r["layer_init"]): r[fig] for r in res["runs"]}
        diffs = [by[(s, "target")] - by[(s, "random")] for s in args.seeds]
        res["target_minus_random"][fig] = {"per_seed": dict(zip(map(str, args.seeds), diffs)),
                                           "mean": statistics.mean(diffs),
                                           "stdev": statistics.stdev(diffs) if len(diffs) > 1 else None}
    res["machine"]["load_average_end"] = os.getloadavg()
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["target_minus_random"]))


if __name__ == "__main__":
    main()
