"""`infire serve` as a real subprocess on a free port, and helpers to talk to it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from infire.serverproc import ServerProcess, free_port

TINY_NAME = "tiny-llama"


class Server(ServerProcess):
    """One `infire serve` process; `url` is its root, `base_url` its /v1."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"
        command = [sys.executable, "-m", "infire.cli", "serve", "--port", str(port), *args]
        super().__init__("infire serve", command, port, f"{self.url}/health", log=log, env=env,
                         timeout=180, poll_s=0.1)  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """The `infire:` samples of /metrics, by name (labels dropped, summed)."""
        values: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith("infire:"):
                name, value = line.rsplit(" ", 1)
                name = name.split("{", 1)[0]
                values[name] = values.get(name, 0.0) + float(value)
        return values


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
