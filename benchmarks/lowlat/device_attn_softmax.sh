#!/usr/bin/env bash
# One device call (issue 30, online softmax): lowlat's attention kernels and decode step at two source trees side by
# side, then the GPU kernel cases of the touched kernels at the second tree. The trees are lowlat snapshots in ignored
# folders, made here and carried:
#   mkdir .attn_base && git archive BASE packages/lowlat | tar -x -C .attn_base      (likewise .attn_new)
# and on the device machine: bash benchmarks/lowlat/device_attn_softmax.sh   (writes under $OUT)
OUT_DEFAULT=/tmp/attn_out
source "$(dirname "$0")/../gpu/device_preamble.sh"
mkdir -p "$OUT"
gpu_clocks utilization.gpu
python3 -m pip install -q --no-index --no-deps --no-build-isolation .attn_new/packages/lowlat >"$OUT/pip.log" 2>&1 \
  || echo "pip install of lowlat failed (plugins imported directly anyway)"
B=benchmarks/lowlat/bench_attn_softmax.py
for t in base new; do  # first round: correctness + timings (compiles)
  PYTHONPATH=.attn_$t/packages/lowlat/src timeout 120 python3 $B --tag $t --json "$OUT/$t.json" 2>&1 | grep "^\[" | tail -14
done
for t in new base; do  # second round, reversed: timings only (cached kernels), for the spread
  PYTHONPATH=.attn_$t/packages/lowlat/src timeout 45 python3 $B --tag ${t}2 --check 0 --json "$OUT/${t}2.json" 2>&1 | grep "^\[" | tail -9
done
cd .attn_new && PYTHONPATH=packages/lowlat/src timeout 150 python3 -m pytest -q -p no:cacheprovider \
  packages/lowlat/tests/kernel_cases.py -k "attention or rows or layer_matches or verify or persistent" 2>&1 | tail -6
