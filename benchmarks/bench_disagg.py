"""Disaggregated prefill and decode against one colocated server, on the same two cores.

The workload is mixed. Long prompts arrive while short-prompt streams decode, and both
loads are sent at once by `infire bench serve`'s load generator (`infire.bench.serve`:
streamed /v1/completions, random prompts from the model's vocabulary, ignore_eos):
- long: --long-requests prompts of --long-input-len tokens (at least 1,024),
  --long-output-len new tokens, Poisson arrivals at --long-rate a second (the same
  arrival times for both setups within a round);
- short: --short-concurrency clients, each sending prompts of --short-input-len tokens
  for --short-output-len new tokens one after the other, from the start until the last
  long request has finished, so that the short streams span the whole long load.

Two setups serve the default model (SmolLM2-135M-Instruct), every server flag at its
default:
- colocated: one `infire serve` with 2 threads;
- disaggregated: `infire serve --role prefill` and `--role decode`, 1 thread each,
  behind `infire balance`.

They are measured alternately, --rounds times each, after waiting for the machine to
idle, on fresh prompts each round (no prefix-cache help across rounds).

Reported for each setup, as medians over the rounds:
- the short requests' TPOT p50/p90 and ITL p90;
- TTFT p50/p90 of both loads;
- output throughput.

Also: the decode worker's KV transfer rate (bytes pulled / seconds pulling, from its
/load), against a raw loopback copy measured in the same run (memcpy, a TCP stream on
127.0.0.1, and one Mooncake read between two transfer engines in this process).
Results go to benchmarks/results/disagg.json and docs/benchmarks-disagg.png, and a
markdown table is printed.

    .venv/bin/python benchmarks/bench_disagg.py            # ~6 minutes on 2 idle cores
    .venv/bin/python benchmarks/bench_disagg.py --quick    # smoke check, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bench_serve import RESULTS, ROOT
from machine_load import wait_until_idle

from infire.bench import serve as bench
from infire.models.loader import default_model_path, load_tokenizer
from infire.serverproc import ServerProcess, free_port

SETUPS = ("colocated", "disaggregated")


class Proc(ServerProcess):
    """An `infire` subcommand on a free port, ready when GET /health answers 200."""

    def __init__(self, name: str, args: list[str], threads: int) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "infire.cli", *args, "--port", str(port)]
        super().__init__(name, command, port, f"{self.url}/health",
                         log=RESULTS / f"disagg-{name}.log",
                         env={"OMP_NUM_THREADS": str(threads), "INFIRE_KV_SECRET": "bench"},
                         timeout=600, poll_s=0.2)  # fmt: skip


def start_servers() -> dict[str, Proc]:
    """The colocated server, the two workers and the balancer."""
    procs: dict[str, Proc] = {}
    try:
        procs["colocated"] = Proc("colocated", ["serve", "--threads-per-rank", "2"], 2)
        for role in ("prefill", "decode"):
            procs[role] = Proc(role, ["serve", "--role", role, "--threads-per-rank", "1"], 1)
        procs["balancer"] = Proc("balancer", ["balance", "--prefill", procs["prefill"].url,
                                              "--decode", procs["decode"].url], 1)  # fmt: skip
    except BaseException:
        for proc in procs.values():
            proc.stop()
        raise
    return procs


def loads(args: argparse.Namespace, tokenizer: Any, base_url: str, model: str,
          seed: int) -> list[bench.BenchConfig]:  # fmt: skip
    """The short and the long load of one measurement, on fresh prompts."""
    short = bench.random_prompts(tokenizer, args.short_pool + 1, args.short_input_len, seed)
    long = bench.random_prompts(tokenizer, args.long_requests, args.long_input_len, seed + 7)
    return [
        bench.BenchConfig(base_url=base_url, model=model, prompts=short[1:],
                          warmup_prompts=short[:1], output_len=args.short_output_len,
                          max_concurrency=args.short_concurrency, label="short",
                          until_others_finish=True),
        bench.BenchConfig(base_url=base_url, model=model, prompts=long,
                          output_len=args.long_output_len, request_rate=args.long_rate,
                          label="long", seed=seed),
    ]  # fmt: skip


def decode_load(procs: dict[str, Proc]) -> dict:
    return httpx.get(f"{procs['decode'].url}/load", timeout=10).json()


def memcpy_rate(num_bytes: int = 256 << 20) -> float:
    """Best-of-3 numpy copy, bytes/s."""
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def tcp_rate(num_bytes: int = 256 << 20) -> float:
    """One TCP stream over 127.0.0.1 (a sender thread, recv_into here), bytes/s."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(bytes(4 << 20))

    def send() -> None:
        with socket.create_connection(server.getsockname()) as out:
            for _ in range(num_bytes // len(payload)):
                out.sendall(payload)

    sender = threading.Thread(target=send)
    start = time.perf_counter()
    sender.start()
    conn, _ = server.accept()
    buffer = bytearray(4 << 20)
    view, received = memoryview(buffer), 0
    with conn:
        while received < num_bytes:
            n = conn.recv_into(view)
            if not n:
                break
            received += n
    seconds = time.perf_counter() - start
    sender.join()
    server.close()
    return received / seconds


def mooncake_rate(num_bytes: int = 256 << 20) -> float:
    """One Mooncake read between two transfer engines of this process, bytes/s."""
    from infire.disagg.connector import MooncakeConnector

    a, b = MooncakeConnector(), MooncakeConnector()
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.zeros(num_bytes, dtype=np.uint8)
    a.register([(src.ctypes.data, num_bytes)])
    b.register([(dst.ctypes.data, num_bytes)])
    best = float("inf")
    for _ in range(3):
        transfer = b.pull(a.address, [(dst.ctypes.data, src.ctypes.data, num_bytes)])
        transfer.wait()
        assert transfer.error is None, transfer.error
        best = min(best, transfer.seconds)
    a.close()
    b.close()
    return num_bytes / best


def summarize(runs: list[list[dict]], transfers: list[tuple[int, float]]) -> dict:
    """Medians over rounds of each setup's figures."""
    out: dict[str, Any] = {}

    def med(load: int, key: str) -> float:
        return statistics.median(r[load]["summary"][key] for r in runs)

    for name, index in (("short", 0), ("long", 1)):
        for key in ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms", "p90_itl_ms",
                    "mean_tpot_ms", "failed", "completed"):  # fmt: skip
            out[f"{name}_{key}"] = med(index, key)
    out["output_throughput"] = statistics.median(
        sum(r[i]["summary"]["total_output_tokens"] for i in (0, 1))
        / max(r[i]["summary"]["duration_s"] for i in (0, 1)) for r in runs)  # fmt: skip
    if transfers:
        sent = sum(b for b, _ in transfers)
        spent = sum(s for _, s in transfers)
        out["kv_bytes_pulled"] = sent
        out["kv_pull_rate"] = sent / spent if spent else None
    return out


