#!/usr/bin/env bash
# One device call: short extends in the decode CUDA graphs (the default since 2026-12-04) checked and timed, and the
# 8B shape's 4k prefill FP8 / bf16 ratio through HTTP with both servers up at once.
#   tests    GPU tests of the graph paths and the FP8 kernels (test_cuda_graph.py, test_overlap.py, test_fp8_kernels.py,
#            test_prefill_graph.py, test_lowlat_adapter.py),
#            output kept whole (tests.log)
#   extend   short extends in graphs vs eagerly in one engine (bench_short_extend.py: graphs / eager / graphs; where
#            the greedy tokens part ways, the top-2 margin there against the logprob drift before it)
#   http     bf16-default / bf16-default+eager-extend / fp8-default servers up at once: 4k prefill rounds (each
#            request's HTTP time and the server's own e2e_latency), then the per-request probes (a 4k radix hit, a
#            one-id prompt)
#   engine   the same 4k prefill in the engine, kernel by kernel (bench_prefill_kernels.py): what HTTP adds
#   long     (not in the default phases) extends of 128-512 new tokens in decode graphs of up to 512 rows, the read
#            bound raised to 524,288 for the run, against eager (a 256-token prefill is host-bound eagerly: FP8 34 ms
#            for 4.9 ms of device work on 2026-12-04)
#   pgraph   (not in the default phases) prefill CUDA graphs (--enable-cuda-graph-prefill, opt-in): their GPU tests,
#            then extends of 128-2,048 new tokens in the decode graphs / eagerly / in prefill graphs in one engine
#            (bench_short_extend.py --prefill-graphs 2048), then the engine's 1,024-token FP8 prefill kernel by kernel
#            with and without them (bench_prefill_kernels.py, the +pgraph setting): ~8-9 minutes, a call of its own
#   pgraph_http (not in the default phases) prefill graphs (the default) through HTTP: bf16 / FP8 with and without them, up
#            at once, prompts of 128-1,024 tokens; then FP8 decode at concurrency 1 and 8 with and without (~9 minutes)
#   pgraph4k_engine (not in the default phases) FP8 prompts of 2,048 / 4,096 tokens in one engine: eagerly and in prefill
#            graphs captured up to 4,096 tokens (ENGINE_SETTINGS: bench_short_extend settings; ~2-3 minutes)
#   pgraph4k (not in the default phases) the 4k prefill through HTTP, bf16 / FP8 with prefill graphs up to 2,048 (the
#            default) and up to 4,096 tokens, servers up at once (~4-5 minutes)
#   bash benchmarks/fp8/device_short_extend.sh MODEL_DIR    (on the GPU machine, repository root; wheels in .whl;
#                                                            MODEL_DIR from benchmarks/fp8/make_model_dir.py)
# PHASES (comma list, default all four) picks phases; HTTP_SETTINGS (bench_fp8_serving settings) and ROUNDS change
# the http phase's servers and prefill rounds. Writes under $OUT: tests.log, extend.txt, http.log,
# http.json, engine.log, engine.json.
PHASES_DEFAULT=tests,extend,http,engine
source "$(dirname "$0")/../gpu/device_preamble.sh"
MODEL=${1:?model dir}
device_install
gpu_clocks
if has tests; then
  echo "[$((SECONDS - t0)) s] tests"
  LMSYS_GPU_ONLY=1 timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    packages/server/tests/test_cuda_graph.py packages/server/tests/test_overlap.py \
    packages/server/tests/test_fp8_kernels.py packages/server/tests/test_prefill_graph.py \
    packages/server/tests/test_lowlat_adapter.py > "$OUT/tests.log" 2>&1
  tail -6 "$OUT/tests.log"
fi
if has extend; then
  echo "[$((SECONDS - t0)) s] extend"
  timeout 240 python3 benchmarks/engine/bench_short_extend.py --model-path "$MODEL" --settings fp8-default \
    bf16-default --lengths 1 2 4 8 16 64 --out "$OUT/extend.txt" 2>&1 | grep -v "^INFO" | tail -30
fi
if has long; then  # extends of 128-512 new tokens in graphs of up to 512 rows, the read bound raised for the run
  echo "[$((SECONDS - t0)) s] long"
  timeout 300 python3 benchmarks/engine/bench_short_extend.py --model-path "$MODEL" --settings fp8-default \
    bf16-default --lengths 128 256 512 --graph-max-bs 512 --max-reads 524288 --hit-prefix 512 \
    --out "$OUT/long.txt" 2>&1 | grep -v "^INFO" | tail -20
