# Sourced (not run) by the one-call device scripts, which start from the repository root as
# `bash benchmarks/<dir>/device_*.sh`:   source "$(dirname "$0")/../gpu/device_preamble.sh"
# A script may set before sourcing it:
#   PHASES_DEFAULT  its phases when PHASES is unset (comma list; unset: none)
#   OUT_DEFAULT     its output folder when OUT is unset (/tmp/out if unset)
# It sets: `set -uo pipefail`; OUT; PHASES; exports PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1; t0=$SECONDS
# (the call's start, for the "[N s]" lines); and defines
#   has PHASE          true when PHASE is in the comma list $PHASES
#   device_install [N] benchmarks/gpu/device_setup.sh install, its last N lines of output shown (1 by default)
#   gpu_clocks [FIELD] nvidia-smi's one CSV line: name, SM / memory clocks, temperature (and FIELD, e.g.
#                      utilization.gpu)
# It runs nothing itself: the script calls device_install / gpu_clocks where (and if) it wants them.
set -uo pipefail
OUT=${OUT:-${OUT_DEFAULT:-/tmp/out}}
PHASES=${PHASES:-${PHASES_DEFAULT:-}}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
t0=$SECONDS
has() { [[ ",$PHASES," == *",$1,"* ]]; }
device_install() { bash benchmarks/gpu/device_setup.sh install 2>&1 | tail "-${1:-1}"; }
gpu_clocks() {
  nvidia-smi --query-gpu="name,clocks.sm,clocks.mem,temperature.gpu${1:+,$1}" --format=csv,noheader
}
