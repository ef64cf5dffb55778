"""Engine speed: infire vs transformers vs llama.cpp on SmolLM2-135M, side by side, one run.

Measures, on the same token-id prompts for every peer, greedy and ignoring EOS:
(a) batch-1 decode tok/s: a 16-token prompt, 128 new tokens; decode rate =
    (N - 1) / (time for N tokens - time for 1 token), i.e. prefill and the first sample
    are measured separately (max_tokens=1) and subtracted; also the time to first token,
    and prefill tok/s of a 128-token prompt (128 / time for max_tokens=1);
(b) batch throughput: 32 requests of 128 random prompt tokens + 128 new tokens each,
    output tok/s = 32 * 128 / wall time of the whole batch;
(c) the memory-bandwidth roofline: read bandwidth (torch.sum over 1 GiB of float32, best of
    5), weight bytes read per decoded token (every parameter once; the tied embedding is
    read once, for the LM head), roofline tok/s = bandwidth / bytes per token;
(d) the compute ceiling of (b): its matmul flops (2 per layer weight per prompt and
    decoded token, 2 per LM-head weight per output token; attention not counted) over the
    fp32 matmul peak (2048^3 torch.mm, best of 5): no fp32 engine beats that output rate.
Each peer is warmed up once; measurements alternate peers (A B A B) and medians are
reported. Before each measurement the script waits for other processes to go idle, and it
repeats a measurement they disturbed (see machine_load.py). llama.cpp runs in its own venv,
.bench-venv (docs/benchmarks.md says how to build it); without it, it is reported as not
available. Results go to benchmarks/results/engine.json, the chart to
docs/benchmarks-engine.png, and a markdown table to stdout (for docs/benchmarks.md).

    .venv/bin/python benchmarks/bench_engine.py            # full run, ~8 minutes on 2 idle cores
    .venv/bin/python benchmarks/bench_engine.py --quick    # smoke check, ~1-2 minutes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from engine_peers import (
    InfirePeer,
    LlamaCppPeer,
    Peer,
    PeerUnavailable,
    label,
    load_transformers,
)
from engine_report import PeerSummary, markdown_report, plot
from machine_load import others_cores, snapshot, wait_until_idle

from infire.models.loader import default_model_path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
TOKEN_RANGE = (1000, 40000)  # ordinary BPE tokens: no specials, no byte fallbacks
SEED = 0
DEFAULT_MAX_OTHERS_CORES = 0.15
LLAMACPP_CONTEXT = 1024  # tokens: any prompt here plus its new tokens
_START = time.perf_counter()


@dataclass(frozen=True, slots=True)
class Plan:
    """Workload sizes and repeat counts."""

    single_prompt_len: int
    single_max_tokens: int
    prefill_prompt_len: int
    batch_size: int
    batch_prompt_len: int
    batch_max_tokens: int
    single_repeats: int
    batch_repeats: int
    bandwidth_bytes: int


FULL = Plan(16, 128, 128, 32, 128, 128, 3, 2, 1 << 30)
QUICK = Plan(16, 16, 32, 4, 32, 16, 1, 1, 1 << 28)


@dataclass(frozen=True, slots=True)
class Prompts:
    """The token-id prompts every peer gets."""

    single: list[int]
    prefill: list[int]
    batch: list[list[int]]


@dataclass(slots=True)
class PeerSamples:
    """Raw timings of one peer, one entry per repeat."""

    label: str
    engine: str
    weights: str
    first_token_s: list[float] = field(default_factory=list)
    full_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    batch_s: list[float] = field(default_factory=list)
    stream_decode_tok_s: list[float] = field(default_factory=list)
    batch_first_token_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Cores other processes used during each kept measurement of workload (a) and (b).
    single_others_cores: list[float] = field(default_factory=list)
    batch_others_cores: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Guard:
    """How the run protects itself from a busy machine and from running too long."""

    budget_s: float  # batch repeats after the first are skipped past this
    max_others_cores: float  # others' CPU use above this (cores) repeats a measurement
    attempts: int = 3
    max_wait_s: float = 300.0  # longest wait for idle before measuring anyway


@dataclass(slots=True)
class Setting:
    """What the run measured besides the peers: the machine, the model, the bandwidth."""

    machine: dict[str, Any]
    weights: dict[str, Any]
    bandwidth: dict[str, float]
    matmul_flops_per_s: float  # fp32 peak, torch.mm 2048^3
    llamacpp_error: str | None = None


def log(message: str) -> None:
    """Progress line with the elapsed time."""
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 repeat")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-infire", action="store_true", help="peers only (debugging)")
    parser.add_argument(
        "--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"],
        help="dtypes for infire and transformers",
    )  # fmt: skip
    parser.add_argument(
        "--budget-minutes", type=float, default=10.0,
        help="skip repeats of the batch workload that would end later than this",
    )  # fmt: skip
    parser.add_argument(
        "--max-others-cores", type=float, default=DEFAULT_MAX_OTHERS_CORES,
        help="repeat a measurement if other processes used more CPU (in cores) meanwhile",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    parser.add_argument("--json", type=Path, help="results file (default: benchmarks/results/)")
    parser.add_argument("--plot", type=Path, help="chart file (default: docs/ or results/)")
    return parser.parse_args(argv)


def make_prompts(plan: Plan) -> Prompts:
    """Seeded random token ids, so every peer sees identical prompt lengths and content."""
    rng = random.Random(SEED)

    def draw(n: int) -> list[int]:
        return [rng.randint(*TOKEN_RANGE) for _ in range(n)]

    batch = [draw(plan.batch_prompt_len) for _ in range(plan.batch_size)]
    return Prompts(draw(plan.single_prompt_len), draw(plan.prefill_prompt_len), batch)


def machine_info(threads: int) -> dict[str, Any]:
    """CPU, cores, memory, ISA features that matter here, load, library versions."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln), "?"
    )
    meminfo = Path("/proc/meminfo").read_text().split()
    flags = set(Path("/proc/cpuinfo").read_text().split())
    import transformers

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1),
        "isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}),
        "threads": threads,
        "load_average_at_start": os.getloadavg(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "infire_source": source_state(),
    }


