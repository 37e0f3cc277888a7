#!/usr/bin/env bash
# Times a new user's first run: a fresh clone of this repository, empty model, kernel and inductor
# caches and no pip cache, `make serve` until the first completion comes back, then until every
# replica says its compiled steps are in use (it serves eagerly meanwhile); then stops the app.
#   cluster/first_run.sh            # this CPU as it is
#   cluster/first_run.sh avx2       # torch, oneDNN and MKL restricted to AVX2: a CPU without native bf16
# Needs port 8000 free. Works in $FIRST_RUN_DIR (default /tmp/specserve-first-run), which it replaces.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
work=${FIRST_RUN_DIR:-/tmp/specserve-first-run}
rm -rf "$work" && mkdir -p "$work"
git clone -q "$here" "$work/repo"
cd "$work/repo"
export SPECSERVE_CACHE="$work/cache" SPECSERVE_KERNEL_CACHE="$work/kernels" \
  TORCHINDUCTOR_CACHE_DIR="$work/inductor" PIP_NO_CACHE_DIR=1
if [ "${1:-}" = avx2 ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
fi
log="$work/serve.log"
start=$(date +%s.%N)
since() { echo "$(date +%s.%N) - $start" | bc; }
setsid make serve >"$log" 2>&1 &
pid=$!
trap 'kill -INT -- -$pid 2>/dev/null || true' EXIT
installed="" built=""
for _ in $(seq 1 2400); do  # at most 20 minutes
  if [ -z "$installed" ] && grep -qa "bin/specserve serve" "$log"; then installed=$(since); echo "installed after $installed s"; fi
  if [ -z "$built" ] && grep -qa "starting a local Ray cluster" "$log"; then built=$(since); echo "pair ready after $built s"; fi
  if curl -sf -m 30 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
       -d '{"model": "target", "prompt": "def fibonacci(n):", "max_tokens": 1, "temperature": 0}' >/dev/null 2>&1; then
    echo "first completion after $(since) s"
    grep -a "no native bf16" "$log" | tr '\r' '\n' | grep -a "no native" | tail -1 || true
    for _ in $(seq 1 3600); do  # at most 30 minutes more: the steps compile in the background
      if grep -qa " s: steps " "$log"; then
        echo "compiled steps in use after $(since) s: $(grep -a ' s: steps ' "$log" | tail -1)"; exit 0
      fi
      kill -0 "$pid" 2>/dev/null || { echo "make serve exited; see $log"; exit 1; }
      sleep 0.5
    done
    echo "steps still compiling 30 minutes after the first completion; see $log"; exit 1
  fi
  kill -0 "$pid" 2>/dev/null || { echo "make serve exited; see $log"; exit 1; }
  sleep 0.5
done
echo "no token within 20 minutes; see $log"
exit 1
