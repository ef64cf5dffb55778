"""How busy other processes keep the CPUs, so a benchmark can wait for quiet and retry.

On a 2-core machine torch's threads slow down many-fold when anything else runs, so
bench_engine.py measures, for every timed call, the CPU time spent by processes other
than itself and its peer subprocesses (from /proc/stat and /proc/PID/stat), waits until
the machine is idle before a measurement, and repeats a measurement that others disturbed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    """CPU seconds used so far: by the whole machine (busy, not idle) and by our processes."""

    at: float
    machine_busy_s: float
    ours_s: float


def machine_busy_seconds() -> float:
    """Busy CPU seconds of all cores since boot (everything but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


def process_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads); 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def snapshot(own_pids: list[int]) -> CpuSnapshot:
    """The machine's and our processes' CPU time now."""
    ours = sum(process_seconds(pid) for pid in [os.getpid(), *own_pids])
    return CpuSnapshot(time.perf_counter(), machine_busy_seconds(), ours)


def others_cores(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """Average number of cores other processes kept busy between two snapshots."""
    wall = after.at - before.at
    others = (after.machine_busy_s - before.machine_busy_s) - (after.ours_s - before.ours_s)
    return max(0.0, others) / wall if wall > 0 else 0.0


def wait_until_idle(
    own_pids: list[int], threshold_cores: float, max_wait_s: float, window_s: float = 1.0
) -> float:
    """Block until others use under threshold_cores for a whole window (or max_wait_s passes).

    Returns the seconds waited.
    """
    start = time.perf_counter()
    while True:
        before = snapshot(own_pids)
        time.sleep(window_s)
        busy = others_cores(before, snapshot(own_pids))
        waited = time.perf_counter() - start
        if busy < threshold_cores or waited >= max_wait_s:
            return waited
