"""What the process hop costs: `infire serve` with the engine core in its own process
(the default) against `--engine-in-process`, on the default model, in one run.

Both servers stay up; at each concurrency the two are measured alternately, --rounds
times each, after waiting for the machine to idle, and the median output tok/s of each
is compared. The load is `infire bench serve`'s (streamed /v1/completions, random
prompts of --input-len tokens, --output-len new tokens, ignore_eos). Results: JSON in
benchmarks/results/, docs/benchmarks-engine-process.png and a markdown table.

    .venv/bin/python benchmarks/bench_engine_process.py [--concurrency 1 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench_serve import RESULTS, ROOT, Running
from machine_load import wait_until_idle

from infire.bench import plot
from infire.bench import serve as bench
from infire.models.loader import default_model_path, load_tokenizer

SERVERS = ("infire", "infire-inproc")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternations per concurrency")
    parser.add_argument("--requests", type=int, default=2,
                        help="requests per round = this x concurrency, at least 4")  # fmt: skip
    args = parser.parse_args()
    gguf = default_model_path()
    tokenizer = load_tokenizer(gguf)
    RESULTS.mkdir(exist_ok=True)
    servers = {name: Running(name, gguf, RESULTS / f"process-{name}.log") for name in SERVERS}
    rows, best = [], {}
    try:
        pids = [s.process.pid for s in servers.values()]
        for concurrency in args.concurrency:
            num = max(4, args.requests * concurrency)
            runs: dict[str, list[dict]] = {name: [] for name in SERVERS}
            for round_ in range(args.rounds):
                for name, server in servers.items():
                    seed = 1000 * concurrency + round_
                    prompts = bench.random_prompts(tokenizer, num + 1, args.input_len, seed)
                    wait_until_idle(pids, 0.15, 120)
                    config = bench.BenchConfig(
                        base_url=server.base_url, model=server.model, prompts=prompts[1:],
                        warmup_prompts=prompts[:1], output_len=args.output_len,
                        max_concurrency=concurrency, label=name,
                    )  # fmt: skip
                    result = bench.run(config, progress=False)
                    runs[name].append(result)
                    print(f"c={concurrency} round {round_} {name}: "
                          f"{result['summary']['output_throughput']:.1f} tok/s", flush=True)  # fmt: skip
            medians = {}
            for name, results in runs.items():
                tps = [r["summary"]["output_throughput"] for r in results]
                tpot = [r["summary"]["p50_tpot_ms"] for r in results]
                medians[name] = (statistics.median(tps), statistics.median(tpot))
                middle = sorted(results, key=lambda r: r["summary"]["output_throughput"])
                best[(name, concurrency)] = middle[len(middle) // 2]
            rows.append((concurrency, medians))
    finally:
        for server in servers.values():
            server.stop()
    for (name, c), result in best.items():
        (RESULTS / f"process-{name}-c{c}.json").write_text(json.dumps(result, indent=1))
    png = plot.plot_compare(list(best.values()), ROOT / "docs" / "benchmarks-engine-process.png")
    print(f"wrote {png}")
    print(table(rows))


def table(rows: list[tuple[int, dict[str, tuple[float, float]]]]) -> str:
    """Markdown rows: median output tok/s and p50 TPOT of each mode, and their ratio."""
    lines = ["| concurrency | own process tok/s | in-process tok/s | ratio | "
             "own process p50 TPOT ms | in-process p50 TPOT ms |",
             "|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for c, m in rows:
        (mp, mp_tpot), (ip, ip_tpot) = m["infire"], m["infire-inproc"]
        lines.append(f"| {c} | {mp:.1f} | {ip:.1f} | {mp / ip:.3f} | {mp_tpot:.1f} | "
                     f"{ip_tpot:.1f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
