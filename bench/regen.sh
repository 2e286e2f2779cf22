#!/usr/bin/env bash
# Target-written answers against ShareGPT's own turns (issue 15, deliverable 2), as the draft's training data.
# Two drafts on the same layers and seed, trained for the same number of epochs over about as many tokens
# (equal feature-pass and training cost; regeneration not counted), each then scored by `elsi eval-draft` on
# Spec-Bench (teacher-forced on the target's own greedy answers: the match that sets τ at temperature 0):
#   target: SAMPLES_TARGET ShareGPT first prompts, each answered by the target (greedy, in the feature pass's
#           precision: --dtype auto; at most 256 new tokens: --regenerate --regen-turns 1);
#   own:    SAMPLES_OWN ShareGPT conversations with their own assistant turns (today's default data); pick
#           SAMPLES_OWN so that its tokens (train + held-out: the feature pass and training cost) come near the
#           target probe's (116 against 256 prompts: 93.0k and 93.2k tokens; 64k and 47k of them scored).
# Held-out figures are on each draft's own kind of data, so only the Spec-Bench figures compare the two.
# Writes RESULTS/<name>.json (bench/train_draft.py's record) and RESULTS.json (the table). Alone on the machine.
#   bash bench/regen.sh [EPOCHS]      (default 3; no time budget)
#   SAMPLES_TARGET=256 SAMPLES_OWN=116 QUESTIONS=5 RESULTS=bench/results/regen ONLY="target own" bash bench/regen.sh
#   SEED=1 RESULTS=bench/results/regen-s1 bash bench/regen.sh   (another split and initialisation, the same caches)
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${1:-3}
SAMPLES_TARGET=${SAMPLES_TARGET:-256}
SAMPLES_OWN=${SAMPLES_OWN:-116}
QUESTIONS=${QUESTIONS:-5}
RESULTS=${RESULTS:-bench/results/regen}
declare -A SAMPLES=([own]=$SAMPLES_OWN [target]=$SAMPLES_TARGET)
declare -A DATA=(
  [own]="--features-dir runs/features-sg${SAMPLES_OWN}-own"
  [target]="--features-dir runs/features-sg${SAMPLES_TARGET}-target --regenerate --regen-turns 1"
)
ORDER=(target own)
[ -n "${ONLY:-}" ] && read -r -a ORDER <<< "$ONLY"
for name in "${ORDER[@]}"; do
  [ -n "${DATA[$name]+set}" ] || { echo "bench/regen.sh: no probe named '$name' (${!DATA[*]})" >&2; exit 2; }
  out=$RESULTS/$name.json
  [ -f "$out" ] && { echo "have $out"; continue; }
  mkdir -p "$RESULTS"
  .venv/bin/python bench/train_draft.py --samples "${SAMPLES[$name]}" --max-tokens 1024 --time-budget 0 \
    --threads 2 --questions "$QUESTIONS" --label "regen-$name" --out "runs/regen-$name" --result "$out" \
    --extra "${DATA[$name]} --ttt 1 --epochs $EPOCHS --restart --eval-every 1m ${SEED:+--seed $SEED}"
done
.venv/bin/python bench/probe_table.py regen "$RESULTS" "${ORDER[@]}"
