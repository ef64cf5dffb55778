"""Disaggregated workers as real processes on 127.0.0.1: `infire serve --role ...` for
the tiny model, and `infire balance` in front of them (KV over Mooncake's transfer engine,
TCP)."""

from __future__ import annotations

import sys
from pathlib import Path

from infire.serverproc import ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from harness import TINY_NAME, Server  # noqa: E402

KV_SECRET = "test-deployment-secret"  # handles are signed with it (--kv-secret)
WORKER_ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name",
               TINY_NAME, "--threads-per-rank", "1"]  # fmt: skip


class Balancer(ServerProcess):
    """`infire balance` over the given workers."""

    def __init__(self, log: Path, prefill: list[str], decode: list[str],
                 both: list[str] | None = None) -> None:  # fmt: skip
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"
        command = [sys.executable, "-m", "infire.cli", "balance", "--port", str(port),
                   "--prefill", *prefill, "--decode", *decode]  # fmt: skip
        if both:
            command += ["--both", *both]
        super().__init__("infire balance", command, port, f"{self.url}/health", log=log,
                         timeout=60, poll_s=0.1)  # fmt: skip


def worker(model: Path, tmp: Path, role: str, *extra: str) -> Server:
    """An `infire serve --role ROLE` process for the tiny model."""
    return Server(["--model", str(model), *WORKER_ARGS, "--role", role, *extra],
                  tmp / f"{role}.log", env={"INFIRE_KV_SECRET": KV_SECRET})  # fmt: skip
