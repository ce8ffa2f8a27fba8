#!/usr/bin/env bash
# The GPU suite: run on a GPU host with prebuilt Remora binaries.
#
#   gpu/run-suite.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds a release `remora` built on the development machine (the GPU host has no Rust
# toolchain); it may lack `remora` entirely, in which case only the native half runs. OUT_DIR
# receives suite.json, suite.md, timing.json (whole-program run times, remoted / native),
# bench.json and outputs/ (every run's stdout and stderr).
# REMORA_SUITE_BUILD=DIR builds the programs into DIR, or reuses DIR when an earlier run built
# them there (a .built marker). REMORA_COMMIT (env; default: the commit `remora --version`
# names) is recorded in suite.json. REMORA_SUITE_ONLY="prog ..." limits the programs
# (REMORA_SUITE_ONLY=driver_bench: the benchmarks alone); REMORA_SUITE_SKIP_BENCH=1 skips them.
#
# Steps:
#   1. build the GPU test programs and kernel images with the host's nvcc (gpu/build.sh);
#   2. run each natively (twice: the two outputs must be identical) and, when `remora run`
#      exists, under `remora run --transport shm --server unix://...` (shared-memory rings),
#      `--transport unix --server unix://...`, `--server tcp://...` (one `remora serve`
#      listening on both) and plain `remora run` (embedded server, shm); also the device inventory,
#      nvidia-smi against `remora info`;
#   3. compare each remoted stdout and exit status with the native one, byte for byte;
#   4. run bench/driver_bench natively and remoted (REMORA_BENCH_ROUNDS rounds, interleaved),
#      `remora bench null` and one profiled remoted run per transport; write median
#      remoted/native ratios; `remora bench launch|copy` with 1, 4 and 16 clients
#      (bench_launch.{json,png}, bench_copy.{json,png}); `remora bench fairness` (a greedy and
#      a latency-sensitive tenant, time slicing against MPS shares: bench_fairness.{json,png};
#      REMORA_BENCH_FAIRNESS=off leaves MPS out);
#   5. only with REMORA_SUITE_TORCH=1 (all four modes) or REMORA_SUITE_TORCH="shm tcp ..." (those
#      modes), and when python3 can import torch: the PyTorch suite, gpu/torch/suite.sh (its
#      TORCH_* variables apply), into OUT_DIR/torch (torch-suite.{json,md}, logs/), counted as one
#      result; it takes several minutes per mode, so give it a device call of its own
#      (REMORA_SUITE_ONLY=none: no programs, no benchmarks), or run gpu/torch/suite.sh directly;
#   6. with REMORA_SUITE_SAMPLES=DIR (a copy of the CUDA samples folder with its run.sh): NVIDIA's
#      CUDA samples natively and in REMORA_SUITE_SAMPLES_MODES (default "shm tcp embedded"),
#      REMORA_SUITE_SAMPLES_REPS timed runs (default 1), REMORA_SUITE_SAMPLES_ONLY="name ..."
#      for some; one result per sample and mode, raw JSONL in OUT_DIR/cuda-samples;
#   7. write suite.json and bench.json and print "N passed, M failed, K skipped".
set -uo pipefail
usage="usage: run-suite.sh BIN_DIR OUT_DIR"
bin=$(cd "${1:?$usage}" && pwd)
out=${2:?$usage}
mkdir -p "$out/outputs"
out=$(cd "$out" && pwd)
src=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
serve_pid=
# shellcheck source=gpu/modes.sh
. "$src/modes.sh"  # start_serve, mode_cmd, remora_commit
# The commit measured: REMORA_COMMIT, else the one `remora --version` says it was built from.
remora_commit "$bin"
cleanup() { [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
# Seconds per program run. Most programs take seconds; a hang must not eat the machine's time
# (one hung program costs this limit once per mode), so the default is short and only the
# long programs (memcpy_sweep, the benchmark) get more.
limit=${REMORA_SUITE_TIMEOUT:-60}
long_limit=${REMORA_SUITE_LONG_TIMEOUT:-300}

pass=0; fail=0; skip=0; results=()
json_str() { printf '%s' "$1" | tr -d '\000-\037' | sed 's/\\/\\\\/g; s/"/\\"/g'; }
result() { # program mode status detail
  case $3 in pass) pass=$((pass+1));; fail) fail=$((fail+1));; *) skip=$((skip+1));; esac
  printf '%-22s %-9s %-7s %s\n' "$1" "$2" "$3" "$4"
  results+=("{\"program\":\"$(json_str "$1")\",\"mode\":\"$2\",\"status\":\"$3\",\"detail\":\"$(json_str "$4")\"}")
}

