#!/usr/bin/env bash
# One device call (issue 33, "Mixtral-shape FP8 decode >= 1.7x bf16 at batch 1"): FP8 (e4m3) MoE experts in the fused
# MoE kernels. Phases (PHASES, comma list; default tests,kernels,serve):
#   tests:   the GPU tests of the FP8 experts (kernels against the dequantized float64 reference at Mixtral's shape,
#            per-row and 128 x 128 block scales, rows beyond fp16's range, the layer in a CUDA graph) and of the bf16
#            fused MoE (unchanged path); an FP8 Mixtral through the model (fused vs torch path) and the engine (CUDA
#            graphs vs eager);
#   kernels: bench_fp8_moe.py, bf16 vs FP8 fused_moe (per-row; 128 x 128 blocks too) at Mixtral-8x7B's layer,
#            1-4,096 tokens (checked first),
#            then the FP8 launch sweep (SWEEP_S seconds, 0: none);
#   serve:   bench_fp8_serving.py on MODEL_DIR (the 8-layer Mixtral shape, dummy weights), bf16-default vs
#            fp8-default (`--quantization fp8 --kv-cache-dtype fp8_e4m3`, server defaults otherwise) at c=1 and 8
#            (decode graphs up to GRAPH_BS rows, 8 by default as in the earlier FP8 rows: shorter start-up).
#   bash benchmarks/fp8/device_fp8_moe.sh MODEL_DIR      (on the GPU machine, repository root; wheels in .whl;
#        MODEL_DIR: `python benchmarks/fp8/make_model_dir.py DIR --shape mixtral-8x7b-8l`, carried with the call)
# Writes under $OUT: tests.log, moe.log, moe.json, serving.log, serving.json. About 8 minutes; if the serve phase runs
# out of the call's 10 minutes, run it alone next (PHASES=serve).
PHASES_DEFAULT=tests,kernels,serve
MODEL=${1:?model dir}
SWEEP_S=${SWEEP_S:-120}
source "$(dirname "$0")/../gpu/device_preamble.sh"
device_install
gpu_clocks
if has tests; then
  echo "[$((SECONDS - t0)) s] tests"
  LMSYS_GPU_ONLY=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
    packages/server/tests/test_fp8_moe_kernels.py packages/server/tests/test_fp8_moe.py packages/server/tests/test_moe_layer.py \
    packages/server/tests/test_kernels_triton.py -k "moe" 2>&1 | tee "$OUT/tests.log" | tail -6
fi
if has kernels; then
  echo "[$((SECONDS - t0)) s] kernels"
  sweep=(); [[ "$SWEEP_S" != 0 ]] && sweep=(--sweep --sweep-budget-s "$SWEEP_S")
  timeout $((SWEEP_S + 180)) python3 benchmarks/fp8/bench_fp8_moe.py --tokens 1,2,4,8,16,64,4096 --blocks "${sweep[@]}" \
    --json "$OUT/moe.json" 2>&1 | tee "$OUT/moe.log" | grep -v "^  " | tail -24
fi
if has serve; then
  echo "[$((SECONDS - t0)) s] serve"
  timeout $((590 - (SECONDS - t0))) python3 benchmarks/fp8/bench_fp8_serving.py --model-path "$MODEL" \
    --server-args "--load-format dummy --dtype bfloat16 --device cuda --context-length 8192 --cuda-graph-max-bs ${GRAPH_BS:-8}" \
    --settings bf16-default fp8-default --concurrency 1 8 --rounds 2 --input-len 512 --output-len 256 \
    --prefill-requests 2 --json "$OUT/serving.json" 2>&1 | tee "$OUT/serving.log" | grep -v "^  " | tail -8
fi
echo "[$((SECONDS - t0)) s] done"
