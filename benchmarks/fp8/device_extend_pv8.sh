#!/usr/bin/env bash
# One device call (issue 33, and short prompts' time to first token): the two opt-in paths built on 2026-12-04 and
# never run on a GPU, checked then timed, each against the path it would replace in the same process:
#   tests    their GPU tests, output kept whole (tests.log): graph extends (test_cuda_graph.py) and the fresh prompt's
#            e4m3 P v (test_fp8_kernels.py)
#   extend   short extends in the decode CUDA graphs vs eagerly (bench_short_extend.py: graphs / eager / graphs)
#   pv8      the extend kernel with e4m3 P v vs bf16 P v vs cuDNN at 4,096 tokens (bench_prefill_attention.py), then
#            the engine's 4k prefill, fp8-default vs fp8-default+pv8 vs bf16-default (bench_prefill_kernels.py)
#   bash benchmarks/fp8/device_extend_pv8.sh MODEL_DIR    (on the GPU machine, repository root; wheels in .whl;
#                                                           MODEL_DIR from benchmarks/fp8/make_model_dir.py)
# PHASES (comma list, default all three) picks phases. Writes under $OUT: tests.log, extend.txt, attention.log,
# prefill.log, prefill.json.
PHASES_DEFAULT=tests,extend,pv8
source "$(dirname "$0")/../gpu/device_preamble.sh"
MODEL=${1:?model dir}
device_install
gpu_clocks
if has tests; then
  echo "[$((SECONDS - t0)) s] tests"
  LMSYS_GPU_ONLY=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
    -k "graph_extends or graph_verify or fp8_pv or gives_back" \
    packages/server/tests/test_cuda_graph.py packages/server/tests/test_fp8_kernels.py > "$OUT/tests.log" 2>&1
  tail -4 "$OUT/tests.log"
fi
if has extend; then
  echo "[$((SECONDS - t0)) s] extend"
  timeout 240 python3 benchmarks/engine/bench_short_extend.py --model-path "$MODEL" --settings fp8-default \
    bf16-default --out "$OUT/extend.txt" 2>&1 | grep -v "^INFO" | tail -14
fi
if has pv8; then
  echo "[$((SECONDS - t0)) s] attention"
  timeout 120 python3 benchmarks/kernels/bench_prefill_attention.py --lens 4096 2048,2048 --variants \
    "triton 64x64 w4 s3 heavy-first (default)" "triton e4m3 P v (FP8 cache)" "triton e4m3 P v 128x64 w8" \
    "sdpa cudnn gqa" 2>&1 | tee "$OUT/attention.log" | tail -12
  echo "[$((SECONDS - t0)) s] prefill"
  timeout $((590 - (SECONDS - t0))) python3 benchmarks/fp8/bench_prefill_kernels.py --model-path "$MODEL" \
    --settings fp8-default fp8-default+pv8 bf16-default --reps 3 --top 8 --json "$OUT/prefill.json" 2>&1 \
    | tee "$OUT/prefill.log" | grep -v "^INFO" | grep "===\|extend\|idle\|span"
fi
echo "[$((SECONDS - t0)) s] done"
