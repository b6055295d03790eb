#!/bin/bash
# The checks a CUDA machine adds to `make test`: the tests marked gpu, then kvinfer against transformers on
# random weights of a real shape (--load-format dummy, so nothing has to be downloaded). Run from the repository
# root with a CUDA build of torch and kvinfer's dependencies importable (PYTHONPATH or an installed venv);
# logs go to $OUT (default ./gpu-check-out). Each step has its own time limit, and one failing does not stop
# the next. Usage: scripts/gpu_check.sh [preset, default llama-3-8b]
set -u
MODEL=${1:-llama-3-8b}
OUT=${OUT:-gpu-check-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
K="$PY -m kvinfer.cli"
{ date -u; nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.is_available())"; } 2>&1 | tee "$OUT/env.log"
echo "== tests marked gpu, and the benchmarks' transformers peer on the GPU"
{ timeout 300 $PY -m pytest -q -p no:cacheprovider -rs -m gpu tests
  timeout 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_bench.py; } 2>&1 | tee "$OUT/tests.log" | tail -30
echo "== bench exact on the GPU (bitwise identical to alone: not promised on CUDA, measured)"
timeout 180 $K bench exact --load-format dummy --model smollm2-135m --prompts 8 --tokens 32 2>&1 | tail -16 | tee "$OUT/exact.log"
echo "== bench decode, $MODEL, vs transformers"
timeout 300 $K bench decode --load-format dummy --model "$MODEL" --tokens 128 --prompt-tokens 512 --rounds 2 \
    --kv-cache-memory 4GiB 2>&1 | tail -12 | tee "$OUT/decode.log"
echo "== bench throughput, $MODEL, vs transformers (static batches)"
timeout 400 $K bench throughput --load-format dummy --model "$MODEL" --num-requests 64 --kv-cache-memory 16GiB 2>&1 \
    | tail -22 | tee "$OUT/throughput.log"
date -u
