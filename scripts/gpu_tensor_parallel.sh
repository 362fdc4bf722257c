#!/usr/bin/env bash
# Tensor parallel on GPUs over NCCL, for when a GPU machine is lent (not run by the suite).
#
#   bash scripts/gpu_tensor_parallel.sh            # 1 GPU, then every GPU of the machine
#   N=2 SOURCE=/path/model.gguf bash scripts/gpu_tensor_parallel.sh
#
# For 1 and N devices: the largest logit difference from one process (--check loads the whole
# model once on each rank, so keep SOURCE small), each rank's parameter bytes, prefill and
# decode times, and one all-reduce's time. Results go to $OUT (or /tmp) as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python}
SOURCE=${SOURCE:-smollm2-135m-instruct}
N=${N:-$(nvidia-smi -L | wc -l)}
OUT=${OUT:-/tmp}
nvidia-smi -L
for ranks in $(printf '1\n%s\n' "$N" | sort -nu); do
  timeout 300 "$PY" -m torch.distributed.run --nproc-per-node "$ranks" \
    benchmarks/tensor_parallel.py --device cuda --source "$SOURCE" --tokens 512 --decode 32 \
    --check --out "$OUT/tp-cuda-$ranks.json"
done
