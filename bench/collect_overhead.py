"""Collection overhead against a plain forward on the same tokens (issue: statistics engine).

For each of --samples ShareGPT samples (the default run's first ones), alternately time
(a) a plain forward `model(input_ids)` (full logits, what any user pays) and
(b) elsi's per-sample collection work: forward with all hidden states, token entropy,
    filter, blocks and Grams (filtered and unfiltered), as `collect` does.
Warm-up samples are excluded; medians of per-token times and their ratio are reported.
Also: tokens/s, the size of G on disk for the default run, and peak memory.

    .venv/bin/python bench/collect_overhead.py [--samples 24] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from elsi.collect.collector import _forward, package_versions
from elsi.collect.grams import block_grams, blocks_of, filter_positions, kept_count, token_entropy
from elsi.data import iter_tokenized, load_dataset
from elsi.models import load_target
from elsi.runtime import machine_info


def collect_one(target, ids, rho=0.3, block=32):
    logits, hidden = _forward(target, ids)
    ent = token_entropy(logits)
    for rho_v in (rho, 0.0):
        grams, bsum = block_grams(hidden, blocks_of(filter_positions(ent, rho_v), block), "center-l2")
    return grams


def plain_one(target, ids):
    with torch.inference_mode():
        return target.model(input_ids=torch.tensor([ids]), use_cache=False).logits


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="bench/results/collect_overhead.json")
    ap.add_argument("--run", default="runs/smollm2-135m", help="a finished default run, for the size of G on disk")
    args = ap.parse_args()
    target = load_target(args.model)
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ds = load_dataset("sharegpt")
    samples = []
    for _, _, ids in iter_tokenized(ds, target.tokenizer, 1024, 0):
        if isinstance(ids, list) and kept_count(len(ids), 0.3) >= 32:
            samples.append(ids)
        if len(samples) >= args.samples + args.warmup:
            break
    plain, coll, tokens = [], [], []
    for k, ids in enumerate(samples):
        order = (plain_one, collect_one) if k % 2 == 0 else (collect_one, plain_one)
        times = {}
        for fn in order:
            t0 = time.perf_counter()
            fn(target, ids)
            times[fn.__name__] = time.perf_counter() - t0
        if k >= args.warmup:
            plain.append(times["plain_one"] / len(ids))
            coll.append(times["collect_one"] / len(ids))
            tokens.append(len(ids))
        print(f"sample {k}: {len(ids)} tokens, plain {times['plain_one']:.3f}s, collect {times['collect_one']:.3f}s",
              file=sys.stderr)
    ratio = statistics.median(c / p for c, p in zip(coll, plain))
    res = {
        "command": "python bench/collect_overhead.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "samples_timed": len(plain),
        "mean_tokens_per_sample": statistics.mean(tokens),
        "plain_forward_tokens_per_s": 1 / statistics.median(plain),
        "collect_tokens_per_s": 1 / statistics.median(coll),
        "overhead_ratio_median": ratio,
        "target_overhead_ratio": 1.15,
        "peak_rss_mib_after_model_load": rss_model,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
        "machine": {**machine_info(), "cpus": torch.get_num_threads(),
                    "load_average_1_5_15_min": os.getloadavg()},
        "versions": package_versions(),
    }
    grams = Path(args.run) / "grams.safetensors"
    if grams.exists():
        man = json.loads((Path(args.run) / "manifest.json").read_text())
        res["default_run"] = {
            "grams_bytes": grams.stat().st_size,
            "blocks": man["counts"]["blocks"],
            "blocks_unfiltered": man["counts"]["blocks_unfiltered"],
            "layers": man["num_layers"] + 1,
            "stored_as": "float32 packed upper triangles, 528 of 32x32 per block and layer, filtered + unfiltered",
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("plain_forward_tokens_per_s", "collect_tokens_per_s", "overhead_ratio_median")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
