#!/usr/bin/env bash
# One device call (issues 33, 34): the lowlat attention on FP8 KV caches with its two dots widened to bf16 (as built
# by default) against fp16 (`LaunchConfig.attn_f16`: K / V e4m3 -> fp16, q scaled by 2^-4, p in fp16), side by side.
#   bash benchmarks/fp8/device_fp8_attn_f16.sh [MODEL_DIR]     (on the GPU machine, repository root; wheels in .whl)
# Phases (PHASES, comma list; default check,attn,stack,step; step needs MODEL_DIR: make_model_dir.py's 8B folder):
#   check: fp8_cases.py's attention cases on the GPU (fp16 path against float64 incl. q beyond fp16's range, the
#          built 8B stack at 1, 3 and 8 rows with attn_f16 against the reference layer; the bf16 path's cases too);
#   attn:  attention alone (bench_verify_step.py part 1, FP8 caches): decode 1 and 8 rows, verify 6 + 2 padding rows
#          and 2 x 6 rows, contexts $ATTN_CTX, the per-row kernel and the stack's rows_attention launch, at the tuned
#          KV blocks, at 64 and at 8 warps, each bf16-widening then f16 (32 layers' caches chained in one CUDA graph,
#          us per layer);
#   stack: the 32-layer FP8 stack (FP8 weights + FP8 KV) at 1 and 8 rows, contexts $STACK_CTX, bf16-widening vs
#          attn-f16, tuned blocks, 64, 8 warps (bench_fp8_stack.py, us per layer);
#   step:  the engine's verify step, graph of 8 rows holding a 6-row verify step (bench_verify_step.py part 2):
#          spec-fp8+plugin-all against the same with attn-f16 ($STEP_SETTINGS), until END_S seconds into the call.
# Writes under $OUT: check.log, attn.log/json, stack<ctx>.log/json, step.log/json.
PHASES_DEFAULT=check,attn,stack,step
MODEL=${1:-}
source "$(dirname "$0")/../gpu/device_preamble.sh"
device_install
gpu_clocks
if has check; then
  echo "[$((SECONDS - t0)) s] checks"
  timeout "${CHECK_S:-180}" python3 -m pytest -q -p no:cacheprovider packages/lowlat/tests/fp8_cases.py \
    -k "f16_on_fp8 or attn_f16 or attention_reads_fp8" 2>&1 | tee "$OUT/check.log" \
    | grep -E "passed|failed|FAILED|Error" | tail -12
fi
if has attn; then
  echo "[$((SECONDS - t0)) s] attention alone"
  timeout "${ATTN_S:-170}" python3 benchmarks/speculative/bench_verify_step.py --attn-kv fp8 \
    --attn-context "${ATTN_CTX:-512,4096}" --attn-grids stack --attn-blocks 64 --attn-warps 8 --json "$OUT/attn.json" 2>&1 \
    | tee "$OUT/attn.log" | grep -E "^  |FAILED" | tail -60
fi
if has stack; then
  for ctx in ${STACK_CTX:-4096}; do
    echo "[$((SECONDS - t0)) s] FP8 stack, context $ctx"
    timeout "${STACK_S:-130}" python3 benchmarks/lowlat/bench_fp8_stack.py --stacks fp8w+kv --batches 1,8 \
      --context "$ctx" --attn-f16 --attn-blocks 64 --attn-warps 8 --json "$OUT/stack$ctx.json" 2>&1 \
      | tee "$OUT/stack$ctx.log" | grep -E "^  " | tail -24
  done
fi
if has step && [[ -n "$MODEL" ]]; then
  echo "[$((SECONDS - t0)) s] verify step"
  timeout $(( ${END_S:-570} - (SECONDS - t0) )) python3 benchmarks/speculative/bench_verify_step.py \
    --model-path "$MODEL" --attn-context 0 --settings ${STEP_SETTINGS:-spec-fp8+plugin-all spec-fp8+plugin-all+attn-f16} \
    --new-tokens 32 --top 12 --json "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | grep -v "^INFO" | tail -50
fi
echo "[$((SECONDS - t0)) s] done"
