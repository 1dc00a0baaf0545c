#!/usr/bin/env bash
# The storm (bench_storm.py) against several server configurations of one tree, one after the other,
# in one device call: install (benchmarks/gpu/device_setup.sh), then each variant's server started,
# stormed and stopped; a table of all variants last. Each variant is NAME=EXTRA_SERVER_ARGS.
#   bash benchmarks/structured/storm_device.sh MODEL_DIR SCHEMA_DIR OUT_DIR [WHEEL_DIR] -- NAME=ARGS ...
# MODEL_DIR: the 8B config.json with SmolLM2's tokenizer files (dummy weights); SCHEMA_DIR: the storm's
# schemas; WHEEL_DIR: wheels installed only where `import jsonschema` fails (jsonschema and its needs).
# ARGS starting with @DIR run that variant with DIR/packages/server/src first on PYTHONPATH (another commit's
# lmserver, e.g. a `git archive` of the commit before, against the same installed cfsm and kernels), then the
# rest of ARGS: "old=@.devdata/storm/old" measures the previous commit side by side.
# Env: STORM_TIMEOUT_S (grammar compile timeout, 15), STORM_RUN_S (cap per variant, 150).
# Writes OUT_DIR/run.log, OUT_DIR/storm_NAME.{log,json}.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODEL=$1 SCHEMAS=$2 OUT=$3
shift 3
WHEELS=""
if [ "${1:-}" != "--" ]; then WHEELS=$1; shift; fi
shift  # --
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/run.log"; }
log "install"
bash benchmarks/gpu/device_setup.sh install >>"$OUT/run.log" 2>&1 || { log "install failed"; exit 1; }
python3 -c "import jsonschema" 2>/dev/null || python3 -m pip install -q --no-index --no-deps "$WHEELS"/*.whl >>"$OUT/run.log" 2>&1
# the installed lmserver is this tree's (a warm machine may hold another tree's install)
python3 - "$PWD" >>"$OUT/run.log" 2>&1 <<'PY' || { log "installed lmserver is not this tree's"; exit 1; }
import filecmp, os, sys
import lmserver.scheduler.admission as m
ok = filecmp.cmp(m.__file__, os.path.join(sys.argv[1], "packages/server/src/lmserver/scheduler/admission.py"), shallow=False)
print("installed lmserver:", m.__file__, "same as this tree:", ok)
sys.exit(0 if ok else 1)
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv >>"$OUT/run.log" 2>&1
git log -1 --format='tree of %h %s' >>"$OUT/run.log" 2>/dev/null || true
BASE="--model-path $MODEL --load-format dummy --dtype bfloat16 --device cuda --context-length 4096 \
--grammar-compile-timeout-s ${STORM_TIMEOUT_S:-15} --step-trace 30000"
names=()
for variant in "$@"; do
  name=${variant%%=*}; extra=${variant#*=}
  names+=("$name")
  pypath=${PYTHONPATH:-}
  if [ "${extra:0:1}" = "@" ]; then
    tree=${extra%% *}; tree=$(cd "${tree:1}" && pwd); extra=${extra#"@"*}; extra=${extra#"${extra%% *}"}
    pypath="$tree/packages/server/src${pypath:+:$pypath}"
  fi
  log "== $name: $extra (PYTHONPATH ${pypath:-none}; load $(cut -d' ' -f1-3 /proc/loadavg))"
  PYTHONPATH="$pypath" python3 -c "import lmserver; print('$name: lmserver from', lmserver.__file__)" | tee -a "$OUT/run.log"
  PYTHONPATH="$pypath" PYTHONUNBUFFERED=1 timeout "${STORM_RUN_S:-150}" python3 benchmarks/structured/bench_storm.py \
    --server-args "$BASE $extra" --streams 8 --stream-tokens 800 --schemas 96 --schema-tokens 128 \
    --schema-dir "$SCHEMAS" --json "$OUT/storm_$name.json" >"$OUT/storm_$name.log" 2>&1
  log "$name rc=$?"
  grep -E "per-user decode speed|^schemas:|own decode speed|server gaps in|SLO admission" "$OUT/storm_$name.log" | tee -a "$OUT/run.log"
done
python3 - "$OUT" "${names[@]}" <<'PY' | tee -a "$OUT/run.log"
import json, sys, os
out, names = sys.argv[1], sys.argv[2:]
print(f"{'variant':>8} {'calm':>7} {'window':>7} {'ratio':>6} {'steady':>6} {'gap ms':>7} {'calm gap':>8} {'fwd':>5} "
      f"{'chain':>5} {'ext':>4} {'held':>5} {'gc s':>5} outcomes   (steady: the ratio without stream gaps > 45 ms)")
for n in names:
    p = os.path.join(out, f"storm_{n}.json")
    if not os.path.exists(p):
        print(f"{n:>8} (no result)"); continue
    d = json.load(open(p)); c, s = d["calm"], d["storm"]; w = s.get("server_window", {})
    counts = {}
    for r in d["schemas"]:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(f"{n:>8} {c['per_user_tok_s_mean']:7.1f} {s['window_tok_s_mean']:7.1f} "
          f"{s['window_tok_s_mean'] / c['per_user_tok_s_mean']:6.3f} "
          f"{s.get('window_tok_s_mean_without_stalls', float('nan')) / c['per_user_tok_s_mean']:6.3f} "
          f"{s['window_max_gap_ms']:7.0f} {c['max_gap_ms']:8.0f} "
          f"{w.get('forwards', 0):5.0f} {w.get('overlap_steps', 0):5.0f} {w.get('extend_forwards', 0):4.0f} "
          f"{w.get('admission_deferred_rounds', 0):5.0f} {w.get('gc_pause_s', 0):5.2f} {counts}")
PY
log "done"
