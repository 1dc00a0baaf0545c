#!/usr/bin/env bash
# One device call (issue 33): the FP8 GEMV variants at batch 1 checked and timed side by side, the winners written into
# lowlat.kernels.tuning.FP8_TABLES, then FP8 + the nvidia plugin against bf16 through HTTP with that table.
#   bash benchmarks/fp8/device_fp8_gemv.sh MODEL_DIR      (on the GPU machine, from the repository root; wheels in .whl)
# Writes under $OUT: check.log, gemv.log, gemv.json, tuning.py (the table served), serving.log, serving.json.
source "$(dirname "$0")/../gpu/device_preamble.sh"
MODEL=${1:?model dir}
device_install 3
gpu_clocks
echo "[$((SECONDS - t0)) s] checks"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x packages/lowlat/tests/fp8_cases.py \
  -k "rowsa or rows16a or mrow_f16 or acc2d" 2>&1 | tee "$OUT/check.log" | tail -3
echo "[$((SECONDS - t0)) s] gemv"
Q=qkv=rows:2:1024:1:2:8,qkv=rows:2:512:1:2:16:1,qkv=rows:2:1024:2:2:16:1,qkv=rows:2:2048:4:2:16:1,qkv=rows:4:1024:4:2:16:1
Q=$Q,qkv=mrow_f16:16:256:4:3,qkv=mrow_f16:32:256:4:3
O=o_proj=rows:4:2048:4:2:16,o_proj=rows:4:2048:4:2:16:1,o_proj=rows:8:2048:4:2:16:1,o_proj=rows:2:2048:4:2:16:1
O=$O,o_proj=rows:4:1024:4:2:16:1,o_proj=mrow_f16:64:256:4:3,o_proj=mrow_f16:32:256:4:4,o_proj=mrow_f16:128:128:4:3
G=gate_up=rows:4:2048:4:2:16,gate_up=rows:4:2048:4:2:16:1,gate_up=rows:2:2048:4:2:16:1,gate_up=rows:8:2048:8:2:16:1
G=$G,gate_up=rows:4:1024:4:2:16:1,gate_up=mrow_f16:64:128:4:4,gate_up=mrow_f16:128:128:8:3,gate_up=mrow_f16:64:256:4:3
D=down=rows:4:2048:4:2,down=rows:4:2048:4:2:16:1,down=rows:2:2048:4:2:16:1,down=rows:4:4096:8:2:16:1
D=$D,down=rows:8:2048:8:2:16:1,down=mrow_f16:32:512:4:3,down=mrow_f16:64:256:4:3,down=mrow_f16:64:512:4:3
timeout 240 python3 benchmarks/lowlat/bench_gemv.py --fp8 --layers 16 --batches 1 --stages qkv,o_proj,gate_up,down \
  --budget-s 230 --configs "$Q,$O,$G,$D" --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.log" | tail -22
python3 benchmarks/fp8/pick_fp8_table.py "$OUT/gemv.json" && cp packages/lowlat/src/lowlat/kernels/tuning.py "$OUT/"
python3 -m pip install -q --no-index --no-deps --no-build-isolation packages/lowlat
echo "[$((SECONDS - t0)) s] serving"
timeout $((590 - (SECONDS - t0))) python3 benchmarks/fp8/bench_fp8_serving.py --model-path "$MODEL" \
  --server-args "--load-format dummy --dtype bfloat16 --device cuda --context-length 8192 --cuda-graph-max-bs 8" \
  --settings bf16 fp8+plugin --concurrency 1 8 --prefill-requests 1 --json "$OUT/serving.json" 2>&1 \
  | tee "$OUT/serving.log" | grep -v "^INFO" | tail -12
echo "[$((SECONDS - t0)) s] done"
