"""The engine core in its own process under `infire serve`: a killed core fails open
requests at once and the server exits non-zero; Ctrl-C and a killed server leave no
process behind; `--engine-in-process` serves the same tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness import TINY_NAME, Server, sse_events


def _children(pid: int) -> list[int]:
    """Pids of the live child processes of `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _serve(model: Path, tmp: Path, *extra: str) -> Server:
    args = ["--model", str(model), "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--served-model-name", TINY_NAME, *extra]  # fmt: skip
    return Server(args, tmp / "server.log")


def _core(server: Server) -> int:
    children = _children(server.pid)
    assert len(children) == 1, children
    return children[0]


LONG = {"model": TINY_NAME, "prompt": "go on", "max_tokens": 3000, "ignore_eos": True}


def test_killed_engine_core_ends_requests_and_the_server(tiny_long: Path, tmp_path: Path):
    server = _serve(tiny_long, tmp_path)
    try:
        core = _core(server)
        results: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", f"{server.base_url}/completions",
                              json={**LONG, "stream": True}, timeout=30) as response:  # fmt: skip
                results["stream"] = sse_events(response)
                results["stream_end"] = time.monotonic()

        def whole() -> None:
            response = httpx.post(f"{server.base_url}/completions", json=LONG, timeout=30)
            results["whole"] = response
            results["whole_end"] = time.monotonic()

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while server.metrics()["infire:num_requests_running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(30)
        events = results["stream"]
        assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "engine_dead"
        assert results["stream_end"] - killed < 5
        whole = results["whole"]
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "engine_dead"
        assert results["whole_end"] - killed < 5
        # It stops taking requests, never answers healthy again, and exits with status 1.
        assert server.process.wait(20) == 1
        assert "the engine died" in server.output()
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["ctrl-c", "kill-server"])
def test_stopping_the_server_leaves_no_process(tiny_llama: Path, tmp_path: Path, how: str):
    server = _serve(tiny_llama, tmp_path)
    try:
        core = _core(server)
        body = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        assert (
            httpx.post(f"{server.base_url}/completions", json=body, timeout=30).status_code == 200
        )
        if how == "ctrl-c":
            server.process.send_signal(signal.SIGINT)
            # uvicorn shuts down cleanly, then re-raises the signal it caught
            assert server.process.wait(20) in (0, -signal.SIGINT)
        else:
            server.process.kill()
            server.process.wait(10)
        assert _gone(core, 5), f"engine core {core} outlived the server"
    finally:
        server.stop()


def test_engine_in_process_serves_the_same_tokens(tiny_llama: Path, tmp_path: Path):
    body = {"model": TINY_NAME, "prompt": "the cat", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 2}  # fmt: skip
    answers = []
    for extra in ((), ("--engine-in-process",)):
        folder = tmp_path / str(len(answers))
        folder.mkdir()
        server = _serve(tiny_llama, folder, *extra)
        try:
            assert len(_children(server.pid)) == (0 if extra else 1)
            answers.append(httpx.post(f"{server.base_url}/completions", json=body, timeout=30))
        finally:
            server.stop()
    first, second = (a.json()["choices"][0] for a in answers)
    assert first["text"] == second["text"] and first["logprobs"] == second["logprobs"]


def test_killed_worker_rank_ends_requests_and_the_server(tiny_long: Path, tmp_path: Path):
    server = _serve(tiny_long, tmp_path, "--tensor-parallel-size", "2")
    try:
        core = _core(server)
        workers = _children(core)
        assert len(workers) == 1, workers
        outcome: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", f"{server.base_url}/completions",
                              json={**LONG, "stream": True}, timeout=30) as response:  # fmt: skip
                outcome["events"] = sse_events(response)
                outcome["end"] = time.monotonic()

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 30
        while server.metrics()["infire:generation_tokens_total"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        thread.join(30)
        assert outcome["events"][-1]["error"]["code"] == "engine_dead"
        assert outcome["end"] - killed < 5
        assert server.process.wait(20) == 1
        assert _gone(core, 5)
    finally:
        server.stop()


def test_a_model_that_cannot_be_cut_is_refused_at_startup(tiny_llama: Path):
    run = subprocess.run(
        [sys.executable, "-m", "infire.cli", "serve", "--model", str(tiny_llama),
         "--tensor-parallel-size", "3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "num_attention_heads 4 is not divisible by tensor_parallel_size 3" in run.stderr
