#!/usr/bin/env bash
# Where a synchronous round trip goes, on a GPU host (issue 12 §3): gpu/tools/sync_probe.c
# natively, then under `remora run --profile` (embedded server) over shm, unix and tcp, each
# with the client's and the server's per-procedure profile.
#
#   gpu/tools/sync_times.sh BIN_DIR OUT_DIR [ITERATIONS]
#
# BIN_DIR holds `remora` and its shim (libcuda.so). Builds into OUT_DIR/build; writes
# OUT_DIR/sync-times.txt (every mode's probe lines) and OUT_DIR/profile.MODE.txt.
set -uo pipefail
bin=$(cd "${1:?usage: sync_times.sh BIN_DIR OUT_DIR [ITERATIONS]}" && pwd)
out=${2:?usage}; mkdir -p "$out/build"; out=$(cd "$out" && pwd)
iters=${3:-5000}
src=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
inc=$(dirname "$(dirname "$nvcc")")/include
[ -f "$inc/cuda.h" ] || inc=$(dirname "$(find / -name cuda.h -path '*include*' 2>/dev/null | head -n 1)")
lib=$(dirname "$(find / -name 'libcuda.so*' -path '*stubs*' 2>/dev/null | head -n 1)")
cc -O2 -I"$inc" -o "$out/build/sync_probe" "$src/tools/sync_probe.c" -L"$lib" -lcuda || exit 1
{
  echo "# sync_probe $iters iterations; columns: name p50_us p99_us extra"
  for mode in native shm unix tcp; do
    echo "== $mode"
    if [ "$mode" = native ]; then
      "$out/build/sync_probe" "$iters" 2>&1
    else
      "$bin/remora" run --profile --transport "$mode" -- "$out/build/sync_probe" "$iters" \
        > "$out/probe.$mode.out" 2> "$out/profile.$mode.txt"
      echo "exit $?"; cat "$out/probe.$mode.out"
    fi
  done
} | tee "$out/sync-times.txt"
