#!/usr/bin/env python3
"""Issue 12's goals, judged from the reports of one set of device calls:

    python3 gpu/tools/issue12_goals.py [--md OUT.md] REPORT.json...

Each REPORT is a JSON that `remora bench startup|copy|launch|contention` wrote (its
`benchmark` field says which; several of one kind are read in order, a later figure of the
same mode, clients and metric replacing an earlier one). Prints one row per goal of issue 12:
the figure, the ratio against its baseline measured in the same run (native, or raw TCP for
§2), and `met`, `missed`, or `not measured` when no report given holds the figure. The
device and commit of every report are listed first: the goals hold for one commit only when
every report names it.

The goals (issue 12, "What to build"):
  §1  embedded `remora run` starts within 30 ms of native (vecadd; and idle-GPU and held);
      against a standing server faster than native (held); the 25-program whole run
      <= 1.10x native; shm never slower than tcp (startup reports over both transports)
  §2  64 MiB copies over TCP, pageable and pinned, both directions: >= 5 GB/s and >= 60% of
      a raw TCP stream (`bench copy --raw-tcp`)
  §3  launch + synchronize p50 <= 12 µs over shm, <= 25 over unix, <= 32 over tcp (1 client,
      `bench launch`)
  §4  adaptive within 10% of the better of spin and block in every cell (mean and p50, the
      rounds' medians, `bench contention`), and polling's CPU per round trip >= 2x
      adaptive's at 2x load
  §5  launch throughput of one client within 1.1x of native over shm (`bench launch`)
"""

import argparse
import json
import sys


def load(paths):
    """{kind: {(mode, clients, metric): figure}} and one line per report."""
    kinds, sources = {}, []
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        if not isinstance(r, dict) or "benchmark" not in r:
            continue  # not a bench report (a suite's, say)
        kind = r["benchmark"]
        notes = r.get("notes", [])
        # Start-up: vecadd alone, or the whole run of several programs.
        if kind == "startup" and any(
            n.startswith("whole_run.programs = ") and not n.startswith("whole_run.programs = 1:")
            for n in notes
        ):
            kind = "startup-whole"
        # Contention under another workload (`--long-every`) or with an experiment's
        # variables set is its own set of cells.
        if kind == "contention":
            label = [n.split(" (", 1)[0] for n in notes if n.startswith("workload: ")]
            label += [n for n in notes if n.startswith("environment: ")]
            if label:
                kind = ", ".join(["contention"] + label)
        figs = kinds.setdefault(kind, {})
        for x in r.get("figures", []):
            figs[(x["mode"], x["clients"], x["metric"])] = x
        sources.append(f"{p}: {kind}, {r.get('device', '?')}, commit {r.get('commit', '?')}")
    return kinds, sources


def fig(kinds, kind, mode, clients, metric):
    return kinds.get(kind, {}).get((mode, clients, metric))


class Table:
    def __init__(self):
        self.rows = []

    def add(self, section, goal, figure, verdict):
        self.rows.append((section, goal, figure, verdict))

    def missing(self, section, goal, what):
        self.add(section, goal, f"({what})", "not measured")

    def markdown(self):
        out = ["| § | goal | figure | state |", "|---|---|---|---|"]
        out += [f"| {s} | {g} | {f} | {v} |" for s, g, f, v in self.rows]
        return "\n".join(out)


def startup(kinds, t):
    """§1 from `bench startup` reports: vecadd alone and the whole run of 25 programs."""
    vec = "startup"  # vecadd alone
    native = fig(kinds, vec, "native", 1, "startup.vecadd")
    if native is None:
        t.missing("1", "embedded within 30 ms of native (vecadd)", "bench startup: vecadd")
    else:
        for mode, base in (("embedded-shm", "native"), ("embedded-held-shm", "native-held")):
            m, b = fig(kinds, vec, mode, 1, "startup.vecadd"), fig(kinds, vec, base, 1, "startup.vecadd")
            if m and b:
                d = (m["value"] - b["value"]) * 1e3
                t.add("1", f"{mode} vecadd within 30 ms of {base}",
                      f"{m['value']:.3f} s against {b['value']:.3f} ({d:+.0f} ms)",
                      "met" if d <= 30 else "missed")
        s, b = fig(kinds, vec, "standing-shm", 1, "startup.vecadd"), fig(kinds, vec, "native-held", 1, "startup.vecadd")
        if s and b:
            t.add("1", "standing server faster than native (vecadd)",
                  f"{s['value']:.3f} s against {b['value']:.3f} (x{s['value'] / b['value']:.3f})",
                  "met" if s["value"] < b["value"] else "missed")
    # The whole run of the 25 programs (a report whose whole run sums more than one).
    w = {k[0]: v for k, v in kinds.get("startup-whole", {}).items() if k[2] == "whole_run.total"}
    if "native" not in w:
        t.missing("1", "25-program whole run <= 1.10x native", "bench startup --programs")
        return
    for mode, base in (("embedded-shm", "native"), ("embedded-held-shm", "native-held"),
                       ("standing-shm", "native-held")):
        if mode in w and base in w:
            r = w[mode]["value"] / w[base]["value"]
            t.add("1", f"whole run, {mode}, <= 1.10x {base}",
                  f"{w[mode]['value']:.2f} s against {w[base]['value']:.2f} (x{r:.3f})",
                  "met" if r <= 1.10 else "missed")
    # Each mode over shm against the same mode over tcp (embedded, held, standing).
    pairs = [(m[: -len("tcp")] + "shm", m) for m in sorted(w) if m.endswith("-tcp")]
    pairs = [(shm, tcp) for shm, tcp in pairs if shm in w]
    if not pairs:
        t.missing("1", "shm never slower than tcp", "bench startup over shm and tcp")
    for shm, tcp in pairs:
        r = w[shm]["value"] / w[tcp]["value"]
        t.add("1", f"whole run, {shm} no slower than {tcp}",
              f"{w[shm]['value']:.2f} s against {w[tcp]['value']:.2f} (x{r:.3f})",
              "met" if r <= 1.0 else "missed")


