# Issue 30's powered study at temperature 1, where the T = 0 study's drafts have no weights any more (its records
# travel without them: bench/study_results.sh): bash bench/study3_t1.sh MODEL [STUDY_DIR [OPTION...]]
#   The same plan as bench/study3.sh (its sets, recipe, feature cache and data) for seeds 0 and 1 of every set,
#   retrained, each decoded live at temperature 1 on 3 questions per subtask (18, both mt_bench turns) at ≤ 128 new
#   tokens with one drafted token, 30 and 60 nodes; no exact τ (temperature 0 is the T = 0 study's). Seed s is
#   trained as the T = 0 study's seed s was (same initialisation, data order and precision), so the T = 1 drafts
#   are those drafts again up to the machine's rounding. Where the T = 0 study trained in bf16 and this CPU has no
#   native bf16 (AVX2 only: emulated, ~5x slower), pass --dtype float32 --train-dtype float32 (then on every machine
#   that resumes it; the study refuses a mix): the same recipe in float32, not those drafts again. SmolLM2-135M's
#   T = 1 study runs so (bench/results/README.md).
#   Resumable as bench/study3.sh; records kept with
#   `PARTIAL=1 bash bench/study_results.sh MODEL STUDY_DIR bench/results/study3-t1-MODEL` and taken up from there.
#   Cost on two cores: a Gemma-3 draft ~7-14 min training + ~31 min decoding (bench/results/README.md), plus the
#   baseline (plain decoding and transformers generate on the same questions, ~10 min) once per machine.
set -e
MODEL=${1:?usage: bash bench/study3_t1.sh MODEL [STUDY_DIR [OPTION...]]}
OUT=${2:-runs/study3-t1-$MODEL}
KEPT=bench/results/study3-t1-$MODEL exec bash "$(dirname "$0")/study3.sh" "$MODEL" "$OUT" --seeds 0 1 \
  --temperature 1 --exact-questions-per-subtask 0 --questions-per-subtask 3 "${@:3}"
