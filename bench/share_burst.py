"""How Linux shares two cores between two sessions for a fraction of a second after both continue:
the scheduler behaviour behind the tail of the service benchmark's drains.

``.venv/bin/python bench/share_burst.py [--a 3] [--b 1 2] [--bursts 12] [--burst-s 0.2]``

Two groups of busy processes, each group in a session of its own (with autogroup scheduling, as
``service_bench.py --share services`` starts the two services): group A with ``--a`` processes,
group B with each count of ``--b`` in turn. Every burst stops all of them, waits, continues them
together and reads each group's CPU time (``/proc/PID/schedstat``) ``--burst-s`` seconds later:
the protocol of a drain, with spinners in place of the services. Nothing here touches kvrouter;
it measures the kernel, so that the benchmark's figures can be read. Bounded: ``--bursts`` bursts
per count, and every process it starts is killed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPIN = "while True: pass"


def start_group(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` spinners in one new session: a leader started in a session of its own, which starts
    the other ``n - 1`` itself (its children stay in its session; ours would be in ours)."""
    code = (
        "import subprocess, sys\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {SPIN!r}]) for _ in range({n - 1})]\n"
        f"{SPIN}\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    return [leader]


def members(leader: subprocess.Popen[bytes], n: int, timeout: float = 30.0) -> list[int]:
    """The session's processes once all ``n`` run."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and _sid(int(p.name)) == leader.pid
        ]
        if len(pids) >= n:
            return pids
        if time.monotonic() > deadline:
            raise RuntimeError(f"group of {n} did not start")
        time.sleep(0.05)


def _sid(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[3])  # (state ppid pgrp session ...)


def cpu_s(pids: list[int]) -> float:
    """Seconds on a CPU, summed over ``pids`` (the scheduler's nanosecond counter)."""
    total = 0
    for pid in pids:
        total += int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    return total / 1e9


def bursts(a: int, b: int, count: int, burst_s: float) -> list[tuple[float, float]]:
    """Cores each group ran on in each burst."""
    la, lb = start_group(a), start_group(b)
    try:
        pa, pb = members(la[0], a), members(lb[0], b)
        out = []
        for _ in range(count):
            for pid in pa + pb:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(0.7)  # (a drain's services wait stopped while the stream is queued)
            a0, b0 = cpu_s(pa), cpu_s(pb)
            for pid in pa + pb:
                os.kill(pid, signal.SIGCONT)
            time.sleep(burst_s)
            out.append(((cpu_s(pa) - a0) / burst_s, (cpu_s(pb) - b0) / burst_s))
        return out
    finally:
        for leader in la + lb:
            sid = leader.pid
            for p in Path("/proc").iterdir():
                if p.name.isdigit() and _sid(int(p.name)) == sid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(p.name), signal.SIGKILL)
            leader.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=int, default=3, help="busy processes in group A (Dynamo's drain: 3 threads)")
    ap.add_argument("--b", type=int, nargs="+", default=[1, 2], help="busy processes in group B, in turn")
    ap.add_argument("--bursts", type=int, default=12)
    ap.add_argument("--burst-s", type=float, default=0.2, help="a 200k-block drain lasts 0.1-0.3 s")
    args = ap.parse_args()
    print(f"autogroup: {Path('/proc/sys/kernel/sched_autogroup_enabled').read_text().strip()}")
    for b in args.b:
        rows = bursts(args.a, b, args.bursts, args.burst_s)
        bs = [r[1] for r in rows]
        print(
            f"A {args.a} busy / B {b} busy, {args.bursts} bursts of {args.burst_s:g} s: B ran on "
            f"{min(bs):.2f}-{max(bs):.2f} cores (median {statistics.median(bs):.2f}), A on "
            f"{min(r[0] for r in rows):.2f}-{max(r[0] for r in rows):.2f} "
            f"(median {statistics.median(r[0] for r in rows):.2f})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
