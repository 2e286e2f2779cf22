"""``elsi analyze`` (collect -> Gram tensor -> analysis.json) and ``elsi score``."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from elsi.cli.common import Command, Runtime, check_inputs, is_main_process, print_json
from elsi.collect.collector import CollectConfig, Progress, collect, existing_run, grams_problem
from elsi.collect.store import GRAMS
from elsi.config import opt
from elsi.data import load_dataset
from elsi.io import RunError, read_json, tensors_checksum
from elsi.models import load_target
from elsi.stats.analysis import ANALYSIS, AnalysisConfig, GramRun, analyze_run
from elsi.text import md_table


@dataclass(frozen=True)
class AnalyzeOutput:
    """Where the run goes."""

    out: str = opt("", "run directory (default: runs/<model>)")


def run_dir_for(out: str, model: str) -> Path:
    return Path(out) if out else Path("runs") / Path(model).name.removesuffix(".gguf")


def analysis_problem(run_dir: Path, acfg: AnalysisConfig) -> str | None:
    """Why ``run_dir/analysis.json`` must be computed (again) from the Gram tensor, or None when it is current."""
    path = run_dir / ANALYSIS
    if not path.exists():
        return "no analysis.json yet"
    try:
        prev = read_json(path)
    except RunError as err:
        return str(err)
    settings = prev.get("settings", {})
    if any(settings.get(k) != v for k, v in acfg.__dict__.items()):
        return "other analysis settings"
    if prev.get("grams_sha256") != tensors_checksum(run_dir / GRAMS):
        return "computed from another Gram tensor"
    return None


def analyze(ccfg: CollectConfig, acfg: AnalysisConfig, dest: AnalyzeOutput, rt: Runtime) -> int:
    check_inputs(ccfg.model, ccfg.data)  # a bad --model or --data fails here, before anything loads
    device, dtype = rt.setup(bulk=True)
    run_dir = run_dir_for(dest.out, ccfg.model)
    main = is_main_process()
    man = existing_run(run_dir, ccfg)
    wrote: list[Path] = []
    # Every rank decides alike (collect() has barriers); collect() warns and starts over on a damaged Gram tensor.
    problem = grams_problem(run_dir) if man is not None and man.get("status") == "complete" else None
    if man is None or man.get("status") != "complete" or problem:
        dataset = load_dataset(ccfg.data)
        target = load_target(ccfg.model, device, dtype, rt.trust_remote_code, rt.device_map or None)
        bar = tqdm(total=ccfg.samples, desc="collect", unit="sample", file=sys.stderr, dynamic_ncols=True,
                   disable=not main)

        def show(p: Progress) -> None:
            if bar.n == 0 and p.resumed:
                bar.write(f"resuming: {p.resumed} samples already collected in {run_dir}", file=sys.stderr)
            bar.n = p.samples_done
            bar.set_postfix_str(f"{p.tokens_seen / max(p.elapsed_s, 1e-9):.0f} tok/s", refresh=True)

        man = collect(target, dataset, ccfg, run_dir, on_progress=show)
        bar.close()
        wrote += [run_dir / GRAMS, run_dir / "manifest.json"]
    if not main:
        return 0  # rank 0 merged the shards; it computes and prints the statistics
    why = analysis_problem(run_dir, acfg)
    if why:
        if (run_dir / ANALYSIS).exists():
            print(f"elsi analyze: {run_dir / ANALYSIS}: {why}; computing it again", file=sys.stderr)
        print("computing statistics from the Gram tensor ...", file=sys.stderr)
        res = analyze_run(run_dir, acfg)
        wrote.append(run_dir / ANALYSIS)
    else:
        res = read_json(run_dir / ANALYSIS)
    c = man["counts"]
    print(
        f"{run_dir}: {c['samples_used']} samples, {c['tokens_seen']} tokens seen, {c['tokens_kept']} kept, "
        f"{c['blocks']} blocks; samples skipped {c['samples_skipped'] or 'none'}; "
        f"unusable records in the data {c.get('data_records_unusable') or 'none'}"
    )
    rows = [
        [l, f"{h:.4f}", f"{s:.4f}" if s is not None else "-", f"{hn:.4f}", f"{t:.4f}" if not math.isnan(t) else "-"]
        for l, h, s, hn, t in zip(res["layers"], res["layer_entropy"], res["layer_entropy_std"],
                                  res["layer_entropy_normalized"], res["transition"][1:] + [math.nan])
    ]
    print(md_table(["layer", "entropy", "std", "normalized", "T(l)"], rows))
    print(f"boundaries (T peaks): {res['boundaries']}; compartments: {res['compartments']}")
    if wrote:
        print("wrote " + ", ".join(map(str, wrote)))
    else:
        print(f"up to date: {run_dir} (Gram tensor checked against its checksum; nothing recomputed)")
    return 0


@dataclass(frozen=True)
class ScoreArgs:
    """The run and the layer set to score."""

    run: str = opt(help="run directory of a finished `elsi analyze`")
    layers: str = opt(help="layer ids, e.g. 2,15,27 (HF hidden-state ids; ranges a-b allowed)")
    json: bool = opt(False, "print JSON")


def score(args: ScoreArgs) -> int:
    run = GramRun(args.run)
    layers = run.check(args.layers)
    st = run.entropy(layers)
    mb = run.mean_block_entropy([layers])[0]
    out = {
        "run": args.run,
        "layers": sorted(layers),
        "entropy": st.mean,
        "entropy_std": st.std,
        "entropy_normalized": st.normalized,
        "entropy_mean_block": mb,
        "entropy_mean_block_normalized": mb / math.log(run.block),
        "num_samples": run.num_samples,
        "num_blocks": run.num_blocks,
    }
    if args.json:
        print_json(out)
    else:
        print(f"layers {out['layers']}: entropy {st.mean:.4f} ± {st.std:.4f} nats "
              f"(normalized {st.normalized:.4f}); mean-block {mb:.4f} "
              f"over {run.num_samples} samples, {run.num_blocks} blocks")
    return 0


COMMANDS = [
    Command("analyze", "collect the Gram tensor of every hidden layer and compute entropy, CKA and transitions",
            (CollectConfig, AnalysisConfig, AnalyzeOutput, Runtime), analyze,
            writes=lambda ccfg, acfg, dest, rt: [(run_dir_for(dest.out, ccfg.model), "the run directory")]),
    Command("score", "entropy (raw and normalised) of any layer set of a finished run", (ScoreArgs,), score),
]
