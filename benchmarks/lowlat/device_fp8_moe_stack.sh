#!/usr/bin/env bash
# One device call (issue 33, FP8 MoE in the lowlat nvidia plugin): the FP8 MoE GPU cases (Mixtral-8x7B layer: expert
# kernels against float64 at 1-8 tokens, activations up to ~8e5, the stack against the reference layer at 1 and 8 rows)
# and the bf16 MoE cases (the expert dispatch changed), then bench_moe_stack.py: an 8-layer Mixtral-shaped stack, bf16
# vs FP8 weights (bf16 and FP8 KV) at 1, 2, 4, 8 tokens, checked first (a mismatch stops it, exit 1), plus an
# alternative FP8 expert tiling (fp8w#0), the row-wise slot kernels at one token (fp8w#1), the rows cast to fp16 once
# (fp8w rows16), the FP8 stack with early PDL release, and per-kernel times of the bf16 / FP8 stacks at one token.
# lowlat only (no server); from the repository root on the GPU machine:
#   bash benchmarks/lowlat/device_fp8_moe_stack.sh        (writes tests.log, bench.log, moe_stack.json under $OUT)
OUT_DEFAULT=/tmp/fp8_moe_out
source "$(dirname "$0")/../gpu/device_preamble.sh"
export PYTHONPATH=packages/lowlat/src
mkdir -p "$OUT"
gpu_clocks utilization.gpu
echo "[$((SECONDS - t0)) s] GPU tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider packages/lowlat/tests/fp8_moe_cases.py \
  packages/lowlat/tests/moe_cases.py 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|FAILED|Error|^E " | tail -12
echo "[$((SECONDS - t0)) s] bench"
left=$((240 - (SECONDS - t0))); [ "$left" -lt 120 ] && left=120
timeout "$left" python3 benchmarks/lowlat/bench_moe_stack.py --layers 8 --batches 1,2,4,8 \
  --expert-configs up=mrow_f16s:64:128:4:4,down=mrow_f16s:64:256:4:3 \
  --rows-at-one --rows-f16 --pdl-releases early --profile \
  --json "$OUT/moe_stack.json" 2>&1 | tee "$OUT/bench.log" | tail -80
echo "[$((SECONDS - t0)) s] done"
