#!/usr/bin/env bash
# One device call (issue 33, "Mixtral-shape FP8 decode >= 1.7x bf16 at batch 1"): a tile sweep of the row-wise FP8
# expert slot kernels that serve one token (`moe_ops.EXPERT_TILES_FP8`'s first entry: gate-up and down both
# rows 4 x 2048, 4 warps, 2 stages; gate-up vec 16). On the H200 the 8-layer FP8 MoE stack ran at 134.4 us per layer
# with them, 70% of its floor, while the dense 8B row-wise FP8 GEMVs on the same matrices reach ~79%: the sweep asks
# whether the tiles, not the kernels, hold the slot kernels back. Each candidate replaces one side (the other keeps
# the default), is checked against the reference layer first (a mismatch drops it, loudly), and is timed at one token
# in the same process as the default (`fp8w`, and `fp8w#0` = the default restated: the run-to-run spread).
# lowlat only (no server); from the repository root on the GPU machine:
#   bash benchmarks/lowlat/device_fp8_moe_slots.sh      (writes slots.log, slots.json under $OUT; ~3 minutes)
# Then: a candidate faster than both default rows by > 3% goes into EXPERT_TILES_FP8's first entry, with its numbers.
OUT_DEFAULT=/tmp/fp8_moe_out
source "$(dirname "$0")/../gpu/device_preamble.sh"
export PYTHONPATH=packages/lowlat/src
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-240}
UP_DEFAULT=rows:4:2048:4:2:16
DOWN_DEFAULT=rows:4:2048:4:2
UPS=(rows:4:2048:4:2:16 rows:2:2048:4:2:16 rows:8:2048:4:2:16 rows:4:1024:4:2:16 rows:4:4096:4:2:16
     rows:4:2048:8:2:16 rows:4:2048:4:3:16 rows:8:1024:4:3:16 rows:4:2048:2:2:16 rows:4:2048:4:2:8)
DOWNS=(rows:4:2048:4:2:16 rows:2:2048:4:2 rows:8:2048:4:2 rows:4:1024:4:2 rows:4:4096:4:2 rows:4:2048:8:2
       rows:4:2048:4:3 rows:8:1024:4:2:16 rows:2:4096:4:2:16)
pairs="up=$UP_DEFAULT,down=$DOWN_DEFAULT"
for u in "${UPS[@]:1}"; do pairs+=",up=$u,down=$DOWN_DEFAULT"; done
for d in "${DOWNS[@]}"; do pairs+=",up=$UP_DEFAULT,down=$d"; done
gpu_clocks utilization.gpu
timeout "$BUDGET_S" python3 benchmarks/lowlat/bench_moe_stack.py --layers 8 --batches 1 --option-batches 1 \
  --stacks bf16,fp8w --expert-configs "$pairs" --json "$OUT/slots.json" 2>&1 | tee "$OUT/slots.log" | tail -40
echo "[$((SECONDS - t0)) s] done"
