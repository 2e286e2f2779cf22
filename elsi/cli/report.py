"""``elsi report``: figures and one HTML page that explain the layer choice of one or more runs."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from elsi.cli.common import Command
from elsi.config import opt
from elsi.report import build_report, default_out


@dataclass(frozen=True)
class ReportArgs:
    """The runs to report on and where the report goes."""

    run_dirs: list[str] = opt(help="run directories of finished `elsi analyze` runs (several: side by side)",
                              positional=True, nargs="+")
    out: str = opt("", "output folder (default: RUN_DIR/report; with several runs FIRST_RUN_DIR/report-compare)")
    study: str = opt("", "a finished study directory (`elsi study --out`): adds its τ tables and the τ-against-entropy "
                         "plot")


def report(args: ReportArgs) -> int:
    out = args.out or default_out(args.run_dirs)
    command = "elsi report " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    paths = build_report(args.run_dirs, out, command=command, study=args.study or None)
    for name, path in paths.items():
        print(f"wrote {path}")
    if not any(name.endswith("beam_tree.png") for name in paths):
        print(f"no selections.json: run `elsi select --run {args.run_dirs[0]} --method all` for the ELSI choice "
              "and its beam tree", file=sys.stderr)
    print(f"open {paths['index.html']}")
    return 0


COMMANDS = [
    Command("report", "figures, selection.md and a self-contained index.html that explain the layer choice",
            (ReportArgs,), report),
]
