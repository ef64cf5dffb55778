"""The GPU path's checks and benchmarks (issue 22) on one CUDA device, in one run.

Models: random-weight Llamas built here with transformers in two shapes (SmolLM2-135M's,
and a Llama 1B: 2048 hidden, 16 layers, GQA 32/8), with SmolLM2's tokenizer as infire
exports it (`--export-tokenizer DIR`, run where the default model is installed: the GGUF
does not travel to the device).

Checks (each true or false in the JSON):
- fp32: infire's greedy tokens equal transformers' on 4 prompts x 32 tokens;
- bf16: decode from CUDA graphs equals `enforce_eager` (the same kernels, eagerly);
- bf16: the 4 prompts batched equal each alone.
Benchmarks: batch-1 decode (a 128-token prompt, 256 new tokens) and batch 64 for infire
and transformers; the roofline from this device's measured copy bandwidth and the bytes
a batch-1 step reads (the weights); the palette matmul against bf16 cuBLAS at batch 1, 8
and 16 on the 1B shape's projections; loading an Unweight rANS folder against the plain
safetensors folder. Results: OUT/gpu_check.json, OUT/gpu_check.png.

    python benchmarks/gpu_check.py --tokenizer DIR --out OUT       # on the device
    python benchmarks/gpu_check.py --tokenizer DIR --out OUT --smoke  # CPU, tiny, quick

`--smoke` runs the same code on CPU on a tiny shape (the kernels under Triton's
interpreter, no graphs, no benchmarks): the tests run it so that the script stays whole.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8),
}  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics are",
]


def export_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer files (tokenizer.json, tokenizer_config.json) from the default
    model, as infire reads it."""
    from infire.models.hf_export import write_hf_files
    from infire.models.loader import load_model

    loaded = load_model(None, __import__("torch").bfloat16)  # headers and metadata only
    folder.mkdir(parents=True, exist_ok=True)
    write_hf_files(loaded.config, loaded.tokenizer, folder, "bfloat16")
    (folder / "config.json").unlink()  # the shapes here are the script's own


def build(folder: Path, shape: dict, tokenizer: Path) -> Path:
    """A random Llama of `shape` with SmolLM2's vocabulary, saved in bf16 as transformers
    saves it, with the tokenizer files beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **shape)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def infire_tokens(folder: Path, device: str, dtype: str, prompts: list[list[int]], new: int,
                  together: bool = True, **kwargs: object) -> list[list[int]]:  # fmt: skip
    """infire's greedy tokens of each prompt (all at once, or each alone)."""
    from infire import LLM, SamplingParams

    # on CPU (--smoke) the PyTorch path, so that the Triton kernels serve, not the C forward
    llm = LLM(str(folder), dtype=dtype, device=device, num_blocks=256, max_num_seqs=8,
              cpu_kernels=device != "cpu", **kwargs)  # type: ignore[arg-type]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    try:
        if together:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    finally:
        llm.shutdown()


def transformers_tokens(folder: Path, device: str, dtype: str, prompts: list[list[int]],
                        new: int) -> list[list[int]]:  # fmt: skip
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=getattr(torch, dtype)).to(device)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            got = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
        out.append(got[0, len(prompt) :].tolist())
    return out


