"""The `infire` command line: generate, chat, serve, compress, verify, inspect, bench serve,
gateway, balance.

Each subcommand imports what it needs when it runs: `infire --help` and `infire gateway`
never import torch, and the gateway's own distribution (infire-gateway, without the
engine) ships this file for its `infire gateway`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from infire.errors import InfireError, InvalidRequestError

if TYPE_CHECKING:
    from infire.catalog.config import Catalog
    from infire.config import EngineConfig
    from infire.engine.engine import LLMEngine
    from infire.sampling_params import SamplingParams


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2G', '1.5GB' (binary units), for argparse."""
    from infire.config import parse_size as config_size

    try:
        return config_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    group.add_argument(
        "--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)"
    )
    group.add_argument(
        "--quantization", default="auto", choices=("auto", "none"),
        help="a quantized GGUF: auto serves its blocks as they are (Q4_K, Q6_K, Q8_0, ...) "
        "on the CPU, tensor/pipeline-parallel ranks included; none dequantizes to --dtype "
        "(default: auto)",
    )  # fmt: skip
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    group.add_argument("--kv-cache-memory", type=parse_size, default="512MiB",
                       help="memory for the paged KV cache (default: 512MiB)")  # fmt: skip
    group.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (default: 16)"
    )
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of one engine step (default: 2048)")  # fmt: skip
    group.add_argument("--max-num-seqs", type=int, default=64,
                       help="most sequences running at once (default: 64)")  # fmt: skip
    group.add_argument(
        "--max-model-len", type=int, help="context length cap (default: the model's)"
    )
    group.add_argument(
        "--no-cpu-kernels", action="store_true",
        help="run every step through PyTorch instead of the fused C forward on CPU",
    )  # fmt: skip
    group.add_argument(
        "--enforce-eager", action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs",
    )  # fmt: skip
    group = parser.add_argument_group("parallelism (torch.distributed: gloo on CPU, NCCL on CUDA)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="ranks that split each layer (default: 1)")  # fmt: skip
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="stages of contiguous layers (default: 1)")  # fmt: skip
    group.add_argument("--nnodes", type=int, default=1,
                       help="hosts the ranks are spread over (default: 1)")  # fmt: skip
    group.add_argument("--node-rank", type=int, default=0,
                       help="this host's index; 0 serves, the others only run ranks")  # fmt: skip
    group.add_argument("--master-addr", default="127.0.0.1",
                       help="address of node 0, where the ranks meet (default: 127.0.0.1)")  # fmt: skip
    group.add_argument("--master-port", type=int, default=0,
                       help="port on node 0 where the ranks meet (default: a free one; "
                       "required with --nnodes > 1)")  # fmt: skip
    group.add_argument("--threads-per-rank", type=int,
                       help="torch threads per rank (default: cores / ranks on this host)")  # fmt: skip


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help=f"default: {max_tokens}")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--seed", type=int, help="sampling seed (same seed, same output)")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    from infire.config import (
        CacheConfig,
        DisaggConfig,
        EngineConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        cpu_kernels=not args.no_cpu_kernels,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len
        ),
        parallel=ParallelConfig(
            args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes,
            args.node_rank, args.master_addr, args.master_port, args.threads_per_rank,
        ),
        disagg=DisaggConfig(
            role=getattr(args, "role", "both"), kv_host=getattr(args, "kv_host", "127.0.0.1"),
            lease_seconds=getattr(args, "kv_lease_timeout", 30.0),
            kv_protocol=getattr(args, "kv_protocol", "tcp"),
            secret=getattr(args, "kv_secret", None) or os.environ.get("INFIRE_KV_SECRET"),
        ),
    )  # fmt: skip


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from infire.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )


def _load(args: argparse.Namespace) -> LLMEngine:
    from infire.engine.engine import LLMEngine

    start = time.perf_counter()
    print(f"infire: loading {args.model or 'the default model (SmolLM2-135M-Instruct)'}",
          file=sys.stderr)  # fmt: skip
    engine = LLMEngine(_engine_config(args))
    print(
        f"infire: ready in {time.perf_counter() - start:.1f}s "
        f"({engine.model_info.architecture}, {engine.dtype}, "
        f"{engine.model_info.num_kv_tokens} KV tokens of "
        f"{engine.model_info.kv_bytes_per_token} bytes, "
        f"CPU kernels {engine.model_info.fused_status})",
        file=sys.stderr,
    )
    return engine