def copies(kinds, t):
    """§2 from a `bench copy --raw-tcp` report, one client."""
    raw = fig(kinds, "copy", "raw-tcp", 1, "copy.raw.send.per_client")
    found = False
    for mem in ("pageable", "pinned"):
        for way in ("htod", "dtoh"):
            x = fig(kinds, "copy", "tcp", 1, f"copy.{mem}.{way}.per_client")
            if x is None:
                continue
            found = True
            gbs = x["value"]
            of_raw = gbs / raw["value"] if raw else None
            ok = gbs >= 5.0 and (of_raw is None or of_raw >= 0.60)
            fig_s = f"{gbs:.2f} GB/s" + (f", {of_raw:.0%} of raw tcp ({raw['value']:.2f})" if raw else ", no raw tcp row")
            t.add("2", f"tcp {mem} {way} >= 5 GB/s and >= 60% of raw", fig_s,
                  ("met" if ok else "missed") if raw else ("met (5 GB/s; raw not measured)" if gbs >= 5.0 else "missed"))
    if not found:
        t.missing("2", "64 MiB copies over tcp", "bench copy --transports tcp --raw-tcp")


def launches(kinds, t):
    """§3 and §5 from a `bench launch` report, one client."""
    for transport, goal in (("shm", 12.0), ("unix", 25.0), ("tcp", 32.0)):
        x = fig(kinds, "launch", transport, 1, "launch_sync.p50")
        n = fig(kinds, "launch", "native", 1, "launch_sync.p50")
        if x is None:
            t.missing("3", f"launch + synchronize p50 <= {goal:g} µs over {transport}", "bench launch")
            continue
        ratio = f" (x{x['value'] / n['value']:.2f} of native's {n['value']:.1f})" if n else ""
        t.add("3", f"launch + synchronize p50 <= {goal:g} µs over {transport}",
              f"{x['value']:.1f} µs{ratio}", "met" if x["value"] <= goal else "missed")
    x = fig(kinds, "launch", "shm", 1, "launch.per_launch")
    n = fig(kinds, "launch", "native", 1, "launch.per_launch")
    if x is None or n is None:
        t.missing("5", "launch throughput within 1.1x of native over shm", "bench launch")
    else:
        r = x["value"] / n["value"]
        t.add("5", "launch throughput within 1.1x of native over shm",
              f"{x['value']:.2f} µs a launch against {n['value']:.2f} (x{r:.3f})",
              "met" if r <= 1.10 else "missed")


def contention(kinds, t):
    """§4 from `bench contention` reports: every cell of adaptive against the better way."""
    sets = sorted(k for k in kinds if k.startswith("contention"))
    if not sets:
        t.missing("4", "adaptive within 10% of the better way, every cell", "bench contention")
    for kind in sets:
        contention_cells(kind, kinds[kind], t)


def contention_cells(kind, figs, t):
    label = kind[len("contention"):].lstrip(", ")
    label = f" ({label})" if label else ""
    cells = sorted({(m.rsplit(" adaptive burn=", 1)[0], m.rsplit("burn=", 1)[1], c)
                    for m, c, metric in figs if " adaptive burn=" in m and metric == "launch_sync.mean"})
    for transport, burn, c in cells:
        def v(policy, metric):
            x = figs.get((f"{transport} {policy} burn={burn}", c, metric))
            return x and x["value"]
        for metric in ("mean", "p50"):
            a, s, b = (v(p, f"launch_sync.{metric}") for p in ("adaptive", "spin", "block"))
            if not (a and s and b):
                continue
            r = a / min(s, b)
            t.add("4", f"{transport} {burn} {c} client(s){label}: adaptive {metric} within 10% of the better way",
                  f"{a:.1f} µs, spin {s:.1f}, block {b:.1f} (x{r:.2f})", "met" if r <= 1.10 else "missed")
        if burn == "2x":
            cpu = {p: (v(p, "launch_sync.client_cpu") or 0.0) + (v(p, "launch_sync.server_cpu") or 0.0)
                   for p in ("adaptive", "spin")}
            if cpu["adaptive"] > 0 and cpu["spin"] > 0:
                r = cpu["spin"] / cpu["adaptive"]
                t.add("4", f"{transport} 2x {c} client(s){label}: polling's CPU >= 2x adaptive's",
                      f"x{r:.2f}", "met" if r >= 2.0 else "missed")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="JSON reports of remora bench startup|copy|launch|contention")
    ap.add_argument("--md", help="also write the table (with its sources) to this markdown file")
    a = ap.parse_args(argv)
    kinds, sources = load(a.reports)
    t = Table()
    startup(kinds, t)
    copies(kinds, t)
    launches(kinds, t)
    contention(kinds, t)
    text = "\n".join(["Reports:"] + [f"- {s}" for s in sources] + ["", t.markdown()])
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    states = [r[3] for r in t.rows]
    print(f"\n{sum(s.startswith('met') for s in states)} met, {states.count('missed')} missed, "
          f"{states.count('not measured')} not measured")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
