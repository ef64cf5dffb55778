"""The cluster the balancer tests share: a colocated reference server, a prefill worker, a
decode worker and the balancer over the pair, started once per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import Balancer, worker

from infire.serverproc import ServerProcess


@pytest.fixture(scope="module")
def cluster(tiny_long: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A colocated server, a prefill and a decode worker, and the balancer over the pair."""
    tmp = tmp_path_factory.mktemp("disagg")
    started: list[ServerProcess] = []
    try:
        for role in ("both", "prefill", "decode"):
            started.append(worker(tiny_long, tmp, role))
        both, prefill, decode = started
        started.append(Balancer(tmp / "balance.log", [prefill.url], [decode.url]))
        yield {"both": both, "prefill": prefill, "decode": decode, "balancer": started[-1]}
    finally:
        for process in reversed(started):
            process.stop()
