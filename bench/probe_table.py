"""The table of a set of draft probes: each a bench/train_draft.py record RESULTS/<name>.json. Writes
RESULTS.json (one row a probe, with its curve, load and CPU) and prints a markdown table.

    .venv/bin/python bench/probe_table.py recipe RESULTS NAME...   (bench/recipe.sh: held-out figures)
    .venv/bin/python bench/probe_table.py regen RESULTS NAME...    (bench/regen.sh: Spec-Bench figures too)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# kind -> (the row's name key, the extra top-level keys of RESULTS.json)
KINDS = {"recipe": ("recipe", {"budget": "see each command"}), "regen": ("data", {})}


def row(kind: str, name: str, r: dict) -> dict:
    """One probe's row: what both kinds record, plus the Spec-Bench figures of a regen probe."""
    out = {KINDS[kind][0]: name, "command": r["command"]}
    if kind == "regen":
        out |= {k: r[k] for k in ("eval_command", "spec_bench_match_per_depth", "spec_bench_accept_length_chain",
                                  "spec_bench_per_subtask", "heldout_depth1_match", "train_tokens", "feature_tokens",
                                  "feature_seconds", "train_tokens_per_s", "steps", "epochs", "train_matmul_dtype")}
    else:
        out |= {k: r[k] for k in ("heldout_depth1_match", "train_tokens_per_s", "steps", "epochs")}
        out["train_match_last"] = (r["train_curve_last"] or {}).get("acc")
    return out | {"probe_curve": [(c["elapsed_s"], c["match"][0]) for c in r["heldout_probe_curve"]],
                  "load_before": r["machine"]["loadavg_1_5_15_before_train"],
                  "cpu": r["machine"].get("cpu"), "cpu_bf16": r["machine"].get("cpu_bf16")}


def markdown(kind: str, rows: list[dict]) -> list[str]:
    """The printed table."""
    if kind == "recipe":
        lines = ["| recipe | held-out depth-1 | train match (last) | tokens/s | steps | epochs |", "|---" * 6 + "|"]
        return lines + [f"| {r['recipe']} | {r['heldout_depth1_match']:.4f} | {r['train_match_last']:.3f} | "
                        f"{r['train_tokens_per_s']:.0f} | {r['steps']} | {r['epochs']:.2f} |" for r in rows]
    subtasks = list(rows[0]["spec_bench_per_subtask"])
    lines = ["| data | Spec-Bench depth-1 | " + " | ".join(subtasks)
             + " | held-out (own kind) | train tokens | steps | epochs |", "|---" * (len(subtasks) + 6) + "|"]
    for r in rows:
        per = " | ".join(f"{r['spec_bench_per_subtask'][s]['match'][0]:.3f}" for s in subtasks)
        lines.append(f"| {r['data']} | {r['spec_bench_match_per_depth'][0]:.4f} | {per} | "
                     f"{r['heldout_depth1_match']:.4f} | {r['train_tokens']} | {r['steps']} | {r['epochs']:.2f} |")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in KINDS:
        print(__doc__, file=sys.stderr)
        return 2
    kind, results, names = argv[0], Path(argv[1]), argv[2:]
    rows = []
    for name in names:
        path = results / f"{name}.json"
        if not path.is_file():
            print(f"bench/probe_table.py: no record {path} (probe {name!r} has not run)", file=sys.stderr)
            return 2
        rows.append(row(kind, name, json.loads(path.read_text())))
    table = {"command": f"bash bench/{kind}.sh", **KINDS[kind][1], "probes": rows}
    Path(f"{results}.json").write_text(json.dumps(table, indent=1))
    print("\n".join(markdown(kind, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
