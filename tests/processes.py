"""The test process's own children, to check that nothing a test started outlives it."""

from __future__ import annotations

import os


def child_pids() -> set[int]:
    """Pids of this process's children (of every thread)."""
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids |= {int(p) for p in f.read().split()}
    return pids
