#!/usr/bin/env bash
# Where a PyTorch training step's time goes through Remora: train.py natively, then under
# `remora run --profile` (an embedded server, profiled too) in each transport.
#
#   gpu/torch/profile.sh BIN_DIR OUT_DIR [MODEL...]     MODEL: gpt cnn (default: both)
#
# Env: PROFILE_MODES (default "shm unix tcp"), PROFILE_STEPS (default 100), PYTHON (default
# python3), TORCH_TIMEOUT (seconds per run, default 180).
# Writes OUT_DIR/profile-MODEL-MODE.txt: the train-stats line, the client's table of calls by
# procedure (count, total, mean, max, share of the run's wall time) and the server's table per
# connection; and OUT_DIR/profile-summary.txt: median step times against native.
set -uo pipefail
usage="usage: profile.sh BIN_DIR OUT_DIR [gpt|cnn ...]"
bin=$(cd "${1:?$usage}" && pwd)
out=${2:?$usage}; shift 2
models=("${@:-gpt}"); [ $# -eq 0 ] && models=(gpt cnn)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"; out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
limit=${TORCH_TIMEOUT:-180}
steps=${PROFILE_STEPS:-100}
read -r -a modes <<< "${PROFILE_MODES:-shm unix tcp}"
median() { grep -o '"median_step_ms": [0-9.]*' "$1" | head -n 1 | awk '{print $2}'; }
summary=$out/profile-summary.txt
: > "$summary"
for model in "${models[@]}"; do
  f=$out/profile-$model-native.txt
  timeout "$limit" "$py" "$here/train.py" "$model" --steps "$steps" > /dev/null 2> "$f"
  native=$(median "$f")
  echo "$model native: median step ${native:-?} ms" | tee -a "$summary"
  for mode in "${modes[@]}"; do
    f=$out/profile-$model-$mode.txt
    timeout "$limit" "$bin/remora" run --profile --transport "$mode" -- \
      "$py" "$here/train.py" "$model" --steps "$steps" > /dev/null 2> "$f"
    rc=$?
    m=$(median "$f")
    ratio=$(awk -v a="${m:-0}" -v b="${native:-0}" 'BEGIN { if (a > 0 && b > 0) printf "x%.2f", a / b; else print "?" }')
    echo "$model $mode: exit $rc, median step ${m:-?} ms ($ratio native)" | tee -a "$summary"
    grep -A 12 '^remora client profile' "$f" | sed 's/^/    /' | tee -a "$summary"
  done
done
