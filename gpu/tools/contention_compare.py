#!/usr/bin/env python3
"""Compare `remora bench contention` reports cell by cell, e.g. a default run against an
experiment's run of the same call (gpu/tools/device_calls.sh's contention step):

    python3 gpu/tools/contention_compare.py contention-default.json contention-EXPERIMENT.json

For each (transport, load, clients) cell and each report: adaptive's launch + synchronize mean
and p50 (medians of the rounds), adaptive against the better of spin and block by the mean
(from the medians, then round by round against the better way by the medians, with the verdict the rounds allow on the goal of
x1.10: the distribution-free interval of their median, as `bench contention`'s notes give it),
and the CPU per round trip (client + server) of
polling against adaptive. With --traces FILE.txt... (the step's .txt files, written with
REMORA_CALLS_TRACE=1), also, round by round, how many of adaptive's clients had settled on
the full call (their completion-word waiter's `spin_first_us` above its `block_at_once_us`),
and each policy's server synchronizes from the `server: synchronize` lines: how many were
deferred to a waiter thread and their mean wake-up and driver times; and (traces of session
42 on) for adaptive's client-side waiters, per cell and kind of waiter: how many of their
planned waits spun first, how many of those gave up and blocked, and how many waiters had
given up at least half (`Waiter`'s rule for trying blocking early); and (traces of session
44 on) for adaptive's clients, settled on the full call or not, their completion-word
synchronizes by how they ended and how many of each had the server last seen on the client's
own CPU (whether a server that answers late waited for the core the client held).
With --table, a markdown table instead of the per-cell lines: a row per cell, and for each
report adaptive's p50 and mean with each over the better of spin and block by the same
figure (the rounds' medians), for bench/results/README.md.
"""

import argparse
import json
import re
import sys


def figures(path):
    with open(path) as f:
        report = json.load(f)
    out = {}
    for x in report["figures"]:
        out[(x["mode"], x["clients"], x["metric"])] = x
    return report, out


def cells(figs):
    """(transport, burn, clients) of every adaptive launch + synchronize figure, sorted."""
    found = set()
    for mode, clients, metric in figs:
        # The transport as the report names it: "shm", or "shm/mps" for the MPS rows.
        m = re.match(r"(\S+) adaptive burn=(\S+)$", mode)
        if m and metric == "launch_sync.mean":
            found.add((m.group(1), m.group(2), clients))
    return sorted(found)


def value(figs, transport, policy, burn, clients, metric):
    f = figs.get((f"{transport} {policy} burn={burn}", clients, metric))
    return f and f["value"], f and f["rounds"]


def cpu(figs, transport, policy, burn, clients):
    total = 0.0
    for side in ("client_cpu", "server_cpu"):
        v, _ = value(figs, transport, policy, burn, clients, f"launch_sync.{side}")
        total += v or 0.0
    return total


GOAL = 1.10