fi
if has pgraph; then  # prefill graphs: GPU tests, three ways in one engine, then the kernel view per length
  echo "[$((SECONDS - t0)) s] pgraph"
  LMSYS_GPU_ONLY=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    packages/server/tests/test_prefill_graph.py > "$OUT/pgraph_tests.log" 2>&1
  tail -3 "$OUT/pgraph_tests.log"
  timeout 300 python3 benchmarks/engine/bench_short_extend.py --model-path "$MODEL" --settings fp8-default \
    bf16-default --lengths 128 256 512 1024 2048 --hit-prefix 512 --prefill-graphs 2048 --reps 5 \
    --out "$OUT/pgraph.txt" 2>&1 | grep -v "^INFO" | tail -30
  timeout $((590 - (SECONDS - t0))) python3 benchmarks/fp8/bench_prefill_kernels.py --model-path "$MODEL" \
    --length 1024 --settings fp8-default fp8-default+pgraph --reps 5 --top 3 --json "$OUT/pgraph_1024.json" 2>&1 \
    | tee "$OUT/pgraph_1024.log" | grep -v "^INFO" | grep "===\|idle\|span"
fi
if has http; then
  echo "[$((SECONDS - t0)) s] http"
  timeout $((510 - (SECONDS - t0))) python3 benchmarks/fp8/bench_fp8_serving.py --model-path "$MODEL" --settings \
    ${HTTP_SETTINGS:-bf16-default bf16-default+eager-extend fp8-default} --prefill-requests ${ROUNDS:-15} --interleave \
    --probe-overhead 15 \
    --json "$OUT/http.json" 2>&1 | tee "$OUT/http.log" | grep -v "INFO" | tail -12
fi
if has pgraph_http; then  # prefill graphs through HTTP: prompts of 128-1,024 tokens, then decode alongside
  echo "[$((SECONDS - t0)) s] pgraph_http"
  timeout 330 python3 benchmarks/fp8/bench_fp8_serving.py --model-path "$MODEL" --settings bf16-default \
    bf16-default+eager-prefill fp8-default fp8-default+eager-prefill --prefill-len 1024 --prefill-vary 896 --prefill-requests 20 \
    --interleave --probe-overhead 10 --json "$OUT/pgraph_http.json" 2>&1 | tee "$OUT/pgraph_http.log" \
    | grep -v "INFO" | tail -14
  timeout $((560 - (SECONDS - t0))) python3 benchmarks/fp8/bench_fp8_serving.py --model-path "$MODEL" --settings \
    fp8-default fp8-default+eager-prefill --concurrency 1 8 --prefill-requests 0 --json "$OUT/pgraph_decode.json" 2>&1 \
    | tee "$OUT/pgraph_decode.log" | grep -v "INFO" | tail -12
fi
if has pgraph4k_engine; then  # FP8 prompts of 2,048 and 4,096 tokens eagerly and in prefill graphs up to 4,096
  echo "[$((SECONDS - t0)) s] pgraph4k_engine"
  timeout $((580 - (SECONDS - t0))) python3 benchmarks/engine/bench_short_extend.py --model-path "$MODEL" \
    --settings ${ENGINE_SETTINGS:-fp8-default} --lengths 2048 4096 --prefill-graphs 4096 --hit-prefix 0 \
    --context 8192 --reps 7 --out "$OUT/pgraph4k_engine.txt" 2>&1 | grep -v "^INFO" | tail -12
fi
if has pgraph4k; then  # the 4k prefill with prefill graphs captured up to 4,096 tokens, servers up at once
  echo "[$((SECONDS - t0)) s] pgraph4k"
  timeout $((580 - (SECONDS - t0))) python3 benchmarks/fp8/bench_fp8_serving.py --model-path "$MODEL" --settings \
    bf16-default bf16-default+pgraph4k fp8-default fp8-default+pgraph4k --prefill-requests ${ROUNDS:-15} --interleave \
    --json "$OUT/pgraph4k.json" 2>&1 | tee "$OUT/pgraph4k.log" | grep -v "INFO" | tail -8
fi
if has engine; then
  echo "[$((SECONDS - t0)) s] engine"
  timeout $((590 - (SECONDS - t0))) python3 benchmarks/fp8/bench_prefill_kernels.py --model-path "$MODEL" \
    --settings fp8-default bf16-default --reps 3 --top 4 --json "$OUT/engine.json" 2>&1 \
    | tee "$OUT/engine.log" | grep -v "^INFO" | grep "===\|idle\|span"
fi
echo "[$((SECONDS - t0)) s] done"
