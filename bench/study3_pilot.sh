# The pilot of issue 30's powered study: bash bench/study3_pilot.sh MODEL [STUDY_DIR [OPTION...]]
#   MODEL: smollm2-135m or gemma3-270m. Two paired seeds of eagle3, elsi:3 and elsi:1 on the study's recipe
#   (bf16 where native, lr 1e-3, ttt 1, --layer-init auto, 1,200 steps on the same 1,200 ShareGPT conversations),
#   τ at temperature 0 from the exact evaluator for one drafted token, 30 and 60 nodes (depth 6, top-k 10),
#   on 20 Spec-Bench questions per subtask (120 of 480: its answers are read from the cached 480 when they exist).
#   It measures the width of the Δ% interval over paired seeds and questions, from which rule 5 of
#   elsi/study/compare.py was written and the full study's seeds are sized (study.json: seeds_needed).
#   Resumable: rerun the same command after an interruption. OPTION...: more `elsi study` options.
set -e
MODEL=${1:?usage: bash bench/study3_pilot.sh MODEL [STUDY_DIR]}
OUT=${2:-runs/study3-pilot-$MODEL}
export HF_HUB_OFFLINE=1
ARGS=(--model "$MODEL" --data sharegpt --run runs/$MODEL --out "$OUT"
  --sets eagle3 elsi:3 elsi:1 --seeds 0 1 --train-budget 0 --max-steps 1200 --samples 1200
  --temperature 0 --tree-nodes 1 30 60 --exact-questions-per-subtask 20 --threads 2 "${@:3}")
.venv/bin/elsi study "${ARGS[@]}" --check
[ -f runs/$MODEL/analysis.json ] || .venv/bin/elsi analyze --model "$MODEL" --out runs/$MODEL --threads 2
.venv/bin/elsi study "${ARGS[@]}"
