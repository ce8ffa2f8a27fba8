#!/usr/bin/env bash
# One device call's worth of GPU work, by name, for a session's short lease on a GPU host:
#
#   gpu/tools/device_calls.sh BIN_DIR STEP...
#
# BIN_DIR holds a release `remora` and the shim (libcuda.so) beside it. Every STEP writes into
# $OUT (else ./device-out) as at most a few files: a device call brings back 8 files, two
# folders down, so each step tars its raw outputs into one STEP.tar.gz beside a short STEP.txt.
# The GPU programs are built once per machine into REMORA_CALLS_BUILD (default /tmp/gpubuild)
# and reused by later calls on the same warm machine.
#
# Steps:
#   suite     gpu/run-suite.sh, programs only (REMORA_SUITE_SKIP_BENCH=1): every GPU program
#             natively and over shm, unix, tcp and embedded, compared byte for byte
#   attrib    where a short program's time goes: native and embedded vecadd alternately
#             (5 each) and the last embedded run's start-up timeline; `remora run -- true`
#             against `true` (a program that never calls CUDA); a native process's exit after
#             its context is destroyed and with it alive, by exit and by _exit
#             (gpu/tools/startup_probe.c's exit_at_ms, STARTUP_PROBE_LIVE), on the idle GPU
#             and held; stream_ordered,
#             managed_memory and multithread natively and against a standing shm server with
#             `remora run --profile`; then vecadd native and embedded alternately while that
#             standing server holds the GPU, with the last embedded run's timeline
#   startup   gpu/bench-startup.sh over REMORA_STARTUP_TRANSPORTS (default here: shm), no torch
#             (more than 4 min: give the call 8; its log grows in $OUT/startup-progress.log,
#             so a call cut short still brings back how far it got)
#   programs  REMORA_CALLS_PROGRAMS (default: managed_memory stream_ordered cublas_simple, the
#             three programs over 30 ms slower embedded than native in session 30's bench
#             startup) natively and embedded alternately, twice each, the embedded runs with
#             `remora run --profile` and their start-up timeline, client and server profiles:
#             where an embedded run's extra time goes beyond start-up; then
#             gpu/tools/pool_probe.cu (stream_ordered's pattern, each call timed) natively and
#             embedded, twice, and once more embedded with both profiles; with
#             REMORA_CALLS_PROGRAMS_EXPERIMENT="VAR=VALUE..." each program also runs embedded
#             twice more with those set (e.g. REMORA_WAIT_SIGNAL_HOLD_US=0), against native;
#             with REMORA_CALLS_PROGRAMS_HELD=1 all of it runs while a standing shm server
#             holds the GPU (as bench startup's held phase: the driver and contexts kept open),
#             each line marked "held"
#   contention `remora bench contention --burn REMORA_CALLS_BURN` (default 2) over
#             REMORA_CALLS_TRANSPORTS (default shm,tcp) with REMORA_CALLS_CLIENTS (default 1,4)
#             clients, spin, block and adaptive, REMORA_CALLS_ROUNDS rounds (default 3), then, when
#             REMORA_CALLS_EXPERIMENT="VAR=VALUE..." is set, once more with them exported (an
#             experiment against the default in one call; several, separated by ';', run
#             one after another; REMORA_CALLS_NO_DEFAULT=1 leaves the default run out), or with
#             REMORA_CALLS_EXPERIMENT=serve:ARG... once more with each ARG given to the
#             servers it starts (e.g. serve:--isolation=thread), or with idle:N once more
#             beside N spinners under SCHED_IDLE (idle cores kept out of their idle state,
#             given way to at once); REMORA_CALLS_TRACE=1 traces the
#             waits (REMORA_WAIT_TRACE) into the tarred .txt files; each round may take
#             REMORA_CALLS_ROUND_S seconds (default 95; give 16 clients 150 a transport and load);
#             a call cut short still brings back each run's JSON of the rounds it finished
#             (written into $OUT after every round) and contention.tar.gz of the runs that
#             ended; REMORA_CALLS_RUN_S bounds each run (default ROUND_S x ROUNDS x ways):
#             keep it under what is left of the call, so the last run's texts come back too;
#             REMORA_CALLS_SHARING=off,mps (default off) measures every cell again under MPS
#             (bench contention --sharing: the MPS control daemon started when none runs,
#             native clients under it too, servers with --gpu-share mps; modes TRANSPORT/mps);
#             REMORA_CALLS_BENCH_ARGS adds words to every run's bench contention command
#             line (e.g. "--long-every 4": a long kernel every 4th launch + synchronize)
#   samples   NVIDIA's CUDA samples (a copy in BIN_DIR/cuda-samples) in
#             REMORA_SUITE_SAMPLES_MODES (default here: tcp)
#   torch     gpu/torch/suite.sh over REMORA_CALLS_TORCH_MODES (default shm) with
#             TORCH_CHECKS and TORCH_MODELS as set (default here: no checks, the cnn model)
#   goals     issue 12's §2, §3 and §5 figures: `bench launch` (1 client, shm, unix and tcp)
#             and `bench copy --raw-tcp` (1 client, 64 MiB, tcp and unix), 3 rounds each
#             (REMORA_CALLS_ROUNDS), about 2 minutes; then gpu/tools/issue12_goals.py over
#             every report in $OUT (a `startup` or `contention` step earlier in the same call
#             adds §1 and §4) into goals.md
#   sched     the host's scheduler, idle and SMT facts (kernel, cpuidle driver and governor,
#             threads per core) and
#             gpu/tools/slice_probe.c: a futex-woken thread's wait for a core among 1x and 2x
#             cores' worth of burners, with the default slice and a 100 µs one, its peer
#             sleeping at once or after 15 µs of spinning (about 20 s; no GPU)
set -uo pipefail
usage="usage: device_calls.sh BIN_DIR STEP..."
bin=$(cd "${1:?$usage}" && pwd); shift
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
src=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$PWD/device-out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
build=${REMORA_CALLS_BUILD:-/tmp/gpubuild}
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
# shellcheck source=gpu/modes.sh
. "$src/modes.sh"  # start_serve, remora_commit
remora_commit "$bin"
commit=${REMORA_COMMIT:-unknown}
echo "device_calls $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1) $(nproc) cores, commit $commit"

