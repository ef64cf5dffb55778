"""Quantized GGUF files served as their blocks: infire against llama.cpp on the same file,
with the same threads, in one run.

Files:
- SmolLM2-135M-Instruct Q4_1 (the default model: Q4_1 layers, a Q8_0 embedding and head);
- a 0.54B Llama-shaped model (32 layers, hidden 1024, GQA 16/4, intermediate 4096,
  SmolLM2's vocabulary, tied head) with random weights, written in F16 and quantized to
  Q4_K_M by llama.cpp's own quantizer. No Q4_K_M model of 0.5B or more installs from this
  machine's package index (the one GGUF package is Gemma 3 270M, whose sliding windows run
  the PyTorch path), so the file is built here; speed and memory do not depend on the
  weights' values. It is cached under benchmarks/results/ (never committed).

Each (file, engine) runs in a fresh process: infire through `infire.LLM` (quantization
auto, dtype auto), once with the CPU's best integer products and once with AVX2's (the
`.bench-venv` llama.cpp is built without AVX-512), and llama.cpp through
llama-cpp-python's C API in `.bench-venv`. Measures:
- batch-1 decode tok/s: 128 greedy tokens after a 16-token prompt, the prompt's step
  excluded; the median of DECODE_REPEATS such runs in each engine's process (a few
  seconds each: single runs of one infire build ranged over 51-71 tok/s within half an
  hour on this machine);
- prefill tok/s: one 512-token prompt to its first token (its own tokens: the decode's
  prompt, a prefix of the same formula's first prompt, would be in infire's prefix cache);
- batch-32 throughput: 32 prompts of 16 tokens, 64 tokens each, generated together
  (llama.cpp: one llama_batch of 32 sequences a step, as its `batched` example); the
  median of BATCH_REPEATS such runs in each engine's process, each run with its own 32
  prompts (the same ones in both engines; a repeated prompt would be served from
  infire's prefix cache);
- peak RSS above the process's baseline (VmHWM minus the resident set after imports),
  with the same KV reservation (the larger run's tokens, bf16 / f16);
- the roofline fraction of batch-1 decode: the bytes a token reads (the weights' blocks;
  the KV of a short context is negligible) times tok/s, over this machine's read
  bandwidth (a 400 MB torch sum on the same threads);
- the compute ceiling of the batch-32 workload: its integer multiply-adds (every matmul
  weight once per prompt and generated token, the head once per generated token) at the
  machine's peak rate of int8 products, in the instruction mix of llama.cpp's arithmetic
  and in the instruction set's cheapest (AVX512-VNNI's vpdpbusd, or AVX2's vpmaddubsw
  summed in 16 bits: no engine's products go faster), as output tok/s
  (benchmarks/int8_peak.c: no memory traffic, independent chains); the same ops at the
  rates of infire's own AVX2 K-quant kernels' inner loops run alone in registers (each
  type's ops at its loop's rate: what those kernels reach if nothing outside their inner
  loop took time); at the rates of the whole kernels (unpacking, mins, conversion to
  float) on weights that stay in L2, both threads at once (what the matmuls alone take
  with the weights' streaming free); and the kernel's own rate at batch 32 through
  `quant_linear` (its call and quantization included) on a weight that stays in cache.

Results go to benchmarks/results/gguf.json and docs/benchmarks-gguf.png.

    .venv/bin/python benchmarks/bench_gguf.py            # ~17 minutes on 2 cores (3 rounds)
    .venv/bin/python benchmarks/bench_gguf.py --quick --rounds 1   # SmolLM2, fewer tokens
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEER_PYTHON = ROOT / ".bench-venv" / "bin" / "python"
THREADS = 2
# infire with the CPU's best products; with the rows where the file maps them
# (INFIRE_NO_REPACK=1), to show what the groups of 16 rows bring; and where the CPU has
# more than AVX2, with AVX2's products: the llama.cpp build in .bench-venv is AVX2-only
# (docs/benchmarks.md), so that row compares like instruction sets. Name -> (products,
# repack).
ALL_ENGINES = {"infire": (None, True), "infire (no repack)": (None, False),
               "infire (AVX2)": ("avx2", True)}  # fmt: skip


def engines() -> dict[str, tuple[str | None, bool]]:
    """The infire rows this CPU gives (AVX2 apart only where the best is another)."""
    from infire.kernels.cpu_forward import quant_isa

    best = quant_isa()
    return {k: v for k, v in ALL_ENGINES.items() if k != "infire (AVX2)" or best != "avx2"}


PROMPT, DECODE, PREFILL, BATCH, BATCH_TOKENS = 16, 128, 512, 32, 64
DECODE_REPEATS = BATCH_REPEATS = 3
SHAPE = {"layers": 32, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 4096}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _context(sizes: dict) -> int:
    """Tokens of KV both engines reserve: the batch-32 run's, or the long prompt's."""
    return max(sizes["prefill"] + 16, sizes["batch"] * (sizes["prompt"] + sizes["batch_tokens"]))


def _prompts(count: int, length: int, vocab: int, first: int = 0) -> list[list[int]]:
    """`count` prompts of `length` tokens, the i-th from `first` on (other `first`s, other
    prompts: a repeated batch is not served from infire's prefix cache)."""
    return [[(97 * i + 31 * j) % (vocab - 300) + 200 for j in range(length)]
            for i in range(first, first + count)]  # fmt: skip


def _batch_runs(
    sizes: dict, vocab: int, generate: Callable[[list[list[int]], int], float]
) -> list[float]:
    """Batch-32 throughput (output tok/s) of BATCH_REPEATS runs, each with its own prompts
    (not the decode's prompt 0 or the prefill's 1); `generate(prompts, tokens)` returns the
    seconds a run took."""
    count, tokens = sizes["batch"], sizes["batch_tokens"]
    return [count * tokens / generate(_prompts(count, sizes["prompt"], vocab, 2 + count * r), tokens)
            for r in range(BATCH_REPEATS)]  # fmt: skip


# --- the engines, each run in a child process ----------------------------------------


def run_infire(path: str, sizes: dict, isa: str | None = None, repack: bool = True) -> dict:
    import os

    os.environ["INFIRE_NO_REPACK"] = "0" if repack else "1"
    from infire import LLM, SamplingParams
    from infire.kernels.cpu_forward import quant_isa

    isa = quant_isa(isa)  # the products' instruction set: the CPU's best, or the one asked

    base = _status("VmRSS")
    start = time.perf_counter()
    blocks = -(-_context(sizes) // 16)  # the KV llama.cpp reserves (both bf16/f16)
    llm = LLM(path, num_blocks=blocks, max_num_seqs=sizes["batch"])
    load = time.perf_counter() - start
    vocab = llm.engine.model_config.vocab_size

    def timed(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    prompt = _prompts(1, sizes["prompt"], vocab)
    timed(prompt, 4)  # warm up (the kernel library, the pools)
    decode = statistics.median(
        sizes["decode"] / (timed(prompt, sizes["decode"] + 1) - timed(prompt, 1))
        for _ in range(DECODE_REPEATS)
    )
    prefill = sizes["prefill"] / timed(_prompts(1, sizes["prefill"], vocab, 1), 1)
    runs = _batch_runs(sizes, vocab, timed)
    return {"load_s": load, "decode": decode, "prefill": prefill,
            "batch": statistics.median(runs), "batch_runs": runs,
            "rss": _status("VmHWM") - base, "status": f"{llm.engine.runner.fused_status}, {isa}"}  # fmt: skip


def run_llamacpp(path: str, sizes: dict) -> dict:
    import ctypes

    import llama_cpp as lc
    import numpy as np

    base = _status("VmRSS")
    start = time.perf_counter()
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx = _context(sizes)
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = sizes["batch"]
    params.kv_unified = True  # one KV buffer the sequences share, as infire's block pool
    params.n_threads = params.n_threads_batch = THREADS
    ctx = lc.llama_init_from_model(model, params)
    load = time.perf_counter() - start
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(512, 0, sizes["batch"])

    def decode(items: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run (token, position, sequence, wants logits) items; greedy next tokens."""
        out = []
        for first in range(0, len(items), 512):
            part = items[first : first + 512]
            batch.n_tokens = len(part)
            for i, (token, pos, seq, logits) in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, item in enumerate(part):
                if item[3]:
                    row = lc.llama_get_logits_ith(ctx, i)
                    values = np.ctypeslib.as_array(
                        ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (vocab,)
                    )
                    out.append(int(values.argmax()))
        return out

    def generate(prompts: list[list[int]], tokens: int) -> float:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        start = time.perf_counter()
        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        last = decode(items)
        for step in range(tokens - 1):
            last = decode([(t, len(prompts[s]) + step, s, True) for s, t in enumerate(last)])
        return time.perf_counter() - start

    prompt = _prompts(1, sizes["prompt"], vocab)
    generate(prompt, 4)
    rate = statistics.median(
        sizes["decode"] / (generate(prompt, sizes["decode"] + 1) - generate(prompt, 1))
        for _ in range(DECODE_REPEATS)
    )
    prefill = sizes["prefill"] / generate(_prompts(1, sizes["prefill"], vocab, 1), 1)
    runs = _batch_runs(sizes, vocab, generate)
    result = {"load_s": load, "decode": rate, "prefill": prefill,
              "batch": statistics.median(runs), "batch_runs": runs,
              "rss": _status("VmHWM") - base, "status": "llama-cpp-python " + lc.__version__}  # fmt: skip
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return result


# --- the files -------------------------------------------------------------------------


def random_q4_k_m(out: Path) -> Path:
    """The 0.54B random Llama as Q4_K_M (built once: F16 by the gguf package, then
    llama.cpp's quantizer in the peer venv)."""
    if out.exists():
        return out
    import gguf
    import numpy as np

    from infire.models.loader import default_model_path

    f16 = out.with_suffix(".f16.gguf")
    source = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(str(f16), "llama")
    for key, field in source.fields.items():
        if key.startswith("tokenizer.") or key == "general.name":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    s, vocab = SHAPE, len(source.fields["tokenizer.ggml.tokens"].data)
    head = s["hidden"] // s["heads"]
    writer.add_block_count(s["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * cols**-0.5).astype(np.float16)

    writer.add_tensor("token_embd.weight", weight(vocab, s["hidden"]))
    writer.add_tensor("output_norm.weight", np.ones(s["hidden"], dtype=np.float32))
    kv = s["kv_heads"] * head
    for i in range(s["layers"]):
        for name, shape in (("attn_q", (s["hidden"], s["hidden"])), ("attn_k", (kv, s["hidden"])),
                            ("attn_v", (kv, s["hidden"])), ("attn_output", (s["hidden"], s["hidden"])),
                            ("ffn_gate", (s["intermediate"], s["hidden"])),
                            ("ffn_up", (s["intermediate"], s["hidden"])),
                            ("ffn_down", (s["hidden"], s["intermediate"]))):  # fmt: skip
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(s["hidden"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    quantize = (
        "import llama_cpp as lc, sys\n"
        "p = lc.llama_model_quantize_default_params()\n"
        f"p.ftype = lc.LLAMA_FTYPE_MOSTLY_Q4_K_M\np.nthread = {THREADS}\n"
        "sys.exit(lc.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n"
    )
    subprocess.run([str(PEER_PYTHON), "-c", quantize, str(f16), str(out)], check=True)
    f16.unlink()
    return out


def read_bandwidth() -> float:
    """Bytes per second a 400 MB sum reads on THREADS threads (the decode roofline)."""
    import torch

    torch.set_num_threads(THREADS)
    data = torch.ones(100_000_000, dtype=torch.float32)
    data.sum()
    start = time.perf_counter()
    for _ in range(5):
        data.sum()
    return 5 * data.numel() * 4 / (time.perf_counter() - start)


def int8_peaks() -> dict[str, float]:
    """Int8 products a second (2 ops each) of each instruction mix in int8_peak.c, on
    THREADS threads: "isa" (the instruction set's cheapest products), "k_quant" and
    "legacy" (llama.cpp's arithmetic), in AVX512-VNNI where the CPU has it, else AVX2; and
    there the inner loops of infire's batch kernels for Q4_K and Q6_K and the whole kernels
    on weights in L2 (kernel_loops.c)."""
    import ctypes

    import torch

    from infire.kernels.cpu_forward import CFLAGS, SOURCE, quant_isa
    from infire.native import compile_library

    torch.set_num_threads(THREADS)
    lib = compile_library(Path(__file__).with_name("int8_peak.c"),
                          ("-O2", "-fopenmp", "-shared", "-fPIC"))  # fmt: skip
    if isinstance(lib, str):
        raise RuntimeError(lib)
    runs = {"isa": "dpbusd", "k_quant": "k_quant", "legacy": "legacy"}
    if quant_isa() != "avx512-vnni":  # and the inner loops of infire's AVX2 batch kernels
        runs = {"isa": "maddubs2", "k_quant": "k_quant2", "legacy": "legacy2"}
        kernel = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]  # it includes the kernel
        loops = compile_library(Path(__file__).with_name("kernel_loops.c"),
                                (*CFLAGS, f"-DKERNEL_SOURCE={kernel}"))  # fmt: skip
        if isinstance(loops, str):
            raise RuntimeError(loops)
    calls = {mix: getattr(lib, f"peak_{name}") for mix, name in runs.items()}
    if quant_isa() != "avx512-vnni":
        calls.update(q4k_inner=loops.loop_q4k_wide, q6k_inner=loops.loop_q6k_wide,
                     q4k_whole=loops.loop_q4k_whole, q6k_whole=loops.loop_q6k_whole)  # fmt: skip
    loop_iters = {"q4k_inner": 500_000, "q6k_inner": 500_000, "q4k_whole": 20_000,
                  "q6k_whole": 20_000}  # fmt: skip
    iters = {mix: loop_iters.get(mix, 20_000_000) for mix in calls}
    for mix, run in calls.items():
        run.restype, run.argtypes = ctypes.c_long, [ctypes.c_long]
        run(iters[mix] // 20)
    # the best of 5 rounds, the mixes taking turns: a busy spell of the machine (other
    # tenants on the cores' siblings halve these rates) does not take all of one mix's tries
    peaks = dict.fromkeys(calls, 0.0)
    for _ in range(5):
        for mix, run in calls.items():
            start = time.perf_counter()
            done = run(iters[mix])
            peaks[mix] = max(peaks[mix], 2 * done / (time.perf_counter() - start))
    return peaks


def kernel_rate(kind: int, cols: int) -> float:
    """Ops a second of infire's products at batch 32 on a [512, cols] weight of GGML type
    `kind` (random blocks: the rate does not depend on the values) that stays in cache,
    its rows in groups of 16 where the forward serves them so."""
    import numpy as np
    import torch

    from infire.kernels.cpu_forward import (
        QuantWeight,
        block_layout,
        can_interleave,
        interleave_rows,
        interleaves,
        quant_linear,
    )

    torch.set_num_threads(THREADS)
    values, size = block_layout(kind)
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (512, cols // values * size), dtype=np.uint8)
    if kind >= 12:  # K-quants: finite fp16 d, dmin at the start of each block (Q6_K: the end)
        at = 208 if kind == 14 else 0
        view = blocks.reshape(512, -1, size)
        view[..., at : at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if kind != 14:
            view[..., 2:4] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    else:
        view = blocks.reshape(512, -1, size)
        view[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if kind in (3, 7):
            view[..., 2:4] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    part = (kind, torch.from_numpy(blocks), None)
    grouped = interleaves() and can_interleave(part)
    weight = QuantWeight([interleave_rows(part) if grouped else part], [grouped])
    x = torch.randn(32, cols)
    for _ in range(20):
        quant_linear(weight, x)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(50):
            quant_linear(weight, x)
        best = max(best, 50 * 2 * 512 * cols * 32 / (time.perf_counter() - start))
    return best


def batch_ops(weights: object, sizes: dict) -> dict[int, float]:
    """Integer ops (2 per multiply-add) of the batch-32 workload's matmuls, per GGML type."""
    names = list(weights.names())
    head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
    prompts = sizes["batch"] * (sizes["prompt"] + sizes["batch_tokens"])
    outputs = sizes["batch"] * sizes["batch_tokens"]
    ops: dict[int, float] = {}
    for name in names:
        if len(weights.shape(name)) != 2 or (name == "model.embed_tokens.weight" != head):
            continue  # not a matmul, or an embedding that is not also the head
        kind = weights.blocks(name)[0]
        tokens = outputs if name == head else prompts
        ops[kind] = ops.get(kind, 0.0) + 2.0 * math.prod(weights.shape(name)) * tokens
    return ops


def kernel_seconds(ops: dict[int, float], peaks: dict[str, float], form: str) -> float | None:
    """Seconds of the ops at the rates of infire's AVX2 batch kernels for Q4_K and Q6_K:
    their inner loops alone (`form` "inner") or the whole kernels on weights in L2
    ("whole"); None where a type has no such loop here."""
    rates = {12: peaks.get(f"q4k_{form}", 0), 14: peaks.get(f"q6k_{form}", 0)}
    if any(not rates.get(kind) for kind in ops):
        return None
    return sum(n / rates[kind] for kind, n in ops.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="SmolLM2 only, fewer tokens")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every (file, engine) run, the engines' order reversed "
                        "every other round; the tables give the medians (default: 3)")  # fmt: skip
    parser.add_argument("--child", nargs=3, metavar=("ENGINE", "FILE", "SIZES"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.child:
        engine, path, sizes = args.child
        if engine == "llama.cpp":
            print(json.dumps(run_llamacpp(path, json.loads(sizes))))
        else:
            print(json.dumps(run_infire(path, json.loads(sizes), *ALL_ENGINES[engine])))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import gguf
    from machine_load import wait_until_idle

    from infire.bench.plot import save
    from infire.models.gguf import load_gguf
    from infire.models.loader import default_model_path

    ENGINES = engines()
    sizes = {"prompt": PROMPT, "decode": DECODE, "prefill": PREFILL, "batch": BATCH,
             "batch_tokens": BATCH_TOKENS}  # fmt: skip
    files = {"SmolLM2-135M Q4_1": default_model_path()}
    if args.quick:
        sizes.update(decode=32, prefill=128, batch=8, batch_tokens=16)
    else:
        RESULTS.mkdir(parents=True, exist_ok=True)
        files["Llama 0.54B Q4_K_M (random)"] = random_q4_k_m(RESULTS / "llama-0.54b-q4_k_m.gguf")
    bandwidth = read_bandwidth()
    peaks = int8_peaks()
    results: dict = {"bandwidth_gbs": bandwidth / 1e9, "sizes": sizes, "files": {},
                     "int8_peak_gops": {mix: rate / 1e9 for mix, rate in peaks.items()}}  # fmt: skip
    for label, path in files.items():
        _, weights, _ = load_gguf(path, __import__("torch").bfloat16)
        stored = sum(size for _, _, _, size in weights.type_counts())
        row = results["files"][label] = {"file_bytes": path.stat().st_size, "weights_bytes": stored}
        kind = int(gguf.GGMLQuantizationType[weights.type_counts()[0][0]])  # the most bytes
        mix = "k_quant" if kind in (12, 13, 14) else "legacy"
        by_type = batch_ops(weights, sizes)
        ops = sum(by_type.values())
        inner, whole = (kernel_seconds(by_type, peaks, form) for form in ("inner", "whole"))
        outputs = sizes["batch"] * sizes["batch_tokens"]
        row["ceiling"] = {
            "batch_ops": ops, "mix": mix, "type": kind,
            "ops_by_type": {str(k): v for k, v in by_type.items()},
            "peak_tok_s": outputs / (ops / peaks[mix]),
            "isa_tok_s": outputs / (ops / peaks["isa"]),
            "inner_tok_s": outputs / inner if inner else None,
            "whole_tok_s": outputs / whole if whole else None,
            "kernel_gops": {str(k): kernel_rate(k, SHAPE["hidden"]) / 1e9 for k in by_type},
        }  # fmt: skip
    # the machine's bandwidth and llama.cpp's own speed drift over minutes: every engine
    # runs once a round, in alternating order, and each measure is a median over rounds
    runs = [(name, sys.executable) for name in ENGINES] + [("llama.cpp", str(PEER_PYTHON))]
    for r in range(args.rounds):
        for label, path in files.items():
            row = results["files"][label]
            for engine, python in runs if r % 2 == 0 else runs[::-1]:
                wait_until_idle([], 0.15, 60)
                out = subprocess.run([python, __file__, "--child", engine, str(path),
                                      json.dumps(sizes)], capture_output=True, text=True,
                                     check=True)  # fmt: skip
                got = json.loads(out.stdout.strip().splitlines()[-1])
                row.setdefault(engine, {"rounds": []})["rounds"].append(got)
                print(f"round {r + 1}", label, engine, json.dumps(got), flush=True)
    for row in results["files"].values():
        for engine, _ in runs:
            rounds = row[engine]["rounds"]
            for key in ("decode", "prefill", "batch", "rss"):
                row[engine][key] = statistics.median(got[key] for got in rounds)
            row[engine]["roofline"] = row["weights_bytes"] * row[engine]["decode"] / bandwidth
    print(f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s on {THREADS} threads")
    print("int8 products, peak of each instruction mix: "
          + ", ".join(f"{mix} {rate / 1e9:.0f} GOP/s" for mix, rate in peaks.items()))  # fmt: skip
    for label, row in results["files"].items():
        c = row["ceiling"]
        needed = 3 * row["llama.cpp"]["batch"]
        for key in ("decode", "batch"):  # a round's engines ran back to back
            ratios = [a[key] / b[key] for a, b in
                      zip(row["infire"]["rounds"], row["llama.cpp"]["rounds"], strict=True)]  # fmt: skip
            row[f"{key}_ratio_per_round"] = ratios
            print(f"{label}: infire / llama.cpp {key} per round: "
                  + ", ".join(f"{x:.2f}x" for x in ratios)
                  + f" (median {statistics.median(ratios):.2f}x)")  # fmt: skip
        print(f"{label}: batch-32 {c['batch_ops'] / 1e12:.2f} Tops; at the {c['mix']} peak "
              f"<= {c['peak_tok_s']:.0f} tok/s, at the instruction set's peak <= "
              f"{c['isa_tok_s']:.0f} (3x llama.cpp: {needed:.0f}); infire's kernels in "
              f"cache: " + ", ".join(f"type {k} {v:.0f} GOP/s" for k, v in c["kernel_gops"].items()))  # fmt: skip
        if c["inner_tok_s"]:
            split = ", ".join(f"type {k} {v / 1e12:.2f} T" for k, v in c["ops_by_type"].items())
            print(f"{label}: ({split}) at infire's kernels' inner loops alone <= "
                  f"{c['inner_tok_s']:.0f} tok/s, at the whole kernels' rate in cache <= "
                  f"{c['whole_tok_s']:.0f} tok/s (the matmuls alone)")  # fmt: skip
    (RESULTS / "gguf.json").write_text(json.dumps(results, indent=2))
    print()
    print(
        "| file | engine | decode tok/s | prefill tok/s | batch-32 tok/s | peak RSS MB | roofline |"
    )
    print("|---|---|--:|--:|--:|--:|--:|")
    for label, row in results["files"].items():
        for engine in (*ENGINES, "llama.cpp"):
            r = row[engine]
            print(f"| {label} | {engine} | {r['decode']:.1f} | {r['prefill']:.1f} | "
                  f"{r['batch']:.1f} | {r['rss'] / 2**20:.0f} | {r['roofline']:.0%} |")  # fmt: skip
        b = row["llama.cpp"]
        for engine in ENGINES:
            a = row[engine]
            print(f"| {label} | **{engine} / llama.cpp** | {a['decode'] / b['decode']:.2f}x | "
                  f"{a['prefill'] / b['prefill']:.2f}x | {a['batch'] / b['batch']:.2f}x | "
                  f"{a['rss'] / b['rss']:.2f}x | |")  # fmt: skip
    plot(results, list(ENGINES), save)


def plot(results: dict, engine_names: list[str], save: object) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = [("decode", "batch-1 decode"), ("prefill", "prefill"), ("batch", "batch-32"),
                ("rss", "peak RSS (lower is better)")]  # fmt: skip
    figure, axes = plt.subplots(1, len(results["files"]), figsize=(6 * len(results["files"]), 4),
                                squeeze=False)  # fmt: skip
    for ax, (label, row) in zip(axes[0], results["files"].items(), strict=True):
        names = [name for _, name in measures]
        width = 0.8 / len(engine_names)
        for i, engine in enumerate(engine_names):
            ratios = [row[engine][k] / row["llama.cpp"][k] for k, _ in measures]
            at = [j + (i - (len(engine_names) - 1) / 2) * width for j in range(len(names))]
            ax.bar(at, ratios, width, label=engine, color=f"C{i}")
            for x, value in zip(at, ratios, strict=True):
                ax.text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names)
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_title(label)
        ax.set_ylabel("infire / llama.cpp")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=8)
    figure.tight_layout()
    save(figure, ROOT / "docs" / "benchmarks-gguf.png")


if __name__ == "__main__":
    main()