def source_state() -> str:
    """The commit measured, plus the source files changed since it (others edit the tree)."""

    def git(*command: str) -> str:
        result = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
        return result.stdout.strip()

    changed = git("status", "--short", "--", "src").replace("\n", ", ")
    return git("rev-parse", "--short", "HEAD") + (f" + uncommitted: {changed}" if changed else "")


def read_bandwidth(num_bytes: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-N memory bandwidth in bytes/s: a sum (read only) and a copy (read + write)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = copy = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.sum(src)
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - start)
    return {"read_bytes_per_s": num_bytes / read, "copy_bytes_per_s": 2 * num_bytes / copy}


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """Best-of-N fp32 matmul rate in flop/s (the machine's practical compute peak)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def batch_flops(plan: Plan, weights: dict[str, Any]) -> float:
    """Matmul flops of workload (b): layers for every prompt and decoded token, the LM head
    for every output token (the tied embedding counted once)."""
    layers = weights["parameters"] - weights["embedding_parameters"]
    per_seq = 2 * (plan.batch_prompt_len + plan.batch_max_tokens - 1) * layers
    per_seq += 2 * plan.batch_max_tokens * weights["embedding_parameters"]
    return plan.batch_size * per_seq


def remeasure_bandwidth(setting: Setting, plan: Plan) -> None:
    """Measure bandwidth again after the peers ran, keeping the best of both runs."""
    wait_until_idle([], DEFAULT_MAX_OTHERS_CORES, max_wait_s=120)
    again = read_bandwidth(plan.bandwidth_bytes)
    for key, value in again.items():
        setting.bandwidth[key] = max(setting.bandwidth[key], value)
    log(f"read bandwidth at the end {again['read_bytes_per_s'] / 1e9:.1f} GB/s")


def gguf_weights(path: Path) -> dict[str, Any]:
    """Parameter count, quantized bytes and the dominant quantization of a GGUF file."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    by_type: Counter[str] = Counter()
    for tensor in tensors:
        by_type[tensor.tensor_type.name] += int(tensor.n_bytes)
    embedding = [t for t in tensors if t.name == "token_embd.weight"]
    return {
        "parameters": sum(int(t.n_elements) for t in tensors),
        "embedding_parameters": int(embedding[0].n_elements) if embedding else 0,
        "gguf_bytes": sum(by_type.values()),
        "gguf_format": by_type.most_common(1)[0][0],
    }


def bytes_per_token(peer: Peer, weights: dict[str, Any]) -> int:
    """Weight bytes one decode step reads: all parameters once (tied head included once)."""
    if peer.engine == "llama.cpp":
        return weights["gguf_bytes"]
    return weights["parameters"] * getattr(torch, peer.weights).itemsize