build_once() {
  [ -f "$build/.built" ] && return 0
  local t0=$SECONDS
  mkdir -p "$build"
  gpu_build_log=$work/build.log
  if "$src/build.sh" "$build" > "$gpu_build_log" 2>&1; then
    touch "$build/.built"; echo "built the GPU programs in $((SECONDS - t0)) s"
  else
    tail -n 30 "$gpu_build_log"; echo "gpu/build.sh failed"; return 1
  fi
}

ms_now() { date +%s%3N; }
# timed LABEL CMD...: runs CMD, prints "LABEL N ms rc=R"
timed() {
  local label=$1; shift
  local t0 t1 rc
  t0=$(ms_now); "$@" > "$work/timed.out" 2> "$work/timed.err"; rc=$?; t1=$(ms_now)
  echo "$label $((t1 - t0)) ms rc=$rc"
}

step_suite() {
  local d=$work/suite
  REMORA_SUITE_SKIP_BENCH=1 REMORA_SUITE_BUILD=$build "$src/run-suite.sh" "$bin" "$d" > "$d.log" 2>&1
  echo "run-suite rc=$?"
  tail -n 3 "$d.log"
  grep -E "\| (fail|skipped) \|" "$d/suite.md" | head -n 20
  cp "$d/suite.md" "$out/suite.md"; cp "$d/suite.json" "$out/suite.json"
  [ -f "$d/timing.json" ] && cp "$d/timing.json" "$out/suite-timing.json"
  tar -C "$work" -czf "$out/suite.tar.gz" suite suite.log
}

# alternate PREFIX HEADING: vecadd cubin natively and embedded (shm) 5 times each, 0.5 s idle
# before each run, each embedded run with its steps in one line (tools/run_summary.py); the
# last embedded run's start-up timeline is appended under HEADING to $work/timeline.txt; then
# that timeline's lines, times as the seconds' fraction
alternate() {
  local prefix=$1 heading=$2
  for i in 1 2 3 4 5; do
    sleep 0.5; timed "${prefix}native vecadd" "$build/vecadd" cubin
    sleep 0.5
    REMORA_LOG=warn,remora::startup=debug,remora_server::worker_pool=info \
      timed "${prefix}embedded-shm vecadd" "$bin/remora" run -- "$build/vecadd" cubin
    python3 "$src/tools/run_summary.py" "$work/timed.err"
    [ "$i" = 5 ] && { echo "== $heading"; cat "$work/timed.err"; } >> "$work/timeline.txt"
  done
  echo; echo "== that last embedded run's timeline"
  sed -n "/^== $heading\$/,/^== /p" "$work/timeline.txt" \
    | grep -E "remora::startup|worker_pool|client (connected|session)" | sed -E 's/^[0-9T:-]+\.([0-9]+)Z/\1/'
}

