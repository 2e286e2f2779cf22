"""Speed of selection on the default run (issue: layer-set selection).

Times, on a finished `elsi analyze` run (default: the 200-sample SmolLM2 run of `make run`):
- ELSI m=3 (beam 8) from a fresh start, including loading G;
- exhaustive m=3 on the block subsample (4 blocks per sample, best/worst 32 rescored) and,
  with --full, on all blocks, checking that both choose the same set;
- the mean-block aggregate (ELSI and exhaustive m=3);
- the cost of one set's entropy from G against the same entropy computed from stored
  hidden states (concatenated normalised states, per block), on the blocks of a few
  samples recomputed with the target, and the ratio.

    .venv/bin/python bench/select_speed.py --run runs/smollm2-135m [--full]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from elsi.collect.collector import _forward, package_versions
from elsi.collect.grams import blocks_of, filter_positions, normalize_blocks, token_entropy
from elsi.data import load_dataset, tokenize
from elsi.models import load_target
from elsi.runtime import machine_info
from elsi.select import SelectConfig, Selector
from elsi.stats.entropy import kernel_entropy


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def from_states_vs_grams(run_dir: Path, sel: Selector, samples: int, sets: list) -> dict:
    """Per-set entropy on the same blocks: from hidden states vs from G."""
    man = sel.run.manifest
    target = load_target(man["model"])
    ds = load_dataset(man["settings"]["data"])
    zs = []
    for rec in man["samples"][:samples]:
        ids = tokenize(ds.samples[rec["index"]], target.tokenizer, man["settings"]["max_tokens"])
        logits, hidden = _forward(target, ids)
        blocks = blocks_of(filter_positions(token_entropy(logits), man["settings"]["rho"]), sel.run.block)
        hidden = torch.stack(hidden)  # (L, T, d)
        z = hidden[:, blocks.reshape(-1)].reshape(hidden.shape[0], *blocks.shape, -1).double()  # (L, nb, B, d)
        zs.append(normalize_blocks(z, "center-l2").transpose(0, 1))  # (nb, L, B, d)
    states = torch.cat(zs)  # (nb, L, B, d)
    nb = states.shape[0]
    block_idx = torch.nonzero(sel.run.block_sample < samples).squeeze(-1)
    assert block_idx.numel() == nb

    def via_states(layers):
        z = states[:, list(layers)]  # (nb, m, B, d)
        z = z / z.flatten(2).norm(dim=-1)[..., None, None]  # each layer scaled to unit Frobenius norm
        cat = z.permute(0, 2, 1, 3).reshape(nb, sel.run.block, -1)  # (nb, B, m*d)
        return kernel_entropy(cat @ cat.transpose(-1, -2))

    u = sel.run._layer_kernels(block_idx)  # (N+1, nb, B, B): built once per search, as SetScorer does

    def via_grams(layers):
        return kernel_entropy(u[list(layers)].sum(0))

    for fn in (via_states, via_grams):  # warm-up
        fn(sets[0])
    t_states = min(timed(lambda: [via_states(s) for s in sets])[1] for _ in range(3))
    t_grams = min(timed(lambda: [via_grams(s) for s in sets])[1] for _ in range(3))
    diff = max(float((via_states(s) - via_grams(s)).abs().max()) for s in sets)
    layers_total, d = states.shape[1], states.shape[-1]
    all_blocks = sel.run.num_blocks
    return {
        "blocks": nb,
        "sets": len(sets),
        "seconds_per_set_from_states": t_states / len(sets),
        "seconds_per_set_from_grams": t_grams / len(sets),
        "ratio_states_over_grams": t_states / t_grams,
        "max_abs_entropy_difference": diff,
        "note": "from states each set pays for forming B x B kernels from m*d-wide blocks; G also needs far less memory",
        "bytes_states_float16_all_blocks": all_blocks * layers_total * sel.run.block * d * 2,
        "bytes_grams_float32_packed_all_blocks": all_blocks * layers_total * sel.run.block * (sel.run.block + 1) // 2 * 4,
        "memory_ratio_states_over_grams": (d * 2) / ((sel.run.block + 1) / 2 * 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/smollm2-135m")
    ap.add_argument("--full", action="store_true", help="also run the exhaustive search on all blocks")
    ap.add_argument("--state-samples", type=int, default=4)
    ap.add_argument("--out", default="bench/results/select_speed.json")
    args = ap.parse_args()
    res: dict = {"command": "python bench/select_speed.py " + " ".join(sys.argv[1:]), "run": args.run}
    sel, t_load = timed(lambda: Selector(SelectConfig(run=args.run)))
    elsi, t_elsi = timed(lambda: sel.select("elsi", 3))
    res["num_blocks"] = sel.run.num_blocks
    res["num_samples"] = sel.run.num_samples
    res["elsi_m3"] = {"layers": list(elsi.layers), "entropy": elsi.entropy, "seconds": t_load + t_elsi,
                      "seconds_load": t_load, "sets_evaluated": sel.scorer.evaluated}
    print(f"ELSI m=3: {list(elsi.layers)} in {t_load + t_elsi:.1f} s", file=sys.stderr)
    ex, t_ex = timed(lambda: sel.exhaustive(3))
    res["exhaustive_m3_subsample"] = {"layers": list(ex.best), "entropy": ex.best_entropy, "seconds": t_ex,
                                      "num_sets": ex.num_sets, "blocks_per_sample": 4, "rescored": 32}
    print(f"exhaustive m=3 (subsample): {list(ex.best)} in {t_ex:.1f} s", file=sys.stderr)
    if args.full:
        full = Selector(SelectConfig(run=args.run, search_blocks=0))
        exf, t_full = timed(lambda: full.exhaustive(3))
        res["exhaustive_m3_all_blocks"] = {"layers": list(exf.best), "entropy": exf.best_entropy, "seconds": t_full}
        res["same_set_as_subsample"] = exf.best == ex.best
        print(f"exhaustive m=3 (all blocks): {list(exf.best)} in {t_full:.1f} s", file=sys.stderr)
    mb = Selector(SelectConfig(run=args.run, aggregate="mean-block"))
    (mb_elsi, t_mb) = timed(lambda: mb.select("elsi", 3))
    mb_ex, t_mbx = timed(lambda: mb.exhaustive(3))
    res["mean_block"] = {"elsi_m3": list(mb_elsi.layers), "elsi_seconds": t_mb,
                         "exhaustive_m3": list(mb_ex.best), "exhaustive_seconds": t_mbx}
    sets = [(2, 15, 27), (5, 18, 27), (1, 10, 20), (3, 16, 29)]
    res["per_set_cost"] = from_states_vs_grams(Path(args.run), sel, args.state_samples, sets)
    res["machine"] = {**machine_info(), "threads": torch.get_num_threads(),
                      "load_average_1_5_15_min": os.getloadavg()}
    res["versions"] = package_versions()
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"elsi_m3_s": res["elsi_m3"]["seconds"], "exhaustive_m3_s": t_ex,
                      "ratio_states_over_grams": res["per_set_cost"]["ratio_states_over_grams"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
