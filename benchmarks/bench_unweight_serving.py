"""Serving Unweight's palette form: SmolLM2-135M held compressed in memory vs its BF16 weights.

The default model (the GGUF dequantized to BF16) is compressed into the palette form; infire
then serves both, bf16, through the fused CPU forward, and this measures, side by side:
(a) weight memory: the bytes of weights the forward holds (each storage once), and each
    process's resident memory after loading (VmRSS of a fresh process that loads only that
    model and generates 8 tokens);
(b) batch-1 decode tok/s: a 16-token prompt, 128 new tokens, greedy, EOS ignored; decode
    rate = 127 / (time for 128 tokens - time for 1 token); the two alternate (A B A B),
    each measurement after the machine went idle (machine_load.py), medians reported;
(c) prefill tok/s of a 128-token prompt (128 / time for 1 new token), in the same rounds;
(d) that both generate the same tokens; and each one's load time (fresh process).

    .venv/bin/python benchmarks/bench_unweight_serving.py     # ~2 minutes on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine_load import wait_until_idle

from infire import LLM, SamplingParams
from infire.models.loader import default_model_path, load_model
from infire.unweight.container import compress_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "unweight-serving.json"
PROMPT = list(range(1000, 1016))
NEW_TOKENS = 128
LONG_PROMPT = list(range(2000, 2128))


def resident(model: str) -> dict[str, float]:
    """Load `model` in bf16 in this (fresh) process and report what it holds."""
    start = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", num_blocks=16)
    load_s = time.perf_counter() - start
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    status = Path("/proc/self/status").read_text()
    rss_kb = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    fused = llm.engine.runner.fused
    return {"rss_mb": rss_kb / 1024, "weight_mb": fused.weight_bytes / 1e6, "load_s": load_s,
            "status": llm.engine.runner.fused_status}  # fmt: skip


def resident_in_subprocess(model: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--resident", model], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed(llm: LLM, max_tokens: int, prompt: list[int] = PROMPT) -> tuple[float, list[int]]:
    wait_until_idle([], threshold_cores=0.15, max_wait_s=120)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    return time.perf_counter() - start, list(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="A B rounds (default: 5)")
    parser.add_argument("--resident", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resident:
        print(json.dumps(resident(args.resident)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        palette = Path(tmp) / "smollm2-palette"
        print("compressing SmolLM2 (BF16) into the palette form", file=sys.stderr)
        compress_model(default_model_path(), palette, "palette")
        models = {"bf16": str(default_model_path()), "palette": str(palette)}
        weights = load_model(None, torch.bfloat16).weights
        parameters_mb = sum(w.numel() * w.element_size() for w in weights.values()) / 1e6
        del weights
        memory = {}
        for name, model in models.items():
            print(f"resident memory: {name}", file=sys.stderr)
            memory[name] = resident_in_subprocess(model)
        llms = {name: LLM(model, dtype="bfloat16", num_blocks=16) for name, model in models.items()}
        for llm in llms.values():
            timed(llm, 8)  # warm-up
        decode: dict[str, list[float]] = {name: [] for name in llms}
        prefill: dict[str, list[float]] = {name: [] for name in llms}
        tokens: dict[str, list[int]] = {}
        for r in range(args.rounds):
            for name, llm in llms.items():
                first, _ = timed(llm, 1)
                full, tokens[name] = timed(llm, NEW_TOKENS)
                decode[name].append((NEW_TOKENS - 1) / (full - first))
                prefill[name].append(len(LONG_PROMPT) / timed(llm, 1, LONG_PROMPT)[0])
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {v[-1]:.1f} tok/s" for n, v in decode.items()), file=sys.stderr)  # fmt: skip
    result = {
        "command": "benchmarks/bench_unweight_serving.py",
        "rounds": args.rounds,
        "bf16_parameters_mb": parameters_mb,
        "memory": memory,
        "decode_tok_s": {n: statistics.median(v) for n, v in decode.items()},
        "decode_samples": decode,
        "prefill_tok_s": {n: statistics.median(v) for n, v in prefill.items()},
        "same_tokens": tokens["bf16"] == tokens["palette"],
    }
    ratio = result["decode_tok_s"]["palette"] / result["decode_tok_s"]["bf16"]
    result["decode_ratio"] = ratio
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("| form | weights held (MB) | process RSS (MB) | load (s) | batch-1 decode tok/s "
          "| prefill tok/s (128) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name in models:
        m = memory[name]
        print(f"| {name} | {m['weight_mb']:.1f} | {m['rss_mb']:.0f} | {m['load_s']:.1f} | "
              f"{result['decode_tok_s'][name]:.1f} | {result['prefill_tok_s'][name]:.0f} |")  # fmt: skip
    print(f"palette / bf16: weights {memory['palette']['weight_mb'] / memory['bf16']['weight_mb']:.3f}"
          f", RSS {memory['palette']['rss_mb'] / memory['bf16']['rss_mb']:.3f}, decode {ratio:.3f}; "
          f"same tokens: {result['same_tokens']}; the model's parameters in BF16: "
          f"{parameters_mb:.1f} MB (infire's bf16 forward also holds a tiled copy of the tied "
          "embedding for the LM head)")  # fmt: skip


if __name__ == "__main__":
    main()
