"""Upstreams for the gateway tests: a real `infire serve` with the tiny Llama."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infire.serverproc import ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))  # harness.Server

from harness import TINY_NAME, Server  # noqa: E402


@pytest.fixture(scope="session")
def infire_upstream(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`infire serve` with the tiny Llama (float32), named tiny-llama."""
    args = ["--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--served-model-name", TINY_NAME]  # fmt: skip
    server = Server(args, tmp_path_factory.mktemp("gateway-upstream") / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free port (no persistence), for the shared-state tests.
    Skipped where redis-server is not installed, unless INFIRE_REQUIRE_REDIS=1 (CI)."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("INFIRE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed (.ci/run installs Debian's package)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    folder = tmp_path_factory.mktemp("redis")
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
               "no", "--dir", str(folder)]  # fmt: skip
    redis = ServerProcess("redis-server", command, port, None, timeout=20)
    with redis:
        yield f"redis://127.0.0.1:{port}/0"
