# Copy a finished study's results (not its features or weights) into bench/results:
#   bash bench/study_results.sh MODEL [STUDY_DIR [DEST]]   (STUDY_DIR default runs/study2-MODEL, as bench/study.sh;
#   DEST default bench/results/study2-MODEL)
# PARTIAL=1 copies an unfinished study's finished drafts (plan, benchmarks, training records, the target's answers
# their exact τ was computed on) with their summary so far (so-far.md) and lists what is left in PARTIAL.txt;
# copied back into STUDY_DIR, they let `bash bench/study.sh MODEL` go on from there on another machine
# (it rebuilds the feature cache, then trains and benchmarks only the missing drafts);
# bench/study3.sh copies them back itself.
set -e
MODEL=${1:?usage: bash bench/study_results.sh MODEL [STUDY_DIR [DEST]]}
OUT=${2:-runs/study2-$MODEL}
DEST=${3:-bench/results/study2-$MODEL}
if [ ! -f "$OUT/study.json" ] && [ "${PARTIAL:-0}" != 1 ]; then
  echo "$OUT has no study.json: run bash bench/study.sh $MODEL first (or PARTIAL=1 for its finished drafts)" >&2; exit 2
fi
# an unfinished study: its finished drafts' summary so far (so-far.json, so-far.md; elsi study --so-far)
if [ ! -f "$OUT/study.json" ]; then .venv/bin/elsi study --out "$OUT" --so-far >/dev/null || true; fi
rm -rf "$DEST" && mkdir -p "$DEST/drafts"
cp "$OUT/plan.json" "$DEST/"
# a finished study's summary, or an unfinished one's so far (never both: so-far.md of a finished study is stale)
if [ -f "$OUT/study.json" ]; then KEEP="study.json study.md"; else KEEP="so-far.json so-far.md"; fi
for f in $KEEP; do [ -f "$OUT/$f" ] && cp "$OUT/$f" "$DEST/"; done
cp -r "$OUT/bench" "$DEST/"
[ -d "$OUT/vllm" ] && cp -r "$OUT/vllm" "$DEST/"
[ -d "$OUT/exact" ] && cp -r "$OUT/exact" "$DEST/"
[ -d "$OUT/report" ] && cp -r "$OUT/report" "$DEST/"
# finished results only: a benchmark still running keeps its questions so far in <record>.progress (for that machine
# to go on from), not a record
find "$DEST" -name "*.progress" -delete
: > "$DEST/.left"
# finished: trained, with every result the plan asks of it (a live benchmark where it decodes that seed live, the
# exact τ where the plan has it: elsi.study.sofar.finished_drafts); a draft record without them would need the
# weights, which are not copied
.venv/bin/python - "$OUT" "$DEST" <<'PY'
import shutil, sys
from pathlib import Path
from elsi.study.plan import load_plan
from elsi.study.run import draft_dir
from elsi.study.sofar import finished_drafts
out, dest = sys.argv[1:]
plan = load_plan(out)
done = finished_drafts(out, plan)[0]
kept = {draft_dir(out, s, sd).name for s, sd in plan.drafts if (s.name, sd) in done}
for d in sorted(Path(out, "drafts").glob("*/")):
    if d.name in kept:
        (Path(dest) / "drafts" / d.name).mkdir(parents=True)
        for f in ("training.json", "config.json"):
            shutil.copy(d / f, Path(dest) / "drafts" / d.name / f)
    else:
        with open(Path(dest) / ".left", "a") as left:
            left.write(f"draft {d.name}: not benchmarked yet (redone from the start)\n")
PY
# what the drafts trained on (not the features themselves): the study's cache, or the one --features-dir named
FEAT=$OUT/features
[ -f "$FEAT/features.json" ] || FEAT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["data"]["features_dir"])' \
  "$(ls "$OUT"/drafts/*/training.json | head -1)")
cp "$FEAT/features.json" "$DEST/features.json"
# the target's greedy answers the exact τ was computed on (gzipped, as the cache names them): a machine that goes on
# from here measures its drafts on the same answers and skips making them (bench/study3.sh puts them back)
if [ -d "$OUT/exact" ]; then
  .venv/bin/python - "$OUT" "$DEST" <<'PY'
import glob, gzip, json, os, shutil, sys
from elsi.models.load import cache_dir
from elsi.specbench.answers import answers_digest
out, dest = sys.argv[1:]
want = {json.load(open(f)).get("answers_digest") for f in glob.glob(f"{out}/exact/*.json")} - {None}
for f in sorted(glob.glob(str(cache_dir() / "spec_bench_answers" / "*.json"))):
    digest = answers_digest(json.load(open(f))["answers"])
    if digest in want:
        os.makedirs(f"{dest}/answers", exist_ok=True)
        to = f"{dest}/answers/{os.path.basename(f)}.gz"
        with open(f, "rb") as src, open(to, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as dst:
            shutil.copyfileobj(src, dst)
        print(f"the answers {digest}: {to}")
PY
fi
if [ ! -f "$OUT/study.json" ]; then
  { echo "Unfinished study ($(date -u +%F)): finished drafts and benchmarks only; to go on, copy this folder"
    echo "to $OUT and run the study's command again (bench/study.sh, bench/study3.sh)"; cat "$DEST/.left"
    echo "drafts done: $(ls "$DEST/drafts" | tr '\n' ' ')"; } > "$DEST/PARTIAL.txt"
fi
rm -f "$DEST/.left"
du -sh "$DEST"
