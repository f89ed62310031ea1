#!/usr/bin/env bash
# GPU smoke check: a few GRPO steps of a randomly initialised ~0.5B-parameter model with sdpa and,
# when the flash-attn package is installed (pip install -e '.[gpu]'), flash_attention_2; prints
# rollout/update tokens per second and peak GPU memory, and writes benchmarks/results/gpu_smoke.json.
#
#   bash benchmarks/gpu_smoke.sh                 # on a GPU machine
#   SIZE=tiny bash benchmarks/gpu_smoke.sh       # the same code path on a CPU, in seconds
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
SIZE="${SIZE:-0.5b}"
STEPS="${STEPS:-4}"
EXTRA=()
if [ "$SIZE" = "tiny" ]; then  # small shapes so a CPU finishes quickly
  EXTRA=(--tasks 2 --group-size 2 --sentences 2 --memory-tokens 8 --answer-tokens 8)
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
"$PYTHON" benchmarks/gpu_smoke.py --size "$SIZE" --steps "$STEPS" --attn sdpa flash_attention_2 \
  --out "benchmarks/results/gpu_smoke_${SIZE}.json" "${EXTRA[@]}" "$@"
