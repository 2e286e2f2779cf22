"""Remake a finished study's summary (study.json, study.md and its report) from its records with this code.

    .venv/bin/python bench/study_summary.py STUDY_DIR [--run ANALYSIS_DIR]

STUDY_DIR: a study's folder (`elsi study --out`) or the copy of its records in bench/results
(bench/study_results.sh: plan.json, bench/, exact/, drafts/*/training.json, the baselines). Nothing is trained,
decoded or loaded: the summary is made again from the same records, with the command, bootstrap and vLLM runs
study.json recorded, so a change to how a summary is worded or computed reaches the committed results. It refuses a
study with a draft not finished. Prints what changed in study.json (the keys whose values differ).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from elsi.io import read_json
from elsi.report import build_report
from elsi.study.plan import load_plan
from elsi.study.run import STUDY_JSON, baseline_paths, vllm_path, write_summary
from elsi.study.sofar import drafts_left, finished_drafts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("study", help="a finished study's folder or its records in bench/results")
    ap.add_argument("--run", default="", help="the analysis the study selected on (default: study.json's run)")
    args = ap.parse_args()
    out = Path(args.study)
    if not (out / STUDY_JSON).is_file():
        print(f"{out}: no {STUDY_JSON}, so no finished study to summarize again (elsi study --so-far for an "
              f"unfinished one)", file=sys.stderr)
        return 2
    old = read_json(out / STUDY_JSON)
    plan = load_plan(out)
    benches, trained = finished_drafts(out, plan)
    left = drafts_left(plan, benches)
    if left:
        print(f"{out}: drafts not finished: {', '.join(left)}", file=sys.stderr)
        return 2
    run = Path(args.run or old["run"])
    if not run.is_dir():
        print(f"{run}: the analysis the study selected on is not here; give it with --run", file=sys.stderr)
        return 2
    vllm = {(s.name, seed): read_json(vllm_path(out, s, seed))
            for s in plan.served for seed in plan.draft_seeds[s.name]} or None
    new = write_summary(out, plan, benches, [read_json(p) for p in baseline_paths(out)],
                        old["bootstrap"]["resamples"], old["command"], vllm, trained)
    build_report([run], out / "report", command=old["command"], study=out)
    changed = [k for k in sorted(set(old) | set(new)) if json.dumps(old.get(k)) != json.dumps(new.get(k))]
    print(f"{out}: study.json, study.md and report/ made again; keys changed: {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
