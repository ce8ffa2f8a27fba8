#!/usr/bin/env bash
# Where a short program's start-up goes, on a GPU host: the driver steps a session adds
# (startup_probe.c), then one small driver-API program (vecadd) and one runtime-API program
# (runtime_static) timed natively and under Remora in each way of running it, then one
# debug-logged run per transport with timestamps.
#
#   gpu/tools/startup_times.sh BIN_DIR OUT_DIR [REPS]
#
# BIN_DIR holds `remora` and its shim (libcuda.so). Builds into OUT_DIR/build.
set -uo pipefail
bin=$(cd "${1:?usage: startup_times.sh BIN_DIR OUT_DIR [REPS]}" && pwd)
out=${2:?usage}; mkdir -p "$out/build"; out=$(cd "$out" && pwd)
reps=${3:-5}
src=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
inc=$(dirname "$(dirname "$nvcc")")/include
[ -f "$inc/cuda.h" ] || inc=$(dirname "$(find / -name cuda.h -path '*include*' 2>/dev/null | head -n 1)")
b=$out/build
cc -O2 -I"$inc" -o "$b/startup_probe" "$src/tools/startup_probe.c" -ldl || exit 1
"$nvcc" -cubin -arch=sm_90 -o "$b/vecadd.cubin" "$src/tests/vecadd_kernel.cu" || exit 1
"$nvcc" -O2 -std=c++17 -cudart none -o "$b/vecadd" "$src/tests/vecadd.cpp" -lcuda -lpthread || exit 1
"$nvcc" -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 -o "$b/runtime_static" "$src/tests/runtime_api.cu" || exit 1
export REMORA_GPU_KERNELS=$b
echo "== driver steps"; "$b/startup_probe" 16 64 256 | tee "$out/probe.txt"
work=$(mktemp -d)
"$bin/remora" serve --listen "unix://$work/p.sock" --listen tcp://127.0.0.1:0 > "$work/p.out" 2> "$work/p.err" &
ppid_=$!
"$bin/remora" serve --isolation thread --listen "unix://$work/t.sock" --listen tcp://127.0.0.1:0 > "$work/t.out" 2> "$work/t.err" &
tpid=$!
for _ in $(seq 100); do [ "$(cat "$work"/p.out "$work"/t.out | grep -c 'listening on')" -ge 4 ] && break; sleep 0.1; done
ptcp=$(grep -o 'tcp://[0-9.:]*' "$work/p.out" | head -n 1); ttcp=$(grep -o 'tcp://[0-9.:]*' "$work/t.out" | head -n 1)
cmd() { # mode -> array run
  case $1 in
    native) run=() ;;
    embedded-*) run=("$bin/remora" run --transport "${1#embedded-}" --) ;;
    process-tcp) run=("$bin/remora" run --server "$ptcp" --) ;;
    process-*) run=("$bin/remora" run --transport "${1#process-}" --server "unix://$work/p.sock" --) ;;
    thread-tcp) run=("$bin/remora" run --server "$ttcp" --) ;;
    thread-*) run=("$bin/remora" run --transport "${1#thread-}" --server "unix://$work/t.sock" --) ;;
    env-shm) run=(env LD_LIBRARY_PATH="$work/lib" REMORA_SERVER="unix://$work/p.sock" REMORA_TRANSPORT=shm) ;;
  esac
}
mkdir -p "$work/lib"; ln -sf "$bin/libcuda.so" "$work/lib/libcuda.so.1"
modes=(native embedded-shm embedded-unix embedded-tcp process-shm process-unix process-tcp thread-shm thread-unix thread-tcp env-shm)
echo "== whole-program seconds (median of $reps; each run's value in brackets)"
for prog in "vecadd cubin" runtime_static; do
  for m in "${modes[@]}"; do
    cmd "$m"; ts=()
    for _ in $(seq "$reps"); do
      t0=$(date +%s%N)
      # shellcheck disable=SC2086
      "${run[@]}" "$b/"$prog > /dev/null 2> "$work/err" || { echo "FAIL $prog $m"; tail -n 3 "$work/err"; }
      ts+=("$(( ($(date +%s%N) - t0) / 1000000 ))")
    done
    med=$(printf '%s\n' "${ts[@]}" | sort -n | sed -n "$(( (reps + 1) / 2 ))p")
    echo "$prog $m ${med} ms [${ts[*]}]"
  done
done | tee "$out/times.txt"
echo "== one debug-logged run per mode (server and client logs with timestamps)"
for m in embedded-shm embedded-tcp; do
  cmd "$m"
  REMORA_LOG=debug "${run[@]}" "$b/vecadd" cubin > /dev/null 2> "$out/log-$m.txt"
  # The start-up and end-of-run steps (driver probes, context, the program's exit, the
  # session freed, the server's shutdown and stop), with their timestamps.
  echo "-- $m"; grep -h "remora::startup" "$out/log-$m.txt" | sed 's/ DEBUG remora::startup://'
done
kill "$ppid_" "$tpid"; wait
cp "$work"/p.err "$out/serve-process.err"; cp "$work"/t.err "$out/serve-thread.err"
