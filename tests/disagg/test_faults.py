"""Faults in a disaggregated deployment, with real processes: kill -9 of the decode or the
prefill worker mid-request, a client that leaves between the legs, a lease that expires.
The client gets a clean error or a retried answer, the survivors end with no lease, no
pull and no KV block in use, and the killed worker's processes are gone."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from cluster import Balancer, worker
from harness import TINY_NAME

LONG_PROMPT = "the " * 2800  # 2,801 tokens of the tiny tokenizer: a prefill of many chunks


def _load(server) -> dict:
    return httpx.get(f"{server.url}/load", timeout=10).json()


def _usage(server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("infire:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kv_cache_usage_perc")


def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def _released(server) -> bool:
    load = _load(server)
    return load["num_leases"] == 0 and load["num_pulling"] == 0 and load["num_running"] == 0


def _kill(server) -> list[int]:
    """kill -9 a worker's front; returns its pids (front and engine core)."""
    pids = [server.pid] + [c.pid for c in psutil.Process(server.pid).children(recursive=True)]
    os.kill(server.pid, signal.SIGKILL)
    return pids


def _gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


@pytest.fixture
def processes():
    started = []
    yield started
    for process in reversed(started):
        process.stop()


def _start(processes: list, process):
    processes.append(process)
    return process


def test_decode_worker_killed_mid_stream(tiny_long: Path, tmp_path: Path, processes) -> None:
    prefill = _start(processes, worker(tiny_long, tmp_path, "prefill", "--kv-lease-timeout", "3"))
    decode = _start(processes, worker(tiny_long, tmp_path, "decode"))
    balancer = _start(processes, Balancer(tmp_path / "balance.log", [prefill.url], [decode.url]))
    body = {"model": TINY_NAME, "prompt": "Once upon a time", "max_tokens": 3000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{balancer.base_url}/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 5:
                pids = _kill(decode)
                break
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest and '"code": "worker_failed"' in rest[-1] and "[DONE]" not in rest[-1]
    _until(lambda: _gone(pids))
    _until(lambda: _released(prefill) and _usage(prefill) == 0.0, timeout=3 + 5)
    _until(lambda: httpx.get(f"{balancer.url}/health").status_code == 503)


def test_prefill_worker_killed_mid_prefill_falls_back(tiny_long: Path, tmp_path: Path,
                                                      processes) -> None:  # fmt: skip
    slow = ("--max-num-batched-tokens", "4")  # the prompt's prefill takes ~700 steps
    prefill = _start(processes, worker(tiny_long, tmp_path, "prefill", *slow))
    decode = _start(processes, worker(tiny_long, tmp_path, "decode"))
    both = _start(processes, worker(tiny_long, tmp_path, "both"))
    balancer = _start(processes, Balancer(tmp_path / "balance.log", [prefill.url], [decode.url],
                                          [both.url]))  # fmt: skip
    body = {"model": TINY_NAME, "prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0}
    expected = httpx.post(f"{both.base_url}/completions", json=body, timeout=120)
    assert expected.status_code == 200, expected.text
    expected = expected.json()
    answer: dict = {}
    thread = threading.Thread(
        target=lambda: answer.update(
            reply=httpx.post(f"{balancer.base_url}/completions", json=body, timeout=120)
        )
    )
    thread.start()
    _until(lambda: _load(prefill)["num_prompt_tokens"] > 0, timeout=30)  # it has the request
    assert _load(prefill)["num_leases"] == 0  # and is still computing its prompt
    pids = _kill(prefill)
    thread.join(timeout=120)
    reply = answer["reply"]
    assert reply.status_code == 200, reply.text  # retried on the colocated worker
    assert reply.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    _until(lambda: _gone(pids))
    assert _released(decode) and _usage(decode) == 0.0 and _load(decode)["kv_pulls"] == 0


def test_client_gone_between_the_legs(tiny_long: Path, tmp_path: Path, processes) -> None:
    prefill = _start(processes, worker(tiny_long, tmp_path, "prefill", "--max-num-batched-tokens",
                                       "4", "--kv-lease-timeout", "600"))  # fmt: skip
    decode = _start(processes, worker(tiny_long, tmp_path, "decode"))
    balancer = _start(processes, Balancer(tmp_path / "balance.log", [prefill.url], [decode.url]))
    body = json.dumps({"model": TINY_NAME, "prompt": LONG_PROMPT, "max_tokens": 50,
                       "stream": True}).encode()  # fmt: skip
    host, port = "127.0.0.1", balancer.port
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        _until(lambda: _load(prefill)["num_prompt_tokens"] > 0, timeout=30)
    # the client left while the prefill ran: the balancer releases the lease at once (the
    # lease would only expire in 10 minutes) and never starts the decode leg
    _until(lambda: _load(prefill)["kv_leases_released"] == 1, timeout=30)
    assert _released(prefill) and _usage(prefill) == 0.0
    assert _load(decode)["kv_pulls"] == 0 and _usage(decode) == 0.0


def test_lease_expires_when_no_decode_worker_comes(tiny_long: Path, tmp_path: Path,
                                                   processes) -> None:  # fmt: skip
    prefill = _start(processes, worker(tiny_long, tmp_path, "prefill", "--kv-lease-timeout", "1"))
    body = {"model": TINY_NAME, "prompt": "a b c d e f g h i j k l m n o p q r s t", "max_tokens": 5,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    reply = httpx.post(f"{prefill.base_url}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    handle = reply.json()["kv_transfer_params"]
    assert handle["lease"] and len(handle["block_ids"]) >= 1 and handle["lease_seconds"] == 1
    load = _load(prefill)
    assert load["num_leases"] == 1 and _usage(prefill) > 0.0
    _until(lambda: _load(prefill)["kv_leases_expired"] == 1, timeout=5)
    assert _released(prefill) and _usage(prefill) == 0.0
    # a decode worker that comes too late: its release is answered, and changes nothing
    late = httpx.post(f"{prefill.url}/kv/release", json={"lease": handle["lease"]}, timeout=10)
    assert late.status_code == 200 and _load(prefill)["kv_leases_released"] == 0