# probe_runs PREFIX: startup_probe (built by step_attrib) 3 times each, in turn: with
# cuCtxDestroy, exiting with its context alive (STARTUP_PROBE_LIVE=1), and leaving by _exit(2)
# with it alive (no atexit handler runs): each step's milliseconds and how long the exit took
# after main returned.
probe_runs() {
  local i live
  for i in 1 2 3; do
    for live in 0 1 _exit; do
      sleep 0.3
      STARTUP_PROBE_LIVE=$live python3 - "$work/startup_probe" "$1" <<'EOF'
import os, subprocess, sys, time
t0 = time.monotonic() * 1e3
o = subprocess.run([sys.argv[1], "16"], capture_output=True, text=True).stdout
t1 = time.monotonic() * 1e3
steps = " ".join(l for l in o.splitlines() if not l.startswith("exit_at_ms"))
how = {"1": "context alive", "_exit": "context alive, _exit"}.get(os.environ.get("STARTUP_PROBE_LIVE"), "context destroyed")
print(f"{sys.argv[2]}startup_probe ({how}) whole {t1 - t0:.1f} ms, exit after main returned {t1 - float(o.split()[-1]):.1f} ms | {steps}")
EOF
    done
  done
}

step_attrib() {
  build_once || return 1
  local r=$out/attrib.txt
  export REMORA_GPU_KERNELS=$build
  {
    echo "== vecadd cubin, native and embedded (shm) alternately; settle 0.5 s before each"
    alternate "" "embedded vecadd, no server up"
    echo; echo "== a program that never calls CUDA"
    for _ in 1 2 3; do sleep 0.3; timed "native true" true; sleep 0.3; timed "embedded true" "$bin/remora" run -- true; done
    echo; echo "== a native process's exit after cuCtxDestroy, and with its context alive (startup_probe)"
    local nvcc inc probe_ok=0
    nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    inc=$(dirname "$(dirname "$nvcc")")/include
    cc -O2 -I"$inc" -o "$work/startup_probe" "$src/tools/startup_probe.c" -ldl && probe_ok=1
    [ $probe_ok = 1 ] && probe_runs ""
    echo; echo "== stream_ordered, managed_memory, multithread: native and a standing shm server (--profile)"
    start_serve "$bin" "$work"
    for p in stream_ordered managed_memory multithread; do
      for _ in 1 2; do
        sleep 0.5; timed "native $p" "$build/$p"
        sleep 0.5; timed "standing-shm $p" "$bin/remora" run --profile --transport shm --server "unix://$sock" -- "$build/$p"
      done
      { echo "== $p"; cat "$work/timed.err"; } >> "$work/profiles.txt"
    done
    echo; echo "== vecadd cubin, native and embedded alternately while that standing server holds the GPU"
    alternate "held " "embedded vecadd beside a standing server"
    if [ $probe_ok = 1 ]; then
      echo; echo "== startup_probe while that standing server holds the GPU"
      probe_runs "held "
    fi
    kill "$serve_pid" 2>/dev/null; wait "$serve_pid" 2>/dev/null; serve_pid=
  } > "$r" 2>&1
  cat "$r"
  cp "$work/timeline.txt" "$work/profiles.txt" "$out/" 2>/dev/null
}

