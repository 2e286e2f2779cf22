"""Five-layer sets (DFlash, DSpark, Domino drafts; issue #31): ELSI m = 5 against DFlash's evenly spaced rule.

On each finished `elsi analyze` run, with one ``Selector`` as `elsi select` builds it (nothing is saved):
- ELSI m = 5 (beam 8), timed as `elsi select --method elsi --m 5` runs it (no rank);
- the exhaustive search of m = 5 as `elsi select --method exhaustive --m 5` runs it: every set up to
  --max-sets (default 30,000), else a uniform sample of them (ranks estimated with a 95 % interval), its
  best polished by swaps; timed, with the cost per set and the cost of scoring every set extrapolated;
- the entropy and rank of ELSI's set, of DFlash's rule (m ids from 1 to N-3 in its numbering, + 1 in
  elsi's) and of elsi's uniform baseline, against the best set found;
- where ELSI's set holds h_N (the final, normed state, which no engine captures: `elsi export` refuses it),
  the same on the pool 1..N-1 (`--pool 1-N-1`), the sets a DFlash-style draft can be served with.
Wall and CPU seconds of each step, and the load average, are recorded: other jobs shared the cores.

    .venv/bin/python bench/select_m5.py --run runs/m5-smollm2 --run runs/m5-gemma3 --out bench/results/select_m5.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from elsi.runtime import machine_info
from elsi.select import SelectConfig, Selector


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def one_run(run: str, max_sets: int, pool: str = "") -> dict:
    sel = Selector(SelectConfig(run=run, max_sets=max_sets, pool=pool))
    man = sel.run.manifest
    res = {"run": run, "model": man["model"], "num_layers": sel.run.num_layers, "samples": sel.run.num_samples,
           "blocks": sel.run.num_blocks, "pool": list(sel.pool), "load_average_start": list(os.getloadavg())}
    elsi, w, c = timed(lambda: sel.select("elsi", 5))
    opt = f" --pool {pool}" if pool else ""
    res["elsi_select"] = {"command": f"elsi select --run {run} --method elsi --m 5{opt}", "layers": list(elsi.layers),
                          "entropy": elsi.entropy, "wall_s": w, "cpu_s": c}
    print(f"{run}: ELSI m=5 {list(elsi.layers)} in {w:.1f} s", file=sys.stderr)
    ex, w, c = timed(lambda: sel.select("exhaustive", 5))
    search = sel.exhaustive(5)
    scored = search.sampled or search.num_sets
    res["exhaustive_select"] = {
        "command": f"elsi select --run {run} --method exhaustive --m 5 --max-sets {max_sets}{opt}",
        "layers": list(ex.layers), "entropy": ex.entropy, "wall_s": w, "cpu_s": c, "num_sets": search.num_sets,
        "sets_scored": scored, "sampled": bool(search.sampled), "cpu_s_per_set": c / scored,
        "cpu_s_all_sets_extrapolated": c / scored * search.num_sets}
    print(f"{run}: exhaustive m=5 ({scored} of {search.num_sets} sets) {list(ex.layers)} in {w:.1f} s", file=sys.stderr)
    rows = {}
    for method in ("elsi", "dflash", "uniform", "exhaustive"):
        r, w, c = timed(lambda m=method: sel.select(m, 5, with_optimum=True))
        rows[method] = {"layers": list(r.layers), "entropy": r.entropy, "entropy_normalized": r.entropy_normalized,
                        "rank": r.rank, "rank_exact": r.rank_exact,
                        "rank_interval": list(r.rank_interval) if r.rank_interval else None,
                        "gap_to_best_found": r.gap, "wall_s_with_cached_search": w}
    best = sel.exhaustive(5)
    res["m5"] = rows
    res["best_found"] = {"layers": list(best.best), "entropy": best.best_entropy}
    res["elsi_minus_dflash_nats"] = rows["elsi"]["entropy"] - rows["dflash"]["entropy"]
    res["load_average_end"] = list(os.getloadavg())
    n = sel.run.num_layers
    if not pool and n in rows["elsi"]["layers"]:
        res["exportable"] = one_run(run, max_sets, f"1-{n - 1}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help="a finished `elsi analyze` run (repeatable)")
    ap.add_argument("--max-sets", type=int, default=30000)
    ap.add_argument("--out", default="bench/results/select_m5.json")
    args = ap.parse_args()
    out = {"command": "python bench/select_m5.py " + " ".join(sys.argv[1:]), "machine": machine_info(),
           "runs": [one_run(r, args.max_sets) for r in args.run]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
