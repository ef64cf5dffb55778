"""A server as a subprocess on 127.0.0.1: a free port, start, wait until it answers, stop.

The integration tests (infire serve, infire gateway, the fault upstream, redis-server) and
the benchmarks (peer servers, LiteLLM's proxy) all run their servers through this.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_200(response: httpx.Response) -> bool:
    return response.status_code == 200


class ServerProcess:
    """`command` as a subprocess, ready once GET `ready_url` satisfies `ready` (200 by default;
    None: once the port accepts a TCP connection). Its output goes to `log` (a file that is
    kept) or to a temporary file; `output()` reads it. RuntimeError with that output when it
    exits or is not ready within `timeout` seconds."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        port: int,
        ready_url: str | None,
        *,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        ready: Callable[[httpx.Response], bool] = answers_200,
        poll_s: float = 0.05,
    ) -> None:
        self.name, self.port, self.log = name, port, log
        self.not_ready: list[httpx.Response] = []  # answers before it was ready
        self._out: IO[bytes] = log.open("w+b") if log else tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(
            list(command), stdout=self._out, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.last: httpx.Response | None = None  # the answer that said ready
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                output = self.output()
                self.stop()
                raise RuntimeError(f"{name} exited with status {self.process.returncode}:\n"
                                   f"{output}")  # fmt: skip
            if self._ready(ready_url, ready):
                return
            time.sleep(poll_s)
        output = self.output()
        self.stop()
        raise RuntimeError(f"{name} not ready in {timeout:g} s:\n{output}")

    def _ready(self, url: str | None, ready: Callable[[httpx.Response], bool]) -> bool:
        if url is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                return False
        try:
            response = httpx.get(url, timeout=5)
        except httpx.TransportError:
            return False
        try:
            if ready(response):
                self.last = response
                return True
        except ValueError:  # an answer that is not the JSON expected yet
            pass
        self.not_ready.append(response)
        return False

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        """What the process printed so far."""
        if self._out.closed:
            return self.log.read_text(errors="replace") if self.log else ""
        fd = self._out.fileno()  # shared with the child: read without moving its offset
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._out.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
