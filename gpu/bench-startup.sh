#!/usr/bin/env bash
# `remora bench startup` on a GPU host: the whole run of short GPU test programs, natively and
# under `remora run` (a fresh embedded server per run, and standing servers; shm, unix and
# tcp), as ratios against native measured in the same run (issue 12: start-up).
#
#   gpu/bench-startup.sh BIN_DIR BUILD_DIR [OUT_DIR]
#
# BIN_DIR holds a release `remora` and the shim libcuda.so beside it (as for run-suite.sh, or
# REMORA_SHIM names the shim); BUILD_DIR the GPU programs, built first with
# `gpu/build.sh BUILD_DIR` (this script fails if one it needs is missing). OUT_DIR (default:
# $OUT when set, else the repository's bench/results) receives
#   bench-startup-DATE-DEVICE-COMMIT.{json,png}         the programs of gpu/startup-programs.txt
#                                                        (copied into BUILD_DIR, whose paths it
#                                                        holds), 3 rounds: each program and the
#                                                        whole run of all of them
#   bench-startup-vecadd-DATE-DEVICE-COMMIT.{json,png}  vecadd alone, 10 rounds: one program's
#                                                        start-up
#   bench-startup-torch-DATE-DEVICE-COMMIT.{json,png}   python3 gpu/torch/startup.py (import
#                                                        torch, one small kernel), 3 rounds,
#                                                        where python3 imports torch (skip it
#                                                        with REMORA_STARTUP_TORCH=0)
# Each run is a fresh process timed from spawn to exit, after an untimed warm-up of every
# program in every mode; `remora bench plot --json F --png P` draws a report again.
# Env: REMORA_COMMIT (recorded in the reports and in the file names; default: the commit
#   `remora --version` names, else unknown),
# REMORA_STARTUP_MODES (default native,embedded,standing), REMORA_STARTUP_TRANSPORTS (default
# shm,unix,tcp), REMORA_DEVICE_TAG (the DEVICE of the file names; default from nvidia-smi, e.g.
# h100). On the H100 the first two benchmarks take about 5 minutes together (25 programs, 7
# modes, a warm-up and 3 rounds; then vecadd 11 times in 7 modes); PyTorch's adds about a
# minute and a half (4 runs of ~2-3 s in 7 modes).
set -euo pipefail
usage="usage: bench-startup.sh BIN_DIR BUILD_DIR [OUT_DIR]"
bin=$(cd "${1:?$usage}" && pwd)
build=$(cd "${2:?$usage}" && pwd)
src=$(cd "$(dirname "$0")" && pwd)
out=${3:-${OUT:-$src/../bench/results}}

fail() { echo "bench-startup.sh: $*" >&2; exit 1; }
[ -x "$bin/remora" ] || fail "no $bin/remora: build it with cargo build --release"
if [ -z "${REMORA_SHIM:-}" ] && [ ! -e "$bin/libcuda.so" ] && [ ! -e "$bin/libcuda.so.1" ]; then
  fail "no shim beside $bin/remora: build it with cargo build --release -p remora-shim, or set REMORA_SHIM"
fi

# Every listed program must be built: a missing one fails here, by name.
list="$src/startup-programs.txt"
missing=()
count=0
while read -r prog _; do
  case $prog in ''|'#'*) continue ;; esac
  count=$((count + 1))
  prog=${prog#./}
  [ -x "$build/$prog" ] || [[ " ${missing[*]} " == *" $prog "* ]] || missing+=("$prog")
done < "$list"
if [ ${#missing[@]} -gt 0 ]; then
  fail "not built in $build: ${missing[*]}; run gpu/build.sh $build first (on this GPU host)"
fi
cp "$list" "$build/startup-programs.txt"  # its ./PROGRAM paths are then BUILD_DIR's
mkdir -p "$out"
out=$(cd "$out" && pwd)

date=$(date -u +%Y-%m-%d)
device=${REMORA_DEVICE_TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
  | head -n 1 | tr '[:upper:]' '[:lower:]' | sed 's/^nvidia //' | awk '{print $1}' || true)}
# shellcheck source=gpu/modes.sh
. "$src/modes.sh"  # remora_commit
remora_commit "$bin"
commit=${REMORA_COMMIT:-unknown}
export REMORA_COMMIT=$commit
tag="$date-${device:-gpu}-${commit:0:7}"
modes=(--modes "${REMORA_STARTUP_MODES:-native,embedded,standing}"
       --transports "${REMORA_STARTUP_TRANSPORTS:-shm,unix,tcp}")

echo "== remora bench startup: $count programs, 3 rounds ($("$bin/remora" --version), commit $commit)"
"$bin/remora" bench startup --programs "$build/startup-programs.txt" --rounds 3 "${modes[@]}" \
  --json "$out/bench-startup-$tag.json" --png "$out/bench-startup-$tag.png"

echo "== remora bench startup: vecadd, 10 rounds"
"$bin/remora" bench startup --program "$build/vecadd" --rounds 10 "${modes[@]}" \
  --json "$out/bench-startup-vecadd-$tag.json" --png "$out/bench-startup-vecadd-$tag.png"

# A Python program's start-up (import torch, one small kernel): where PyTorch is installed,
# unless REMORA_STARTUP_TORCH=0.
if [ "${REMORA_STARTUP_TORCH:-1}" = 0 ]; then
  echo "== PyTorch start-up skipped (REMORA_STARTUP_TORCH=0)"
elif ! python3 -c "import torch" > /dev/null 2>&1; then
  echo "== PyTorch start-up skipped: python3 cannot import torch here"
else
  echo "== remora bench startup: python3 gpu/torch/startup.py, 3 rounds"
  "$bin/remora" bench startup --program "python3 $src/torch/startup.py" --rounds 3 "${modes[@]}" \
    --json "$out/bench-startup-torch-$tag.json" --png "$out/bench-startup-torch-$tag.png"
fi
