"""Upstreams for the gateway tests: a real `infire serve` with the tiny Llama."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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
