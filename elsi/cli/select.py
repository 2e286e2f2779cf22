"""``elsi select`` and ``elsi export``."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from elsi.cli.common import Command, print_json, table
from elsi.config import opt
from elsi.models import model_num_layers
from elsi.select import FORMATS, SelectConfig, Selector, chosen_layers, export_fragment, save_selections, select_all
from elsi.select.run import all_steps
from elsi.stats.analysis import parse_layers


def _fmt(v, spec=".4f"):
    return "-" if v is None else format(v, spec)


def select(cfg: SelectConfig) -> int:
    sel = Selector(cfg)
    if cfg.method == "all":
        with tqdm(total=len(all_steps(sel)), desc="select all", unit="search", file=sys.stderr) as bar:
            results = select_all(sel, on_step=lambda r: (bar.set_postfix_str(f"{r.method} m={r.m}"), bar.update()))
        elsi = [r for r in results if r.method == "elsi"]
        chosen = elsi[-1]  # ELSI at the largest m
    else:
        results = [sel.select(cfg.method, cfg.m)]
        chosen = results[0]
    path = save_selections(cfg.run, results, chosen)
    payload = [r.to_json() for r in results] if cfg.method == "all" else results[0].to_json()
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(payload, indent=1) + "\n")
    if cfg.json:
        print_json(payload)
        return 0
    rows = [[r.method, r.m, ",".join(map(str, r.layers)), _fmt(r.entropy), _fmt(r.entropy_normalized),
             "-" if r.rank is None else f"{r.rank}{'' if r.rank_exact else '~'}", _fmt(r.gap), f"{r.elapsed_s:.1f}"]
            for r in results]
    print(table(rows, ["method", "m", "layers", "entropy", "normalized", "rank", "gap", "s"]))
    if any(r.rank_exact is False for r in results):
        print("~ rank estimated on the exhaustive search's block subsample")
    print(f"chosen: {chosen.method} m={chosen.m} layers {list(chosen.layers)}; saved in {path}")
    return 0


@dataclass(frozen=True)
class ExportArgs:
    """A layer set and the runtime to write it for."""

    layers: str = opt(help="layer ids (elsi numbering, e.g. 2,15,27), or 'chosen' with --run")
    model: str = opt("smollm2-135m", "the target (to check ids against its N)")
    format: str = opt("vllm", "runtime whose numbering to write", choices=FORMATS)
    run: str = opt("", "run directory whose chosen selection --layers chosen refers to")
    out: str = opt("", "write the fragment to this file (default: print)")


def export(args: ExportArgs) -> int:
    n = model_num_layers(args.model)
    if args.layers == "chosen":
        if not args.run:
            raise ValueError("--layers chosen needs --run RUN_DIR")
        layers = chosen_layers(args.run)
    else:
        layers = parse_layers(args.layers, n)
    frag = export_fragment(tuple(layers), n, args.format, args.model)
    text = json.dumps(frag, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    print(f"note: {frag['_elsi_note']}", file=sys.stderr)
    return 0


COMMANDS = [
    Command("select", "choose a layer set from a finished run (ELSI, ELSI-C, exhaustive, baselines, or all)",
            (SelectConfig,), select),
    Command("export", "write the draft-config fragment of a layer set for vLLM, SGLang or SpecForge",
            (ExportArgs,), export),
]
