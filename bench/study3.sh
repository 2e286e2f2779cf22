# Issue 30's powered study: bash bench/study3.sh MODEL [STUDY_DIR [OPTION...]]
#   MODEL: smollm2-135m or gemma3-270m. Paired seeds: eagle3, elsi:3 and elsi:1 get 8 (0-7), eagle2, elsi:2,
#   elsi-c:3, low-entropy:3 and uniform:3 the first 2; trained seed by seed (every set's seed 0, then seed 1,
#   ...), so a study stopped part way holds paired seeds. The pilot's recipe (bench/study3_pilot.sh: bf16 where
#   native, lr 1e-3, --layer-init auto, 1,200 steps on the same 1,200 ShareGPT conversations) with the
#   training-time test depth TTT (default 2: at this budget ttt 2 gives τ 1.787 at 60 nodes, ttt 1 1.664, on
#   all 480 questions; bench/results/README.md, "ttt 1 against ttt 2").
#   τ at temperature 0 from the exact evaluator on all 480 Spec-Bench questions for one drafted token, 30 and
#   60 nodes (depth 6, top-k 10); the target's states over the answers are computed by the first draft and
#   read by the others ($ELSI_CACHE/spec_bench_states).
#   Temperature 1 (issue 30: live decoding, on a larger subset than the 12 questions of the studies before) comes
#   after the T = 0 drafts, as the same study with live decoding added for each set's two paired seeds:
#     bash bench/study3.sh MODEL STUDY_DIR --temperature 0 1 --questions-per-subtask 3 --live-seeds 0 1
#   (18 questions, 3 per subtask, at ≤ 128 tokens on 16 drafts; ~20 minutes per Gemma-3 draft:
#   bench/results/t1_cost_gemma3-270m.json). It trains and evaluates nothing again, but needs the drafts' weights;
#   where they are gone (records kept, another machine), bench/study3_t1.sh retrains seeds 0-1 for temperature 1.
#   Resumable across interruptions and machines of the same precision: rerun the same command. Finished drafts
#   travel without their weights: `PARTIAL=1 bash bench/study_results.sh MODEL STUDY_DIR bench/results/study3-MODEL`
#   keeps their records (plan, training.json, exact τ), and this script copies them back into a STUDY_DIR that has
#   no plan.json yet, so a new machine trains only the drafts still missing.
set -e
MODEL=${1:?usage: bash bench/study3.sh MODEL [STUDY_DIR [OPTION...]]}
OUT=${2:-runs/study3-$MODEL}
export HF_HUB_OFFLINE=1
ARGS=(--model "$MODEL" --data sharegpt --run runs/$MODEL --out "$OUT" --features-dir runs/features-study3-$MODEL
  --sets eagle3 elsi:3 elsi:1 eagle2 elsi:2 elsi-c:3 low-entropy:3 uniform:3 --seeds 0 1 2 3 4 5 6 7
  --multi-seed-sets eagle3 elsi:3 elsi:1 --other-seeds 2 --train-budget 0 --max-steps 1200 --samples 1200
  --ttt "${TTT:-2}" --temperature 0 --tree-nodes 1 30 60 --exact-questions-per-subtask 80 --threads 2 "${@:3}")
KEPT=${KEPT:-bench/results/study3-$MODEL}  # the kept records it goes on from (bench/study3_t1.sh: its own)
if [ ! -f "$OUT/plan.json" ] && [ -f "$KEPT/plan.json" ]; then
  mkdir -p "$OUT" && cp -r "$KEPT"/. "$OUT"/ && rm -rf "$OUT/PARTIAL.txt" "$OUT/answers"
  echo "$OUT: went on from the records in $KEPT"
fi
# the target's answers the kept drafts were measured on (bench/study_results.sh): the same reference for every
# draft, and not made again; a machine where they would be keyed otherwise (another model path) makes its own
ANSWERS=${ELSI_CACHE:-$HOME/.cache/elsi}/spec_bench_answers
for f in "$KEPT"/answers/*.json.gz; do
  [ -f "$f" ] || continue
  to=$ANSWERS/$(basename "$f" .gz)
  [ -f "$to" ] || { mkdir -p "$ANSWERS" && gunzip -c "$f" > "$to.part" && mv "$to.part" "$to" && echo "$to: from $f"; }
done
.venv/bin/elsi study "${ARGS[@]}" --check
[ -f runs/$MODEL/analysis.json ] || .venv/bin/elsi analyze --model "$MODEL" --out runs/$MODEL --threads 2
.venv/bin/elsi study "${ARGS[@]}"