def load_peers(args: argparse.Namespace, model: Path, setting: Setting) -> list[Peer]:
    """Load every selected peer; an unavailable llama.cpp is reported and skipped."""
    peers: list[Peer] = []
    kv_memory = 512 * 1024**2 if args.quick else 1024**3
    for dtype in [] if args.skip_infire else args.dtype:
        log(f"loading infire {dtype}")
        peers.append(InfirePeer(dtype, kv_memory))
    if not args.skip_transformers:
        log(f"loading transformers {' '.join(args.dtype)}")
        peers.extend(load_transformers(model, args.dtype))
    if not args.skip_llamacpp:
        peers.extend(load_llamacpp(args, model, setting))
    return peers


def load_llamacpp(args: argparse.Namespace, model: Path, setting: Setting) -> list[Peer]:
    """The llama.cpp subprocess, or nothing (with the reason logged) where it cannot run."""
    log("loading llama.cpp (subprocess in .bench-venv)")
    try:
        weights = f"{setting.weights['gguf_format']} GGUF"
        return [LlamaCppPeer(model, args.threads, LLAMACPP_CONTEXT, weights)]
    except PeerUnavailable as e:
        log(f"llama.cpp not available: {e}")
        setting.llamacpp_error = str(e)
        return []


def generate_checked(peer: Peer, prompts: list[list[int]], max_tokens: int) -> Any:
    """peer.generate, failing loudly if any request got a different number of tokens."""
    generation = peer.generate(prompts, max_tokens)
    lengths = {len(ids) for ids in generation.token_ids}
    if lengths != {max_tokens} or len(generation.token_ids) != len(prompts):
        raise RuntimeError(f"{label(peer)}: generated lengths {lengths}, wanted {max_tokens}")
    return generation


def warm_up(peer: Peer, prompts: Prompts) -> None:
    """One short single and one short batched call, untimed."""
    log(f"warm-up {label(peer)}")
    generate_checked(peer, [prompts.single], 8)
    generate_checked(peer, prompts.batch[:4], 4)


def measure_single(peer: Peer, samples: PeerSamples, prompts: Prompts, plan: Plan) -> None:
    """Workload (a): time to first token, N tokens at batch 1, and a longer prefill."""
    n = plan.single_max_tokens
    samples.first_token_s.append(generate_checked(peer, [prompts.single], 1).wall_s)
    full = generate_checked(peer, [prompts.single], n)
    samples.full_s.append(full.wall_s)
    samples.token_ids = full.token_ids[0]
    if full.first_token_s:
        samples.stream_decode_tok_s.append((n - 1) / (full.wall_s - full.first_token_s[0]))
    samples.prefill_s.append(generate_checked(peer, [prompts.prefill], 1).wall_s)
    decode = (n - 1) / (samples.full_s[-1] - samples.first_token_s[-1])
    log(f"  {label(peer)}: batch-1 decode {decode:.1f} tok/s")


def measure_batch(peer: Peer, samples: PeerSamples, prompts: Prompts, plan: Plan) -> None:
    """Workload (b): all batch prompts in one call, output tokens over wall time."""
    batch = generate_checked(peer, prompts.batch, plan.batch_max_tokens)
    samples.batch_s.append(batch.wall_s)
    if batch.first_token_s:
        samples.batch_first_token_s.extend(batch.first_token_s)
    rate = plan.batch_size * plan.batch_max_tokens / batch.wall_s
    log(f"  {label(peer)}: batch-{plan.batch_size} {rate:.1f} output tok/s")


def run_rounds(
    peers: list[Peer],
    samples: dict[str, PeerSamples],
    prompts: Prompts,
    plan: Plan,
    guard: Guard,
) -> None:
    """Repeat each workload, alternating peers within a round (A B A B).

    Batch rounds after the first run only if another round of the same length still ends
    within the time budget; single-request rounds always run in full.
    """
    workloads = [(measure_single, plan.single_repeats), (measure_batch, plan.batch_repeats)]
    for measure, repeats in workloads:
        last_round_s = 0.0
        for round_index in range(repeats):
            projected = time.perf_counter() - _START + last_round_s
            if measure is measure_batch and round_index > 0 and projected > guard.budget_s:
                log(f"skipping {measure.__name__} rounds {round_index + 1}..{repeats}: "
                    f"would end at {projected:.0f}s, budget {guard.budget_s:.0f}s")  # fmt: skip
                break
            log(f"{measure.__name__} round {round_index + 1}/{repeats}")
            started = time.perf_counter()
            run_round(measure, peers, samples, prompts, plan, guard)
            last_round_s = time.perf_counter() - started


