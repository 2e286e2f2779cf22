# The study of bench/results/study-smollm2 (issue 7): SmolLM2-135M, 2 CPU cores, 76 minutes.
# Features: the cache of bench/train_draft.py (384 target-written answers); see bench/results/README.md.
set -e
HF_HUB_OFFLINE=1 .venv/bin/elsi study --model smollm2-135m --data sharegpt --run runs/smollm2-135m --out runs/study-smollm2 \
  --sets eagle2 eagle3 elsi:1 elsi:3 elsi-c:3 low-entropy:3 --seeds 0 1 --multi-seed-sets eagle3 elsi:3 \
  --train-budget 6m --questions-per-subtask 4 --max-new-tokens 96 --temperature 0 --tree-nodes 16 --depth 5 --top-k 4 \
  --samples 384 --max-tokens 512 --regenerate --regen-turns 1 --features-dir runs/features-smollm2-regen1 \
  --ttt 3 --head-init target --exact-questions-per-subtask 0 --threads 2
