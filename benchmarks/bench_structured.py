"""Structured outputs: decode throughput with a JSON Schema against without one, and
grammar compile times, in one run.

SmolLM2-135M-Instruct (the default model, `--dtype auto`: bfloat16 through the fused CPU
forward here) in this process (`infire.LLM`). Each request generates exactly 128 tokens:
- unconstrained: `ignore_eos`, 128 tokens;
- constrained: a schema whose smallest answer is far longer than 128 tokens (an object
  with an array of 40 strings, each up to 40 characters), so it ends at max_tokens too.

Batch 1 (one request a call) and batch 16 (16 requests in one call), greedy. The two
alternate within each of 3 rounds; tok/s is the median. Compile time: a 5-property schema
and a 150-property one with patterns and ranges, each on a fresh GrammarCache (first
compile) and again (cached).

Results go to benchmarks/results/structured.json and docs/benchmarks-structured.png.

    .venv/bin/python benchmarks/bench_structured.py          # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_structured.py --quick  # smoke check
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench_serve import RESULTS, ROOT
from machine_load import wait_until_idle

from infire import LLM, SamplingParams
from infire.engine.structured import GrammarCache

LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "maxItems": 40,
        "items": {"type": "string", "maxLength": 40}}}, "required": ["items"],
        "additionalProperties": False}  # fmt: skip
SMALL = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "color": {"enum": ["r", "g", "b"]},
    "scores": {"type": "array", "items": {"type": "number"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
    "required": ["name", "age", "color", "scores", "address"]}  # fmt: skip
LARGE = {"type": "object", "properties": {
    f"field_{i}": ({"type": "string", "pattern": "^[a-z]{2,8}[0-9]{0,3}$"} if i % 3 == 0 else
                   {"type": "integer", "minimum": -i, "maximum": 1000 + i} if i % 3 == 1 else
                   {"enum": [f"v{i}_{j}" for j in range(5)]}) for i in range(150)},
    "required": [f"field_{i}" for i in range(0, 150, 2)]}  # fmt: skip
TOKENS = 128
PROMPT = [{"role": "user", "content": "List forty short facts about rivers as JSON."}]


def run(llm: LLM, batch: int, constrained: bool) -> float:
    """Generated tokens per second of one call with `batch` requests."""
    spec = {"json": LONG} if constrained else None
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=not constrained,
                            structured_output=spec)  # fmt: skip
    start = time.perf_counter()
    outputs = llm.chat([PROMPT] * batch, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == batch * TOKENS, tokens
    return tokens / elapsed


def compile_times(llm: LLM) -> dict[str, float]:
    out = {}
    for name, schema in (("small", SMALL), ("large", LARGE)):
        cache = GrammarCache(llm.engine.tokenizer, llm.engine.model_config.vocab_size)
        cache.ll_tokenizer()  # built once per tokenizer, not per schema
        start = time.perf_counter()
        cache.check({"json": schema})
        out[f"{name} first ms"] = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        cache.matcher({"json": schema})
        out[f"{name} cached ms"] = (time.perf_counter() - start) * 1000
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args()
    rounds = 1 if args.quick else 3
    llm = LLM()
    run(llm, 1, True)  # warm: the grammar compiles, the kernels load
    results: dict[str, list[float]] = {}
    for r in range(rounds):
        for batch in (1, 16):
            for constrained in (False, True):
                wait_until_idle([], 0.15, 60)
                key = f"batch {batch} {'json schema' if constrained else 'unconstrained'}"
                results.setdefault(key, []).append(run(llm, batch, constrained))
                print(f"round {r}: {key}: {results[key][-1]:.1f} tok/s", flush=True)
    medians = {k: statistics.median(v) for k, v in results.items()}
    compiles = compile_times(llm)
    llm.shutdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps({"runs": results, "medians": medians,
                                                         "compile": compiles}, indent=1))  # fmt: skip
    print("| batch | unconstrained tok/s | JSON Schema tok/s | ratio |\n|---|--:|--:|--:|")
    for batch in (1, 16):
        free, json_ = medians[f"batch {batch} unconstrained"], medians[f"batch {batch} json schema"]
        print(f"| {batch} | {free:.1f} | {json_:.1f} | {json_ / free:.3f} |")
    print("\n| schema | first compile ms | cached ms |\n|---|--:|--:|")
    for name in ("small", "large"):
        print(
            f"| {name} | {compiles[f'{name} first ms']:.1f} | {compiles[f'{name} cached ms']:.3f} |"
        )
    plot(medians, ROOT / "docs" / "benchmarks-structured.png")


def plot(medians: dict[str, float], path: Path) -> None:
    from infire.bench.plot import pyplot, save

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for i, (kind, color) in enumerate((("unconstrained", "#5c7cfa"), ("json schema", "#d9480f"))):
        values = [medians[f"batch {b} {kind}"] for b in (1, 16)]
        bars = axis.bar([x + (i - 0.5) * 0.38 for x in range(2)], values, 0.38, label=kind,
                        color=color)  # fmt: skip
        labels = [f"{v:.0f}" + (f"\n{v / medians[f'batch {b} unconstrained']:.2f}x" if i else "")
                  for v, b in zip(values, (1, 16), strict=True)]  # fmt: skip
        axis.bar_label(bars, labels, fontsize=8)
    axis.set_xticks(range(2), ["batch 1", "batch 16"])
    axis.set_ylabel("generated tokens / s")
    axis.set_title("SmolLM2-135M decode, CPU: with a JSON Schema vs without")
    axis.legend()
    save(figure, path)


if __name__ == "__main__":
    main()