def decode_speed(folder: Path, batch: int, device: str, infire: bool) -> float:
    """Decode tokens per second: `batch` 128-token prompts, 256 new tokens each (the
    prefill's time left out: the first token's time is subtracted)."""
    import torch

    prompt = [(7 * j) % 40000 + 100 for j in range(128)]
    if infire:
        from infire import LLM, SamplingParams

        llm = LLM(str(folder), dtype="bfloat16", device=device, max_num_seqs=max(batch, 8))
        try:

            def run(n: int) -> float:
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                start = time.perf_counter()
                llm.generate([prompt] * batch, params)
                return time.perf_counter() - start

            run(4)  # warm-up
            return batch * 255 / (run(256) - run(1))
        finally:
            llm.shutdown()
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).to(device)
    ids = torch.tensor([prompt] * batch, device=device)

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(4)
    return batch * 255 / (generate(256) - generate(1))


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + write counted)."""
    import torch

    a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 10 * 2 * a.numel() * 2 / (time.perf_counter() - start)


def palette_speed(shape: dict) -> list[dict]:
    """The 1B shape's projections at batch 1, 8, 16: bf16 cuBLAS against the palette
    matmul (fused) and decode-then-cuBLAS, median of 20 each."""
    import torch
    import torch.nn.functional as F

    from infire.kernels.triton_palette import pack_palette, palette_decode, palette_matmul

    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    rows = []
    for name, (n, k) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        p = pack_palette(w)
        for batch in (1, 8, 16):
            x = torch.randn(batch, k, device="cuda").bfloat16()
            times = {}
            ways = (("bf16", lambda x=x, w=w: F.linear(x, w)),
                    ("fused", lambda x=x, p=p: palette_matmul(x, p)),
                    ("decode", lambda x=x, p=p: F.linear(x, palette_decode(p))))  # fmt: skip
            for label, fn in ways:
                fn()
                samples = []
                for _ in range(20):
                    start, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) / 1000)
                times[label] = sorted(samples)[10]
            rows.append({"projection": name, "batch": batch, **times,
                         "palette_bytes_ratio": p.nbytes / (w.numel() * 2)})  # fmt: skip
    return rows


def load_time(folder: Path, device: str) -> dict:
    """Seconds to an LLM ready to serve: the safetensors folder, and its Unweight rANS
    form (compressed first, not timed)."""
    from infire import LLM
    from infire.unweight.container import compress_model

    rans = folder.parent / (folder.name + "-rans")
    compress_model(folder, rans, "rans", progress=False)
    out = {}
    for label, path in (("safetensors", folder), ("unweight_rans", rans)):
        start = time.perf_counter()
        llm = LLM(str(path), dtype="bfloat16", device=device)
        out[label] = time.perf_counter() - start
        llm.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--export-tokenizer", type=Path, help="write SmolLM2's tokenizer files here, then stop"
    )
    parser.add_argument("--tokenizer", type=Path, help="the folder --export-tokenizer wrote")
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results/gpu"))
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, checks only")
    args = parser.parse_args()
    if args.export_tokenizer:
        export_tokenizer(args.export_tokenizer)
        return
    if args.smoke:  # the kernels, under the interpreter (set before anything imports triton)
        os.environ["INFIRE_TRITON"] = os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from infire.tokenizer import Tokenizer

    device = "cpu" if args.smoke else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_hf_folder(args.tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    new = 6 if args.smoke else 32
    shapes = {"tiny": TINY} if args.smoke else SHAPES
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "checks": {}, "speed": {}}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="infire-gpu-"))
    try:
        for name, shape in shapes.items():
            folder = build(work / name, shape, args.tokenizer)
            # fp32 parity is checked on the smaller shape only (time)
            if name in ("tiny", "smollm2-135m"):
                want = transformers_tokens(folder, device, "float32", prompts, new)
                got = infire_tokens(folder, device, "float32", prompts, new)
                result["checks"][f"{name}: fp32 greedy = transformers"] = got == want
            graphed = infire_tokens(folder, device, "bfloat16", prompts, new)
            eager = infire_tokens(folder, device, "bfloat16", prompts, new, enforce_eager=True)
            alone = infire_tokens(folder, device, "bfloat16", prompts, new, together=False)
            result["checks"][f"{name}: bf16 graph replay = eager"] = graphed == eager
            result["checks"][f"{name}: bf16 batched = alone"] = graphed == alone
            print(name, result["checks"], flush=True)
            if args.smoke:
                continue
            speed = result["speed"][name] = {}
            for batch in (1, 64):
                speed[f"infire batch {batch}"] = decode_speed(folder, batch, device, True)
                speed[f"transformers batch {batch}"] = decode_speed(folder, batch, device, False)
            weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            speed["roofline batch 1"] = copy_bandwidth() / weights
            print(name, speed, flush=True)
            if name == "llama-1b":
                result["palette"] = palette_speed(shape)
                result["load_s"] = load_time(folder, device)
                print(result["palette"], result["load_s"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    if not args.smoke:
        plot(result, args.out / "gpu_check.png")
    failed = [k for k, ok in result["checks"].items() if not ok]
    print("checks failed:" if failed else "every check passed", *failed)
    sys.exit(1 if failed else 0)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["speed"]), figsize=(6 * len(result["speed"]), 4))
    for ax, (name, speed) in zip(list(axes) if len(result["speed"]) > 1 else [axes],
                                 result["speed"].items(), strict=True):  # fmt: skip
        ax.bar(list(speed), list(speed.values()), color=["C1", "C0", "C1", "C0", "C7"])
        ax.set_title(f"{name}: decode tok/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
