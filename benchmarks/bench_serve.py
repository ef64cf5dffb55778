"""Serving benchmark: `infire serve` against llama.cpp's server (llama-cpp-python) and
`transformers serve`, on the default model, with the same prompts and load, in one run.

Each server runs alone (started, measured at every concurrency, stopped) on the 2 cores.
The load is `infire bench serve`'s (infire.bench.serve): streamed /v1/completions with
random prompts of --input-len tokens and max_tokens --output-len (ignore_eos where the
server knows it; output tokens are counted from usage or streamed chunks either way),
--max-concurrency 1, 4, 16 after one warm-up request. Results: JSON per run in
benchmarks/results/, docs/benchmarks-serve.png, and a markdown table with the ratios.

    .venv/bin/python benchmarks/bench_serve.py [--servers infire llama.cpp transformers]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx
from machine_load import wait_until_idle

from infire.bench import plot
from infire.bench import serve as bench
from infire.models.loader import default_model_path, load_tokenizer
from infire.serverproc import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEER_PYTHON = ROOT / ".bench-venv" / "bin" / "python"
VENV_BIN = ROOT / ".venv" / "bin"


def server_command(name: str, gguf: Path, port: int) -> list[str]:
    """How each server is started on the default model's GGUF."""
    if name in ("infire", "infire-inproc"):  # the engine core in its own process, or not
        extra = ["--engine-in-process"] if name == "infire-inproc" else []
        return [str(VENV_BIN / "infire"), "serve", "--port", str(port), "--no-access-log", *extra]
    if name == "llama.cpp":
        # One decode thread: with two, its server's Python threads and the load generator
        # fight llama.cpp's spinning workers for the 2 cores (27 vs 19 ms per token here).
        return [str(PEER_PYTHON), "-m", "llama_cpp.server", "--model", str(gguf),
                "--n_threads", "1", "--n_threads_batch", "2", "--n_ctx", "4096",
                "--model_alias", "smollm2", "--interrupt_requests", "False",
                "--port", str(port)]  # fmt: skip
    if name == "transformers":  # its GGUF loading leaves config.architectures unset: a folder
        return [str(VENV_BIN / "transformers"), "serve", str(hf_folder(gguf)),
                "--port", str(port), "--dtype", "bfloat16", "--device", "cpu",
                "--continuous-batching"]  # fmt: skip
    raise SystemExit(f"unknown server {name!r}")


def hf_folder(gguf: Path) -> Path:
    """The GGUF as a Hugging Face folder (bf16 safetensors, config, tokenizer), written once.

    transformers' own GGUF loading keeps the weights quantized and will not save them, so
    the folder is written from infire's loader (the same dequantized, HF-named weights).
    """
    folder = RESULTS / "smollm2-hf"
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from safetensors.torch import save_file

    from infire.models.hf_export import write_hf_files
    from infire.models.loader import load_model

    loaded = load_model(gguf, torch.bfloat16)
    write_hf_files(loaded.config, loaded.tokenizer, folder, "bfloat16")
    weights = {k: v.contiguous() for k, v in loaded.weights.items()}
    if loaded.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _lists_a_model(response: httpx.Response) -> bool:
    return response.status_code == 200 and bool(response.json().get("data"))


class Running(ServerProcess):
    """A server subprocess, ready when /v1/models lists a model (`model`)."""

    def __init__(self, name: str, gguf: Path, log: Path) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}/v1"
        super().__init__(f"{name} server", server_command(name, gguf, port), port,
                         f"{self.base_url}/models", log=log, env={"OMP_NUM_THREADS": "2"},
                         timeout=600, ready=_lists_a_model, poll_s=0.5)  # fmt: skip
        assert self.last is not None
        self.model = self.last.json()["data"][0]["id"]

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=["infire", "llama.cpp", "transformers"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2,
                        help="requests per concurrency = rounds x concurrency, at least 8")  # fmt: skip
    args = parser.parse_args()
    gguf = default_model_path()
    tokenizer = load_tokenizer(gguf)
    # The same lengths from every server: ignore_eos where known, EOS banned where not.
    banned = {str(i): -100 for i in {*tokenizer.eos_token_ids, 0}}
    RESULTS.mkdir(exist_ok=True)
    files = []
    for name in args.servers:
        if name == "llama.cpp" and not PEER_PYTHON.exists():
            print("llama.cpp: .bench-venv missing (see docs/benchmarks.md); skipped")
            continue
        print(f"starting {name} ...", flush=True)
        server = Running(name, gguf, RESULTS / f"serve-{name}.log")
        try:
            for concurrency in args.concurrency:
                num = max(8, args.rounds * concurrency)
                prompts = bench.random_prompts(tokenizer, num + 1, args.input_len, seed=concurrency)
                waited = wait_until_idle([server.process.pid], 0.15, 120)
                config = bench.BenchConfig(
                    base_url=server.base_url, model=server.model, prompts=prompts[1:],
                    warmup_prompts=prompts[:1], output_len=args.output_len,
                    max_concurrency=concurrency, label=name, extra_body={"logit_bias": banned},
                    ignore_eos=name != "transformers",  # it refuses fields it does not know
                    prompt_tokens=[len(tokenizer.encode(p)) for p in prompts[1:]],
                )  # fmt: skip
                result = bench.run(config)
                result["settings"]["idle_wait_s"] = waited
                print(bench.report(result), flush=True)
                path = RESULTS / f"serve-{name}-c{concurrency}.json"
                path.write_text(json.dumps(result, indent=1))
                files.append(path)
        finally:
            server.stop()
    results = [json.loads(p.read_text()) for p in files]
    png = plot.plot_compare(results, ROOT / "docs" / "benchmarks-serve.png")
    print(f"wrote {png}")
    print(table(results))


def table(results: list[dict]) -> str:
    """Markdown rows: one per server and concurrency, with infire's ratios."""
    by = {(r["settings"]["label"], r["settings"]["max_concurrency"]): r["summary"] for r in results}
    lines = ["| server | concurrency | requests | output tok/s | mean output tokens | "
             "p50 TTFT ms | p90 TTFT ms | p50 TPOT ms | p90 TPOT ms | p90 E2E ms |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for (label, c), s in sorted(by.items(), key=lambda item: (item[0][1], item[0][0])):
        mean_out = s["total_output_tokens"] / max(1, s["completed"])
        lines.append(
            f"| {label} | {c} | {s['completed']}/{s['completed'] + s['failed']} | "
            f"{s['output_throughput']:.1f} | {mean_out:.0f} | {s['p50_ttft_ms']:.0f} | "
            f"{s['p90_ttft_ms']:.0f} | {s['p50_tpot_ms']:.1f} | {s['p90_tpot_ms']:.1f} | "
            f"{s['p90_e2el_ms']:.0f} |"
        )
    for (label, c), s in sorted(by.items()):
        ours = by.get(("infire", c))
        if label == "infire" or ours is None:
            continue
        lines.append(
            f"\ninfire / {label} at concurrency {c}: output tok/s "
            f"{ours['output_throughput'] / s['output_throughput']:.2f}x, p90 TPOT "
            f"{ours['p90_tpot_ms'] / s['p90_tpot_ms']:.2f}x (lower is better)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
