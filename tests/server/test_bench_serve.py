"""`infire bench serve` as a user runs it, against a real `infire serve` on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import TINY_NAME, Server


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infire.cli", "bench", "serve", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def base(server: Server, tiny_llama: Path, out: Path, *extra: str) -> list[str]:
    return ["--base-url", server.base_url, "--tokenizer", str(tiny_llama), "--input-len", "12",
            "--output-len", "6", "--output", str(out), *extra]  # fmt: skip


def test_fixed_concurrency_run(tiny_server: Server, tiny_llama: Path, tmp_path: Path):
    out = tmp_path / "run.json"
    args = base(tiny_server, tiny_llama, out, "--num-prompts", "10", "--max-concurrency", "3",
                "--goodput", "ttft:600000", "tpot:600000", "--label", "tiny")  # fmt: skip
    done = bench(*args)
    assert done.returncode == 0, done.stderr
    assert "successful / failed requests  10 / 0" in done.stdout, done.stdout
    result = json.loads(out.read_text())
    s, requests = result["summary"], result["requests"]
    assert result["settings"]["model"] == TINY_NAME  # taken from /v1/models
    assert result["settings"]["label"] == "tiny" and result["settings"]["num_warmups"] == 1
    assert (s["completed"], s["failed"]) == (10, 0)
    assert [r["output_tokens"] for r in requests] == [6] * 10  # ignore_eos: exact lengths
    assert s["total_output_tokens"] == 60
    assert all(10 <= r["prompt_tokens"] <= 13 for r in requests)  # from the server's usage
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    assert all(0 < r["ttft"] <= r["e2el"] and len(r["itl"]) <= 5 for r in requests)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < s[f"p50_{name}_ms"] <= s[f"p90_{name}_ms"] <= s[f"p99_{name}_ms"]
    assert s["output_throughput"] == pytest.approx(60 / s["duration_s"])
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # every request met the SLOs
    # Never more than 3 requests in flight.
    events = sorted([(r["start"], 1) for r in requests]
                    + [(r["start"] + r["e2el"], -1) for r in requests])  # fmt: skip
    in_flight = [sum(step for _, step in events[: i + 1]) for i in range(len(events))]
    assert max(in_flight) <= 3
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_arrivals_chat_and_strict_goodput(
    tiny_server: Server, tiny_llama: Path, tmp_path: Path
):
    out = tmp_path / "poisson.json"
    args = base(tiny_server, tiny_llama, out, "--num-prompts", "6", "--request-rate", "20",
                "--endpoint", "chat", "--goodput", "ttft:0.001", "--no-plot")  # fmt: skip
    done = bench(*args)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    starts = [r["start"] for r in result["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0  # spread out, in arrival order
    assert result["summary"]["completed"] == 6 and result["summary"]["goodput"] == 0
    assert result["settings"]["request_rate"] == 20
    assert not out.with_suffix(".png").exists()


def test_prompt_file_and_compare(tiny_server: Server, tiny_llama: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the cat"}\n{"prompt": "a dog and a bird"}\n')
    results = []
    for concurrency in ("1", "4"):
        out = tmp_path / f"c{concurrency}.json"
        args = base(tiny_server, tiny_llama, out, "--dataset", str(prompts), "--num-prompts",
                    "4", "--max-concurrency", concurrency, "--no-plot")  # fmt: skip
        assert bench(*args).returncode == 0
        results.append(str(out))
    tokens = [r["prompt_tokens"] for r in json.loads(Path(results[0]).read_text())["requests"]]
    assert tokens[0] != tokens[1] and tokens[0] == tokens[2]  # the file's prompts, cycled
    png = tmp_path / "compare.png"
    done = bench("--compare", *results, "--output", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failures_are_counted_and_reported(tiny_server: Server, tiny_llama: Path, tmp_path: Path):
    out = tmp_path / "fail.json"
    done = bench(*base(tiny_server, tiny_llama, out, "--model", "no-such-model"))
    assert done.returncode == 2 and "warm-up request failed: HTTP 404" in done.stderr
    args = base(tiny_server, tiny_llama, out, "--model", "no-such-model", "--num-warmups", "0",
                "--num-prompts", "3", "--no-plot")  # fmt: skip
    done = bench(*args)
    assert done.returncode == 1
    result = json.loads(out.read_text())
    assert result["summary"]["failed"] == 3 and result["summary"]["completed"] == 0
    assert all("HTTP 404" in r["error"] for r in result["requests"])
    missing = bench("--dataset", str(tmp_path / "none.txt"), "--base-url", tiny_server.base_url)
    assert missing.returncode == 2 and "none.txt" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_mixed_loads_run_together(tiny_server: Server, tiny_llama: Path) -> None:
    """run_many: warm-ups first, then both loads at once; the open-ended one streams until
    the other is done, and each is summarized on its own."""
    from infire.bench import serve as load
    from infire.models.loader import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_llama))
    shorts = load.random_prompts(tokenizer, 5, 8, seed=1)
    longs = load.random_prompts(tokenizer, 2, 120, seed=2)
    common = {"base_url": tiny_server.base_url, "model": TINY_NAME}
    short = load.BenchConfig(**common, prompts=shorts[1:], warmup_prompts=shorts[:1],
                              output_len=4, max_concurrency=2, label="short",
                              until_others_finish=True)  # fmt: skip
    long = load.BenchConfig(**common, prompts=longs, output_len=40, request_rate=2.0,
                             label="long")  # fmt: skip
    short_result, long_result = load.run_many([short, long], progress=False)
    assert long_result["summary"]["completed"] == 2
    s = short_result["summary"]
    assert s["failed"] == 0 and s["completed"] >= 2  # 2 clients, at least one request each
    assert s["duration_s"] >= long_result["summary"]["duration_s"] - 0.5
    assert short_result["settings"]["label"] == "short"
