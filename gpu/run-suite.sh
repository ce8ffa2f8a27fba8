#!/usr/bin/env bash
# The GPU suite: run on a GPU host with prebuilt Remora binaries.
#
#   gpu/run-suite.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds a release `remora` built on the development machine (the GPU host has no Rust
# toolchain). OUT_DIR receives suite.json and suite.md.
#
# Steps, as the project requires of this script:
#   1. build the GPU test programs with the host's nvcc;
#   2. run each natively and under Remora;
#   3. compare their outputs;
#   4. run the benchmarks.
# Today Remora serves the HELLO handshake only (the CUDA driver shim is issue 3), so the one
# "program" is the device inventory: nvidia-smi natively against `remora info` through a real
# `remora serve`. CUDA programs join this script as the shim lands.
set -uo pipefail
bin=$(cd "${1:?usage: run-suite.sh BIN_DIR OUT_DIR}" && pwd)
out=${2:?usage: run-suite.sh BIN_DIR OUT_DIR}
mkdir -p "$out"
work=$(mktemp -d)
trap 'kill $serve_pid 2>/dev/null; rm -rf "$work"' EXIT

pass=0; fail=0
result() { # name status detail
  if [ "$2" = ok ]; then pass=$((pass+1)); else fail=$((fail+1)); fi
  printf '%-28s %s %s\n' "$1" "$2" "$3"
  results+=("{\"test\":\"$1\",\"status\":\"$2\",\"detail\":\"${3//\"/\'}\"}")
}
results=()

echo "== 1. build GPU test programs"
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  echo "nvcc: $($nvcc --version | tail -n 1)"
else
  echo "nvcc not found"
fi
echo "(no CUDA test programs yet: the driver shim is issue 3)"

echo "== 2. native vs Remora: device inventory"
nvidia-smi --query-gpu=index,name,uuid,memory.total,pci.bus_id --format=csv,noheader > "$work/native.csv" 2>&1
native_rc=$?
cat "$work/native.csv"
sock="$work/remora.sock"
"$bin/remora" serve --listen "unix://$sock" --listen tcp://127.0.0.1:0 > "$work/serve.out" 2> "$work/serve.err" &
serve_pid=$!
for _ in $(seq 100); do [ "$(grep -c 'listening on' "$work/serve.out")" -ge 2 ] && break; sleep 0.1; done
tcp=$(grep -o 'tcp://[0-9.:]*' "$work/serve.out" | head -n 1)
"$bin/remora" info --server "unix://$sock" > "$work/info-unix.txt" 2>&1; info_rc=$?
"$bin/remora" info --server "$tcp" > "$work/info-tcp.txt" 2>&1; info_tcp_rc=$?
cat "$work/info-unix.txt"

echo "== 3. compare"
if [ $native_rc -ne 0 ]; then
  result inventory fail "nvidia-smi failed: $(head -c 200 "$work/native.csv")"
elif [ $info_rc -ne 0 ] || [ $info_tcp_rc -ne 0 ]; then
  result inventory fail "remora info failed: $(head -c 300 "$work/info-unix.txt")"
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
  if [ $ok = 1 ]; then result inventory ok "$native_count GPU(s) match nvidia-smi over unix and tcp"; else result inventory fail "mismatch, see log"; fi
fi
grep -i 'driver' "$work/info-unix.txt" | head -n 1

echo "== 4. benchmarks"
echo "(GPU benchmarks arrive with the driver shim; the RPC benchmark runs on the development machine: remora bench rpc)"

echo "== summary"
echo "$pass passed, $fail failed"
{
  printf '{\n  "date": "%s",\n  "device": "%s",\n  "driver": "%s",\n  "remora": "%s",\n  "results": [%s]\n}\n' \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)" \
    "$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)" \
    "$("$bin/remora" --version)" \
    "$(IFS=,; echo "${results[*]}")"
} > "$out/suite.json"
cp "$work/info-unix.txt" "$out/remora-info.txt"
cp "$work/native.csv" "$out/nvidia-smi.csv"
[ $fail -eq 0 ]
