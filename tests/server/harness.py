"""`infire serve` as a real subprocess on a free port, and helpers to talk to it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TINY_NAME = "tiny-llama"


class Server:
    """One `infire serve` process; `url` is its root, `base_url` its /v1."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.log = log
        self.not_ready: list[httpx.Response] = []  # /health answers before it was ready
        command = [sys.executable, "-m", "infire.cli", "serve", "--port", str(self.port), *args]
        with log.open("w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"infire serve exited:\n{self.log.read_text()}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=2)
                if response.status_code == 200:
                    return
                self.not_ready.append(response)
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"infire serve not ready in {timeout}s:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        """The `infire:` samples of /metrics, by name (labels dropped, summed)."""
        values: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith("infire:"):
                name, value = line.rsplit(" ", 1)
                name = name.split("{", 1)[0]
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The `data:` payloads of a server-sent event stream: JSON objects, or '[DONE]'."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response is an OpenAI-shaped error with this status (and param); its error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error
    return error
