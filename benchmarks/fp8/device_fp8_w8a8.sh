#!/usr/bin/env bash
# One device call (issues 33, 34): the W8A8 multi-row GEMV kernels (mrow_w8a8 / mrow_w8a8b) checked on the GPU, then
# timed next to the FP8 table's row-wise and mrow_f16s entries, cuBLAS (bf16 weights) and torch._scaled_mm (W8A8
# GEMM) at 8 rows first, then 1, 16, 4, 2, 6 (benchmarks/fp8/w8a8_sweep.py: the first W8A8 candidate of each stage at
# every row count, the others at 8). No model dir; about 4-5 minutes; nothing in the tables changes.
#   bash benchmarks/fp8/device_fp8_w8a8.sh      (on the GPU machine, repository root; wheels in .whl)
# Writes under $OUT: check.log, gemv.log, gemv.json.
source "$(dirname "$0")/../gpu/device_preamble.sh"
device_install
gpu_clocks
echo "[$((SECONDS - t0)) s] checks (w8a8_cases.py: CPU cases + the 8B stages)"
timeout "${CHECK_S:-130}" python3 -m pytest -q -p no:cacheprovider packages/lowlat/tests/w8a8_cases.py 2>&1 \
  | tee "$OUT/check.log" | grep -E "passed|failed|FAILED|Error" | tail -12
echo "[$((SECONDS - t0)) s] gemv"
CONFIGS=${CONFIGS:-$(python3 benchmarks/fp8/w8a8_sweep.py)}
timeout "${GEMV_S:-160}" python3 benchmarks/lowlat/bench_gemv.py --fp8 --layers 16 --iters 10 \
  --batches "${BATCHES:-8,1,16,4,2,6}" --stages qkv,o_proj,gate_up,down --budget-s $(( ${GEMV_S:-160} - 10 )) \
  --configs "$CONFIGS" --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.log" | grep -E "^ *[0-9]+ +(qkv|o_proj|gate_up|down) |WRONG|skip|budget|best us" | tail -40
echo "[$((SECONDS - t0)) s] done"