step_programs() {
  build_once || return 1
  local r=$out/programs.txt p
  : > "$r"
  # The embedded server's profiles too: its per-procedure table (remora_oncrpc) and its
  # launch and copy lines (remora_server::profile).
  local profile_log=warn,remora::startup=debug,remora::module_load=debug,remora_server::worker_pool=info,remora_oncrpc::server::profile=info,remora_server::profile=info
  export REMORA_GPU_KERNELS=$build
  local held=
  if [ "${REMORA_CALLS_PROGRAMS_HELD:-0}" = 1 ]; then
    start_serve "$bin" "$work"; held="held "
    echo "a standing shm server holds the GPU (pid $serve_pid): every run below is held" > "$r"
  fi
  {
    for p in ${REMORA_CALLS_PROGRAMS:-managed_memory stream_ordered cublas_simple}; do
      for _ in 1 2; do
        sleep 0.5; timed "${held}native $p" "$build/$p"
        sleep 0.5
        REMORA_LOG=$profile_log timed "${held}embedded-shm $p" "$bin/remora" run --profile -- "$build/$p"
        python3 "$src/tools/run_summary.py" "$work/timed.err"
      done
      echo "== $held$p: the last embedded run's timeline and profiles (client, then server)"
      grep -E "remora::startup|worker_pool|client (connected|session)|^procedure|^rm_|^ +RM_|^\(within|profile:" "$work/timed.err" \
        | sed -E 's/^[0-9T:-]+\.([0-9]+)Z/\1/'
      # Each module's image: its size, the server's SHA-256 check, the driver's load.
      grep -E "remora::module_load" "$work/timed.err" | sed -E 's/^[0-9T:-]+\.([0-9]+)Z/\1/; s/ DEBUG remora::module_load://'
      if [ -n "${REMORA_CALLS_PROGRAMS_EXPERIMENT:-}" ]; then
        # The same embedded run with the experiment's variables, against a native run
        # beside each (word-split on purpose: VAR=VALUE words).
        for _ in 1 2; do
          sleep 0.5; timed "${held}native $p" "$build/$p"
          sleep 0.5
          # shellcheck disable=SC2086
          REMORA_LOG=$profile_log timed "${held}embedded-shm $p ($REMORA_CALLS_PROGRAMS_EXPERIMENT)" \
            env $REMORA_CALLS_PROGRAMS_EXPERIMENT "$bin/remora" run -- "$build/$p"
          python3 "$src/tools/run_summary.py" "$work/timed.err"
        done
        echo "== $p ($REMORA_CALLS_PROGRAMS_EXPERIMENT): the last run's end"
        grep -E "remora::startup" "$work/timed.err" | grep -E "exited|freed|destroyed|left to|leaves|released|stopped" \
          | sed -E 's/^[0-9T:-]+\.([0-9]+)Z/\1/'
      fi
    done
    # stream_ordered's pattern with every call timed, natively and embedded: which calls
    # carry a remoted run's extra time (session 32: a pageable copy's synchronize, 1431 µs
    # per 4 MiB before 861064a, 420-456 after).
    echo "== ${held}pool_probe (gpu/tools/pool_probe.cu): native, then embedded, twice"
    local nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    if "$nvcc" -O2 -o "$work/pool_probe" "$src/tools/pool_probe.cu" > "$work/pool_probe.log" 2>&1; then
      for _ in 1 2; do
        echo "-- native"; "$work/pool_probe"
        echo "-- embedded-shm"; "$bin/remora" run -- "$work/pool_probe"
      done
      echo "-- embedded-shm, profiled (client, then server)"
      REMORA_LOG=$profile_log "$bin/remora" run --profile -- "$work/pool_probe" 2> "$work/pool_probe.err"
      grep -E "^procedure|^rm_|^ +RM_|profile:" "$work/pool_probe.err"
    else
      echo "pool_probe did not build:"; cat "$work/pool_probe.log"
    fi
  } >> "$r" 2>&1
  if [ -n "$held" ]; then kill "$serve_pid" 2>/dev/null; wait "$serve_pid" 2>/dev/null; serve_pid=; fi
  cat "$r"
}

