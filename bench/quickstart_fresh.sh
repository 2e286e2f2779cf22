#!/bin/bash
# The README's install and quickstart on a fresh clone of this checkout, timed (issue 33): bash bench/quickstart_fresh.sh [REV]
# Clones into /tmp/fresh with its own cache (/tmp/fresh-cache); run alone. Result: bench/results/quickstart_fresh.json.
set -e
REV=${1:-HEAD}
rm -rf /tmp/fresh /tmp/fresh-cache
git clone -q "$(git rev-parse --show-toplevel)" /tmp/fresh && cd /tmp/fresh && git checkout -q "$REV"
export ELSI_CACHE=/tmp/fresh-cache HF_HUB_OFFLINE=1
t() { local s=$(date +%s); echo "== $*"; "$@"; echo "== $(( $(date +%s) - s )) s: $*"; }
t make setup
source .venv/bin/activate
t elsi analyze --out runs/smollm2-135m
t elsi select --run runs/smollm2-135m --method all
t elsi report runs/smollm2-135m
t elsi export --layers chosen --run runs/smollm2-135m --format sglang
L=$(python -c "import json; print(','.join(map(str, json.load(open('runs/smollm2-135m/selections.json'))['chosen']['layers'])))")
echo "chosen: $L (README says 5,18,27)"
t elsi train-draft --layers $L --samples 200 --time-budget 5m --out runs/draft
t elsi bench --draft runs/draft --questions-per-subtask 2 --max-new-tokens 64 --tree-nodes 1 --depth 1 --top-k 1
ls runs/smollm2-135m/report
