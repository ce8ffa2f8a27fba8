"""Writes torch-suite.json and torch-suite.md from what gpu/torch/suite.sh left in its OUT_DIR.

    python3 gpu/torch/report.py OUT_DIR [IN_DIR...]

IN_DIR (default OUT_DIR) is an OUT_DIR of suite.sh: logs/results.tsv (NAME, MODE, STATUS,
SECONDS, DETAIL per run) and logs/NAME.MODE.err (train.py's `train-stats` lines; without them
the step times in results.tsv are used). Several
IN_DIRs, from suite.sh runs split over several device calls, are merged into one report, mode
by mode (a check or model run in one mode in several: that mode's last run). Device and commit: env TORCH_SUITE_DEVICE and
REMORA_COMMIT, else what the first IN_DIR's torch-suite.json says; the torch version: train.py's
output, else env TORCH_VERSION (suite.sh sets it), else that file's. Standard library only.
"""
import datetime
import json
import os
import re
import statistics
import sys

MODES = ["shm", "unix", "tcp", "embedded"]


def stats(d, name, mode):
    try:
        for line in open(f"{d}/logs/{name}.{mode}.err"):
            if line.startswith("train-stats "):
                return json.loads(line.split(" ", 1)[1])
    except (OSError, ValueError):
        pass
    return {}


def main():
    out = sys.argv[1]
    ins = sys.argv[2:] or [out]
    rows, order = {}, []  # name -> ({mode: dir}, {mode: (status, seconds, detail)})
    for d in ins:
        runs = {}
        for line in open(f"{d}/logs/results.tsv"):
            name, mode, status, secs, detail = line.rstrip("\n").split("\t", 4)
            runs.setdefault(name, {})[mode] = (status, float(secs), detail)
        for name, r in runs.items():
            if name not in rows:
                order.append(name)
                rows[name] = ({}, {})
            for m, v in r.items():
                rows[name][0][m] = d
                rows[name][1][m] = v
    prev = {}
    try:
        prev = json.load(open(f"{ins[0]}/torch-suite.json"))
    except (OSError, ValueError):
        pass
    device = os.environ.get("TORCH_SUITE_DEVICE") or prev.get("device") or "unknown"
    commit = os.environ.get("REMORA_COMMIT") or prev.get("commit") or "unknown"
    modes = [m for m in MODES if any(m in r for _, r in rows.values())]
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for _, r in rows.values():
        for m in modes:
            if m in r:
                s = r[m][0]
                counts["passed" if s == "pass" else "failed" if s == "fail" else "skipped"] += 1
    summary = "{passed} passed, {failed} failed, {skipped} skipped".format(**counts)

    checks, training, torch_version = [], [], None
    for name in order:
        dirs, r = rows[name]
        native = r.get("native", ("fail", 0.0, "no native run"))
        if not name.startswith("train-"):
            e = {"check": name, "native": native[0]}
            e.update({m: r[m][0] for m in modes if m in r})
            e["match"] = native[0] == "ok" and any(m in r for m in modes) and all(
                r[m][0] == "pass" for m in modes if m in r)
            if native[0] == "ok":
                try:
                    e["output"] = open(f"{dirs['native']}/logs/{name}.native.out").read().strip()
                except OSError:  # logs not kept (a device call returns few files)
                    e["output"] = native[2]
            else:
                e["reason"] = native[2]
            e["seconds"] = {m: v[1] for m, v in r.items()}
            fails = {m: v[2] for m, v in r.items() if m != "native" and v[0] == "fail"}
            if fails:
                e["details"] = fails
            checks.append(e)
            continue
        model = name[len("train-"):]
        nat = [stats(dirs[m], name, m) for m in ("native", "native2") if r.get(m, ("",))[0] == "ok"]
        torch_version = torch_version or next((s["torch"] for s in nat if "torch" in s), None)
        nat_ms = [s["median_step_ms"] for s in nat if "median_step_ms" in s]
        native_ms = round(statistics.fmean(nat_ms), 4) if nat_ms else None
        native_sps = [s["steps_per_s"] for s in nat if s.get("steps_per_s")]
        common = {"native_step_ms": native_ms, "native_step_ms_runs": nat_ms,
                  "native_deterministic": r.get("native2", ("",))[0] == "ok",
                  "native_steps_per_s": round(statistics.fmean(native_sps), 2) if native_sps else None,
                  "steps": nat[0].get("steps") if nat else None}
        if not any(m in r for m in modes):
            training.append({"model": model, "mode": None, "status": native[0], **common,
                             **({"detail": native[2]} if native[0] != "ok" else {})})
        for m in modes:
            if m not in r:
                continue
            status, secs, detail = r[m]
            s = stats(dirs[m], name, m) if status != "skip" else {}
            rem = s.get("median_step_ms")
            # Without the run's stderr, the figures suite.sh wrote into results.tsv.
            got = re.search(r"([\d.]+) ms/step, native ([\d.]+)", detail)
            if rem is None and got:
                rem = float(got.group(1))
                common["native_step_ms"] = common["native_step_ms"] or float(got.group(2))
            native_ms = common["native_step_ms"]
            training.append({
                "model": model, "mode": m, "status": status, "losses_match": status == "pass",
                "remote_step_ms": rem, "ratio": round(rem / native_ms, 3) if rem and native_ms else None,
                "remote_steps_per_s": s.get("steps_per_s"), "seconds": secs, **common,
                **({"detail": detail} if status != "pass" else {}),
            })

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc = {"date": date, "device": device, "commit": commit, "torch": torch_version or os.environ.get("TORCH_VERSION") or prev.get("torch"),
           "modes": modes, "summary": counts, "checks": checks, "training": training,
           "note": "each run its own process; stdout compared byte for byte with the native run; "
                   "step times: median per-step wall time (device synchronized at both ends), "
                   "warmup excluded; native_step_ms: mean of two native runs; "
                   "ratio = remote / native (>1 is slower)"}
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/torch-suite.json", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

    def fmt(v):
        return "-" if v is None else f"{v:.3f}"

    with open(f"{out}/torch-suite.md", "w") as md:
        md.write(f"# PyTorch suite: {summary}\n\n{device}, torch {doc['torch'] or '?'}, commit {commit}, {date}\n\n")
        if checks:
            md.write("| check | native | " + " | ".join(modes) + " | match |\n|---|---|" + "---|" * len(modes) + "---|\n")
            for e in checks:
                md.write(f"| {e['check']} | {e['native']} | " + " | ".join(e.get(m, "-") for m in modes)
                         + f" | {'yes' if e['match'] else 'no'} |\n")
            md.write("\n")
        if training:
            md.write("| model | mode | losses match | native ms/step | remoted ms/step | ratio |\n"
                     "|---|---|---|---|---|---|\n")
            for t in training:
                match = "-" if t["mode"] is None else "yes" if t["losses_match"] else f"no ({t['status']})"
                md.write(f"| {t['model']} | {t['mode'] or 'native only'} | {match} | {fmt(t['native_step_ms'])} "
                         f"| {fmt(t.get('remote_step_ms'))} | {t.get('ratio') or '-'} |\n")
    print(f"torch suite report: {summary} -> {out}/torch-suite.json, torch-suite.md")


if __name__ == "__main__":
    main()
