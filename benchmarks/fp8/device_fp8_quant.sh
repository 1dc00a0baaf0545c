#!/usr/bin/env bash
# One device call (issue 33): the fused per-token FP8 quantizers of the prefill (RMSNorm + quantizer for qkv / gate_up,
# SiLU-and-mul + quantizer for down_proj, lmserver.kernels.fp8_quant): their GPU tests, old vs new kernel timings at
# 4,096 rows with a launch sweep (bench_quant_kernels), then a 4k-token prefill kernel by kernel, bf16 vs FP8
# (bench_prefill_kernels).
#   bash benchmarks/fp8/device_fp8_quant.sh MODEL_DIR      (on the GPU machine, repository root; wheels in .whl;
#                                                             MODEL_DIR from benchmarks/fp8/make_model_dir.py)
# Writes under $OUT: tests.log, quant.log, quant.json, prefill.log, prefill.json.
source "$(dirname "$0")/../gpu/device_preamble.sh"
MODEL=${1:?model dir}
device_install
echo "[$((SECONDS - t0)) s] tests"
LMSYS_GPU_ONLY=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu packages/server/tests/test_fp8_kernels.py \
  -k "quantizer or fused or fp8_linear" 2>&1 | tee "$OUT/tests.log" | tail -4
echo "[$((SECONDS - t0)) s] kernels"
timeout 240 python3 benchmarks/fp8/bench_quant_kernels.py --sweep --json "$OUT/quant.json" 2>&1 \
  | tee "$OUT/quant.log" | grep -v "| fused sweep |\|| sweep " | tail -32
echo "[$((SECONDS - t0)) s] prefill"
timeout $((590 - (SECONDS - t0))) python3 benchmarks/fp8/bench_prefill_kernels.py --model-path "$MODEL" \
  --settings bf16 fp8 --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log" | tail -40
echo "[$((SECONDS - t0)) s] done"
