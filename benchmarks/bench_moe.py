"""Mixture of experts on CPU: infire's batch-1 decode against its roofline, and batched
throughput against transformers, on a random Mixtral-shaped model, side by side, one run.

The model (random weights, bf16, built once with transformers' MixtralConfig and saved to
a git-ignored folder under benchmarks/results/): hidden 1024, 8 layers, 8 experts top-2,
expert intermediate size 3072, 16 heads / 4 KV heads of 64, vocab 32000, untied head.
Measured, greedy and ignoring EOS, on the same token-id prompts for both peers:
(a) batch-1 decode tok/s: a 32-token prompt, 128 new tokens; decode rate =
    (N - 1) / (t(N tokens) - t(1 token)), as in bench_engine.py;
(b) the roofline of (a): bytes a decoded token reads = attention, norms and router of
    every layer + exactly k experts per layer + one embedding row + the LM head + the KV
    cache at the mean decode context; roofline tok/s = read bandwidth / those bytes. The
    bandwidth (torch.sum over 1 GiB of float32, best of 3) is read right before and right
    after each decode measurement, and the higher of the two is that measurement's
    roofline: this host's bandwidth drifts between ~30 and ~60 GB/s over seconds (other
    tenants), so a decode is set against the bandwidth of the moment it ran. The run's
    highest reading is reported beside it (the fraction a run-wide peak gives);
(c) the experts alone: every layer's FusedMoE (the PyTorch path) on one token routed to
    k experts, i.e. the rate at which oneDNN's expert matmuls stream their weights;
(d) batch throughput: 16 requests of 64 prompt + 64 new tokens in one call, output
    tok/s, infire vs transformers (`generate`, bf16, left padding);
(e) where a PyTorch-path decode step goes: time inside attention, experts, router,
    norms, the LM head and outside the model per decoded token (forward hooks).
infire runs three ways: its fused CPU forward (the default: routed experts in C), its
PyTorch path (--no-cpu-kernels: FusedMoE with each expert prepacked for oneDNN) and, as
the before of that packing, the PyTorch path with plain stacked expert weights.
Peers alternate within each round (A B A B); every measurement waits for an idle machine
and is repeated (up to 3 times) if other processes took CPU meanwhile (machine_load.py),
and medians are over the undisturbed ones. Results: benchmarks/results/moe.json (with the
raw samples), docs/benchmarks-moe.png, and the tables on stdout (for docs/benchmarks.md).
The first run builds the model (~20 s, 1.3 GB under benchmarks/results/).

    .venv/bin/python benchmarks/bench_moe.py            # full run, ~2-4 minutes on 2 idle cores
    .venv/bin/python benchmarks/bench_moe.py --quick    # smoke check: 2 layers, ~20 seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from unittest.mock import patch

import torch
from bench_engine import machine_info, read_bandwidth
from engine_peers import Generation, InfirePeer, TransformersPeer
from machine_load import others_cores, snapshot, wait_until_idle

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
SEED = 0
DEFAULT_MAX_OTHERS_CORES = 0.15
TARGET_FRACTION = 0.70
UNPACKED = "infire bfloat16, PyTorch path, experts unpacked"
PYTORCH = "infire bfloat16, PyTorch path"
_START = time.perf_counter()
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MoEShape:
    """The benchmark model's sizes (Mixtral's layout)."""

    hidden_size: int = 1024
    num_layers: int = 8
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 3072
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 64
    vocab_size: int = 32000

    @property
    def name(self) -> str:
        """The cache folder's name: every size that changes the weights."""
        return (
            f"moe-h{self.hidden_size}-l{self.num_layers}-e{self.num_experts}k{self.top_k}"
            f"-i{self.moe_intermediate_size}-a{self.num_heads}x{self.num_kv_heads}"
            f"x{self.head_dim}-v{self.vocab_size}"
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """Workload sizes and repeat counts."""

    shape: MoEShape
    decode_prompt_len: int
    decode_tokens: int
    decode_repeats: int
    batch_size: int
    batch_prompt_len: int
    batch_tokens: int
    batch_repeats: int
    experts_repeats: int
    bandwidth_bytes: int


FULL = Plan(MoEShape(), 32, 128, 5, 16, 64, 64, 2, 20, 1 << 30)
QUICK = Plan(MoEShape(num_layers=2), 16, 16, 1, 4, 16, 8, 1, 5, 1 << 28)


@dataclass(slots=True)
class PeerSamples:
    """Raw timings of one peer, one entry per accepted measurement."""

    label: str
    first_token_s: list[float] = field(default_factory=list)
    full_s: list[float] = field(default_factory=list)
    batch_s: list[float] = field(default_factory=list)
    # read bandwidth around each decode measurement (the higher of before and after)
    decode_bandwidth: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # cores other processes used during each kept decode / batch measurement
    decode_others: list[float] = field(default_factory=list)
    batch_others: list[float] = field(default_factory=list)


def log(message: str) -> None:
    """Progress line with the elapsed time."""
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, short runs, 1 repeat")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--skip-unpacked", action="store_true",
        help="leave out infire with its experts unpacked (the before of the oneDNN packing)",
    )  # fmt: skip
    parser.add_argument(
        "--moe-intermediate-size", type=int, help="each expert's intermediate size (3072)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--max-others-cores", type=float, default=DEFAULT_MAX_OTHERS_CORES,
        help="repeat a measurement if other processes used more CPU (in cores) meanwhile",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="results file (default: benchmarks/results/)")
    parser.add_argument("--plot", type=Path, help="chart file (default: docs/ or results/)")
    return parser.parse_args(argv)


