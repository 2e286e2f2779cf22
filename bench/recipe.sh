#!/usr/bin/env bash
# Draft recipe probes (issue 15, deliverable 2): the same 4,800 ShareGPT conversations (bf16 feature
# cache, layers 2,15,27), the same seed and a short equal time budget per recipe; one change at a time
# against the default. Writes bench/results/recipe/<name>.json (bench/train_draft.py's record: held-out
# figures on the 240 held-out conversations, probe curve, tokens/s) and bench/results/recipe.json (the
# table). Alone on the machine: about 6 minutes a probe. Every probe starts its midlayer at random (the default
# when the table was made) unless it says otherwise (layer-target).
#   bash bench/recipe.sh [BUDGET]       (default 5m)
# Elsewhere (another feature cache, a step budget, a subset of the probes; e.g. on a CPU without native bf16):
#   FEAT=DIR SAMPLES=N STEPS=N RESULTS=DIR ONLY="lr1e-3 layer-target" bash bench/recipe.sh
#   STEPS: --max-steps N with no time budget (equal steps, whatever the machine's speed); RESULTS: the
#   probes' records go to RESULTS/<name>.json and the table to RESULTS.json. A missing FEAT is built by the
#   first probe (not counted in its budget; recorded in its JSON).
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET=${1:-5m}
FEAT=${FEAT:-runs/features-sg2400-bf16}
SAMPLES=${SAMPLES:-4800}
RESULTS=${RESULTS:-bench/results/recipe}
LIMIT="--time-budget $BUDGET"
[ -n "${STEPS:-}" ] && LIMIT="--time-budget 0"
declare -A PROBES=(
  [default]=""
  [head-target]="--head-init target"
  [lr1e-3]="--lr 1e-3"
  [batch4]="--batch-size 4"
  [fc-norm]="--fc-norm"
  [layer-target]="--lr 1e-3 --layer-init target"  # against lr1e-3, today's default
)
ORDER=(default head-target lr1e-3 batch4 fc-norm layer-target)
[ -n "${ONLY:-}" ] && read -r -a ORDER <<< "$ONLY"
for name in "${ORDER[@]}"; do
  [ -n "${PROBES[$name]+set}" ] || { echo "bench/recipe.sh: no probe named '$name' (${!PROBES[*]})" >&2; exit 2; }
  out=$RESULTS/$name.json
  [ -f "$out" ] && { echo "have $out"; continue; }
  mkdir -p "$RESULTS"
  .venv/bin/python bench/train_draft.py --samples "$SAMPLES" --max-tokens 1024 $LIMIT --threads 2 \
    --no-eval --label "recipe-$name" --out "runs/recipe-$name" --result "$out" \
    --extra "--features-dir $FEAT --ttt 1 --restart --eval-every 1m --layer-init random ${STEPS:+--max-steps $STEPS}
      ${PROBES[$name]}"
done
.venv/bin/python bench/probe_table.py recipe "$RESULTS" "${ORDER[@]}"
