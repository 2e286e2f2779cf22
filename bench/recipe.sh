#!/usr/bin/env bash
# Draft recipe probes (issue 15, deliverable 2): the same 4,800 ShareGPT conversations (bf16 feature
# cache, layers 2,15,27), the same seed and a short equal time budget per recipe; one change at a time
# against the default. Writes bench/results/recipe/<name>.json (bench/train_draft.py's record: held-out
# figures on the 240 held-out conversations, probe curve, tokens/s) and bench/results/recipe.json (the
# table). Alone on the machine: about 6 minutes a probe.
#   bash bench/recipe.sh [BUDGET]       (default 5m)
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET=${1:-5m}
FEAT=${FEAT:-runs/features-sg2400-bf16}
declare -A PROBES=(
  [default]=""
  [head-target]="--head-init target"
  [lr1e-3]="--lr 1e-3"
  [batch4]="--batch-size 4"
  [fc-norm]="--fc-norm"
  [layer-target]="--lr 1e-3 --layer-init target"  # against lr1e-3, today's default
)
ORDER=(default head-target lr1e-3 batch4 fc-norm layer-target)
for name in "${ORDER[@]}"; do
  out=bench/results/recipe/$name.json
  [ -f "$out" ] && { echo "have $out"; continue; }
  .venv/bin/python bench/train_draft.py --samples 4800 --max-tokens 1024 --time-budget "$BUDGET" --threads 2 \
    --no-eval --label "recipe-$name" --out "runs/recipe-$name" --result "$out" \
    --extra "--features-dir $FEAT --ttt 1 --restart --eval-every 1m ${PROBES[$name]}"
done
.venv/bin/python - "${ORDER[@]}" <<'PY'
import json, sys
rows = []
for name in sys.argv[1:]:
    r = json.load(open(f"bench/results/recipe/{name}.json"))
    rows.append({"recipe": name, "command": r["command"], "heldout_depth1_match": r["heldout_depth1_match"],
                 "train_tokens_per_s": r["train_tokens_per_s"], "steps": r["steps"],
                 "epochs": r["epochs"], "train_match_last": (r["train_curve_last"] or {}).get("acc"),
                 "probe_curve": [(c["elapsed_s"], c["match"][0]) for c in r["heldout_probe_curve"]],
                 "load_before": r["machine"]["loadavg_1_5_15_before_train"]})
json.dump({"command": "bash bench/recipe.sh", "budget": "see each command", "probes": rows},
          open("bench/results/recipe.json", "w"), indent=1)
print("| recipe | held-out depth-1 | train match (last) | tokens/s | steps | epochs |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['recipe']} | {r['heldout_depth1_match']:.4f} | {r['train_match_last']:.3f} | "
          f"{r['train_tokens_per_s']:.0f} | {r['steps']} | {r['epochs']:.2f} |")
PY
