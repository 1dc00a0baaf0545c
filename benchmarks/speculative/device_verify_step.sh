#!/usr/bin/env bash
# One device call for issue 34's verify step (see bench_verify_step.py): install, the GPU kernel cases of the
# attention and verify paths against their oracles, then attention alone and the verify step, old vs new vs generic.
#   bash benchmarks/speculative/device_verify_step.sh MODEL_DIR OUT_DIR [settings...]
set -uo pipefail
cd "$(dirname "$0")/../.."
model=$1; out=$2; shift 2
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$out/gpu.txt"
bash benchmarks/gpu/device_setup.sh install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
timeout 150 python3 -m pytest -q -p no:cacheprovider packages/lowlat/tests/kernel_cases.py \
  -k "rows_attention or verify_rows or layer_matches or split_kv" 2>&1 | tail -15 | tee "$out/gpu_cases.txt"
python3 benchmarks/speculative/bench_verify_step.py --model-path "$model" --json "$out/verify_step.json" \
  ${1:+--settings "$@"} 2>&1 | tee "$out/verify_step.log" | grep -v "^\s*$" | tail -120
