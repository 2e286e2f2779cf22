"""``elsi select``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from elsi.cli.common import Command, print_json
from elsi.select import SelectConfig, Selector, save_selections, select_all
from elsi.select.run import all_steps, skipped_steps
from elsi.text import md_table, num


def _rank(r) -> str:
    if r.rank is None:
        return "-"
    if r.rank_interval:
        return f"{r.rank}~ [{r.rank_interval[0]}-{r.rank_interval[1]}]"
    return f"{r.rank}{'' if r.rank_exact else '~'}"


def select(cfg: SelectConfig) -> int:
    sel = Selector(cfg)
    skipped = None
    if cfg.method == "all":
        skipped = skipped_steps(sel)
        with tqdm(total=len(all_steps(sel)), desc="select all", unit="search", file=sys.stderr) as bar:
            results = select_all(sel, on_step=lambda r: (bar.set_postfix_str(f"{r.method} m={r.m}"), bar.update()))
        elsi = [r for r in results if r.method == "elsi"]
        chosen = elsi[-1]  # ELSI at the largest m
    else:
        results = [sel.select(cfg.method, cfg.m, with_optimum=cfg.rank)]
        chosen = results[0]
    path = save_selections(cfg.run, results, chosen, skipped)
    payload = [r.to_json() for r in results] if cfg.method == "all" else results[0].to_json()
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(payload, indent=1) + "\n")
    if cfg.json:
        print_json(payload)
        return 0
    f = lambda x: num(x, 4, missing="-")  # noqa: E731
    rows = [[r.method, r.m, ",".join(map(str, r.layers)), f(r.entropy), f(r.entropy_normalized), _rank(r), f(r.gap),
             f"{r.elapsed_s:.1f}"] for r in results]
    print(md_table(["method", "m", "layers", "entropy", "normalized", "rank", "gap", "s"], rows))
    sampled = next((r.optimum for r in results if r.optimum and r.optimum.get("sampled")), None)
    if sampled:
        print(f"~ rank estimated from {sampled['sampled']:,} of the {sampled['num_sets']:,} sets (uniform sample, "
              f"block subsample; [95 % interval]); gap to the best set found, {sampled['layers']}")
    elif any(r.rank_exact is False for r in results):
        print("~ rank estimated on the exhaustive search's block subsample")
    for s in skipped or []:
        print(f"left out: {s['method']} m={s['m']}: {s['why']}")
    print(f"chosen: {chosen.method} m={chosen.m} layers {list(chosen.layers)}; saved in {path}")
    return 0


COMMANDS = [
    Command("select", "choose a layer set from a finished run (ELSI, ELSI-C, exhaustive, baselines, or all)",
            (SelectConfig,), select),
]
