# Copy a finished study's results (not its features or weights) into bench/results:
#   bash bench/study_results.sh MODEL [STUDY_DIR]   (STUDY_DIR default runs/study2-MODEL, as bench/study.sh)
set -e
MODEL=${1:?usage: bash bench/study_results.sh MODEL [STUDY_DIR]}
OUT=${2:-runs/study2-$MODEL}
DEST=bench/results/study2-$MODEL
[ -f "$OUT/study.json" ] || { echo "$OUT has no study.json: run bash bench/study.sh $MODEL first" >&2; exit 2; }
rm -rf "$DEST" && mkdir -p "$DEST/drafts"
cp "$OUT/plan.json" "$OUT/study.json" "$OUT/study.md" "$DEST/"
cp -r "$OUT/bench" "$DEST/"
[ -d "$OUT/vllm" ] && cp -r "$OUT/vllm" "$DEST/"
[ -d "$OUT/report" ] && cp -r "$OUT/report" "$DEST/"
for d in "$OUT"/drafts/*/; do
  name=$(basename "$d"); mkdir -p "$DEST/drafts/$name"
  cp "$d/training.json" "$d/config.json" "$DEST/drafts/$name/"
done
cp "$OUT/features/features.json" "$DEST/features.json"  # what the drafts trained on (not the features themselves)
du -sh "$DEST"
