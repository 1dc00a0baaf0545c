#!/usr/bin/env bash
# One device call (issue 33): the opt-in FP8 LM head (`--quantize-lm-head`). Phases (PHASES, comma list; default
# tests,kernels,serve):
#   tests:   the GPU tests of test_fp8_lm_head.py (the FP8 head's GEMV at the 8B / Mixtral / SmolLM2 head shapes at 1,
#            8, 16 rows and `_scaled_mm` at 40 against the dequantized float64 reference; a tiny tied model through
#            the engine in CUDA graphs, greedy = its dequantized twin) and test_fp8_kernels.py's FP8 linear paths;
#   kernels: bench_lm_head.py: bf16 cuBLAS vs the FP8 head at 1-32 rows (CUDA-graph replays), checked first;
#            SWEEP=1 adds the GEMV tile sweep (TUNED entries for the head shapes);
#   serve:   bench_fp8_serving.py, bf16-default / fp8-default / fp8-default+lmhead at c=1 and 8 (decode graphs up to
#            GRAPH_BS rows, 8 by default as the earlier FP8 rows), on MODEL_8B then on MODEL_MIXTRAL (dummy weights).
#   bash benchmarks/fp8/device_fp8_lmhead.sh MODEL_8B MODEL_MIXTRAL   (on the GPU machine, repository root; wheels in
#        .whl; model dirs: `python benchmarks/fp8/make_model_dir.py DIR [--shape mixtral-8x7b-8l]`, carried)
# Writes under $OUT: tests.log, lmhead.log, lmhead.json, serving-8b.{log,json}, serving-mixtral.{log,json}. About 9
# minutes (six server starts); if the serve phase runs out of the call's 10 minutes, run PHASES=serve next.
PHASES_DEFAULT=tests,kernels,serve
MODEL_8B=${1:?8B model dir}
MODEL_MIXTRAL=${2:?Mixtral model dir}
source "$(dirname "$0")/../gpu/device_preamble.sh"
device_install
gpu_clocks
if has tests; then
  echo "[$((SECONDS - t0)) s] tests"
  LMSYS_GPU_ONLY=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu packages/server/tests/test_fp8_lm_head.py \
    packages/server/tests/test_fp8_kernels.py -k "lm_head or fp8_linear_cuda" 2>&1 | tee "$OUT/tests.log" | tail -6
fi
if has kernels; then
  echo "[$((SECONDS - t0)) s] kernels"
  sweep=(); [[ "${SWEEP:-0}" != 0 ]] && sweep=(--sweep)
  (cd benchmarks/fp8 && timeout 240 python3 bench_lm_head.py --rows 1 2 4 8 16 32 "${sweep[@]}" \
    --json "$OUT/lmhead.json") 2>&1 | tee "$OUT/lmhead.log" | tail -24
fi
if has serve; then
  for pair in "8b:$MODEL_8B" "mixtral:$MODEL_MIXTRAL"; do
    name=${pair%%:*}; dir=${pair#*:}
    left=$((590 - (SECONDS - t0)))
    [[ $name == 8b ]] && left=$((left * 55 / 100))  # the 8B's starts are the longer half
    echo "[$((SECONDS - t0)) s] serve $name (${left} s)"
    timeout "$left" python3 benchmarks/fp8/bench_fp8_serving.py --model-path "$dir" \
      --server-args "--load-format dummy --dtype bfloat16 --device cuda --context-length 8192 --cuda-graph-max-bs ${GRAPH_BS:-8}" \
      --settings bf16-default fp8-default fp8-default+lmhead --concurrency 1 8 --rounds 2 --input-len 512 \
      --output-len 256 --prefill-requests 0 --json "$OUT/serving-$name.json" 2>&1 | tee "$OUT/serving-$name.log" \
      | grep -v "^  " | tail -8
  done
fi
echo "[$((SECONDS - t0)) s] done"