def markdown(result: dict) -> str:
    """The tables docs/benchmarks.md quotes."""
    s = result["summaries"]
    col, dis = s["colocated"], s["disaggregated"]
    lines = ["| setup | short TPOT p50 ms | short TPOT p90 ms | short ITL p90 ms | "
             "short TTFT p50 / p90 ms | long TTFT p50 / p90 ms | output tok/s | failed |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for name, row in (("colocated, 2 threads", col), ("disaggregated, 1 + 1 threads", dis)):
        lines.append(
            f"| {name} | {row['short_p50_tpot_ms']:.1f} | {row['short_p90_tpot_ms']:.1f} | "
            f"{row['short_p90_itl_ms']:.1f} | {row['short_p50_ttft_ms']:.0f} / "
            f"{row['short_p90_ttft_ms']:.0f} | {row['long_p50_ttft_ms']:.0f} / "
            f"{row['long_p90_ttft_ms']:.0f} | {row['output_throughput']:.1f} | "
            f"{row['short_failed'] + row['long_failed']:.0f} |"
        )
    ratio = col["short_p90_tpot_ms"] / dis["short_p90_tpot_ms"]
    copy = result["copy"]
    lines += [
        "",
        f"p90 TPOT colocated / disaggregated: **{ratio:.2f}x** (target 3x); p50 "
        f"{col['short_p50_tpot_ms'] / dis['short_p50_tpot_ms']:.2f}x; long TTFT p50 "
        f"{dis['long_p50_ttft_ms'] / col['long_p50_ttft_ms']:.2f}x colocated's; output "
        f"throughput {dis['output_throughput'] / col['output_throughput']:.2f}x.",
        "",
        "| copy | GB/s |",
        "|---|--:|",
        f"| KV pulls of the decode worker ({dis['kv_bytes_pulled'] / 1e6:.0f} MB in the run) "
        f"| {dis['kv_pull_rate'] / 1e9:.2f} |",
        f"| Mooncake alone, one 256 MB read, two engines in one process | "
        f"{copy['mooncake'] / 1e9:.2f} |",
        f"| raw TCP stream on 127.0.0.1 | {copy['tcp'] / 1e9:.2f} |",
        f"| memcpy (numpy, 256 MB) | {copy['memcpy'] / 1e9:.2f} |",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """TPOT, TTFT and throughput of both setups side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summaries"]
    colors = {"colocated": "#5c7cfa", "disaggregated": "#d9480f"}
    figure, axes = plt.subplots(1, 3, figsize=(15, 5))
    panels = [
        ("short requests' TPOT, ms", ["short_p50_tpot_ms", "short_p90_tpot_ms"], ["p50", "p90"]),
        ("TTFT, ms", ["short_p50_ttft_ms", "short_p90_ttft_ms", "long_p50_ttft_ms",
                      "long_p90_ttft_ms"], ["short p50", "short p90", "long p50", "long p90"]),
        ("output throughput, tok/s", ["output_throughput"], ["all requests"]),
    ]  # fmt: skip
    for axis, (title, keys, ticks) in zip(axes, panels, strict=True):
        x = np.arange(len(keys))
        for i, setup in enumerate(SETUPS):
            values = [s[setup][k] for k in keys]
            bars = axis.bar(x + (i - 0.5) * 0.38, values, 0.38, label=setup, color=colors[setup])
            axis.bar_label(bars, [f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in values],
                           fontsize=8)  # fmt: skip
        axis.set_xticks(x, ticks)
        axis.set_title(title)
        axis.legend()
    figure.suptitle(f"mixed workload, SmolLM2-135M, 2 cores: {result['workload']}", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short-pool", type=int, default=300,
                        help="distinct short prompts, sent in turn (default: 300)")  # fmt: skip
    parser.add_argument("--short-input-len", type=int, default=64)
    parser.add_argument("--short-output-len", type=int, default=96)
    parser.add_argument("--short-concurrency", type=int, default=4)
    parser.add_argument("--long-requests", type=int, default=10)
    parser.add_argument("--long-input-len", type=int, default=1024)
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--long-rate", type=float, default=0.25, help="long prompts a second")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.short_pool, args.long_requests = 1, 40, 2
        args.short_output_len = 32
    gguf = default_model_path()
    tokenizer = load_tokenizer(gguf)
    RESULTS.mkdir(exist_ok=True)
    print("starting the colocated server, the two workers and the balancer ...", flush=True)
    procs = start_servers()
    runs: dict[str, list[list[dict]]] = {name: [] for name in SETUPS}
    transfers: list[tuple[int, float]] = []
    try:
        pids = [p.pid for p in procs.values()]
        urls = {"colocated": procs["colocated"].url, "disaggregated": procs["balancer"].url}
        model = httpx.get(f"{urls['colocated']}/v1/models").json()["data"][0]["id"]
        copy = {"memcpy": memcpy_rate(), "tcp": tcp_rate(), "mooncake": mooncake_rate()}
        print("raw copies: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in copy.items()))
        for round_ in range(args.rounds):
            for setup in SETUPS:
                wait_until_idle(pids, 0.15, 120)
                before = decode_load(procs)
                configs = loads(args, tokenizer, f"{urls[setup]}/v1", model, 100 * round_ + 1)
                result = bench.run_many(configs, progress=False)
                after = decode_load(procs)
                if setup == "disaggregated":
                    transfers.append((after["kv_bytes_pulled"] - before["kv_bytes_pulled"],
                                      after["kv_pull_seconds"] - before["kv_pull_seconds"]))  # fmt: skip
                runs[setup].append(result)
                short, long = (r["summary"] for r in result)
                print(f"round {round_ + 1} {setup}: short TPOT p90 {short['p90_tpot_ms']:.1f} ms, "
                      f"long TTFT p50 {long['p50_ttft_ms']:.0f} ms, failed "
                      f"{short['failed'] + long['failed']}", flush=True)  # fmt: skip
    finally:
        for proc in reversed(procs.values()):
            proc.stop()
    workload = (f"{args.short_concurrency} streams of ({args.short_input_len} prompt + "
                f"{args.short_output_len} new) tokens while {args.long_requests} x "
                f"({args.long_input_len} + {args.long_output_len}) arrive at "
                f"{args.long_rate}/s")  # fmt: skip
    result = {
        "workload": workload, "args": vars(args), "copy": copy,
        "summaries": {"colocated": summarize(runs["colocated"], []),
                      "disaggregated": summarize(runs["disaggregated"], transfers)},
        "runs": runs,
    }  # fmt: skip
    name = "disagg-quick" if args.quick else "disagg"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    png = RESULTS / f"{name}.png" if args.quick else ROOT / "docs" / "benchmarks-disagg.png"
    plot(result, png)
    print("\n" + markdown(result))
    print(f"\nwrote {RESULTS / f'{name}.json'} and {png}")


if __name__ == "__main__":
    main()