echo "== 1. build GPU test programs"
build="${REMORA_SUITE_BUILD:-$work/build}"
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
built=0
if [ -n "${REMORA_SUITE_BUILD:-}" ] && [ -f "$build/.built" ]; then
  built=1; echo "using the programs built earlier in $build (REMORA_SUITE_BUILD)"
elif [ -x "$nvcc" ] || command -v "$nvcc" >/dev/null; then
  echo "nvcc: $("$nvcc" --version | tail -n 1)"
  if NVCC="$nvcc" "$src/build.sh" "$build" > "$out/outputs/build.log" 2>&1; then
    built=1; touch "$build/.built"; echo "built into $build"
  else
    echo "BUILD FAILED:"; tail -n 30 "$out/outputs/build.log"
  fi
else
  echo "nvcc not found"
fi

echo "== 2. Remora"
have_remora=0; have_run=0; sock=; tcp=
if [ -x "$bin/remora" ]; then
  have_remora=1
  echo "remora: $("$bin/remora" --version 2>&1)"
  if "$bin/remora" run --help > "$work/run-help.txt" 2>&1; then
    have_run=1; echo "remora run: available"
  else
    echo "remora run: NOT AVAILABLE (\`remora run --help\` failed): the remoted runs are marked skipped"
  fi
  start_serve "$bin" "$work"
  echo "serve: unix://$sock and $tcp"
else
  echo "no $bin/remora: native runs only; the remoted runs are marked skipped"
fi

echo "== 3. device inventory: nvidia-smi against remora info"
nvidia-smi --query-gpu=index,name,uuid,memory.total,pci.bus_id --format=csv,noheader > "$work/native.csv" 2>&1
native_rc=$?
cat "$work/native.csv"
if [ $have_remora = 0 ]; then
  result inventory remora skipped "no remora binary in $bin"
else
  "$bin/remora" info --server "unix://$sock" > "$work/info-unix.txt" 2>&1; info_rc=$?
  "$bin/remora" info --server "$tcp" > "$work/info-tcp.txt" 2>&1; info_tcp_rc=$?
  cat "$work/info-unix.txt"
  if [ $native_rc -ne 0 ]; then
    result inventory remora fail "nvidia-smi failed: $(head -c 200 "$work/native.csv")"
  elif [ $info_rc -ne 0 ] || [ $info_tcp_rc -ne 0 ]; then
    result inventory remora fail "remora info failed: $(head -c 300 "$work/info-unix.txt")"
  else
    ok=1
    native_count=$(grep -c . "$work/native.csv")
    remote_count=$(awk '/^GPUs/ {print $2}' "$work/info-unix.txt")
    [ "$native_count" = "$remote_count" ] || { ok=0; echo "count differs: native $native_count, remora $remote_count"; }
    while IFS=, read -r idx name uuid mem bus; do
      name=$(echo "$name" | xargs); uuid=$(echo "$uuid" | xargs | tr 'A-F' 'a-f'); bus=$(echo "$bus" | xargs)
      bus_short=${bus#0000}; bus_short=${bus_short#:}
      line=$(grep "^  \[$(echo "$idx" | xargs)\]" "$work/info-unix.txt")
      echo "$line" | grep -qF "$name" || { ok=0; echo "GPU $idx name differs: $name"; }
      echo "$line" | grep -qiF "$uuid" || { ok=0; echo "GPU $idx uuid differs: $uuid"; }
      echo "$line" | grep -qiF "$bus_short" || { ok=0; echo "GPU $idx PCI bus id differs: $bus"; }
    done < "$work/native.csv"
    cmp -s <(sed 1d "$work/info-unix.txt") <(sed 1d "$work/info-tcp.txt") || { ok=0; echo "unix and tcp answers differ"; }
    if [ $ok = 1 ]; then result inventory remora pass "$native_count GPU(s) match nvidia-smi over unix and tcp"
    else result inventory remora fail "mismatch, see log"; fi
  fi
  cp "$work/info-unix.txt" "$out/remora-info.txt"
fi
cp "$work/native.csv" "$out/nvidia-smi.csv"

# Runs one program under a mode; stdout to $o.out, stderr to $o.err, exit status to $o.rc.
run_mode() { # mode tag prog args...
  local mode=$1 tag=$2; shift 2
  local limit=$limit run
  case $tag in memcpy_sweep*|driver_bench*) limit=$long_limit ;; esac
  local o="$out/outputs/$tag.$mode"
  local t0; t0=$(date +%s.%N)
  mode_cmd "$bin" "$mode"
  timeout "$limit" "${run[@]}" "$@" > "$o.out" 2> "$o.err"
  echo $? > "$o.rc"
  echo "$(date +%s.%N) $t0" | awk '{printf "%.3f\n", $1 - $2}' > "$o.time"
}

