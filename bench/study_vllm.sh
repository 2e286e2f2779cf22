# Deliverable 3 of issue 16 for a study whose draft weights were not kept (Gemma-3's: only records are committed):
#   bash bench/study_vllm.sh MODEL [STUDY_DIR [FEATURES_DIR]]
# trains the eagle3 and elsi:3 drafts again (seeds 0 1 2, bench/study.sh's recipe and budget, on the feature cache
# FEATURES_DIR, default runs/study2-MODEL/features: that study's cache, reused rather than rebuilt), benchmarks each
# in elsi's engine at this machine's best small tree only (one drafted token, temperature 0), then has vLLM serve
# each as a chain of one token next to elsi's chain on the same questions (make vllm first). Results: STUDY_DIR
# (default runs/study2-MODEL-vllm); copy them with bash bench/study_results.sh MODEL STUDY_DIR bench/results/study2-MODEL-vllm.
# Without that cache (a fresh machine), the study builds one of its own in FEATURES_DIR: the same 1,200
# conversations and precision, only these sets' layers (gemma3-270m: 53 min on an AVX512-BF16 EPYC; 600 conversations took 41 min on an AVX512-BF16 Xeon).
# SAMPLES (default 1200, the study's): the conversations of a cache built here; fewer make a quicker feature pass
# (the drafts then differ from the study's recipe in their data; the engines' comparison is on the same drafts either way).
# SEEDS (default "0 1 2"): the seeds of both sets; seeds may be added later to a finished study (its drafts are kept).
# Resumable: rerun the same command after an interruption. bench/study.sh's recipe and budget, with its sets,
# seeds, conditions and vLLM step overridden (a repeated option: the last one counts).
set -e
MODEL=${1:?usage: bash bench/study_vllm.sh MODEL [STUDY_DIR [FEATURES_DIR]]}
OUT=${2:-runs/study2-$MODEL-vllm}
FEAT=${3:-runs/study2-$MODEL/features}
SEEDS=(${SEEDS:-0 1 2})
[ -f "$FEAT/features.json" ] || echo "no feature cache in $FEAT: the study builds one there for its own layers" >&2
bash "$(dirname "$0")/study.sh" "$MODEL" "$OUT" --features-dir "$FEAT" --sets eagle3 elsi:3 --seeds "${SEEDS[@]}" \
  --samples "${SAMPLES:-1200}" --temperature 0 --tree-nodes 1 --vllm-sets eagle3 elsi:3 --vllm-spec-tokens 1
