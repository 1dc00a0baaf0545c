#!/usr/bin/env bash
# Device calls for issue 33's FP8 decode at concurrency 8, in phases (PHASES, comma list; default check,serve):
#   PHASES=check,serve SETTINGS="bf16 fp8 fp8+plugin fp8+plugin-all" CONC="1 8 32" \
#     bash benchmarks/fp8/device_fp8_c8.sh MODEL_DIR      (on the GPU machine, repository root; wheels in .whl)
# gemv: bench_gemv --fp8 --batches 8 over $CONFIGS (each config checked against float32 torch on the dequantized
#   weights first); pick: pick_fp8_table.py --batch 8 (the winners into FP8_TABLES' lines of max batch 8), lowlat
#   reinstalled (the served table comes back as tuning.py); check: fp8_cases.py's 8-row and split-K cases (float64 /
#   reference-layer oracles, fresh inputs); step: bench_step_kernels at 8 live rows for $STEP_SETTINGS; serve:
#   bench_fp8_serving for $SETTINGS at $CONC (graphs up to $GRAPH_BS rows, 8 by default as in the earlier FP8 rows:
#   above it every setting decodes without graphs). `fp8+plugin-all` runs the plugin at every batch it covers
#   (`auto+all-batches`): against `fp8` (off) it is the end-to-end check that tuning.FP8_WINS_UP_TO may go to 8.
# MODEL_DIR: the Llama-3-8B config.json with SmolLM2's tokenizer files (dummy weights): benchmarks/fp8/make_model_dir.py
#   writes one here (into a git-ignored folder, carried with the call).
# Writes under $OUT: gemv.log/json, tuning.py, check.log, step.log/json, serving.log/json.
PHASES_DEFAULT=check,serve
MODEL=${1:?model dir}
source "$(dirname "$0")/../gpu/device_preamble.sh"
# the FP8_TABLES lines at 2-16 rows until 2026-12-02 (dot / mrow in bf16), the multi-row kernel in fp16 (mrow_f16,
# the lines at 2-8 rows since 2026-12-03), o_proj / down also split over K (the 8th field: GemvConfig.split_k)
Q=qkv=dot:32:256:4:3,qkv=mrow_f16:32:256:4:3,qkv=mrow_f16:16:256:4:3,qkv=rows:2:1024:1:2:8
O=o_proj=dot:32:256:4:4,o_proj=mrow_f16:32:256:4:4,o_proj=mrow_f16:16:256:4:4,o_proj=mrow_f16:32:256:4:4:0:0:2
O=$O,o_proj=mrow_f16:32:512:4:3:0:0:2,o_proj=mrow_f16:32:256:4:4:0:0:4
G=gate_up=mrow:128:128:8:3,gate_up=mrow_f16:64:256:4:3,gate_up=mrow_f16:128:128:8:3,gate_up=mrow_f16:64:128:4:4
D=down=dot:32:512:4:3,down=mrow_f16:32:512:4:3,down=mrow_f16:64:256:4:3,down=mrow_f16:32:512:4:3:0:0:2
D=$D,down=mrow_f16:32:512:4:3:0:0:4,down=mrow_f16:32:512:4:3:0:0:7
# the table's fp16 lines with the rows scaled into fp16's range first (mrow_f16s: what may serve real checkpoints)
S=qkv=mrow_f16s:32:256:4:3,o_proj=mrow_f16s:32:256:4:4,gate_up=mrow_f16s:64:256:4:3,down=mrow_f16s:32:512:4:3
CONFIGS=${CONFIGS:-$Q,$O,$G,$D,$S}
device_install
gpu_clocks
if has gemv; then
  echo "[$((SECONDS - t0)) s] gemv at 8 rows"
  timeout "${GEMV_S:-130}" python3 benchmarks/lowlat/bench_gemv.py --fp8 --layers 16 --batches 8 \
    --stages qkv,o_proj,gate_up,down --budget-s $(( ${GEMV_S:-130} - 10 )) --configs "$CONFIGS" --json "$OUT/gemv.json" \
    2>&1 | tee "$OUT/gemv.log" | grep -v "^ *$" | tail -16
fi
if has pick; then
  python3 benchmarks/fp8/pick_fp8_table.py "$OUT/gemv.json" --batch 8 && cp packages/lowlat/src/lowlat/kernels/tuning.py "$OUT/"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation packages/lowlat
fi
if has check; then
  echo "[$((SECONDS - t0)) s] checks"
  timeout 150 python3 -m pytest -q -p no:cacheprovider packages/lowlat/tests/fp8_cases.py \
    -k "8-tuned-h4096 or 8-mrow_f16-h4096 or 8-mrow_f16s-h4096 or eight_rows or 3-tuned-h4096 or split_k or large_and_small or (layer_matches and h4096)" 2>&1 \
    | tee "$OUT/check.log" | tail -3
fi
if has step; then
  echo "[$((SECONDS - t0)) s] step kernels at 8 rows"
  timeout "${STEP_S:-200}" python3 benchmarks/lowlat/bench_step_kernels.py --model-path "$MODEL" \
    --settings ${STEP_SETTINGS:-fp8 fp8+plugin-all} --sizes 8 --concurrency 8 --new-tokens 32 --top 12 \
    --json "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | grep -v "^INFO" | tail -40
fi
if has serve; then
  echo "[$((SECONDS - t0)) s] serving"
  timeout $(( ${END_S:-560} - (SECONDS - t0) )) python3 benchmarks/fp8/bench_fp8_serving.py --model-path "$MODEL" \
    --server-args "--load-format dummy --dtype bfloat16 --device cuda --context-length 8192 --cuda-graph-max-bs ${GRAPH_BS:-8}" \
    --settings ${SETTINGS:-bf16 fp8 fp8+plugin fp8+plugin-all} --concurrency ${CONC:-1 8 32} --prefill-requests 1 --json "$OUT/serving.json" \
    2>&1 | tee "$OUT/serving.log" | grep -v "^INFO" | tail -14
fi
echo "[$((SECONDS - t0)) s] done"