echo "== 4. programs: native (twice) and remoted, outputs compared byte for byte"
export REMORA_GPU_KERNELS="$build"  # the programs find their kernel images here (see common.h)
programs=("vecadd cubin" "vecadd ptx" "vecadd fatbin" "vecadd library" "multikernel" "streams_events"
          "memcpy_sweep" "memcpy2d3d" "occupancy" "cluster" "multithread" "errors illegal" "errors trap"
          "errors assert" "errors api" "devprintf" "hostfunc" "runtime_static" "runtime_shared" "device_props" "graphs" "async_visibility" "mapped_memory" "mapped_default" "managed_memory" "vmm" "stream_ordered" "explicit_graphs" "explicit_graphs_pinned" "graph_memory" "libraries"
          "matmul" "histogram" "lu_solve" "bandwidth" "streams_overlap" "cublas_simple")
remote_modes=(shm unix tcp embedded)
for p in "${programs[@]}"; do
  read -r prog args <<< "$p"
  if [ -n "${REMORA_SUITE_ONLY:-}" ] && ! [[ " $REMORA_SUITE_ONLY " == *" $prog "* ]]; then continue; fi
  tag=${p// /-}
  if [ $built = 0 ]; then
    result "$p" native fail "build failed"
    for m in "${remote_modes[@]}"; do result "$p" "$m" skipped "build failed"; done
    continue
  fi
  if [ ! -x "$build/$prog" ]; then
    for m in native "${remote_modes[@]}"; do result "$p" "$m" skipped "not built here (see outputs/build.log)"; done
    continue
  fi
  # shellcheck disable=SC2086
  run_mode native "$tag" "$build/$prog" $args
  # shellcheck disable=SC2086
  run_mode native2 "$tag" "$build/$prog" $args
  o="$out/outputs/$tag"
  rc=$(cat "$o.native.rc"); rc2=$(cat "$o.native2.rc")
  native_ok=0
  if [ "$rc" != 0 ] || [ "$rc2" != 0 ]; then
    result "$p" native fail "exit $rc/$rc2: $( (grep -h FAIL "$o.native.out" "$o.native.err"; cat "$o.native.err") | head -n 1)"
  elif ! cmp -s "$o.native.out" "$o.native2.out"; then
    result "$p" native fail "not deterministic: two native runs differ"
  else
    native_ok=1
    result "$p" native pass "$(tail -n 1 "$o.native.out")"
  fi
  for m in "${remote_modes[@]}"; do
    if [ $have_run = 0 ]; then result "$p" "$m" skipped "remora run not available"; continue; fi
    if [ $native_ok = 0 ]; then result "$p" "$m" skipped "no native reference"; continue; fi
    # shellcheck disable=SC2086
    run_mode "$m" "$tag" "$build/$prog" $args
    rrc=$(cat "$o.$m.rc")
    if [ "$rrc" != 0 ]; then
      result "$p" "$m" fail "exit $rrc: $(grep -m1 -h 'FAIL\|rror' "$o.$m.out" "$o.$m.err" | head -n 1)"
    elif ! cmp -s "$o.native.out" "$o.$m.out"; then
      result "$p" "$m" fail "stdout differs from native: $(diff "$o.native.out" "$o.$m.out" | sed -n 2p)"
    else
      result "$p" "$m" pass "identical to native"
    fi
  done
done

echo "== 4b. whole-program run times, remoted against native (same run)"
python3 - "$out" <<'PY' || echo "timing.json: python3 failed"
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for f in glob.glob(f"{out}/outputs/*.time"):
    tag, mode = os.path.basename(f)[:-5].rsplit(".", 1)
    if tag.startswith("driver_bench"):
        continue
    try:
        rows.setdefault(tag, {})[mode] = float(open(f).read())
    except ValueError:
        pass
table = {}
for tag, t in sorted(rows.items()):
    native = min(v for m, v in t.items() if m in ("native", "native2")) if "native" in t else None
    entry = {"seconds": t}
    if native:
        entry["ratio"] = {m: round(v / native, 3) for m, v in t.items() if m in ("shm", "unix", "tcp", "embedded")}
        print(f"{tag:<22} native {native:7.3f} s  " + "  ".join(f"{m} x{r}" for m, r in entry["ratio"].items()))
    table[tag] = entry
json.dump({"note": "wall time of each program run (process start to exit); ratio = remoted / fastest native run",
           "programs": table}, open(f"{out}/timing.json", "w"), indent=1, sort_keys=True)
PY

echo "== 5. benchmarks"
# driver_bench runs REMORA_BENCH_ROUNDS times (default 3) in each mode, the modes interleaved
# (native, unix, tcp, native, ...), so that drift of the machine hits every mode alike; each
# figure is the median over the rounds, and the ratios are remoted median / native median.
# `remora bench null` measures the bare RPC round trip; one more driver_bench run goes to a
# `remora serve --profile` whose per-procedure timings are saved in outputs/profile.{unix,tcp}.txt.
bench_modes=(native)
[ $have_run = 1 ] && bench_modes+=(shm unix tcp)
rounds=${REMORA_BENCH_ROUNDS:-3}
# REMORA_SUITE_SKIP_BENCH=1 leaves the benchmarks out: the whole suite with them no longer fits
# one 10-minute device call, so run the programs (REMORA_SUITE_SKIP_BENCH=1) and the benchmarks
# (REMORA_SUITE_ONLY=driver_bench) in two calls.
if [ "${REMORA_SUITE_SKIP_BENCH:-0}" = 1 ]; then
  echo "benchmarks skipped (REMORA_SUITE_SKIP_BENCH=1)"
elif [ $built = 1 ] && { [ -z "${REMORA_SUITE_ONLY:-}" ] || [[ " $REMORA_SUITE_ONLY " == *" driver_bench "* ]]; }; then
  for r in $(seq "$rounds"); do
    for m in "${bench_modes[@]}"; do
      echo "driver_bench round $r/$rounds: $m"
      run_mode "$m" "driver_bench.r$r" "$build/driver_bench" ${REMORA_BENCH_SCALE:-1}
      o="$out/outputs/driver_bench.r$r.$m"
      if [ "$(cat "$o.rc")" = 0 ] && python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$o.out" 2>/dev/null; then
        result "driver_bench r$r" "$m" pass "valid JSON"
      else
        result "driver_bench r$r" "$m" fail "exit $(cat "$o.rc"): $(head -c 200 "$o.err")"
      fi
    done
  done
  [ $have_run = 0 ] && for m in shm unix tcp; do result driver_bench "$m" skipped "remora run not available"; done
  if [ $have_remora = 1 ]; then
    for m in shm unix tcp; do
      url="unix://$sock"; [ $m = tcp ] && url=$tcp
      if "$bin/remora" bench null --transport "$m" --server "$url" --calls 100000 --json "$out/outputs/bench_null.$m.json" > "$out/outputs/bench_null.$m.out" 2>&1; then
        result "bench null" "$m" pass "$(cat "$out/outputs/bench_null.$m.out" | head -n 1)"
      else
        result "bench null" "$m" fail "$(head -c 200 "$out/outputs/bench_null.$m.out")"
      fi
    done
  fi
  if [ $have_run = 1 ]; then
    for m in shm unix tcp; do
      purl="unix://$work/profile.$m.sock"; [ $m = tcp ] && purl=tcp://127.0.0.1:0
      "$bin/remora" serve --profile --listen "$purl" > "$work/profile-serve.$m.out" 2> "$out/outputs/profile.$m.txt" &
      ppid=$!
      for _ in $(seq 100); do grep -q 'listening on' "$work/profile-serve.$m.out" && break; sleep 0.1; done
      purl=$(grep -o '\(unix\|tcp\)://[^ ]*' "$work/profile-serve.$m.out" | head -n 1)
      timeout "$long_limit" "$bin/remora" run --transport "$m" --server "$purl" -- "$build/driver_bench" ${REMORA_BENCH_SCALE:-1} > "$out/outputs/driver_bench.profiled.$m.out" 2>&1
      sleep 1; kill "$ppid" 2>/dev/null; wait "$ppid" 2>/dev/null
      echo "server profile of one driver_bench run over $m:"
      grep -A 14 'profile' "$out/outputs/profile.$m.txt" | grep -v '^--' | head -n 16
    done
  fi
  if [ $have_run = 1 ]; then
    # `remora bench launch|copy`: 1, 4 and 16 concurrent clients, native against shm, unix and
    # tcp in the same run (the command interleaves the modes each round).
    for what in launch copy; do
      echo "remora bench $what (clients ${REMORA_BENCH_CLIENTS:-1,4,16}, $rounds rounds)"
      extra=(); [ $what = copy ] && extra=(--reps "${REMORA_BENCH_COPY_REPS:-5}")
      if timeout "$long_limit" "$bin/remora" bench $what --clients "${REMORA_BENCH_CLIENTS:-1,4,16}" \
          --rounds "$rounds" "${extra[@]}" --json "$out/bench_$what.json" --png "$out/bench_$what.png" \
          > "$out/outputs/bench_$what.out" 2> "$out/outputs/bench_$what.err"; then
        result "bench $what" all pass "$(grep -c ' x' "$out/outputs/bench_$what.out") ratios"
        cat "$out/outputs/bench_$what.out"
      else
        result "bench $what" all fail "$(tail -n 2 "$out/outputs/bench_$what.err" | tr '\n' ' ')"
      fi
    done
  fi
  if [ $have_run = 1 ]; then
    # `remora bench fairness`: a greedy and a latency-sensitive tenant on the GPU, natively,
    # with time slicing (off) and under MPS shares (mps; the command starts and stops the MPS
    # control daemon when none runs).
    echo "remora bench fairness (${REMORA_BENCH_FAIRNESS:-off,mps})"
    if timeout "$long_limit" "$bin/remora" bench fairness --sharing "${REMORA_BENCH_FAIRNESS:-off,mps}" \
        --json "$out/bench_fairness.json" --png "$out/bench_fairness.png" \
        > "$out/outputs/bench_fairness.out" 2> "$out/outputs/bench_fairness.err"; then
      result "bench fairness" all pass "$(grep -c 'met' "$out/outputs/bench_fairness.out") goals judged"
      cat "$out/outputs/bench_fairness.out"
    else
      result "bench fairness" all fail "$(tail -n 2 "$out/outputs/bench_fairness.err" | tr '\n' ' ')"
    fi
  fi
  if [ $have_run = 1 ] && [ "${REMORA_BENCH_CONTENTION:-on}" != off ]; then
    # `remora bench contention` (issue 12 §4): launch + synchronize loops beside CPU-burning
    # processes (0, 1, 2 per core) for each way of waiting, with CPU and run-queue time per
    # round trip on both sides. REMORA_BENCH_CONTENTION_ARGS replaces the default cells.
    read -r -a cargs <<< "${REMORA_BENCH_CONTENTION_ARGS:---clients 1,4 --burn 0,1,2 --launches 0 --syncs 2000 --rounds 1}"
    echo "remora bench contention ${cargs[*]}"
    if timeout "$long_limit" "$bin/remora" bench contention "${cargs[@]}" \
        --json "$out/bench_contention.json" --png "$out/bench_contention.png" \
        > "$out/outputs/bench_contention.out" 2> "$out/outputs/bench_contention.err"; then
      result "bench contention" all pass "$(grep -c '^note: .* / better' "$out/outputs/bench_contention.out") comparisons"
      grep '^note' "$out/outputs/bench_contention.out"
    else
      result "bench contention" all fail "$(tail -n 2 "$out/outputs/bench_contention.err" | tr '\n' ' ')"
    fi
  fi
  python3 - "$out" "$rounds" "${bench_modes[@]}" <<'PY' || echo "bench.json: python3 failed"
import json, statistics, sys
out, rounds, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def flat(r):
    f = {}
    for k, v in r.items():
        if isinstance(v, dict):
            for kk in ("p50", "p99"):
                if kk in v: f[f"{k}.{kk}"] = v[kk]
        elif isinstance(v, (int, float)) and k.endswith(("per_launch", "_us")):
            f[k] = v
    for c in r.get("memcpy", []):
        key = f"memcpy.{c['dir']}.{c['mem']}.{c['bytes']}"
        f[key + ".us_per_copy"] = c["us_per_copy"]
        f[key + ".gbps"] = c["gbps"]
    return f

runs, med, spread = {}, {}, {}
for m in modes:
    runs[m] = []
    for r in range(1, rounds + 1):
        try:
            runs[m].append(json.load(open(f"{out}/outputs/driver_bench.r{r}.{m}.out")))
        except Exception as e:
            runs[m].append({"error": str(e)})
    fl = [flat(x) for x in runs[m] if "error" not in x]
    keys = set().union(*fl) if fl else set()
    med[m] = {k: statistics.median([f[k] for f in fl if k in f]) for k in keys}
    spread[m] = {k: [min(f[k] for f in fl if k in f), max(f[k] for f in fl if k in f)] for k in keys}
ratios = {}
native = med.get("native", {})
for m in modes:
    if m == "native": continue
    ratios[m] = {k: round(med[m][k] / v, 3) for k, v in sorted(native.items()) if k in med[m] and v}
null = {}
for m in ("shm", "unix", "tcp"):
    try: null[m] = json.load(open(f"{out}/outputs/bench_null.{m}.json"))
    except Exception: pass
json.dump({"rounds": rounds, "median": med, "min_max": spread, "ratios_remoted_over_native": ratios,
           "rpc_null_round_trip": null, "runs": runs,
           "note": "median over rounds, modes interleaved; ratios are remoted/native medians: >1 is slower for times (us), <1 is slower for gbps"},
          open(f"{out}/bench.json", "w"), indent=1, sort_keys=True)
for m, r in ratios.items():
    print(f"{m}: " + ", ".join(f"{k} x{v}" for k, v in r.items() if not k.startswith("memcpy") or k.endswith("gbps")))
for m, n in null.items():
    print(f"rpc null round trip {m}: p50 {n['p50_us']} us, p99 {n['p99_us']} us")
PY
  echo "native (round 1): $(tr -d '\n' < "$out/outputs/driver_bench.r1.native.out" | head -c 400)..."
fi

# 6. the PyTorch suite, when asked for (REMORA_SUITE_TORCH) and python3 can import torch
if [ -n "${REMORA_SUITE_TORCH:-}" ] && [ "$REMORA_SUITE_TORCH" != 0 ]; then
  echo "== 6. PyTorch suite (gpu/torch/suite.sh)"
  torch_modes=(); [ "$REMORA_SUITE_TORCH" != 1 ] && read -r -a torch_modes <<< "$REMORA_SUITE_TORCH"
  if ! python3 -c 'import torch' > "$out/outputs/torch-import.err" 2>&1; then
    result "torch suite" all skipped "python3 cannot import torch: $(tail -n 1 "$out/outputs/torch-import.err")"
  else
    "$src/torch/suite.sh" "$bin" "$out/torch" "${torch_modes[@]}"; trc=$?
    tsum=$(grep -o '[0-9]* passed, [0-9]* failed, [0-9]* skipped' "$out/torch/torch-suite.md" 2>/dev/null | head -n 1)
    if [ $trc -ne 0 ]; then result "torch suite" all fail "exit $trc: ${tsum:-no summary} (torch/torch-suite.md)"
    elif [[ ${tsum:-0 passed} == 0\ passed* ]]; then result "torch suite" all skipped "${tsum:-no summary}"
    else result "torch suite" all pass "$tsum (torch/torch-suite.md)"; fi
  fi
fi

# 7. NVIDIA's CUDA samples (programs nobody here wrote), when REMORA_SUITE_SAMPLES names the
# folder that holds their run.sh (the project does not carry them: copy them beside the binaries)
if [ -n "${REMORA_SUITE_SAMPLES:-}" ]; then
  echo "== 7. NVIDIA's CUDA samples ($REMORA_SUITE_SAMPLES/run.sh)"
  sample_modes=${REMORA_SUITE_SAMPLES_MODES:-shm tcp embedded}
  read -r -a sample_names <<< "${REMORA_SUITE_SAMPLES_ONLY:-}"
  if [ ! -f "$REMORA_SUITE_SAMPLES/run.sh" ]; then
    result "cuda samples" all fail "REMORA_SUITE_SAMPLES=$REMORA_SUITE_SAMPLES holds no run.sh"
  elif [ $have_run != 1 ]; then
    result "cuda samples" all skipped "no usable remora in $bin"
  else
    # A port of its own: the suite's server still listens on its own.
    sample_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    MODES=$sample_modes REPS=${REMORA_SUITE_SAMPLES_REPS:-1} PORT=$sample_port TIMEOUT=${REMORA_SUITE_SAMPLES_TIMEOUT:-120} \
      BUILD_DIR=${REMORA_SUITE_SAMPLES_BUILD:-$work/cuda-samples-build} \
      bash "$REMORA_SUITE_SAMPLES/run.sh" "$out/cuda-samples" "$bin" "${sample_names[@]}" > "$out/cuda-samples.txt" 2>&1
    tail -n 3 "$out/cuda-samples.txt"
    # One result per sample and remoted mode: pass when every timed run passed; skipped when
    # the sample fails natively too (or did not build); a native failure is a failure of its own.
    while IFS='|' read -r name mode status detail; do
      result "$name" "$mode" "$status" "$detail"
    done < <(python3 - "$out/cuda-samples" $sample_modes <<'PY'
import json, os, sys
out, modes = sys.argv[1], sys.argv[2:]
def rows(m):
    try: return {json.loads(l)["name"]: json.loads(l) for l in open(os.path.join(out, m + ".jsonl"))}
    except OSError: return {}
ok = lambda r: bool(r.get("build")) and r.get("passed") == r.get("reps")
tail = lambda r: " ".join((r.get("tail") or "").split())[-160:].replace("|", "/")
native = rows("native")
if not native: print("cuda samples|native|fail|run.sh wrote no native.jsonl (cuda-samples.txt)")
for name, n in native.items():
    if not ok(n): print(f"{name}|native|fail|{'does not build' if not n.get('build') else 'fails natively: ' + tail(n)}")
for m in modes:
    got = rows(m)
    for name, n in native.items():
        r = got.get(name)
        if not ok(n): print(f"{name}|{m}|skipped|fails natively")
        elif r is None: print(f"{name}|{m}|fail|no result (cuda-samples.txt)")
        elif ok(r): print(f"{name}|{m}|pass|{r['median_s'] / max(n['median_s'], 1e-9):.2f}x native time")
        else: print(f"{name}|{m}|fail|{r.get('passed')} of {r.get('reps')} runs passed: {tail(r)}")
PY
)
  fi
fi

echo "== summary"
summary="$pass passed, $fail failed, $skip skipped"
echo "$summary"
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
remora_version=null
[ $have_remora = 1 ] && remora_version="\"$(json_str "$("$bin/remora" --version 2>&1)")\""
{
  printf '{\n  "date": "%s",\n  "device": "%s",\n  "driver": "%s",\n  "commit": "%s",\n' \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(json_str "$device")" "$(json_str "$driver")" "$(json_str "${REMORA_COMMIT:-unknown}")"
  printf '  "remora": %s,\n  "remora_run": %s,\n' "$remora_version" "$([ $have_run = 1 ] && echo true || echo false)"
  printf '  "summary": {"passed": %d, "failed": %d, "skipped": %d},\n' $pass $fail $skip
  printf '  "results": [\n    %s\n  ]\n}\n' "$(IFS=$'\n'; echo "${results[*]}" | paste -sd, | sed 's/},{/},\n    {/g')"
} > "$out/suite.json"
{
  echo "# GPU suite: $summary"
  echo
  echo "$device, driver $driver, commit ${REMORA_COMMIT:-unknown}, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "| program | mode | status | detail |"
  echo "|---|---|---|---|"
  for r in "${results[@]}"; do
    python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("| %s | %s | %s | %s |" % (r["program"], r["mode"], r["status"], r["detail"].replace("|", "/")))' "$r" 2>/dev/null
  done
} > "$out/suite.md"
[ $fail -eq 0 ]
