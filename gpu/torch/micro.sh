#!/usr/bin/env bash
# Start-up and tiny-op cost of PyTorch through Remora against native, in the same run
# (issue 11's goals: `import torch; torch.cuda.init()` adds at most 100 ms; a tiny eager op
# costs at most 1.15x native over shm).
#
#   gpu/torch/micro.sh BIN_DIR OUT_DIR [MODE...]   MODE: shm unix tcp (standing `remora serve`),
#                                                  embedded (default: all four)
#
# Env: MICRO_REPS (runs per mode, default 5), PYTHON (default python3).
# Writes OUT_DIR/micro.json (every run, medians and ratios) and prints a table.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=gpu/modes.sh
. "$here/../modes.sh"
bin_out_modes "usage: micro.sh BIN_DIR OUT_DIR [MODE...]" "$@"
py=${PYTHON:-python3}
reps=${MICRO_REPS:-5}
work=$(mktemp -d); serve_pid=
trap '[ -n "$serve_pid" ] && kill $serve_pid 2>/dev/null; rm -rf "$work"' EXIT
start_serve "$bin" "$work"
: > "$work/runs.jsonl"
for rep in $(seq "$reps"); do
  for m in native "${modes[@]}"; do  # interleaved, so drift hits every mode alike
    mode_cmd "$bin" "$m" || exit 2
    t0=$(date +%s.%N)
    line=$(timeout 120 "${run[@]}" "$py" "$here/micro.py" 2> "$work/$m.err" | tail -n 1)
    rc=$?
    wall=$(echo "$(date +%s.%N) $t0" | awk '{printf "%.4f", $1 - $2}')
    if [ $rc -ne 0 ] || [ -z "$line" ]; then
      echo "micro: $m run $rep failed (exit $rc): $(tail -n 2 "$work/$m.err" | tr '\n' ' ')" >&2
      continue
    fi
    echo "{\"mode\":\"$m\",\"rep\":$rep,\"wall_s\":$wall,\"run\":$line}" >> "$work/runs.jsonl"
  done
done
"$py" - "$work/runs.jsonl" "$out/micro.json" "${REMORA_COMMIT:-unknown}" <<'PY'
import json, statistics, sys, datetime, subprocess
runs = [json.loads(l) for l in open(sys.argv[1])]
modes = []
for r in runs:
    if r["mode"] not in modes:
        modes.append(r["mode"])
def med(mode, key, wall=False):
    v = [r["wall_s"] if wall else r["run"][key] for r in runs if r["mode"] == mode]
    return statistics.median(v) if v else None
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = "unknown"
summary = {}
keys = ("init_s", "cuda_s", "tiny_op_us", "tiny_op_sync_us")
def med_keys(mode):  # runs of an older micro.py lack cuda_s
    return {k: med(mode, k) for k in keys if all(k in r["run"] for r in runs if r["mode"] == mode)}
n = med_keys("native")
n["wall_s"] = med("native", None, wall=True)
print(f"{'mode':9} {'process s':>10} {'init s':>8} {'added ms':>9} {'cuda s':>7} {'added ms':>9} {'tiny op us':>11} {'ratio':>6} {'op+sync us':>11} {'ratio':>6}")
for m in modes:
    s = med_keys(m)
    s["wall_s"] = med(m, None, wall=True)
    if m != "native" and n["init_s"]:
        s["init_added_ms"] = round((s["init_s"] - n["init_s"]) * 1000, 1)
        if s.get("cuda_s") is not None and n.get("cuda_s") is not None:
            s["cuda_added_ms"] = round((s["cuda_s"] - n["cuda_s"]) * 1000, 1)
        s["process_added_ms"] = round((s["wall_s"] - n["wall_s"]) * 1000, 1)
        s["tiny_op_ratio"] = round(s["tiny_op_us"] / n["tiny_op_us"], 3)
        s["tiny_op_sync_ratio"] = round(s["tiny_op_sync_us"] / n["tiny_op_sync_us"], 3)
    summary[m] = s
    print(f"{m:9} {s['wall_s']:10.3f} {s['init_s']:8.3f} {s.get('init_added_ms', 0):9.1f} "
          f"{s.get('cuda_s', float('nan')):7.3f} {s.get('cuda_added_ms', 0):9.1f} "
          f"{s['tiny_op_us']:11.2f} {s.get('tiny_op_ratio', 1):6.2f} {s['tiny_op_sync_us']:11.2f} "
          f"{s.get('tiny_op_sync_ratio', 1):6.2f}")
json.dump({"date": datetime.date.today().isoformat(), "gpu": gpu, "commit": sys.argv[3],
           "summary": summary, "runs": runs}, open(sys.argv[2], "w"), indent=1)
PY
