"""Servers shared by the server tests: started once per session, stopped at its end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import TINY_NAME, Server


def _serve(args: list[str], tmp: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    server = Server(args, tmp / "server.log", env)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny Llama served in float32, named `tiny-llama`, no API key."""
    args = ["--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--served-model-name", TINY_NAME]  # fmt: skip
    yield from _serve(args, tmp_path_factory.mktemp("tiny-server"))


@pytest.fixture(scope="session")
def guarded_server(tiny_long: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an API key (from the environment), a 64 KiB body limit, one running
    sequence at a time and at most two waiting: for auth, 413, 429 and disconnect tests."""
    args = ["--model", str(tiny_long), "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--served-model-name", TINY_NAME, "--max-body-bytes", "64KiB",
            "--max-num-seqs", "1", "--max-waiting", "2"]  # fmt: skip
    env = {"INFIRE_API_KEY": "sk-test-key"}
    yield from _serve(args, tmp_path_factory.mktemp("guarded-server"), env)
