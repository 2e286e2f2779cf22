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
.venv/bin/python - "$RESULTS" "${ORDER[@]}" <<'PY'
import json, sys
rows = []
results = sys.argv[1]
for name in sys.argv[2:]:
    r = json.load(open(f"{results}/{name}.json"))
    rows.append({"data": name, "command": r["command"], "eval_command": r["eval_command"],
                 "spec_bench_match_per_depth": r["spec_bench_match_per_depth"],
                 "spec_bench_accept_length_chain": r["spec_bench_accept_length_chain"],
                 "spec_bench_per_subtask": r["spec_bench_per_subtask"],
                 "heldout_depth1_match": r["heldout_depth1_match"], "train_tokens": r["train_tokens"],
                 "feature_tokens": r["feature_tokens"], "feature_seconds": r["feature_seconds"],
                 "train_tokens_per_s": r["train_tokens_per_s"], "steps": r["steps"], "epochs": r["epochs"],
                 "train_matmul_dtype": r["train_matmul_dtype"],
                 "probe_curve": [(c["elapsed_s"], c["match"][0]) for c in r["heldout_probe_curve"]],
                 "load_before": r["machine"]["loadavg_1_5_15_before_train"],
                 "cpu": r["machine"].get("cpu"), "cpu_bf16": r["machine"].get("cpu_bf16")})
json.dump({"command": "bash bench/regen.sh", "probes": rows}, open(f"{results}.json", "w"), indent=1)
subtasks = list(rows[0]["spec_bench_per_subtask"])
print("| data | Spec-Bench depth-1 | " + " | ".join(subtasks) + " | held-out (own kind) | train tokens | steps | epochs |")
print("|---" * (len(subtasks) + 6) + "|")
for r in rows:
    per = " | ".join(f"{r['spec_bench_per_subtask'][s]['match'][0]:.3f}" for s in subtasks)
    print(f"| {r['data']} | {r['spec_bench_match_per_depth'][0]:.4f} | {per} | {r['heldout_depth1_match']:.4f} | "
          f"{r['train_tokens']} | {r['steps']} | {r['epochs']:.2f} |")
PY
