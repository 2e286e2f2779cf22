"""The target's LM head on r rows against one row (issue 15: the verify phase of a decoding step).

A tree step needs the target's logits at the nodes its walk visits. On CPU the head (V x d, float32) is a
weight read: a product over a few rows costs about what one row costs. This bench times
``TargetRunner.logits`` on r = 1..8 rows of real final states for each target, interleaving the row
counts (median of --repeats), and prints each count's time over one row's: the figure
``elsi.decode.engine.SPINE_ROWS`` rests on.

    .venv/bin/python bench/head_rows.py [--models smollm2-135m gemma3-270m] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from elsi.decode.engine import SPINE_ROWS, TargetRunner
from elsi.io import write_json
from elsi.models import load_target
from elsi.runtime import machine_info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/head_rows.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models:
        target = load_target(name, dtype=torch.float32)
        runner = TargetRunner.from_target(target)
        ids = target.tokenizer("The quick brown fox jumps over the lazy dog. " * 2, return_tensors="pt").input_ids[0]
        with torch.inference_mode():
            hidden, _ = runner.forward(ids, torch.arange(len(ids)), runner.new_cache())  # (n, d)
            times: dict[int, list[float]] = {r: [] for r in args.rows}
            for rep in range(args.repeats + 2):  # two warm-up rounds
                for r in args.rows:
                    t0 = time.perf_counter()
                    runner.logits(hidden[:r])
                    if rep >= 2:
                        times[r].append(time.perf_counter() - t0)
        med = {r: statistics.median(v) * 1e3 for r, v in times.items()}
        row = {"model": name, "vocab": runner.vocab_size, "hidden": int(hidden.shape[1]),
               "ms_by_rows": {str(r): med[r] for r in args.rows},
               "ratio_to_one_row": {str(r): med[r] / med[args.rows[0]] for r in args.rows}}
        results.append(row)
        print(f"{name} (V {row['vocab']}, d {row['hidden']}): "
              + ", ".join(f"{r} rows {med[r]:.1f} ms ({row['ratio_to_one_row'][str(r)]:.2f}x)" for r in args.rows))
        del target, runner
    write_json(Path(args.out), {"command": "python " + " ".join(sys.argv), "spine_rows": SPINE_ROWS,
                          "repeats": args.repeats, "machine": machine_info(), "results": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