def _stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Text deltas of one request as the engine produces them."""
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            yield "".join(choice.text for choice in delta.choices)


def cmd_generate(args: argparse.Namespace) -> int:
    """Complete one prompt, streaming the text to stdout."""
    if (status := worker_only(args)) is not None:
        return status
    engine = _load(args)
    try:
        return _generate(engine, args)
    finally:
        engine.shutdown()


def _generate(engine: LLMEngine, args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    sys.stdout.write("" if args.chat else args.prompt)
    for delta in _stream(engine, prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat with the model's chat template; the answer streams as it comes."""
    if (status := worker_only(args)) is not None:
        return status
    engine = _load(args)
    try:
        return _chat(engine, args)
    finally:
        engine.shutdown()


def _chat(engine: LLMEngine, args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("infire chat: type a message, /reset to start over, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() == "/reset":
            del messages[int(bool(args.system)) :]
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        for delta in _stream(engine, engine.tokenizer.encode_chat(messages), params):
            reply += delta
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def worker_only(args: argparse.Namespace) -> int | None:
    """On a host other than node 0, or as a torchrun rank other than 0: run the ranks
    here until rank 0 stops them (their exit status); None on rank 0."""
    from infire.config import resolve_dtype
    from infire.engine import worker

    config = _engine_config(args)
    if os.environ.get("RANK", "0") != "0":  # started by torchrun
        dtype = resolve_dtype(config.dtype, config.device)
        return worker.run_rank(config, dtype, int(os.environ["RANK"]))
    if args.node_rank == 0:
        return None
    parallel = config.parallel
    print(f"infire: node {parallel.node_rank}: running its ranks, waiting for node 0 at "
          f"{parallel.master_addr}:{parallel.master_port}", file=sys.stderr)  # fmt: skip
    return worker.run_node_ranks(config)


def _catalog(args: argparse.Namespace) -> Catalog:
    """`--catalog FILE`, `--model PATH` as a catalog of one, or the default catalog."""
    from infire.catalog.config import default_catalog, load_catalog, one_model_catalog
    from infire.engine.encoder import encoder_task
    from infire.server.catalog import ENCODER_TASKS

    if args.catalog and args.model:
        raise ValueError("give --catalog or --model, not both")
    if args.served_model_name and not args.model:
        raise ValueError("--served-model-name names the --model; a catalog names its models")
    if args.catalog:
        return load_catalog(args.catalog)
    if args.model:
        from infire.models.whisper import is_whisper_folder

        task = ENCODER_TASKS.get(encoder_task(args.model) or "", "text-generation")
        if Path(args.model).is_dir() and is_whisper_folder(Path(args.model)):
            task = "automatic-speech-recognition"
        return one_model_catalog(args.model, task, args.served_model_name)
    return default_catalog()


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from infire.server import ServerConfig, create_app
    from infire.server.app import default_memory_budget

    if (status := worker_only(args)) is not None:
        return status
    engine_config = _engine_config(args)
    if engine_config.parallel.world_size > 1:  # refuse a model that cannot be cut, now
        import torch

        from infire.models.loader import load_model
        from infire.models.registry import check_split

        parallel = engine_config.parallel
        model_config = load_model(args.model, torch.float32).config  # weights are not read
        check_split(model_config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.no_access_log:
        logging.getLogger("infire.access").setLevel(logging.WARNING)
    if engine_config.disagg.role == "decode" and not engine_config.disagg.secret:
        print("infire: warning: --role decode without --kv-secret takes KV handles from "
              "anyone who reaches it; set the same secret on the prefill and decode workers",
              file=sys.stderr)  # fmt: skip
    config = ServerConfig(
        catalog=_catalog(args),
        memory_budget=args.memory_budget or default_memory_budget(),
        api_key=args.api_key or os.environ.get("INFIRE_API_KEY"),
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        max_audio_bytes=args.max_audio_bytes,
        max_audio_seconds=args.max_audio_seconds,
        engine_in_process=args.engine_in_process,
        evict_hold_s=args.evict_hold,
    )
    died: list[str] = []

    def engine_dead(reason: str) -> None:
        # Open requests have their error; stop taking new ones and exit non-zero, so that
        # a supervisor (systemd, Kubernetes, a balancer) restarts or replaces the server.
        died.append(reason)
        server.should_exit = True

    app = create_app(engine_config, config, on_engine_dead=engine_dead)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=5,
    ))  # fmt: skip
    names = ", ".join(e.name for e in config.catalog.entries)
    print(f"infire: serving {names} on http://{args.host}:{args.port} within "
          f"{config.memory_budget / 2**30:.1f} GiB (pinned models load in the background, "
          "the others on their first request; GET /health answers 200 once the pinned "
          "ones are ready)", file=sys.stderr)  # fmt: skip
    server.run()
    if died:
        print(f"infire: the engine died ({died[0]}); exiting", file=sys.stderr)
        return 1
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from infire.gateway import create_app, load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.no_access_log:
        logging.getLogger("infire.gateway.access").setLevel(logging.WARNING)
    config = load_config(Path(args.config))
    app = create_app(config)
    reads = "need the admin token" if config.admin_sha256 else "are open to anyone"
    print(f"infire gateway: {len(config.providers)} providers, gateways "
          f"{', '.join(config.gateways)}, log {config.store}, on http://{args.host}:{args.port}; "
          f"logs, analytics and metrics {reads}", file=sys.stderr)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def cmd_balance(args: argparse.Namespace) -> int:
    import uvicorn

    from infire.disagg.balancer import BalancerConfig, create_app

    if not (args.prefill and args.decode) and not args.both:
        raise ValueError("give --prefill and --decode workers (and/or --both ones)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per load poll
    config = BalancerConfig(args.prefill, args.decode, args.both,
                            args.api_key or os.environ.get("INFIRE_API_KEY"))  # fmt: skip
    print(f"infire balance: {len(args.prefill)} prefill, {len(args.decode)} decode and "
          f"{len(args.both)} colocated workers, on http://{args.host}:{args.port} (GET /health "
          "answers 200 once a prefill and a decode worker, or a colocated one, are up)",
          file=sys.stderr)  # fmt: skip
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning",
                access_log=False)  # fmt: skip
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Load-test an OpenAI-compatible server, or plot saved results side by side."""
    import json

    from infire.bench import plot
    from infire.bench import serve as bench

    if args.compare:
        results = []
        for name in args.compare:
            try:
                results.append(json.loads(Path(name).read_text()))
            except (OSError, ValueError) as e:
                raise InvalidRequestError(f"{name}: not a bench result file: {e}") from None
        out = plot.plot_compare(results, Path(args.output or "bench-serve-compare.png"))
        print(f"infire: wrote {out}", file=sys.stderr)
        return 0
    goodput = bench.parse_goodput(args.goodput or [])
    model = args.model or _served_model(args.base_url, args.api_key)
    total = args.num_prompts + args.num_warmups
    if args.dataset == "random":
        from infire.models.loader import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        prompts = bench.random_prompts(tokenizer, total, args.input_len, args.seed)
        counts = [len(tokenizer.encode(p)) for p in prompts[args.num_warmups :]]
    else:
        prompts, counts = bench.file_prompts(Path(args.dataset), total), []
    config = bench.BenchConfig(
        base_url=args.base_url, model=model, prompts=prompts[args.num_warmups :],
        warmup_prompts=prompts[: args.num_warmups], prompt_tokens=counts,
        output_len=args.output_len,
        endpoint=args.endpoint, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature, api_key=args.api_key, goodput=goodput,
        label=args.label or model, seed=args.seed,
    )  # fmt: skip
    result = bench.run(config)
    print(bench.report(result))
    load = f"c{args.max_concurrency}" if args.max_concurrency else f"r{args.request_rate:g}"
    name = re.sub(r"[^\w.-]+", "_", config.label)
    out = Path(args.output or f"bench-serve-{name}-{load}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"infire: wrote {out}", file=sys.stderr)
    if not args.no_plot:
        print(f"infire: wrote {plot.plot_run(result, out.with_suffix('.png'))}", file=sys.stderr)
    return 0 if result["summary"]["completed"] else 1


def _served_model(base_url: str, api_key: str | None) -> str:
    """The first model id the server lists."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"cannot reach {base_url}: {e}") from None
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise InvalidRequestError(
            f"GET {base_url}/models answered {response.status_code} without a model "
            f"({response.text[:200]!r}); name one with --model"
        ) from None


def _add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="the server's OpenAI base URL (default: http://127.0.0.1:8000/v1)",
    )
    parser.add_argument("--model", help="model id to request (default: the first in /models)")
    parser.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/completions or /chat/completions (default: completions)",
    )
    parser.add_argument(
        "--dataset",
        default="random",
        help="'random' (random words, --input-len tokens) or a prompt file: "
        'one prompt a line, or .jsonl with a "prompt" field',
    )
    parser.add_argument(
        "--tokenizer",
        help="model folder or GGUF whose vocabulary random "
        "prompts use (default: the default model)",
    )
    parser.add_argument("--input-len", type=int, default=128, help="default: 128")
    parser.add_argument(
        "--output-len", type=int, default=128, help="max_tokens of each request (default: 128)"
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="default: 64")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: inf, all at once)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, help="most requests in flight (default: unlimited)"
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=1,
        help="requests sent first and not counted (default: 1)",
    )
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: ignore_eos, exact lengths)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="Bearer token (default: $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (ttft, tpot, e2el)",
    )
    parser.add_argument("--label", help="name of this run in reports (default: the model id)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")
    parser.add_argument(
        "--output",
        help="result JSON (a PNG beside it); with --compare the "
        "PNG (default: bench-serve-LABEL-LOAD.json / bench-serve-compare.png)",
    )
    parser.add_argument("--no-plot", action="store_true", help="no PNG")
    parser.add_argument("--compare", nargs="+", metavar="RESULT.json",
                        help="plot saved results side by side instead of running")  # fmt: skip


