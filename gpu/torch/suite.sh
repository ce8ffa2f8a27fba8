#!/usr/bin/env bash
# The PyTorch suite: every smoke.py check and both train.py models, natively and through Remora.
#
#   gpu/torch/suite.sh BIN_DIR OUT_DIR [MODE...]     MODE: shm unix tcp embedded (default: all four)
#
# Every check and training run is a process of its own, limited to TORCH_TIMEOUT seconds
# (default 180). Its stdout must equal the native run's byte for byte (a check's checksums; a
# model's losses as float.hex and the final SHA-256 of its parameters) and its exit status too.
# What fails natively is "skip" in every mode, with the reason, and is not run remoted. Each
# model trains natively twice first: the two stdouts must agree (else skip: not deterministic),
# and native_step_ms is the mean of their median step times; ratio = remote / native.
#
# Env: TORCH_CHECKS="a b" (default: every check `smoke.py --list` names; empty: none),
# TORCH_MODELS="gpt cnn" (the default; empty: none), TORCH_TRAIN_ARGS (more train.py arguments,
# e.g. "--steps 100"), TORCH_TIMEOUT, PYTHON (default python3), REMORA_COMMIT (recorded; default:
# the commit `BIN_DIR/remora --version` names).
# Every run's stdout and stderr go to OUT_DIR/logs/NAME.MODE.{out,err} (NAME: the check, or
# train-MODEL), a line per run to OUT_DIR/logs/results.tsv, from which gpu/torch/report.py writes
# OUT_DIR/torch-suite.json and torch-suite.md (it also merges the OUT_DIRs of split runs). Prints a
# line per run and "torch suite: N passed, M failed, K skipped" (remoted runs); exits 1 when one
# failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=gpu/modes.sh
. "$here/../modes.sh"
bin_out_modes "usage: suite.sh BIN_DIR OUT_DIR [shm|unix|tcp|embedded ...]" "$@"
logs=$out/logs; mkdir -p "$logs"
py=${PYTHON:-python3}
remora_commit "$bin"
# recorded in the report (train.py's output says it too, but a run of checks alone has none)
TORCH_VERSION=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null) && export TORCH_VERSION
limit=${TORCH_TIMEOUT:-180}
read -r -a checks <<< "${TORCH_CHECKS-$("$py" "$here/smoke.py" --list)}"
read -r -a models <<< "${TORCH_MODELS-gpt cnn}"
read -r -a train_args <<< "${TORCH_TRAIN_ARGS:-}"
work=$(mktemp -d); serve_pid=; sock=; tcp=
trap '[ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null; rm -rf "$work"' EXIT
for m in "${modes[@]}"; do mode_cmd "$bin" "$m" || exit 2; done
if [ ! -x "$bin/remora" ]; then
  echo "no $bin/remora: native runs only"; modes=()
elif [[ " ${modes[*]} " =~ \ (shm|unix|tcp)\  ]]; then
  start_serve "$bin" "$work"
  [ -n "$tcp" ] || { echo "remora serve did not start: $(tail -n 3 "$work/serve.err")"; exit 2; }
fi
: > "$logs/results.tsv"
pass=0; fail=0; skip=0

# one run: NAME MODE COMMAND...; stdout/stderr in $logs/NAME.MODE.{out,err}; sets rc and secs
run_one() {
  local name=$1 mode=$2 t0; shift 2
  mode_cmd "$bin" "$mode"
  t0=$(date +%s.%N)
  timeout "$limit" "${run[@]}" "$@" > "$logs/$name.$mode.out" 2> "$logs/$name.$mode.err"; rc=$?
  secs=$(echo "$(date +%s.%N) $t0" | awk '{printf "%.2f", $1 - $2}')
}
tail_err() { tail -n 2 "$logs/$1.err" | tr '\n\t' '  ' | cut -c1-300; }
# record NAME MODE STATUS DETAIL: a line of results.tsv and of progress; the remoted runs are
# counted (native runs are "ok" or "fail", a second native run "ok" or "differs")
record() {
  case $2:$3 in native*) ;; *:pass) pass=$((pass+1));; *:fail) fail=$((fail+1));; *) skip=$((skip+1));; esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$secs" "$4" >> "$logs/results.tsv"
  printf '%-22s %-9s %-5s %6ss %s\n' "$1" "$2" "$3" "$secs" "$4"
}
# the verdict of a remoted run against the native NAME.native: sets status and detail
verdict() { # NAME MODE
  if [ $rc -eq 124 ]; then status=fail; detail="timeout after ${limit}s"
  elif [ $rc -ne 0 ]; then status=fail; detail="exit $rc: $(tail_err "$1.$2")"
  elif ! cmp -s "$logs/$1.native.out" "$logs/$1.$2.out"; then
    status=fail; detail="stdout differs: $(diff "$logs/$1.native.out" "$logs/$1.$2.out" | grep -m 2 '^[<>]' | tr '\n' ' ' | cut -c1-300)"
  else status=pass; detail=
  fi
}
# NAME COMMAND...: native, then (if it passed and, for training, a second native run agrees)
# every mode
compare() {
  local name=$1 m reason=; shift
  run_one "$name" native "$@"
  if [ $rc -ne 0 ]; then
    reason="native exit $rc: $(tail_err "$name.native")"; record "$name" native fail "$reason"
  else
    record "$name" native ok "$(head -c 200 "$logs/$name.native.out" | head -n 1)"
    if [[ $name == train-* ]]; then
      run_one "$name" native2 "$@"
      verdict "$name" native2
      if [ $status = pass ]; then record "$name" native2 ok "identical to the first native run"
      else reason="native runs disagree (not deterministic): $detail"; record "$name" native2 differs "$detail"; fi
    fi
  fi
  for m in "${modes[@]}"; do
    if [ -n "$reason" ]; then secs=0; record "$name" "$m" skip "$reason"; continue; fi
    run_one "$name" "$m" "$@"
    verdict "$name" "$m"
    [[ $name == train-* ]] && detail+=$(grep -h '^train-stats' "$logs/$name".{native,native2,"$m"}.err | cut -d' ' -f2- |
      "$py" -c 'import json,sys; a,b,c=(json.loads(l)["median_step_ms"] for l in sys.stdin); print(" %.3f ms/step, native %.3f: x%.3f" % (c, (a+b)/2, 2*c/(a+b)))' 2>/dev/null)
    record "$name" "$m" "$status" "$detail"
  done
}

echo "== torch suite: ${#checks[@]} checks, models: ${models[*]:-none}, modes: native ${modes[*]}"
for c in "${checks[@]}"; do compare "$c" "$py" "$here/smoke.py" "$c"; done
for model in "${models[@]}"; do compare "train-$model" "$py" "$here/train.py" "$model" "${train_args[@]}"; done

summary="$pass passed, $fail failed, $skip skipped"
TORCH_SUITE_DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) \
  "$py" "$here/report.py" "$out" || echo "torch-suite.json: report.py failed"
echo "torch suite: $summary"
[ $fail -eq 0 ]
