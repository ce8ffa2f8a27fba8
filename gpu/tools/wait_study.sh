#!/usr/bin/env bash
# Where adaptive waiting still loses (issue 12 §4), on a GPU host, in one call of ~5 minutes:
#
#   1. `bench contention` traced (REMORA_WAIT_TRACE: each waiter's counts and its histogram of
#      wait times, `took_us`), 1 and 4 clients, no load and 1x load, spin/block/adaptive,
#      REMORA_STUDY_ROUNDS rounds (default 3) of REMORA_STUDY_SYNCS round trips per client
#      (default 1000; pure polling under load can take milliseconds each): once with the
#      spare-core spin off (REMORA_WAIT_SPARE_SPIN_US=0) and once with
#      REMORA_WAIT_SPARE_SPIN_US=REMORA_STUDY_SPARE_US (default 1000, the default value) exported;
#   2. which side's spinning makes 4 TCP clients faster than native on an idle host (session
#      26's lead): a standing `remora serve` on TCP loopback with one REMORA_WAIT and `bench
#      launch --server` clients with another, for each pair of spin and adaptive.
#
#   gpu/tools/wait_study.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds `remora` and its shim (libcuda.so). Writes OUT_DIR/contention-{off,spare}.
# {json,png,txt}, OUT_DIR/waits-{off,spare}.txt (the trace lines under their headings),
# OUT_DIR/split-SERVER-CLIENTS.{json,txt} and OUT_DIR/summary.txt. REMORA_STUDY_EMULATED=1
# runs it against the emulated backend (no GPU: a check of the script itself, no figures).
set -uo pipefail
bin=$(cd "${1:?usage: wait_study.sh BIN_DIR OUT_DIR}" && pwd)
out=${2:?usage: wait_study.sh BIN_DIR OUT_DIR}; mkdir -p "$out"; out=$(cd "$out" && pwd)
rounds=${REMORA_STUDY_ROUNDS:-3}
syncs=${REMORA_STUDY_SYNCS:-1000}
spare_us=${REMORA_STUDY_SPARE_US:-1000}
remora=$bin/remora
emu=()
serve_emu=()
if [ "${REMORA_STUDY_EMULATED:-0}" = 1 ]; then
  emu=(--shim "$bin/libcuda.so" --serve-arg=--backend --serve-arg=emulated --no-native)
  serve_emu=(--backend emulated)
  export REMORA_BENCH_IMAGE=$'REMORA-EMU-MODULE\nfunc remora_bench_empty\n'
  export REMORA_BENCH_KERNEL=remora_bench_empty
fi
summary=$out/summary.txt
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
say "wait_study $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || echo 'no GPU') ($(nproc) cores), $("$remora" --version)"

# 1. Traced contention, with the spare-core spin off and on.
for run in off spare; do
  us=0
  [ "$run" = spare ] && us=$spare_us
  say "== contention ($run, REMORA_WAIT_SPARE_SPIN_US=$us)"
  env "REMORA_WAIT_SPARE_SPIN_US=$us" REMORA_WAIT_TRACE=1 REMORA_LOG=warn,remora::wait=info \
    timeout 250 "$remora" bench contention "${emu[@]}" --transports shm,tcp --clients 1,4 \
    --burn 0,1 --policies spin,block,adaptive --launches 0 --syncs "$syncs" --rounds "$rounds" \
    --json "$out/contention-$run.json" --png "$out/contention-$run.png" \
    > "$out/contention-$run.txt" 2>&1
  say "exit $?"
  # The trace lines under their load/policy heading and cell (a client's lines follow its
  # cell's progress line; the servers' come when their connections end).
  grep -E "^== |^\[[0-9]+/[0-9]+\] round|waits waiter" "$out/contention-$run.txt" | sed -E \
    's/^(\[[0-9]+\/[0-9]+\] round [0-9]+: [^.]*)\.\.\. .*waits (waiter=.*)$/\1\n  \2/; t
     s/^(\[[0-9]+\/[0-9]+\] round [0-9]+: [^.]*)\.\.\. .*$/\1/; t
     s/^.*waits (waiter=)/  \1/' > "$out/waits-$run.txt"
  grep -E "^note: .*launch_sync\.(p50|mean): adaptive" "$out/contention-$run.txt" | tee -a "$summary"
done

# 2. Split sides: a standing server waiting one way, clients another (4 TCP clients, idle).
port=$((40000 + RANDOM % 20000))
for server_wait in spin adaptive; do
  for client_wait in spin adaptive; do
    tag=$server_wait-$client_wait
    REMORA_WAIT=$server_wait "$remora" serve "${serve_emu[@]}" --listen "tcp://127.0.0.1:$port" \
      > "$out/split-$tag.serve.txt" 2>&1 &
    spid=$!
    for _ in $(seq 100); do
      "$remora" info --server "tcp://127.0.0.1:$port" > /dev/null 2>&1 && break
      sleep 0.1
    done
    say "== split: server REMORA_WAIT=$server_wait, clients REMORA_WAIT=$client_wait"
    REMORA_WAIT=$client_wait timeout 120 "$remora" bench launch "${emu[@]}" \
      --server "tcp://127.0.0.1:$port" --transports tcp --clients 4 --rounds "$rounds" \
      --json "$out/split-$tag.json" > "$out/split-$tag.txt" 2>&1
    say "exit $?"
    sed -n '/^metric/,$p' "$out/split-$tag.txt" | grep -E "launch_sync\.(p50|mean|client_cpu)" | tee -a "$summary"
    kill "$spid" 2>/dev/null
    wait "$spid" 2>/dev/null
    port=$((port + 1))
  done
done
say "wait_study: done; $summary"
