"""Is a retrained draft the same draft? Compare two studies' training records, draft by draft.

    python3 bench/retrain_check.py NEW_STUDY OLD_STUDY [DRAFT...]

NEW_STUDY, OLD_STUDY: study folders or their records in bench/results (each with drafts/<set>-s<seed>/training.json);
DRAFT: e.g. elsi-3-s1 (default: every draft both have). For each draft prints whether the held-out figures and the
last curve entry (all but its timings) are equal, and where the held-out figures differ, the held-out match of both;
exits 1 if any differs. Used for the T = 1 study, whose drafts are the T = 0 study's retrained (bench/study3_t1.sh;
in float32 where the T = 0 study trained in bf16: then they differ, by that much).
"""

import json
import sys
from pathlib import Path


def untimed(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if "time" not in k and "tok_s" not in k and "per_s" not in k
            and k != "elapsed_s"}


def matches(rec: dict) -> str:
    """The held-out match at each training-time-test depth, as "0.327 / 0.287"."""
    return " / ".join(f"{m:.3f}" for m in (rec.get("heldout") or {}).get("match", [])) or "none"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    new, old = (Path(a) / "drafts" for a in argv[:2])
    names = argv[2:] or sorted({p.parent.name for p in new.glob("*/training.json")}
                               & {p.parent.name for p in old.glob("*/training.json")})
    same = True
    for name in names:
        a, b = (json.loads((d / name / "training.json").read_text()) for d in (new, old))
        held, last = a.get("heldout") == b.get("heldout"), untimed(a["curve"][-1]) == untimed(b["curve"][-1])
        same &= held and last
        print(f"{name}: held-out {'equal' if held else 'DIFFERS'}, last curve entry {'equal' if last else 'DIFFERS'}"
              + ("" if held else f" (held-out match by depth: {matches(a)} here, {matches(b)} there)"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
