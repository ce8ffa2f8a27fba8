#!/usr/bin/env bash
# PyTorch smoke checks natively and through Remora, each in its own process.
#
#   gpu/torch/run.sh BIN_DIR [MODE...]      MODE: embedded (default), or shm/unix/tcp against
#                                           one standing `remora serve`
#
# TORCH_CHECKS="a b" runs only those checks; SMOKE_LOGS=DIR keeps every run's stderr there.
# Prints one line per check and mode: pass (identical to native), FAIL (different output or
# exit status, with the last lines of its stderr) or skip (native failed too).
set -uo pipefail
bin=$(cd "${1:?usage: run.sh BIN_DIR [MODE...]}" && pwd); shift
modes=("${@:-embedded}")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d); serve_pid=
trap '[ -n "$serve_pid" ] && kill $serve_pid 2>/dev/null; rm -rf "$work"' EXIT
# shellcheck source=gpu/modes.sh
. "$here/../modes.sh"
read -r -a checks <<< "${TORCH_CHECKS:-$(python3 "$here/smoke.py" --list)}"  # or TORCH_CHECKS="a b"
limit=${TORCH_TIMEOUT:-180}
if [[ " ${modes[*]} " != " embedded " ]]; then
  start_serve "$bin" "$work"
fi
pass=0; fail=0
for c in "${checks[@]}"; do
  timeout "$limit" python3 "$here/smoke.py" "$c" > "$work/$c.native" 2> "$work/$c.native.err"; nrc=$?
  for m in "${modes[@]}"; do
    mode_cmd "$bin" "$m" || exit 2
    timeout "$limit" "${run[@]}" python3 "$here/smoke.py" "$c" > "$work/$c.$m" 2> "$work/$c.$m.err"; rc=$?
    if [ $nrc -ne 0 ]; then
      echo "$c $m skip (native exit $nrc)"
    elif [ $rc -eq $nrc ] && cmp -s "$work/$c.native" "$work/$c.$m"; then
      echo "$c $m pass $(cat "$work/$c.native")"; pass=$((pass+1))
    else
      echo "$c $m FAIL exit $rc: $(tail -n 3 "$work/$c.$m.err" | tr '\n' ' ' | cut -c1-300)"; fail=$((fail+1))
    fi
  done
done
[ -n "${SMOKE_LOGS:-}" ] && mkdir -p "$SMOKE_LOGS" && cp "$work"/*.err "$SMOKE_LOGS"/ 2>/dev/null
echo "torch smoke: $pass passed, $fail failed"