def median_interval(n):
    """(k, coverage): the 1-based order statistics k and n + 1 - k bounding the median of n
    rounds' ratios, distribution-free; the narrowest interval covering at least 90%, or
    min-max when even that covers less (as `remora bench contention`'s notes)."""
    from math import comb

    def cover(k):
        return 1.0 - 2.0 * sum(comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k < n // 2 and cover(k + 1) >= 0.9:
        k += 1
    return k, cover(k)


def verdict(ratios):
    """Whether the rounds decide issue 12 §4's goal (adaptive within 10% of the better way)."""
    n = len(ratios)
    if n < 3:
        return ""
    r = sorted(ratios)
    k, c = median_interval(n)
    lo, hi = r[k - 1], r[n - k]
    word = "met" if hi <= GOAL else "missed" if lo > GOAL else "undecided"
    return f"{c:.0%} x{lo:.2f}-x{hi:.2f}: {word}"


def over_better(figs, cell, metric):
    """Adaptive's `metric` and its ratio to the better of spin's and block's (None: absent)."""
    t, burn, c = cell
    a, _ = value(figs, t, "adaptive", burn, c, metric)
    spin, _ = value(figs, t, "spin", burn, c, metric)
    block, _ = value(figs, t, "block", burn, c, metric)
    if a is None:
        return None, None
    return a, (a / min(spin, block) if spin and block else None)


def label(report, path):
    """What a report measured, for a table's column: its environment note, else the file."""
    env = [n.split(":", 1)[1].strip() for n in report.get("notes", []) if n.startswith("environment:")]
    return " ".join(env) or f"defaults ({path})"


def table(loaded, all_cells):
    """The markdown table of --table (see the module's doc)."""
    head = ["cell"]
    for p, report, _ in loaded:
        name = label(report, p)
        head += [f"{name} p50 (µs)", "/better", "mean (µs)", "/better"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in all_cells:
        t, burn, c = cell
        row = [f"{t} {burn} {c} client{'s' if c != 1 else ''}"]
        for _, _, figs in loaded:
            for metric in ("launch_sync.p50", "launch_sync.mean"):
                v, r = over_better(figs, cell, metric)
                row += ["-" if v is None else f"{v:.2f}", "-" if r is None else f"x{r:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def describe(figs, cell):
    t, burn, c = cell
    mean, a_rounds = value(figs, t, "adaptive", burn, c, "launch_sync.mean")
    p50, _ = value(figs, t, "adaptive", burn, c, "launch_sync.p50")
    spin, s_rounds = value(figs, t, "spin", burn, c, "launch_sync.mean")
    block, b_rounds = value(figs, t, "block", burn, c, "launch_sync.mean")
    parts = [f"mean {mean:7.1f}", f"p50 {p50:6.1f}"]
    if spin and block:
        parts.append(f"/better x{mean / min(spin, block):.2f}")
        n = min(len(a_rounds), len(s_rounds), len(b_rounds))
        # Against the better fixed way by the medians (the lower of the two per round would
        # favour the fixed ways in a noisy cell).
        better = s_rounds if spin <= block else b_rounds
        ratios = [a_rounds[i] / better[i] for i in range(n)]
        per = " ".join(f"x{r:.2f}" for r in ratios)
        parts.append(f"(rounds {per})")
        if verdict(ratios):
            parts.append(f"[{verdict(ratios)}]")
        a_cpu = cpu(figs, t, "adaptive", burn, c)
        if a_cpu > 0:
            parts.append(f"poll cpu x{cpu(figs, t, 'spin', burn, c) / a_cpu:.2f}")
    return "  ".join(parts)


SYNC = re.compile(
    r'waiter="server: synchronize" inline=(\d+) deferred=(\d+) .*?wake_mean_us=([\d.]+) '
    r"driver_mean_us=([\d.]+)"
)


SCHED = re.compile(
    r"missed_poll_cpu_mean_us=([\d.]+) missed_poll_runq_mean_us=([\d.]+) "
    r"driver_cpu_mean_us=([\d.]+) driver_runq_mean_us=([\d.]+)"
)


def traces(path):
    """Per `== burn=...` section of a contention .txt: (section, deferred, total, wake, driver,
    sched) summed over its server synchronize lines; sched, where the lines have them (session
    40 on), the deferred-weighted sums of the missed polls' and the waiter threads' on-CPU
    and run-queue means, else None."""
    sections = {}
    order = []
    section = None
    with open(path) as f:
        for line in f:
            if line.startswith("== burn="):
                m = re.match(r"== burn=(\S+) .*REMORA_WAIT=(\w+)", line)
                mps = "/mps" if " under MPS" in line else ""
                section = m and f"{m.group(1)}{mps} {m.group(2)}"
                if section and section not in sections:
                    sections[section] = [0, 0, 0.0, 0.0, None]
                    order.append(section)
                continue
            m = SYNC.search(line)
            if m and section:
                inline, deferred = int(m.group(1)), int(m.group(2))
                s = sections[section]
                s[0] += deferred
                s[1] += inline + deferred
                s[2] += deferred * float(m.group(3))
                s[3] += deferred * float(m.group(4))
                sm = SCHED.search(line)
                if sm:
                    prev = s[4] or [0.0, 0.0, 0.0, 0.0]
                    s[4] = [p + deferred * float(v) for p, v in zip(prev, sm.groups())]
    return [(k, *sections[k]) for k in order]


CELL = re.compile(r"^\[\d+/\d+\] round (\d+): (\w+), (\d+) client")
WORD = re.compile(r'waiter="completion word" .*?spin_first_us=([\d.]+) block_at_once_us=([\d.]+)')


def cell_lines(path):
    """The lines of a traced contention .txt, each with its cell (burn, policy, transport,
    clients), None before a section's first cell, and whether the line starts a cell."""
    burn = policy = cell = None
    mps = ""
    with open(path) as f:
        for line in f:
            m = re.match(r"== burn=(\S+) .*REMORA_WAIT=(\w+)", line)
            if m:
                burn, policy, cell = m.group(1), m.group(2), None
                # The MPS sections' cells, named as the report names them ("shm/mps").
                mps = "/mps" if " under MPS" in line else ""
                continue
            m = CELL.match(line)
            if m:
                cell = (burn, policy, m.group(2) + mps, int(m.group(3)))
            yield line, cell, bool(m)


def settled(path):
    """Per (burn, policy, transport, clients) of a traced contention .txt, round by round:
    (clients whose completion-word waiter had settled on the full call, completion-word
    waiters). Settled: watching the word first has lately taken longer than making the full
    call at once (`spin_first_us` > `block_at_once_us` > 0), so its synchronizes make the
    full call but for the explored few (session 38: the 4-client p50 at 2x load followed how
    many had)."""
    out = {}
    for line, cell, starts in cell_lines(path):
        if starts:
            out.setdefault(cell, []).append([0, 0])
        m = WORD.search(line)
        if m and cell:
            first, block = float(m.group(1)), float(m.group(2))
            tally = out[cell][-1]
            tally[0] += first > block > 0
            tally[1] += 1
    return out


GAVE_UP = re.compile(
    r'waiter="((?:completion word|shm client: a reply|socket: readable)[^"]*)" .*?'
    r"spin_first=(\d+) spin_first_gave_up=(\d+)"
)


WAITER_LAST_LOOK = re.compile(r'waiter="([^"]+)" [^"]*? last_look=(\d+)')


def gave_up(path):
    """Per (burn, policy, transport, clients) and client-side waiter label of a traced
    contention .txt, over all rounds: [waiters, planned waits that spun first, those that gave
    up and blocked, waiters that gave up at least half of theirs, waits whose value the look
    after the spin's deadline found (`last_look`, session 47 on)]. Server lines are left out:
    a server logs its waiters when a connection ends, which may fall in the next cell."""
    out = {}
    for line, cell, _ in cell_lines(path):
        m = GAVE_UP.search(line)
        if m and cell:
            spun, gave = int(m.group(2)), int(m.group(3))
            t = out.setdefault((*cell, m.group(1)), [0, 0, 0, 0, 0])
            t[0] += 1
            t[1] += spun
            t[2] += gave
            t[3] += spun > 0 and 2 * gave >= spun
            last = WAITER_LAST_LOOK.search(line, m.start())
            if last and last.group(1) == m.group(1):
                t[4] += int(last.group(2))
    return out


CPUS = re.compile(
    r'waiter="completion word cpus" fast=(\d+) fast_same_cpu=(\d+) slow=(\d+) '
    r"slow_same_cpu=(\d+) gave_up=(\d+) gave_up_same_cpu=(\d+) at_once=(\d+) "
    r"at_once_same_cpu=(\d+)"
)
ENDINGS = ("fast", "slow", "gave_up", "at_once")
YIELDS = re.compile(r"waiter=\"completion word cpus\" .*? yields=(\d+)")
LAST_LOOK = re.compile(r"waiter=\"completion word cpus\" .*? last_look=(\d+)")
FULL = re.compile(
    r"waiter=\"completion word cpus\" .*? gave_up_full=(\d+) gave_up_full_mean_us=([\d.]+) "
    r"gave_up_full_1ms=(\d+) at_once_full=(\d+) at_once_full_mean_us=([\d.]+) "
    r"at_once_full_1ms=(\d+)"
)


def cpus(path):
    """Per (burn, policy, transport, clients) of a traced contention .txt (session 44 on) and
    whether the client had settled on the full call (its `completion word` line just before):
    its completion-word synchronizes by how they ended (a word within 32 µs, a later word, a
    watch given up, the full call at once), each [all, with the server last seen on the
    client's own CPU], summed over the rounds, then the watches' yields of their core as
    [count, 0] (session 44's `REMORA_WAIT_WATCH_YIELD=1`, removed in session 46: only its
    traces have them), then as [count, 0] the words seen only by the look a watch makes
    after its deadline (session 47 on: before, such a watch gave up and made the full call),
    then as a last entry the full calls after a watch without its word and at once: [count,
    µs in all, count of 1 ms or more] for each (session 47 on)."""
    out = {}
    was_settled = None
    for line, cell, _ in cell_lines(path):
        m = WORD.search(line)
        if m:
            first, block = float(m.group(1)), float(m.group(2))
            was_settled = first > block > 0
            continue
        m = CPUS.search(line)
        if m and cell and was_settled is not None:
            v = [int(x) for x in m.groups()]
            fresh = [[0, 0] for _ in range(len(ENDINGS) + 2)] + [[0, 0.0, 0, 0, 0.0, 0]]
            t = out.setdefault((*cell, was_settled), fresh)
            for i in range(len(ENDINGS)):
                t[i][0] += v[2 * i]
                t[i][1] += v[2 * i + 1]
            y = YIELDS.search(line)
            t[-2][0] += int(y.group(1)) if y else 0
            last = LAST_LOOK.search(line)
            t[-2][0] += int(last.group(1)) if last else 0
            full = FULL.search(line)
            if full:
                f = t[-1]
                for i, (n, mean, slow) in enumerate(((1, 2, 3), (4, 5, 6))):
                    count = int(full.group(n))
                    f[3 * i] += count
                    f[3 * i + 1] += count * float(full.group(mean))
                    f[3 * i + 2] += int(full.group(slow))
            was_settled = None
    return out


MOVES = re.compile(r'waiter="server avoids its client\'s cpu" moves=(\d+)')


def moves(path):
    """Per (burn, policy, transport, clients) of a traced contention .txt: the server
    connection threads' moves off their client's CPU (the default since session 46, unless
    `REMORA_SERVE_AVOID_PEER_CPU=0`; each thread traced at its 1st, 2nd, 4th... move), as
    (threads that moved, the most moves one thread traced)."""
    out = {}
    for line, cell, _ in cell_lines(path):
        m = MOVES.search(line)
        if m and cell:
            n = int(m.group(1))
            t = out.setdefault(cell, [0, 0])
            t[0] += n == 1
            t[1] = max(t[1], n)
    return out


BUCKETS = ["<1", "<2", "<4", "<8", "<16", "<32", "<64", "<128", "<256", "<512", "<1024", ">=1024"]
HIST = re.compile(r'waiter="([^"]+)" .*?took_us=(\S+(?: \S+:\d+)*)')
MARK = re.compile(r'waiter="completion word mark" marked=(\d+) mark_mean_us=([\d.]+)')


def waits_by_policy(path):
    """Per (burn, policy, transport, clients) and waiter label of a traced contention .txt, over
    all rounds: the waits' time histogram summed (bucket label -> count), and the completion
    words' marks (count, summed µs: how long the server took to take a synchronize's request
    and mark its word). Spin, block and adaptive side by side: where in the round trip
    adaptive's extra microseconds are (session 48: the server's request waits and the
    words)."""
    hist, marks = {}, {}
    for line, cell, _ in cell_lines(path):
        if not cell:
            continue
        m = MARK.search(line)
        if m:
            n, mean = int(m.group(1)), float(m.group(2))
            t = marks.setdefault(cell, [0, 0.0])
            t[0] += n
            t[1] += n * mean
            continue
        m = HIST.search(line)
        if m:
            h = hist.setdefault((*cell, m.group(1)), dict.fromkeys(BUCKETS, 0))
            for part in m.group(2).split():
                k, _, v = part.partition(":")
                if k in h:
                    h[k] += int(v)
    return hist, marks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="bench contention --json reports")
    ap.add_argument("--traces", nargs="*", default=[], help="the step's traced .txt files")
    ap.add_argument(
        "--waits",
        action="store_true",
        help="with --traces: each waiter's wait times by policy (share of waits per power-of-two bucket of µs) and the words' mark means",
    )
    ap.add_argument(
        "--table",
        action="store_true",
        help="a markdown table of adaptive's p50 and mean against the better way, per cell and report",
    )
    args = ap.parse_args()
    loaded = [(p, *figures(p)) for p in args.reports]
    all_cells = sorted({c for _, _, figs in loaded for c in cells(figs)})
    if args.table:
        print(table(loaded, all_cells))
        return
    for p, report, _ in loaded:
        env = [n for n in report.get("notes", []) if n.startswith("environment:")]
        print(f"# {p}: commit {report.get('commit')}, {report.get('device')}; {' '.join(env) or 'defaults'}")
    for cell in all_cells:
        t, burn, c = cell
        print(f"{t} {burn} {c} client(s)")
        for p, _, figs in loaded:
            if (f"{t} adaptive burn={burn}", c, "launch_sync.mean") in figs:
                print(f"  {describe(figs, cell)}  [{p}]")
    for path in args.traces:
        print(f"# clients settled on the full call in {path}, round by round (settled/traced)")
        for (burn, policy, t, c), rounds in sorted(settled(path).items()):
            if policy == "adaptive" and any(n for _, n in rounds):
                per = " ".join(f"{k}/{n}" for k, n in rounds)
                print(f"  {t} {burn} {c} client(s): {per}")
        given = sorted(gave_up(path).items())
        if given:
            print(f"# adaptive's client waiters in {path}: spins first given up (waiters at half or more)")
            for (burn, policy, t, c, label), (n, spun, gave, half, last) in given:
                if policy == "adaptive":
                    share = gave / spun if spun else 0.0
                    print(
                        f"  {t} {burn} {c} client(s) {label:22} {gave}/{spun} ({share:.0%}),"
                        f" {half} of {n} waiters at half or more"
                        + (f", {last} found at the last look" if last else "")
                    )
        where = sorted(cpus(path).items())
        if where:
            print(
                f"# adaptive's clients in {path}, settled on the full call or not: their synchronizes"
                " by how they ended, with the server on the client's CPU / all"
            )
            for (burn, policy, t, c, was), ends in where:
                if policy == "adaptive":
                    parts = [
                        f"{name} {same}/{n}" + (f" ({same / n:.0%})" if n else "")
                        for name, (n, same) in zip(ENDINGS, ends[: len(ENDINGS)])
                    ]
                    if ends[-3][0]:
                        parts.append(f"yields {ends[-3][0]}")
                    if ends[-2][0]:
                        parts.append(f"seen at the last look {ends[-2][0]}")
                    full = ends[-1]
                    for i, name in enumerate(("after a watch", "at once")):
                        n, us, slow = full[3 * i : 3 * i + 3]
                        if n:
                            parts.append(
                                f"full calls {name} {n} (mean {us / n:.0f} us, {slow} of 1 ms or more)"
                            )
                    kind = "settled" if was else "spinning"
                    print(f"  {t} {burn} {c} client(s) {kind:8} " + ", ".join(parts))
        moved = sorted(moves(path).items())
        if moved:
            print(f"# server threads moved off their client's CPU in {path} (threads, most moves of one)")
            for (burn, policy, t, c), (threads, most) in moved:
                print(f"  {t} {burn} {policy} {c} client(s): {threads} threads, up to {most}+ moves")
        if args.waits:
            hist, marks = waits_by_policy(path)
            print(f"# waits by policy in {path}: share of waits by time (us), waits")
            for (burn, policy, t, c, label), h in sorted(hist.items()):
                total = sum(h.values())
                if total:
                    shares = " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in h.items() if v)
                    print(f"  {t} {burn} {c} client(s) {policy:8} {label:24} {shares} ({total})")
            for (burn, policy, t, c), (n, us) in sorted(marks.items()):
                if n:
                    print(f"  {t} {burn} {c} client(s) {policy:8} completion word marks: {n}, mean {us / n:.2f} us")
        print(f"# server synchronizes in {path} (deferred / all, mean wake-up and driver us)")
        for section, deferred, total, wake, driver, sched in traces(path):
            if total:
                n = max(deferred, 1)
                line = (
                    f"  {section:16} {deferred:6}/{total:<6} wake {wake / n:6.0f}"
                    f" driver {driver / n:6.0f}"
                )
                if sched:
                    # Missed polls and waiter threads: on-CPU / run-queue µs (GPU or host).
                    line += (
                        f"  missed poll ran {sched[0] / n:.0f} queued {sched[1] / n:.0f}"
                        f"  driver ran {sched[2] / n:.0f} queued {sched[3] / n:.0f}"
                    )
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
