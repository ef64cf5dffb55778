"""Tensor and pipeline parallelism on this machine's CPU: decode speed and memory per rank.

Each layout is an `LLM(..., tensor_parallel_size=T, pipeline_parallel_size=P)` in float32
(rank 0 in this process, the other ranks worker processes, one thread each on 2 cores).
For each: batch-1 decode (one 32-token prompt, 64 new tokens) and a batch of 16 such
requests, --rounds times, medians; resident memory of every rank after loading (each
layout runs in a fresh process, so rank 0's memory is its own). The
reference is T = P = 1, both with the fused C forward (the default) and on the PyTorch
path that sharded ranks run. SmolLM2-135M (9 heads, 3 KV heads) splits into 3 tensor
shards, not 2, so TP=2 runs on a random model of SmolLM2's shape with 8 heads and 4 KV
heads (head_dim 72). Results: a markdown table and docs/benchmarks-parallel.png.

    .venv/bin/python benchmarks/bench_parallel.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from infire import LLM, SamplingParams
from infire.models.hf_export import write_hf_files
from infire.models.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MB = 1024**2


def eight_head_model() -> Path:
    """A random model of SmolLM2-135M's shape with 8 heads / 4 KV heads, written once."""
    folder = RESULTS / "smollm2-shape-8-heads"
    if (folder / "model.safetensors").exists():
        return folder
    loaded = load_model(None, torch.float32)
    config = dataclasses.replace(loaded.config, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=72, tie_word_embeddings=True)  # fmt: skip
    write_hf_files(config, loaded.tokenizer, folder, "float32")
    g = torch.Generator().manual_seed(0)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, h),
               "model.norm.weight": torch.ones(h)}  # fmt: skip
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(8 * d, h),
            p + "self_attn.k_proj.weight": rand(4 * d, h),
            p + "self_attn.v_proj.weight": rand(4 * d, h),
            p + "self_attn.o_proj.weight": rand(h, 8 * d),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }  # fmt: skip
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def rss_mb(pid: int) -> float:
    """Resident memory of a process."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def children(pid: int) -> list[int]:
    """Pids of a process's children (the worker ranks)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def measure(model: str | None, tp: int, pp: int, fused: bool, rounds: int) -> dict:
    """Load one layout, time batch-1 and batch-16 decode, read every rank's RSS."""
    prompt = [(7 * j) % 5000 + 100 for j in range(32)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with LLM(model, dtype="float32", num_blocks=256, cpu_kernels=fused,
             tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:  # fmt: skip
        ranks = [os.getpid(), *children(os.getpid())]
        rss = [rss_mb(pid) for pid in ranks]
        llm.generate([prompt], params)  # warm-up
        single, batch = [], []
        for r in range(rounds):
            start = time.perf_counter()
            llm.generate([[r + 1, *prompt]], params)
            single.append(64 / (time.perf_counter() - start))
            prompts = [[r + 2 + k, *prompt] for k in range(16)]
            start = time.perf_counter()
            llm.generate(prompts, params)
            batch.append(16 * 64 / (time.perf_counter() - start))
    return {"tp": tp, "pp": pp, "fused": fused, "batch1_tok_s": statistics.median(single),
            "batch16_tok_s": statistics.median(batch), "rank_rss_mb": rss}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a layout, in its own process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*json.loads(args.one))))
        return
    RESULTS.mkdir(exist_ok=True)
    eight = str(eight_head_model())
    layouts = [
        ("SmolLM2-135M", None, 1, 1, True), ("SmolLM2-135M", None, 1, 1, False),
        ("SmolLM2-135M", None, 1, 2, False), ("SmolLM2-135M", None, 3, 1, False),
        ("SmolLM2 shape, 8 heads", eight, 1, 1, False), ("SmolLM2 shape, 8 heads", eight, 2, 1, False),
        ("SmolLM2 shape, 8 heads", eight, 1, 2, False),
    ]  # fmt: skip
    rows = []
    for name, model, tp, pp, fused in layouts:
        spec = json.dumps([model, tp, pp, fused, args.rounds])
        run = subprocess.run([sys.executable, __file__, "--one", spec], check=True,
                             capture_output=True, text=True)  # fmt: skip
        row = {"model": name, **json.loads(run.stdout.strip().splitlines()[-1])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    (RESULTS / "parallel.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print(f"wrote {plot(rows, ROOT / 'docs' / 'benchmarks-parallel.png')}")


def table(rows: list[dict]) -> str:
    """Markdown: per layout, tok/s with the ratio to the same model's 1x1 PyTorch path."""
    lines = ["| model | T x P | path | batch-1 tok/s | batch-16 tok/s | vs 1x1 (PyTorch) batch-1 / 16 "
             "| RSS per rank MB |", "|---|---|---|--:|--:|--:|---|"]  # fmt: skip
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["tp"] * r["pp"] == 1
                    and not r["fused"])  # fmt: skip
        lines.append(
            f"| {row['model']} | {row['tp']}x{row['pp']} | {'fused C' if row['fused'] else 'PyTorch'} "
            f"| {row['batch1_tok_s']:.1f} | {row['batch16_tok_s']:.1f} | "
            f"{row['batch1_tok_s'] / base['batch1_tok_s']:.2f}x / "
            f"{row['batch16_tok_s'] / base['batch16_tok_s']:.2f}x | "
            f"{', '.join(f'{m:.0f}' for m in row['rank_rss_mb'])} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """Two panels: decode tok/s (batch 1 and 16) and resident memory per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"SmolLM2-135M": "SmolLM2", "SmolLM2 shape, 8 heads": "8-head"}
    labels = [f"{short.get(r['model'], r['model'])}\n{r['tp']}x{r['pp']}"
              f"{' fused' if r['fused'] else ''}" for r in rows]  # fmt: skip
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = range(len(rows))
    speed.bar([i - 0.2 for i in x], [r["batch1_tok_s"] for r in rows], 0.4, label="batch 1")
    speed.bar([i + 0.2 for i in x], [r["batch16_tok_s"] for r in rows], 0.4, label="batch 16")
    speed.set_ylabel("output tok/s")
    speed.set_title("decode speed (2-core CPU, float32)")
    speed.legend()
    for i, row in enumerate(rows):
        for k, mb in enumerate(row["rank_rss_mb"]):
            memory.bar(i + (k - (len(row["rank_rss_mb"]) - 1) / 2) * 0.25, mb, 0.22,
                       color=f"C{k}")  # fmt: skip
    memory.set_ylabel("resident MB per rank")
    memory.set_title("memory of each rank (rank 0 left)")
    for axis in (speed, memory):
        axis.set_xticks(list(x), labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    sys.exit(main())