def run_round(
    measure: Any,
    peers: list[Peer],
    samples: dict[str, PeerSamples],
    prompts: Prompts,
    plan: Plan,
    guard: Guard,
) -> None:
    """One measurement of every peer, in order; a peer whose subprocess dies is dropped."""
    own_pids = [pid for peer in peers for pid in peer.child_pids]
    for peer in list(peers):
        try:
            measure_undisturbed(measure, peer, samples[label(peer)], own_pids, prompts, plan, guard)
        except PeerUnavailable as e:
            log(f"{label(peer)} failed: {e}")
            samples[label(peer)].error = str(e)
            peers.remove(peer)


def measure_undisturbed(
    measure: Any,
    peer: Peer,
    samples: PeerSamples,
    own_pids: list[int],
    prompts: Prompts,
    plan: Plan,
    guard: Guard,
) -> None:
    """Wait for an idle machine, measure, and repeat if other processes took CPU meanwhile."""
    for attempt in range(1, guard.attempts + 1):
        waited = wait_until_idle(own_pids, guard.max_others_cores, guard.max_wait_s)
        if waited > 2:
            log(f"  waited {waited:.0f}s for other processes to go idle")
        scratch = PeerSamples(samples.label, samples.engine, samples.weights)
        before = snapshot(own_pids)
        measure(peer, scratch, prompts, plan)
        busy = others_cores(before, snapshot(own_pids))
        if busy < guard.max_others_cores or attempt == guard.attempts:
            merge_samples(samples, scratch, busy)
            return
        log(f"  others used {busy:.2f} cores during that measurement: repeating it")


def merge_samples(samples: PeerSamples, new: PeerSamples, others_cores: float) -> None:
    """Append one accepted measurement's values to a peer's samples."""
    for name in ("first_token_s", "full_s", "prefill_s", "batch_s", "stream_decode_tok_s"):
        getattr(samples, name).extend(getattr(new, name))
    samples.batch_first_token_s.extend(new.batch_first_token_s)
    samples.token_ids = new.token_ids or samples.token_ids
    workload = samples.batch_others_cores if new.batch_s else samples.single_others_cores
    workload.append(round(others_cores, 3))


def summarize(
    samples: PeerSamples, plan: Plan, roofline: float, reference: list[int]
) -> PeerSummary:
    """Medians and rates of one peer's samples."""
    n = plan.single_max_tokens
    decode = [(n - 1) / (f - t) for f, t in zip(samples.full_s, samples.first_token_s, strict=True)]
    agreement = common_prefix_length(samples.token_ids, reference)
    return PeerSummary(
        label=samples.label,
        engine=samples.engine,
        weights=samples.weights,
        decode_tok_s=_median(decode),
        first_token_ms=_scaled(_median(samples.first_token_s), 1000),
        prefill_tok_s=_inverse(_median(samples.prefill_s), plan.prefill_prompt_len),
        batch_tok_s=_inverse(_median(samples.batch_s), plan.batch_size * plan.batch_max_tokens),
        roofline_tok_s=roofline,
        stream_decode_tok_s=_median(samples.stream_decode_tok_s),
        batch_prefill_tok_s=_inverse(_median(samples.batch_first_token_s), plan.batch_prompt_len),
        greedy_agreement=agreement if samples.token_ids and reference else None,
        max_others_cores=max(
            samples.single_others_cores + samples.batch_others_cores, default=None
        ),
        error=samples.error,
    )


def undisturbed(samples: PeerSamples, limit: float) -> PeerSamples:
    """The samples without measurements other processes disturbed, where clean ones exist."""
    single = _quiet_indexes(samples.single_others_cores, limit)
    batch = _quiet_indexes(samples.batch_others_cores, limit)
    kept = copy.deepcopy(samples)
    for name in ("first_token_s", "full_s", "prefill_s", "single_others_cores"):
        setattr(kept, name, [getattr(samples, name)[i] for i in single])
    if samples.stream_decode_tok_s:
        kept.stream_decode_tok_s = [samples.stream_decode_tok_s[i] for i in single]
    kept.batch_s = [samples.batch_s[i] for i in batch]
    kept.batch_others_cores = [samples.batch_others_cores[i] for i in batch]
    return kept


def _quiet_indexes(others: list[float], limit: float) -> list[int]:
    quiet = [i for i, cores in enumerate(others) if cores < limit]
    return quiet or list(range(len(others)))


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _inverse(seconds: float | None, count: int) -> float | None:
    return None if not seconds else count / seconds


def default_outputs(args: argparse.Namespace) -> tuple[Path, Path]:
    """Where the JSON and the chart go: quick runs never overwrite the published chart."""
    if args.quick:
        return RESULTS_DIR / "engine-quick.json", RESULTS_DIR / "engine-quick.png"
    return RESULTS_DIR / "engine.json", ROOT / "docs" / "benchmarks-engine.png"