def cmd_compress(args: argparse.Namespace) -> int:
    """Compress a model folder or GGUF into an Unweight folder."""

    from infire.unweight.container import compress_model

    def report(line: str) -> None:
        print(f"infire: {line}", file=sys.stderr)

    compress_model(Path(args.src), Path(args.dst), args.form, args.tensors, report=report)
    print(f"infire: wrote {args.dst}", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Decode every tensor of an Unweight folder and check it bit for bit."""

    from infire.unweight.container import verify

    problems = verify(Path(args.dst), Path(args.against) if args.against else None)
    for problem in problems:
        print(f"infire: {problem}", file=sys.stderr)
    if problems:
        print(f"infire: {args.dst}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    against = f" and equal to {args.against}" if args.against else ""
    print(f"infire: {args.dst}: every tensor decodes to its recorded SHA-256{against}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Per-tensor and total sizes of an Unweight folder; a GGUF file's tensor types and the
    memory its weights take served."""
    if Path(args.path).is_file():
        return _inspect_gguf(Path(args.path))
    from infire.unweight.container import inspect_rows, load

    rows = list(inspect_rows(load(Path(args.path))))
    print(f"{'tensor':<52} {'form':<8} {'dtype':<9} {'bits/w':>7} {'ratio':>7} {'bound':>7} "
          f"{'palette':>8} {'verbatim':>8}")  # fmt: skip

    def opt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        print(f"{r['name'][:52]:<52} {r['form']:<8} {r['dtype']:<9} {r['bits_per_weight']:7.3f} "
              f"{r['ratio']:7.4f} {opt(r['bound_bits_per_weight'], '7.3f'):>7} "
              f"{opt(r['palette_coverage'], '8.4%'):>8} {opt(r['verbatim_row_share'], '8.4%'):>8}")  # fmt: skip
    size = sum(r["bytes"] for r in rows)
    original = sum(r["original_bytes"] for r in rows)
    weights = sum(r["weights"] for r in rows)
    bound = [r for r in rows if r["bound_bits_per_weight"] is not None]
    bound_bytes = sum(r["bound_bits_per_weight"] * r["weights"] / 8 for r in bound)
    bound_original = sum(r["original_bytes"] for r in bound)
    print(f"total: {len(rows)} tensors, {weights} weights, {original / 1e6:.1f} MB -> "
          f"{size / 1e6:.1f} MB, {size * 8 / max(1, weights):.3f} bits/weight, ratio "
          f"{size / max(1, original):.4f}; exponent-entropy bound of the coded tensors "
          f"{bound_bytes / max(1, bound_original):.4f}")  # fmt: skip
    return 0


def _inspect_gguf(path: Path) -> int:
    import torch

    from infire.errors import InfireError
    from infire.models.loader import load_model, weight_bytes

    try:
        loaded = load_model(path, torch.bfloat16)  # headers and metadata only
    except InfireError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{'type':<8} {'tensors':>8} {'weights':>14} {'MB':>10} {'bits/w':>7}")
    for kind, count, weights, size in loaded.weights.type_counts():
        print(f"{kind:<8} {count:8d} {weights:14d} {size / 1e6:10.1f} {size * 8 / weights:7.3f}")
    blocks = weight_bytes(loaded, torch.bfloat16, "auto")
    plain = weight_bytes(loaded, torch.bfloat16, "none")
    print(f"resident weights: {blocks / 1e6:.1f} MB served as GGUF blocks (--quantization "
          f"auto, one rank), {plain / 1e6:.1f} MB dequantized to bfloat16; add the KV cache "
          f"(--kv-cache-memory)")  # fmt: skip
    return 0


def cmd_transcribe(args: argparse.Namespace) -> int:
    """A recording to text or subtitles on stdout; progress on stderr."""
    import json

    from infire.audio import decode_audio
    from infire.models.whisper import load_whisper, whisper_base_path
    from infire.models.whisper_tokenizer import LANGUAGES, WhisperTokenizer
    from infire.server.speech import subtitles
    from infire.speech import TranscribeOptions, transcribe

    folder = Path(args.model) if args.model else whisper_base_path()
    whisper = load_whisper(folder, args.dtype)
    tokenizer = WhisperTokenizer(folder / "tokenizer.json")
    samples = decode_audio(Path(args.file))
    options = TranscribeOptions(task=args.task, language=args.language, beam_size=args.beam_size,
                                word_timestamps=args.word_timestamps, vad_filter=args.vad_filter)  # fmt: skip
    bar = None
    if samples.size / 16000 > 30 and sys.stderr.isatty() or args.progress:
        from tqdm import tqdm

        bar = tqdm(total=round(samples.size / 16000, 1), unit="s", file=sys.stderr, desc="audio")

    def progress(done: float, total: float) -> None:
        if bar is not None:
            bar.update(round(done - bar.n, 1))

    result = transcribe(whisper, tokenizer, samples, options, progress)
    if bar is not None:
        bar.close()
    if args.format == "text":
        print(result.text.strip())
    elif args.format in ("srt", "vtt"):
        print(subtitles(result, args.format), end="")
    else:
        print(json.dumps({
            "text": result.text.strip(), "language": LANGUAGES.get(result.language, result.language),
            "duration": round(result.duration, 2),
            "segments": [{"start": s.start, "end": s.end, "text": s.text.strip(),
                          **({"words": [{"word": w.word.strip(), "start": w.start, "end": w.end}
                                        for w in s.words]} if args.word_timestamps else {})}
                         for s in result.segments],
        }, ensure_ascii=False, indent=2))  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `infire` command."""
    parser = argparse.ArgumentParser(prog="infire", description="LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete a prompt and print the result")
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the chat template"
    )
    _add_engine_args(generate)
    _add_sampling_args(generate, max_tokens=64)
    generate.set_defaults(func=cmd_generate)
    chat = commands.add_parser("chat", help="interactive chat on the terminal")
    chat.add_argument("--system", help="system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)
    serve = commands.add_parser("serve", help="OpenAI- and Workers-AI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /ai "
                       "(default: $INFIRE_API_KEY, else no key)")  # fmt: skip
    serve.add_argument(
        "--served-model-name", help="with --model: its id in the API (default: file or folder name)"
    )
    group = serve.add_argument_group("catalog (docs/catalog.md)")
    group.add_argument("--catalog", help="catalog.toml: the models to serve, loaded on demand "
                       "(default: --model alone, else SmolLM2-135M-Instruct for chat and "
                       "all-MiniLM-L6-v2 for embeddings)")  # fmt: skip
    group.add_argument("--memory-budget", type=parse_size,
                       help="bytes every loaded model's processes may take together (weights, "
                       "KV, runtime); models beyond it are evicted when idle, else requests "
                       "get 429 (default: 80%% of the memory available at startup)")  # fmt: skip
    group.add_argument("--evict-hold", type=float, default=0.5,
                       help="seconds after its load during which a model is not evicted; a "
                       "request that needs its room waits (hysteresis against thrash; "
                       "default: 0.5)")  # fmt: skip
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="answer 429 while this many sequences wait (default: 256)")  # fmt: skip
    serve.add_argument("--max-body-bytes", type=parse_size, default="4MiB",
                       help="largest request body, else 413 (default: 4MiB)")  # fmt: skip
    serve.add_argument("--max-audio-bytes", type=parse_size, default="25MiB",
                       help="largest body of /v1/audio/* and /ai/run/* (audio uploads), else 413 "
                       "(default: 25MiB, OpenAI's)")  # fmt: skip
    serve.add_argument("--max-audio-seconds", type=float, default=3600.0,
                       help="longest audio a speech request may send, else 413 (default: 3600)")  # fmt: skip
    serve.add_argument("--no-access-log", action="store_true", help="no JSON line per request")
    serve.add_argument(
        "--engine-in-process", action="store_true",
        help="run each model's engine in threads of the server process instead of its own "
        "process (default: its own process; if a pinned model's dies, the server exits "
        "with status 1)",
    )  # fmt: skip
    group = serve.add_argument_group("disaggregation (docs/disaggregation.md)")
    group.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                       help="both: a whole engine; prefill: run prompts and lease their KV "
                       "to decode workers; decode: pull the KV and decode (default: both)")  # fmt: skip
    group.add_argument("--kv-host", default="127.0.0.1",
                       help="address peers reach this worker's KV transfer engine at "
                       "(default: 127.0.0.1)")  # fmt: skip
    group.add_argument("--kv-protocol", choices=("tcp", "rdma"), default="tcp",
                       help="Mooncake transport: tcp, or rdma with its CUDA build "
                       "(mooncake-transfer-engine) and RDMA NICs (default: tcp)")  # fmt: skip
    group.add_argument("--kv-secret",
                       help="shared by a deployment's prefill and decode workers: handles "
                       "are signed with it, and a decode worker takes no other (default: "
                       "$INFIRE_KV_SECRET; without one, any client that reaches a decode "
                       "worker can hand it KV)")  # fmt: skip
    group.add_argument("--kv-lease-timeout", type=float, default=30.0,
                       help="seconds a prefill worker holds KV blocks for a decode worker "
                       "that has not released them (default: 30)")  # fmt: skip
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    compress = commands.add_parser(
        "compress", help="Unweight: compress a model's weights losslessly into a folder"
    )
    compress.add_argument("src", help="HF model folder or .gguf file (GGUF: dequantized to bf16), "
                          "or a Whisper folder (Hugging Face or CTranslate2)")  # fmt: skip
    compress.add_argument("dst", help="new folder (must not exist or be empty)")
    compress.add_argument("--form", choices=("rans", "palette"), default="rans",
                          help="rans: smallest (decoded at load); palette: 12 bits per "
                          "BF16 weight (default: rans)")  # fmt: skip
    compress.add_argument("--tensors", choices=("all", "linear", "mlp"), default="all",
                          help="which tensors to compress; the others are stored as they are "
                          "(default: all)")  # fmt: skip
    compress.set_defaults(func=cmd_compress)
    verify = commands.add_parser("verify", help="Unweight: check a compressed folder bit for bit")
    verify.add_argument("dst", help="compressed folder")
    verify.add_argument("--against", help="the original folder or GGUF to compare with")
    verify.set_defaults(func=cmd_verify)
    inspect = commands.add_parser(
        "inspect",
        help="Unweight: sizes, ratios and entropy bounds per tensor; GGUF: tensor "
        "types and resident size",
    )
    inspect.add_argument("path", help="compressed folder, or a .gguf file")
    inspect.set_defaults(func=cmd_inspect)
    speech = commands.add_parser("transcribe", help="speech to text with Whisper (a file: any "
                                 "format FFmpeg reads)")  # fmt: skip
    speech.add_argument("file", help="the recording")
    speech.add_argument("--model", help="a Whisper folder (Hugging Face or CTranslate2; "
                        "default: the installed Whisper base)")  # fmt: skip
    speech.add_argument("--language", help="ISO 639-1 code (default: detected)")
    speech.add_argument("--task", choices=["transcribe", "translate"], default="transcribe",
                        help="translate: into English (default: transcribe)")  # fmt: skip
    speech.add_argument("--format", choices=["text", "srt", "vtt", "json"], default="text",
                        help="output (default: text)")  # fmt: skip
    speech.add_argument("--beam-size", type=int, default=1, help="1: greedy (default), else beams")
    speech.add_argument("--word-timestamps", action="store_true", help="words' times in json")
    speech.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="auto, bfloat16: the decoder's linears in bf16 through the CPU "
                        "kernel; float32: PyTorch float32 throughout (default: auto)")  # fmt: skip
    speech.add_argument("--vad-filter", action="store_true",
                        help="decode the speech only (webrtcvad; the recording's times kept)")  # fmt: skip
    speech.add_argument("--progress", action="store_true",
                        help="a progress bar on stderr (default: for files over 30 s on a terminal)")  # fmt: skip
    speech.set_defaults(func=cmd_transcribe)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True
    )
    bench_serve = bench.add_parser(
        "serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, goodput)"
    )
    _add_bench_args(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    gateway = commands.add_parser(
        "gateway", help="AI gateway: one endpoint in front of many providers (gateway.toml)"
    )
    gateway.add_argument("--config", required=True, help="the gateway.toml to serve")
    gateway.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    gateway.add_argument("--port", type=int, default=8787, help="port (default: 8787)")
    gateway.add_argument("--no-access-log", action="store_true",
                         help="no JSON line per request on stderr (the SQLite log keeps them)")  # fmt: skip
    gateway.set_defaults(func=cmd_gateway)
    balance = commands.add_parser(
        "balance", help="one OpenAI / Workers AI front over prefill and decode workers"
    )
    balance.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                         help="prefill workers (infire serve --role prefill)")  # fmt: skip
    balance.add_argument("--decode", nargs="+", default=[], metavar="URL",
                         help="decode workers (infire serve --role decode)")  # fmt: skip
    balance.add_argument("--both", nargs="+", default=[], metavar="URL",
                         help="colocated workers (--role both): requests fall back to them")  # fmt: skip
    balance.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    balance.add_argument("--port", type=int, default=8100, help="port (default: 8100)")
    balance.add_argument("--api-key", help="sent to the workers as 'Authorization: Bearer KEY' "
                         "(default: $INFIRE_API_KEY; else the client's own header)")  # fmt: skip
    balance.set_defaults(func=cmd_balance)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `infire` console script."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # in the try: parsing sizes imports the engine config
        return args.func(args)
    except (InfireError, ValueError) as e:  # ValueError: a config's own checks
        print(f"infire: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if importlib.util.find_spec("infire.engine") is not None:
            raise  # a full install missing a module: the traceback says which
        print(f"infire: error: this command needs the engine, which this install "
              f"(infire-gateway: the gateway alone) does not have ({e.name} is missing); "
              "pip install infire for every command", file=sys.stderr)  # fmt: skip
        return 2


if __name__ == "__main__":
    sys.exit(main())
