"""Draft training target (issue 5): SmolLM2-135M, layers [2, 15, 27], 2 CPU cores, 20 minutes.

Runs `elsi train-draft` (target features are cached and not counted in the time budget),
then `elsi eval-draft` unless --no-eval, and writes ``bench/results/train_draft.json``:
held-out depth-1 top-1 match (target: >= 0.5), per-depth match, chain acceptance length,
training tokens/s, feature (target forward) tokens/s, and the exact commands.

    .venv/bin/python bench/train_draft.py                          # the full target run
    .venv/bin/python bench/train_draft.py --time-budget 3m --samples 150 --label short

The machine's load average before and after training is recorded: on a shared machine the
training tokens/s depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from elsi.cli import main as elsi_main
from elsi.draft.cache import FeatureStore
from elsi.runtime import machine_info


def run(argv: list[str]) -> float:
    print("$ elsi " + shlex.join(argv), file=sys.stderr)
    t0 = time.perf_counter()
    rc = elsi_main(argv)
    if rc:
        raise SystemExit(f"elsi {argv[0]} failed with exit code {rc}")
    return time.perf_counter() - t0


def spec_bench(model: str, draft: str, questions: int, threads: int) -> dict:
    """`elsi eval-draft` of ``draft`` (teacher-forced on the float32 target's own greedy Spec-Bench answers, cached
    per target) -> the record's fields: its command, depth-1 match, match per depth, chain acceptance length and the
    same per subtask."""
    import contextlib
    import io

    ev = ["eval-draft", "--model", model, "--draft", draft, "--questions", str(questions), "--threads", str(threads),
          "--json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run(ev)
    res = json.loads(buf.getvalue())
    return {"eval_command": "elsi " + shlex.join(ev), "spec_bench_depth1_match": res["all"]["match"][0],
            "spec_bench_match_per_depth": res["all"]["match"],
            "spec_bench_accept_length_chain": res["all"]["accept_length_chain"],
            "spec_bench_per_subtask": {k: {"match": v["match"], "accept_length_chain": v["accept_length_chain"]}
                                       for k, v in res["subtasks"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="2,15,27")
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--time-budget", default="20m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/draft-smollm2-2-15-27")
    ap.add_argument("--extra", default="", help="more train-draft options, e.g. '--regenerate --ttt 5'")
    ap.add_argument("--questions", type=int, default=5, help="eval-draft questions per subtask")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--skip-train", action="store_true",
                    help="reuse the draft already trained in --out by this script with the same options "
                         "(e.g. to add or redo the evaluation); the load average is then not known")
    ap.add_argument("--label", default="full", help="what this run is (e.g. 'short' for a pipeline check)")
    ap.add_argument("--result", default="bench/results/train_draft.json")
    args = ap.parse_args()

    train = ["train-draft", "--model", args.model, "--layers", args.layers, "--data", "sharegpt", "--out", args.out,
             "--samples", str(args.samples), "--max-tokens", str(args.max_tokens), "--time-budget", args.time_budget,
             "--threads", str(args.threads), *shlex.split(args.extra)]
    if args.skip_train:
        print("reusing the draft in " + args.out + " (trained by: elsi " + shlex.join(train) + ")", file=sys.stderr)
        load_before = load_after = wall_train = None
    else:
        load_before = os.getloadavg()
        wall_train = run(train)
        load_after = os.getloadavg()
    rec = json.loads((Path(args.out) / "training.json").read_text())
    store = FeatureStore(rec["data"]["features_dir"])
    h = rec["heldout"]
    result = {
        "label": args.label,
        "target": "held-out depth-1 top-1 match >= 0.5 with --time-budget 20m on 2 CPU cores",
        "command": "elsi " + shlex.join(train),
        "bench_command": ".venv/bin/python bench/train_draft.py " + shlex.join(sys.argv[1:]),
        "layers": rec["layers"],
        "heldout_depth1_match": h["match"][0],
        "heldout_match_per_depth": h["match"],
        "heldout_match_in_vocab_per_depth": h["match_in_vocab"],
        "heldout_accept_length_chain": h["accept_length_chain"],
        "heldout_accept_length_product": h["accept_length_product"],
        "heldout_tokens": rec["data"]["heldout_tokens"],
        "train_tokens": rec["data"]["train_tokens"],
        "draft_vocab_coverage": rec["data"]["draft_vocab_coverage"],
        "train_tokens_per_s": rec["train_tokens_per_s"],
        "train_matmul_dtype": rec.get("train_matmul_dtype", "float32"),
        "train_seconds": rec["train_seconds"],
        "steps": rec["steps"],
        "epochs": rec["epochs"],
        "heldout_probe_curve": rec["heldout_curve"],  # during training, on up to 16 held-out conversations
        "train_curve_last": rec["curve"][-1] if rec["curve"] else None,  # running training loss and match
        "feature_tokens": store.manifest.get("tokens"),
        "feature_seconds": store.manifest.get("seconds"),
        "feature_tokens_per_s": (store.manifest.get("tokens") or 0) / max(1e-9, store.manifest.get("seconds") or 0),
        "wall_seconds_train_draft": wall_train,
        "settings": rec["settings"],
        "machine": {**machine_info(), "torch": torch.__version__, "threads": args.threads,
                    "cpu_count": os.cpu_count(),
                    "loadavg_1_5_15_before_train": load_before and [round(x, 2) for x in load_before],
                    "loadavg_1_5_15_after_train": load_after and [round(x, 2) for x in load_after]},
    }
    if not args.no_eval:
        result.update(spec_bench(args.model, args.out, args.questions, args.threads))
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("label", "heldout_depth1_match", "train_tokens_per_s")}))


if __name__ == "__main__":
    main()