def measure_setting(args: argparse.Namespace, plan: Plan, model: Path) -> Setting:
    """Machine facts, the model's weight sizes and the memory bandwidth, before any peer loads."""
    machine = machine_info(args.threads)
    load = machine["load_average_at_start"]
    log(f"machine: {machine['cpu']}, {machine['cores']} cores, load average {load}")
    log(f"infire source: {machine['infire_source']}")
    wait_until_idle([], DEFAULT_MAX_OTHERS_CORES, max_wait_s=300)
    bandwidth = read_bandwidth(plan.bandwidth_bytes)
    log(f"read bandwidth {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s")
    peak = matmul_peak()
    log(f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s")
    return Setting(machine, gguf_weights(model), bandwidth, peak)


def benchmark(peers: list[Peer], plan: Plan, guard: Guard) -> dict[str, PeerSamples]:
    """Warm every peer up, then run the alternating rounds; closes the peers at the end."""
    prompts = make_prompts(plan)
    for peer in peers:
        warm_up(peer, prompts)
    samples = {label(p): PeerSamples(label(p), p.engine, p.weights) for p in peers}
    run_rounds(list(peers), samples, prompts, plan, guard)
    for peer in peers:
        peer.close()
    return samples


def summarize_all(
    peers: list[Peer], samples: dict[str, PeerSamples], plan: Plan, setting: Setting, limit: float
) -> list[PeerSummary]:
    """One summary per peer from its undisturbed samples, its roofline from the bandwidth."""
    reference = samples.get("transformers float32")
    reference_ids = reference.token_ids if reference else []
    bandwidth = setting.bandwidth["read_bytes_per_s"]
    return [
        summarize(
            undisturbed(s, limit),
            plan,
            bandwidth / bytes_per_token(p, setting.weights),
            reference_ids,
        )
        for p, s in zip(peers, samples.values(), strict=True)
    ]


def main(argv: list[str] | None = None) -> None:
    """Load the peers, run the workloads alternating peers, write JSON, chart and table."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else FULL
    model = default_model_path()
    setting = measure_setting(args, plan, model)
    peers = load_peers(args, model, setting)
    guard = Guard(args.budget_minutes * 60, args.max_others_cores)
    samples = benchmark(peers, plan, guard)
    remeasure_bandwidth(setting, plan)
    summaries = summarize_all(peers, samples, plan, setting, guard.max_others_cores)
    setting.machine["load_average_at_end"] = os.getloadavg()
    ceiling = (
        plan.batch_size
        * plan.batch_max_tokens
        / (batch_flops(plan, setting.weights) / setting.matmul_flops_per_s)
    )
    report = markdown_report(
        summaries, plan_text(plan), setting.bandwidth, setting.weights, setting.llamacpp_error
    )
    report += (
        f"\n\nCompute ceiling of the batch workload: {batch_flops(plan, setting.weights) / 1e12:.2f}"
        f" Tflop of matmuls at the fp32 matmul peak {setting.matmul_flops_per_s / 1e9:.0f} "
        f"GFLOP/s measured in this run: at most {ceiling:.0f} output tok/s for any fp32 engine."
    )
    print("\n" + report)
    json_path, plot_path = default_outputs(args)
    json_path, plot_path = args.json or json_path, args.plot or plot_path
    write_json(json_path, setting, plan, samples, summaries, argv)
    plot(summaries, plot_path, plan.batch_size)
    log(f"wrote {json_path} and {plot_path}")


def plan_text(plan: Plan) -> dict[str, str]:
    """Human descriptions of the workloads, for the table header."""
    return {
        "single": f"{plan.single_prompt_len}-token prompt, {plan.single_max_tokens} new tokens",
        "prefill": f"{plan.prefill_prompt_len}-token prompt",
        "batch": (
            f"{plan.batch_size} requests x ({plan.batch_prompt_len} prompt + "
            f"{plan.batch_max_tokens} new) tokens"
        ),
        "batch_size": str(plan.batch_size),
    }


def write_json(
    path: Path,
    setting: Setting,
    plan: Plan,
    samples: dict[str, PeerSamples],
    summaries: list[PeerSummary],
    argv: list[str] | None,
) -> None:
    """Everything measured, raw samples included."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "command": " ".join(["benchmarks/bench_engine.py", *(argv or sys.argv[1:])]),
        "plan": asdict(plan),
        **asdict(setting),
        "summaries": [asdict(s) for s in summaries],
        "samples": [asdict(s) for s in samples.values()],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