step_startup() {
  build_once || return 1
  local d=$work/startup; mkdir -p "$d"
  REMORA_STARTUP_TRANSPORTS=${REMORA_STARTUP_TRANSPORTS:-shm} REMORA_STARTUP_TORCH=${REMORA_STARTUP_TORCH:-0} \
    "$src/bench-startup.sh" "$bin" "$build" "$d" 2>&1 | tee "$out/startup-progress.log" > "$work/startup.log"
  echo "bench-startup rc=${PIPESTATUS[0]}"
  grep -E "^(==|whole|mode|note)|x[0-9]" "$work/startup.log" | tail -n 60
  cp "$d"/*.json "$out/" 2>/dev/null
  tar -C "$work" -czf "$out/startup.tar.gz" startup startup.log
  # The progress log is what comes back of a call cut short; a finished step has it tarred.
  rm -f "$out/startup-progress.log"
}

step_contention() {
  local burn=${REMORA_CALLS_BURN:-2} runs=() exp
  local transports=${REMORA_CALLS_TRANSPORTS:-shm,tcp} clients=${REMORA_CALLS_CLIENTS:-1,4}
  local sharing=${REMORA_CALLS_SHARING:-off} ways
  ways=$(echo "$sharing" | tr ',' '\n' | grep -c .)
  [ "${REMORA_CALLS_NO_DEFAULT:-0}" = 1 ] || runs+=(default)
  # Several experiments, one run each, separated by ';'.
  IFS=';' read -r -a exps <<< "${REMORA_CALLS_EXPERIMENT:-}"
  for exp in "${exps[@]}"; do
    exp=$(echo "$exp" | xargs)
    [ -n "$exp" ] && runs+=("$exp")
  done
  [ ${#runs[@]} -gt 0 ] || { echo "contention: nothing to run (REMORA_CALLS_NO_DEFAULT=1 and no experiment)"; return 1; }
  for run in "${runs[@]}"; do
    local tag=contention-${run//[^A-Za-z0-9._-]/_}
    echo "== bench contention --transports $transports --clients $clients --burn $burn --sharing $sharing ($run)"
    (
      # serve:ARG... passes each ARG to the servers the bench starts (--serve-arg), e.g.
      # serve:--isolation=thread; anything else is one or more VAR=VALUE words, exported.
      extra=()
      case $run in
        default) ;;
        serve:*) for a in ${run#serve:}; do extra+=("--serve-arg=$a"); done ;;
        idle:*)
          # idle:N: N spinners under SCHED_IDLE beside the run, which keep idle cores out of
          # their idle state (a halted vCPU wakes slowly) and give way at once to any other
          # thread: what waking on an idle core costs the cell.
          fillers=()
          for _ in $(seq "${run#idle:}"); do
            chrt --idle 0 sh -c 'while :; do :; done' & fillers+=($!)
          done
          trap 'kill "${fillers[@]}" 2>/dev/null' EXIT
          echo "idle fillers: ${#fillers[@]} (SCHED_IDLE)" ;;
        *) for kv in $run; do export "${kv?}"; done ;;
      esac
      # Each waiter's counts and wait-time histogram (gpu/README.md), in the .txt.
      [ "${REMORA_CALLS_TRACE:-0}" = 1 ] && export REMORA_WAIT_TRACE=1 REMORA_LOG=warn,remora::wait=info
      # 95 s a round at most (REMORA_CALLS_ROUND_S): a round of shm and tcp, 1 and 4 clients,
      # 1x and 2x load took about 50 s in session 31; one of shm, unix and tcp with 4 and 16
      # clients at 2x load alone took over 95 s in session 39 (16 clients: 6-12 s a cell).
      # REMORA_CALLS_RUN_S bounds one run as a whole instead (set it below the call's limit
      # so that a run cut short ends here, and its report and traces still come back).
      timeout "${REMORA_CALLS_RUN_S:-$((${REMORA_CALLS_ROUND_S:-95} * ${REMORA_CALLS_ROUNDS:-3} * ways))}" "$bin/remora" bench contention --transports "$transports" --clients "$clients" --burn "$burn" \
        --sharing "$sharing" --policies spin,block,adaptive --syncs 1000 --rounds "${REMORA_CALLS_ROUNDS:-3}" "${extra[@]}" \
        ${REMORA_CALLS_BENCH_ARGS:-} \
        --json "$out/$tag.json" --png "$work/$tag.png" > "$work/$tag.txt" 2>&1
      echo "exit $?"
    )
    grep -E "^note: .*launch_sync\.(p50|mean): adaptive|environment" "$work/$tag.txt"
    # The report is written into $OUT after each round (a call cut short keeps the rounds
    # it finished); the texts, traces and plots of every run so far are tarred as each run
    # ends, so a later run cut short does not take the earlier ones' with it.
    cp "$out/$tag.json" "$work/" 2>/dev/null
    (cd "$work" && tar -czf "$out/contention.tar.gz.part" contention-* && mv "$out/contention.tar.gz.part" "$out/contention.tar.gz")
  done
}

step_samples() {
  local d=$work/samples
  REMORA_SUITE_ONLY=none REMORA_SUITE_SKIP_BENCH=1 REMORA_SUITE_SAMPLES=$bin/cuda-samples \
    REMORA_SUITE_SAMPLES_MODES=${REMORA_SUITE_SAMPLES_MODES:-tcp} \
    "$src/run-suite.sh" "$bin" "$d" > "$work/samples.log" 2>&1
  echo "samples rc=$?"
  tail -n 3 "$work/samples.log"
  cp "$d/cuda-samples.txt" "$out/" 2>/dev/null
  tar -C "$work" -czf "$out/samples.tar.gz" samples samples.log
}

step_torch() {
  local d=$work/torch
  # shellcheck disable=SC2086  # the modes are words
  TORCH_CHECKS=${TORCH_CHECKS-} TORCH_MODELS=${TORCH_MODELS-cnn} \
    "$src/torch/suite.sh" "$bin" "$d" ${REMORA_CALLS_TORCH_MODES:-shm} > "$work/torch.log" 2>&1
  echo "torch suite rc=$?"
  # Every run's line, not only the last ones: a call whose $OUT holds more than it can bring
  # back (8 files) loses torch-suite.md, and this output is then the record.
  grep -E '^[a-z0-9_-]+ +(native2?|shm|unix|tcp|embedded) ' "$work/torch.log"
  tail -n 2 "$work/torch.log"
  cp "$d/torch-suite.md" "$d/torch-suite.json" "$out/" 2>/dev/null
  tar -C "$work" -czf "$out/torch.tar.gz" torch torch.log
}

step_goals() {
  local rounds=${REMORA_CALLS_ROUNDS:-3} what
  for what in launch copy; do
    local extra=(--transports shm,unix,tcp)
    [ $what = copy ] && extra=(--transports tcp,unix --raw-tcp --reps 5)
    echo "== bench $what --clients 1 --rounds $rounds ${extra[*]}"
    timeout 240 "$bin/remora" bench $what --clients 1 --rounds "$rounds" "${extra[@]}" \
      --json "$out/bench-$what.json" --png "$work/bench-$what.png" > "$work/bench-$what.txt" 2>&1
    echo "exit $?"
    grep -E " x[0-9]" "$work/bench-$what.txt" | head -n 30
  done
  python3 "$src/tools/issue12_goals.py" --md "$out/goals.md" "$out"/*.json
  (cd "$work" && tar -czf "$out/goals.tar.gz" bench-*)
}

step_sched() {
  echo "kernel $(uname -r); cpuidle driver $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none), governor $(cat /sys/devices/system/cpu/cpuidle/current_governor 2>/dev/null || cat /sys/devices/system/cpu/cpuidle/current_governor_ro 2>/dev/null || echo none); base slice $(cat /sys/kernel/debug/sched/base_slice_ns 2>/dev/null || echo unknown) ns"
  # SMT: which CPUs share a core (a client and its server on two threads of one core share
  # its pipeline while both spin).
  echo "threads per core $(lscpu 2>/dev/null | awk -F: '/^Thread\(s\) per core/ {gsub(/ /, "", $2); print $2}'); core siblings of cpu0: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>/dev/null || echo unknown)"
  cc -O2 -pthread -o "$work/slice_probe" "$src/tools/slice_probe.c" || return 1
  local n b s p
  n=$(nproc)
  for b in "$n" $((2 * n)); do
    for p in 0 15; do
      for s in 0 100; do
        timeout 60 "$work/slice_probe" "$b" "$s" "$p" 20000
      done
    done
  done | tee "$out/sched.txt"
}

for step in "$@"; do
  t0=$SECONDS
  echo "===== $step"
  case $step in
    suite|attrib|startup|programs|contention|samples|torch|goals|sched) "step_$step" ;;
    *) echo "unknown step $step (suite, attrib, startup, programs, contention, samples, torch, goals, sched)"; exit 2 ;;
  esac
  echo "===== $step took $((SECONDS - t0)) s"
done
