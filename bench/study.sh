# The study of issue 16 on one model family: bash bench/study.sh MODEL [STUDY_DIR [OPTION...]]
#   MODEL: smollm2-135m or gemma3-270m. Results: STUDY_DIR (default runs/study2-MODEL), copied to
#   bench/results/study2-MODEL/ when complete. Resumable: rerun the same command after an interruption.
#   OPTION...: further `elsi study` options (e.g. --compile off: a feature cache begun uncompiled stays so).
# Budget for 2 CPU cores (see README "Results of the study"): drafts of the default recipe (bf16, lr 1e-3,
# ttt 1, max 1,024 tokens) for 1,200 steps each (about 5 minutes here; a step budget, not a time budget, so
# that the load on the machine cannot favour one set) on 1,200 ShareGPT conversations (such a draft sees under
# one epoch of them: the default 4,800 would change nothing but the disk: 11 layers x 13.8 KB/token);
# eight sets, three seeds for eagle3 and elsi:3; the paper's grid (temperature 0 and 1, 30 and 60 tree
# nodes) and this machine's best tree (one drafted token); random-initialised midlayers (--layer-init random: the
# committed studies' drafts predate the default auto, which starts a Llama target's draft from its last layer);
# 2 questions per subtask, 48 new tokens; vLLM serves
# the eagle3 and elsi:3 drafts as chains of one token (make vllm first; SmolLM2 only, see below).
set -e
MODEL=${1:?usage: bash bench/study.sh MODEL [STUDY_DIR]}
OUT=${2:-runs/study2-$MODEL}
export HF_HUB_OFFLINE=1
# vLLM serves the eagle3 and elsi:3 drafts of SmolLM2. Gemma-3 targets it serves too since elsi adds EAGLE-3 to
# vLLM's Gemma3ForCausalLM (elsi/engines/vllm_models.py), but the committed Gemma-3 study's drafts were trained
# on other machines without keeping their weights: bench/study_vllm.sh trains them again on this study's feature
# cache and runs their vLLM step in a study of its own (runs/study2-gemma3-270m-vllm)
VLLM="--vllm-sets eagle3 elsi:3 --vllm-spec-tokens 1"
[ "$MODEL" = gemma3-270m ] && VLLM=""
ARGS=(--model "$MODEL" --data sharegpt --run runs/$MODEL --out "$OUT"
  --sets eagle2 eagle3 elsi:1 elsi:2 elsi:3 elsi-c:3 low-entropy:3 uniform:3
  --seeds 0 1 2 --multi-seed-sets eagle3 elsi:3 --train-budget 0 --max-steps 1200 --samples 1200 --layer-init random
  --exact-questions-per-subtask 0
  --questions-per-subtask 2 --max-new-tokens 48 --temperature 0 1 --tree-nodes 1 30 60
  $VLLM --threads 2 "${@:3}")
# a resumed study that cannot go on here (other settings; drafts trained in a precision this CPU would not use:
# the committed ones are bf16, from an AMX CPU) fails now, not after the analysis (~25 min in float32 for gemma3-270m)
.venv/bin/elsi study "${ARGS[@]}" --check
# the analysis the sets are selected on (the main job; a finished run is reused)
[ -f runs/$MODEL/analysis.json ] || .venv/bin/elsi analyze --model "$MODEL" --out runs/$MODEL --threads 2
.venv/bin/elsi study "${ARGS[@]}"