# --- the model ---------------------------------------------------------------------------


def build_model(shape: MoEShape) -> Path:
    """The random bf16 Mixtral of `shape` as a Hugging Face folder, written once."""
    folder = RESULTS_DIR / shape.name
    if (folder / "model.safetensors").is_file():
        return folder
    import transformers

    log(f"building the random model {shape.name} (once)")
    config = transformers.MixtralConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.moe_intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, num_local_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, shape.vocab_size)
    return folder


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` ids (prompts are token ids; this only has to
    load and detokenize): <pad>, <s>, </s>, then w3, w4, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config) + "\n")


def bytes_per_token(shape: MoEShape, context: float, itemsize: int) -> dict[str, float]:
    """What one batch-1 decode step reads, by part: every layer's attention, norms and
    router, k experts per layer, one embedding row, the final norm, the LM head, and the
    KV cache of `context` tokens."""
    h, d = shape.hidden_size, shape.head_dim
    attention = h * d * (2 * shape.num_heads + 2 * shape.num_kv_heads)  # q, o; k, v
    expert = 3 * h * shape.moe_intermediate_size
    parts = {
        "attention": shape.num_layers * attention,
        "norms": (2 * shape.num_layers + 1) * h,
        "router": shape.num_layers * shape.num_experts * h,
        "active_experts": shape.num_layers * shape.top_k * expert,
        "embedding_row": h,
        "lm_head": shape.vocab_size * h,
        "kv_cache": shape.num_layers * 2 * shape.num_kv_heads * d * context,
    }
    return {name: elements * itemsize for name, elements in parts.items()}


# --- the peers ---------------------------------------------------------------------------


class InfireMoE(InfirePeer):
    """infire's offline API on the benchmark model, bf16, prefix caching off: the fused CPU
    forward (routed experts in C), or with `cpu_kernels` False the PyTorch path (FusedMoE,
    each expert prepacked for oneDNN; with pack_experts False too, its plain stacked
    weights under F.linear, what it ran before it was packed)."""

    def __init__(self, folder: Path, pack_experts: bool = True, cpu_kernels: bool = True) -> None:
        from infire.layers.moe import FusedMoE

        self.label = "infire bfloat16" if cpu_kernels else PYTORCH if pack_experts else UNPACKED
        pack = FusedMoE.pack_for_cpu if pack_experts else lambda _: True
        with patch.object(FusedMoE, "pack_for_cpu", pack):
            super().__init__("bfloat16", 512 * 1024**2, str(folder), cpu_kernels=cpu_kernels)

    @property
    def model(self) -> torch.nn.Module:
        """The loaded model (on the PyTorch path, its weights packed for oneDNN)."""
        return self.llm.engine.runner.model

    def close(self) -> None:
        """Stop the engine and drop the weights."""
        self.llm.shutdown()
        del self.llm


def load_transformers(folder: Path) -> TransformersPeer:
    """transformers' Mixtral in bf16, with the experts implementation it picks itself."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    peer = TransformersPeer(model, torch.bfloat16, pad_token_id=0)
    peer.experts_implementation = model.config._experts_implementation
    log(f"transformers experts implementation: {peer.experts_implementation}")
    return peer


# --- measuring ---------------------------------------------------------------------------


def make_prompts(plan: Plan) -> tuple[list[int], list[list[int]]]:
    """Seeded random token ids: the batch-1 prompt and the batch prompts."""
    rng = random.Random(SEED)

    def draw(n: int) -> list[int]:
        return [rng.randint(3, plan.shape.vocab_size - 1) for _ in range(n)]

    return draw(plan.decode_prompt_len), [
        draw(plan.batch_prompt_len) for _ in range(plan.batch_size)
    ]


def generate_checked(peer: Any, prompts: list[list[int]], max_tokens: int) -> Generation:
    """peer.generate, failing loudly unless every prompt got exactly max_tokens tokens."""
    generation = peer.generate(prompts, max_tokens)
    lengths = {len(ids) for ids in generation.token_ids}
    if lengths != {max_tokens} or len(generation.token_ids) != len(prompts):
        raise RuntimeError(f"{peer_label(peer)}: generated lengths {lengths}, wanted {max_tokens}")
    return generation


def peer_label(peer: Any) -> str:
    """'infire bfloat16' or 'transformers bfloat16'."""
    return getattr(peer, "label", None) or f"{peer.engine} {peer.weights}"


def undisturbed(measure: Callable[[], T], max_others: float, attempts: int = 3) -> tuple[T, float]:
    """Wait for an idle machine, run `measure`, and repeat it if other processes took CPU
    meanwhile; returns the kept run's result and the cores others used during it."""
    for attempt in range(1, attempts + 1):
        waited = wait_until_idle([], max_others, max_wait_s=300)
        if waited > 2:
            log(f"  waited {waited:.0f}s for other processes to go idle")
        before = snapshot([])
        result = measure()
        busy = others_cores(before, snapshot([]))
        if busy < max_others or attempt == attempts:
            return result, busy
        log(f"  others used {busy:.2f} cores during that measurement: repeating it")
    raise AssertionError("unreachable")


def measure_decode(peer: Any, prompt: list[int], plan: Plan) -> dict[str, Any]:
    """Workload (a): t(1 token) then t(N tokens) on the batch-1 prompt, between two reads
    of the bandwidth (its roofline, (b))."""
    before = read_bandwidth(plan.bandwidth_bytes, repeats=3)["read_bytes_per_s"]
    first = generate_checked(peer, [prompt], 1).wall_s
    full = generate_checked(peer, [prompt], plan.decode_tokens)
    after = read_bandwidth(plan.bandwidth_bytes, repeats=3)["read_bytes_per_s"]
    rate = (plan.decode_tokens - 1) / (full.wall_s - first)
    log(f"  {peer_label(peer)}: batch-1 decode {rate:.1f} tok/s, read bandwidth "
        f"{before / 1e9:.1f} GB/s before and {after / 1e9:.1f} after")  # fmt: skip
    return {"first_token_s": first, "full_s": full.wall_s, "token_ids": full.token_ids[0],
            "decode_bandwidth": max(before, after)}  # fmt: skip


def measure_batch(peer: Any, prompts: list[list[int]], plan: Plan) -> dict[str, Any]:
    """Workload (d): every batch prompt in one call."""
    wall = generate_checked(peer, prompts, plan.batch_tokens).wall_s
    log(f"  {peer_label(peer)}: batch-{plan.batch_size} "
        f"{len(prompts) * plan.batch_tokens / wall:.1f} output tok/s")  # fmt: skip
    return {"batch_s": wall}


def record(samples: PeerSamples, result: dict[str, Any], others: float) -> None:
    """Add one kept measurement to a peer's samples."""
    for name, value in result.items():
        if name == "token_ids":
            samples.token_ids = value
        else:
            getattr(samples, name).append(value)
    workload = samples.batch_others if "batch_s" in result else samples.decode_others
    workload.append(round(others, 3))


def experts_rate(model: torch.nn.Module, shape: MoEShape, repeats: int) -> dict[str, float]:
    """Workload (c): one token through every layer's FusedMoE, routed to experts
    (l, l + 1, ...) mod E so layers differ; best and median seconds, and the bytes read."""
    from infire.layers.moe import FusedMoE

    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    x = torch.randn(1, shape.hidden_size, dtype=torch.bfloat16)
    weights = torch.full((1, shape.top_k), 1.0 / shape.top_k, dtype=torch.bfloat16)
    times = []
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            ids = [torch.tensor([[(repeat + n + j) % shape.num_experts for j in range(shape.top_k)]])
                   for n in range(len(layers))]  # fmt: skip
            start = time.perf_counter()
            for layer, expert_ids in zip(layers, ids, strict=True):
                layer(x, expert_ids, weights)
            times.append(time.perf_counter() - start)
    times = times[1:]  # the first pass warms up
    expert_bytes = 2 * 3 * shape.hidden_size * shape.moe_intermediate_size
    read = len(layers) * shape.top_k * expert_bytes
    return {"bytes": read, "best_s": min(times), "median_s": statistics.median(times)}


def step_breakdown(peer: InfireMoE, prompt: list[int], tokens: int) -> dict[str, float]:
    """Workload (e): where a batch-1 decode step's time goes, in seconds per token: the
    wall time, and the time inside each kind of module (forward hooks), the prefill and
    first token (a 1-token call) subtracted."""
    model = peer.model
    layers = list(model.layers)
    parts = {
        "model": [model], "lm_head": [model.lm_head],
        "attention": [layer.self_attn for layer in layers],
        "norms": [n for layer in layers
                  for n in (layer.input_layernorm, layer.post_attention_layernorm)],
        "moe_block": [layer.mlp for layer in layers],
        "router": [layer.mlp.gate for layer in layers],
        "experts": [layer.mlp.experts for layer in layers],
    }  # fmt: skip
    spent: dict[str, float] = dict.fromkeys(parts, 0.0)
    handles = [h for name, modules in parts.items() for m in modules
               for h in timer_hooks(m, name, spent)]  # fmt: skip
    try:
        first = generate_checked(peer, [prompt], 1).wall_s
        at_first = dict(spent)
        full = generate_checked(peer, [prompt], 1 + tokens).wall_s
    finally:
        for handle in handles:
            handle.remove()
    per_token = {name: (spent[name] - 2 * at_first[name]) / tokens for name in parts}
    per_token["wall"] = (full - first) / tokens
    return per_token


def timer_hooks(module: torch.nn.Module, name: str, spent: dict[str, float]) -> list[Any]:
    """Forward hooks adding the module's forward time to spent[name]."""
    starts: list[float] = []

    def before(*_: Any) -> None:
        starts.append(time.perf_counter())

    def after(*_: Any) -> None:
        spent[name] += time.perf_counter() - starts.pop()

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


# --- the run -----------------------------------------------------------------------------


def measure_bandwidth(plan: Plan, when: str) -> dict[str, float]:
    """Read and copy bandwidth on an idle machine."""
    wait_until_idle([], DEFAULT_MAX_OTHERS_CORES, max_wait_s=300)
    bandwidth = read_bandwidth(plan.bandwidth_bytes)
    log(f"read bandwidth {when} {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s")
    return bandwidth


def run_rounds(
    peers: list[Any], samples: dict[str, PeerSamples], plan: Plan, max_others: float
) -> None:
    """Decode rounds then batch rounds, peers alternating within each round."""
    prompt, batch = make_prompts(plan)
    for peer in peers:
        log(f"warm-up {peer_label(peer)}")
        generate_checked(peer, [prompt], 8)
        generate_checked(peer, batch[:2], 4)
    workloads = [(measure_decode, prompt, plan.decode_repeats),
                 (measure_batch, batch, plan.batch_repeats)]  # fmt: skip
    for measure, prompts, repeats in workloads:
        for round_index in range(repeats):
            log(f"{measure.__name__} round {round_index + 1}/{repeats}")
            for peer in peers:
                result, busy = undisturbed(partial(measure, peer, prompts, plan), max_others)
                record(samples[peer_label(peer)], result, busy)


def summarize(
    samples: PeerSamples, plan: Plan, max_others: float, per_token: float
) -> dict[str, Any]:
    """Medians over the undisturbed measurements (all of them where none was): batch-1
    decode tok/s, its roofline and fraction of it (each measurement against the bandwidth
    read around it), first-token ms, batch output tok/s; and each decode round's rate."""
    n = plan.decode_tokens
    decode = [(n - 1) / (f - t) for f, t in zip(samples.full_s, samples.first_token_s, strict=True)]
    fractions = [rate * per_token / bw for rate, bw in zip(decode, samples.decode_bandwidth,
                                                            strict=True)]  # fmt: skip
    quiet = quiet_indexes(samples.decode_others, max_others)
    batch = [samples.batch_s[i] for i in quiet_indexes(samples.batch_others, max_others)]
    kept = [samples.decode_others[i] for i in quiet] + [
        samples.batch_others[i] for i in quiet_indexes(samples.batch_others, max_others)
    ]
    return {
        "decode_tok_s": statistics.median(decode[i] for i in quiet) if quiet else None,
        "decode_tok_s_by_round": decode,
        "decode_rounds_kept": quiet,
        "roofline_tok_s": statistics.median(samples.decode_bandwidth[i] / per_token
                                            for i in quiet) if quiet else None,
        "decode_fraction": statistics.median(fractions[i] for i in quiet) if quiet else None,
        "decode_fraction_by_round": fractions,
        "first_token_ms": statistics.median(samples.first_token_s[i] for i in quiet) * 1000
        if quiet else None,
        "batch_tok_s": plan.batch_size * plan.batch_tokens / statistics.median(batch)
        if batch else None,
        "max_others_cores": max(kept, default=None),
    }  # fmt: skip


def quiet_indexes(others: list[float], limit: float) -> list[int]:
    """The measurements other processes left alone, or all of them if none was."""
    quiet = [i for i, cores in enumerate(others) if cores < limit]
    return quiet or list(range(len(others)))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Build the model, measure both peers alternating, write JSON, chart and table."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else FULL
    if args.moe_intermediate_size:
        shape = dataclasses.replace(plan.shape, moe_intermediate_size=args.moe_intermediate_size)
        plan = dataclasses.replace(plan, shape=shape)
    machine = machine_info(args.threads)
    log(
        f"machine: {machine['cpu']}, {machine['cores']} cores, load {machine['load_average_at_start']}"
    )
    log(f"infire source: {machine['infire_source']}")
    folder = build_model(plan.shape)
    bandwidth_before = measure_bandwidth(plan, "at the start")
    log("loading infire bfloat16")
    peers: list[Any] = [InfireMoE(folder)]
    log(f"loading {PYTORCH}")
    pytorch_path = InfireMoE(folder, cpu_kernels=False)
    peers.append(pytorch_path)
    if not args.skip_unpacked:
        log(f"loading {UNPACKED}")
        peers.append(InfireMoE(folder, pack_experts=False, cpu_kernels=False))
    if not args.skip_transformers:
        log("loading transformers bfloat16")
        peers.append(load_transformers(folder))
    samples = {peer_label(p): PeerSamples(peer_label(p)) for p in peers}
    try:
        run_rounds(peers, samples, plan, args.max_others_cores)
        log("experts alone (infire's FusedMoE on the PyTorch path, one token)")
        measure = partial(experts_rate, pytorch_path.model, plan.shape, plan.experts_repeats)
        experts, _ = undisturbed(measure, args.max_others_cores)
        log("where a PyTorch-path decode step's time goes (forward hooks)")
        prompt, _ = make_prompts(plan)
        measure = partial(step_breakdown, pytorch_path, prompt, plan.decode_tokens)
        breakdown, _ = undisturbed(measure, args.max_others_cores)
    finally:
        for peer in peers:
            peer.close()
    bandwidth_after = measure_bandwidth(plan, "at the end")
    machine["load_average_at_end"] = os.getloadavg()
    bandwidth = {"before": bandwidth_before, "after": bandwidth_after}
    result = analyse(plan, samples, experts, bandwidth, args.max_others_cores)
    result["step_breakdown_s"] = breakdown
    result |= {"command": " ".join(["benchmarks/bench_moe.py", *(argv or sys.argv[1:])]),
               "plan": asdict(plan), "machine": machine,
               "transformers_experts": getattr(peers[-1], "experts_implementation", None)}  # fmt: skip
    result["samples"] = [asdict(s) for s in samples.values()]
    print("\n" + markdown(result))
    json_path, plot_path = outputs(args)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, plot_path)
    log(f"wrote {json_path} and {plot_path}")


def analyse(
    plan: Plan,
    samples: dict[str, PeerSamples],
    experts: dict[str, float],
    bandwidth: dict[str, Any],
    max_others: float,
) -> dict[str, Any]:
    """Summaries (each decode against the bandwidth read around it), the fraction of the
    roofline at the run's highest reading too, and the ratios to transformers."""
    around = [bw for s in samples.values() for bw in s.decode_bandwidth]
    readings = [bandwidth["before"]["read_bytes_per_s"], bandwidth["after"]["read_bytes_per_s"]]
    highest = max(readings + around)
    spread = {"around_decodes": around, "highest": highest, "lowest": min(readings + around)}
    context = plan.decode_prompt_len + plan.decode_tokens / 2  # mean over the decode
    parts = bytes_per_token(plan.shape, context, torch.bfloat16.itemsize)
    per_token = sum(parts.values())
    summaries = {label: summarize(s, plan, max_others, per_token) for label, s in samples.items()}
    mine = summaries["infire bfloat16"]
    peer = summaries.get("transformers bfloat16")
    reference = samples.get("transformers bfloat16")
    return {
        "bandwidth": bandwidth | spread,
        "bytes_per_token": parts | {"total": per_token, "mean_context": context},
        "roofline_tok_s": mine["roofline_tok_s"],
        "decode_fraction_of_roofline": mine["decode_fraction"],
        "peak_roofline_tok_s": highest / per_token,
        "decode_fraction_at_peak": mine["decode_tok_s"] * per_token / highest,
        "target_fraction": TARGET_FRACTION,
        "experts_alone": experts
        | {
            "read_bytes_per_s_best": experts["bytes"] / experts["best_s"],
            "read_bytes_per_s_median": experts["bytes"] / experts["median_s"],
        },  # fmt: skip
        "summaries": summaries,
        "batch_ratio": mine["batch_tok_s"] / peer["batch_tok_s"] if peer else None,
        "decode_ratio": mine["decode_tok_s"] / peer["decode_tok_s"] if peer else None,
        "greedy_agreement": {
            label: common_prefix(s.token_ids, reference.token_ids)
            for label, s in samples.items()
            if s is not reference
        }
        if reference
        else None,
    }


def outputs(args: argparse.Namespace) -> tuple[Path, Path]:
    """Where the JSON and the chart go: quick runs never overwrite the published chart."""
    if args.quick:
        json_path, plot_path = RESULTS_DIR / "moe-quick.json", RESULTS_DIR / "moe-quick.png"
    else:
        json_path, plot_path = RESULTS_DIR / "moe.json", ROOT / "docs" / "benchmarks-moe.png"
    return args.json or json_path, args.plot or plot_path


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The table and the notes docs/benchmarks.md quotes."""
    plan, parts = result["plan"], result["bytes_per_token"]
    band = result["bandwidth"]
    experts = result["experts_alone"]
    lines = [
        f"Read bandwidth {band['before']['read_bytes_per_s'] / 1e9:.1f} GB/s at the start, "
        f"{band['after']['read_bytes_per_s'] / 1e9:.1f} GB/s at the end, "
        f"{band['lowest'] / 1e9:.1f}-{band['highest'] / 1e9:.1f} GB/s over the run (each "
        "decode's roofline is the bandwidth read around it). "
        f"Bytes per decoded token {parts['total'] / 1e6:.1f} MB (active experts "
        f"{parts['active_experts'] / 1e6:.1f}, attention {parts['attention'] / 1e6:.1f}, LM head "
        f"{parts['lm_head'] / 1e6:.1f}, router {parts['router'] / 1e6:.2f}, KV cache at context "
        f"{parts['mean_context']:.0f} {parts['kv_cache'] / 1e6:.2f}).",
        "",
        f"| engine | batch-1 decode tok/s | roofline tok/s | decode / roofline "
        f"| decode / run's peak roofline | first token ms "
        f"| batch-{plan['batch_size']} output tok/s |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    peak = result["peak_roofline_tok_s"]
    for label, s in result["summaries"].items():
        at_peak = s["decode_tok_s"] / peak if s["decode_tok_s"] else None
        lines.append(
            f"| {label} | {_fmt(s['decode_tok_s'])} | {_fmt(s['roofline_tok_s'])} "
            f"| {_fmt(s['decode_fraction'], 2)} | {_fmt(at_peak, 2)} "
            f"| {_fmt(s['first_token_ms'])} | {_fmt(s['batch_tok_s'])} |"
        )
    rounds = result["summaries"]["infire bfloat16"]["decode_fraction_by_round"]
    lines += ["", f"infire's decode rounds against the bandwidth read around each: "
                  f"{', '.join(f'{f:.2f}' for f in rounds)} of the roofline; the run's peak "
                  f"reading {band['highest'] / 1e9:.1f} GB/s makes {peak:.1f} tok/s."]  # fmt: skip
    summaries = result["summaries"]
    for before, what in (
        (PYTORCH, "Fused forward / PyTorch path"),
        (UNPACKED, "PyTorch path, experts packed for oneDNN / unpacked"),
    ):
        if before in summaries:
            after = summaries["infire bfloat16" if before == PYTORCH else PYTORCH]
            lines += [
                "",
                f"{what}: batch-1 decode "
                f"{after['decode_tok_s'] / summaries[before]['decode_tok_s']:.2f}x, "
                f"batch-{plan['batch_size']} throughput "
                f"{after['batch_tok_s'] / summaries[before]['batch_tok_s']:.2f}x.",
            ]
    if result["batch_ratio"]:
        lines += ["", f"infire / transformers: batch-1 decode {result['decode_ratio']:.2f}x, "
                      f"batch-{plan['batch_size']} throughput {result['batch_ratio']:.2f}x."]  # fmt: skip
    lines += [
        "",
        f"Experts alone (every layer's FusedMoE, one token, k experts): "
        f"{experts['read_bytes_per_s_best'] / 1e9:.1f} GB/s best, "
        f"{experts['read_bytes_per_s_median'] / 1e9:.1f} GB/s median, "
        f"{experts['median_s'] * 1000:.2f} ms a token.",
        *breakdown_table(result),
        "",
        f"Greedy tokens equal to transformers' at batch 1 (leading): {result['greedy_agreement']}.",
        f"Other processes used at most {max_disturbance(result):.2f} cores during a kept "
        "measurement.",
    ]
    return "\n".join(lines)


def breakdown_rows(result: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Workload (e): each part of a decode step -> (seconds per token, bytes it reads)."""
    t, parts = result["step_breakdown_s"], result["bytes_per_token"]
    rows = {
        "experts (FusedMoE)": (t["experts"], parts["active_experts"]),
        "attention (qkv, RoPE, KV write, SDPA, o)": (t["attention"], parts["attention"]
                                                     + parts["kv_cache"]),
        "LM head": (t["lm_head"], parts["lm_head"]),
        "router matmul": (t["router"], parts["router"]),
        "routing (top-k) and residual sums": (t["moe_block"] - t["router"] - t["experts"], 0),
        "RMS norms": (t["norms"], parts["norms"]),
        "rest of the model (embedding, final norm)": (
            t["model"] - t["attention"] - t["moe_block"] - t["norms"], 0),
        "outside the model (metadata, sampling, scheduler)": (
            t["wall"] - t["model"] - t["lm_head"], 0),
        "whole step": (t["wall"], parts["total"]),
    }  # fmt: skip
    return rows


def breakdown_table(result: dict[str, Any]) -> list[str]:
    """Workload (e) as markdown rows: ms per decoded token, and the rate of the parts that
    stream weights (their bytes over their time)."""
    lines = ["", "| part of a decode step | ms per token | MB read | GB/s |", "|---|--:|--:|--:|"]
    for name, (seconds, nbytes) in breakdown_rows(result).items():
        rate = f"{nbytes / seconds / 1e9:.1f}" if nbytes and seconds > 0 else ""
        mb = f"{nbytes / 1e6:.1f}" if nbytes else ""
        lines.append(f"| {name} | {seconds * 1000:.2f} | {mb} | {rate} |")
    return lines


def max_disturbance(result: dict[str, Any]) -> float:
    """The most CPU others took during any kept measurement."""
    return max((s["max_others_cores"] or 0.0 for s in result["summaries"].values()), default=0.0)


def plot(result: dict[str, Any], path: Path) -> None:
    """Left: batch-1 decode of each peer against the roofline and its 70% target; middle:
    where infire's decode step goes, against the step time at the roofline; right: batch
    throughput, each bar labelled with its ratio to transformers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = result["summaries"]
    labels = list(summaries)
    ticks = [name.replace(", ", ",\n") for name in labels]
    palette = {"infire bfloat16": "#d9480f", PYTORCH: "#f08c00", UNPACKED: "#ffd43b"}
    colors = [palette.get(name, "#5c7cfa") for name in labels]
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(18, 6))
    roof, peak = result["roofline_tok_s"], result["peak_roofline_tok_s"]
    decode = [summaries[name]["decode_tok_s"] or 0 for name in labels]
    fractions = [summaries[name]["decode_fraction"] or 0 for name in labels]
    bars = left.bar(ticks, decode, color=colors)
    left.axhline(roof, color="black", linestyle="--",
                 label=f"roofline around infire's decodes {roof:.0f} tok/s")  # fmt: skip
    left.axhline(TARGET_FRACTION * roof, color="gray", linestyle=":",
                 label=f"{TARGET_FRACTION:.0%} of it")  # fmt: skip
    left.axhline(peak, color="black", linestyle="-.", linewidth=0.8,
                 label=f"at the run's peak reading {peak:.0f} tok/s")  # fmt: skip
    left.bar_label(bars, [f"{v:.1f} ({f:.2f} of roof)" for v, f in zip(decode, fractions,
                                                                       strict=True)])  # fmt: skip
    left.set_title("batch-1 decode tok/s vs its roofline\n(k active experts; bandwidth read "
                   "around each decode)")  # fmt: skip
    left.legend(loc="upper right")
    breakdown_panel(middle, result)
    batch = [summaries[name]["batch_tok_s"] or 0 for name in labels]
    bars = right.bar(ticks, batch, color=colors)
    base = batch[-1] or 1
    right.bar_label(bars, [f"{v:.1f} ({v / base:.2f}x)" for v in batch])
    right.set_title(f"batch-{result['plan']['batch_size']} output throughput, tok/s")
    shape = result["plan"]["shape"]
    figure.suptitle(
        f"random Mixtral-shaped MoE (hidden {shape['hidden_size']}, {shape['num_layers']} layers,"
        f" {shape['num_experts']} experts top-{shape['top_k']}, expert intermediate "
        f"{shape['moe_intermediate_size']}), bf16, CPU ({result['machine']['threads']} threads)"
    )
    left.set_ylim(0, max(roof, peak) * 1.15)
    right.set_ylim(0, max(batch, default=1) * 1.2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def breakdown_panel(axis: Any, result: dict[str, Any]) -> None:
    """Two stacked bars of ms per decoded token: infire's measured parts, and the same
    bytes at the fused forward's roofline; a line at the 70% target's step time."""
    rows = breakdown_rows(result)
    del rows["whole step"]
    bandwidth = result["roofline_tok_s"] * result["bytes_per_token"]["total"]
    measured = [seconds * 1000 for seconds, _ in rows.values()]
    ideal = [nbytes / bandwidth * 1000 for _, nbytes in rows.values()]
    colors = plt_colors(len(rows))
    for bar, values in (("PyTorch path,\nmeasured", measured), ("at the roofline", ideal)):
        left = 0.0
        for name, value, color in zip(rows, values, colors, strict=True):
            axis.barh(
                bar, value, left=left, color=color, label=name if bar != "at the roofline" else None
            )
            left += value
    target = 1000 / (TARGET_FRACTION * result["roofline_tok_s"])
    axis.axvline(target, color="gray", linestyle=":", label=f"step time at {TARGET_FRACTION:.0%}")
    axis.set_xlabel("ms per decoded token")
    axis.set_title("infire's PyTorch-path batch-1 decode step, by part")
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)


def plt_colors(count: int) -> list[Any]:
    """`count` distinct colors."""
    import matplotlib

    return [matplotlib.colormaps["tab10"](i % 10) for i in range(count)]


if __name__ == "__main__":
    main()
