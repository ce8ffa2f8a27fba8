#!/usr/bin/env python3
"""One line for an embedded `remora run`'s start-up log (REMORA_LOG with remora::startup=debug).

    run_summary.py FILE

Prints the milliseconds from the embedded server's listening line to each step of the run
(worker handed the session, driver probed, context created, client connected, HELLO, context
destroyed, program exited, GPU released, server stopped) and the steps' own times, so that
runs can be compared line by line where only one run's whole timeline is kept.
"""
import re
import sys
from datetime import datetime

STEPS = [
    ("session handed to a worker", "handed"),
    ("driver probed", "probed"),
    ("context created", "context"),
    ("client connected", "connected"),
    ("HELLO answered", "hello"),
    ("context destroyed", "destroyed"),
    ("program exited", "exited"),
    ("every session's worker released", "released"),
    ("embedded server stopped", "stopped"),
]
FIELDS = {
    "probe_ms": "probe_ms",
    "connected_us": "connected_us",
    "destroy_us": "destroy_us",
    "free_us": "free_us",
    "released_ms": "released_ms",
}


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    t0, marks, values = None, [], {}
    for line in open(sys.argv[1], errors="replace"):
        m = re.match(r"(\d{4}-\d\d-\d\dT[\d:.]+)Z", line)
        if not m:
            continue
        # Python 3.10's fromisoformat takes at most 6 fraction digits.
        stamp = re.sub(r"(\.\d{6})\d+$", r"\1", m.group(1))
        t = datetime.fromisoformat(stamp).timestamp() * 1e3
        if "embedded server listening" in line:
            t0 = t
        if t0 is None:
            continue
        for text, name in STEPS:
            if text in line:
                marks.append(f"{name}@{t - t0:.1f}")
        for key, name in FIELDS.items():
            v = re.search(rf"\b{key}=(\d+)", line)
            if v:
                values[name] = v.group(1)
        if "context created" in line:
            v = re.search(r"\bus=(\d+)", line)
            if v:
                values["ctx_create_us"] = v.group(1)
    if t0 is None:
        print("  run: no 'embedded server listening' line")
        return
    print("  run: " + " ".join(marks) + " | " + " ".join(f"{k}={v}" for k, v in values.items()))


if __name__ == "__main__":
    main()
