"""Resident memory of loading a model: peak against final, and per rank under TP / PP.

Every measurement runs in a fresh process (multiprocessing spawn), so its memory is its
own: `base` is the resident set after the imports and after opening the model (config,
tokenizer, a lazy weight source), `final` after ModelRunner has built and loaded its
part of the model, `peak` the high-water mark (VmHWM) over all of it. Table 1 loads the
whole model in one process, with and without the fused CPU forward (which keeps its own
tiled copy of the weights in float32). Table 2 starts T x P ranks that join a gloo group
on 127.0.0.1, each loading its tensor-parallel slice of its pipeline stage's layers;
"weights" is what the rank's modules hold (oneDNN-packed matmuls included). The KV pool
is kept at 16 blocks so that weights dominate; every rank of table 2 runs the PyTorch
path (as sharded ranks do), 1x1 included, so the rows compare.

    python benchmarks/bench_load_memory.py [--model PATH] [--dtype float32]
        [--layouts 1x1 1x2 3x1 3x2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
from typing import Any

MB = 1024**2
NUM_BLOCKS = 16


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _held_bytes(model: Any) -> int:
    """Bytes of every parameter and packed matmul weight of the model (each storage once)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = [getattr(m, "packed", None) for m in model.modules()]
    return total + sum(p.numel() * p.element_size() for p in packed if p is not None)


def _load(model: str | None, dtype_name: str, cpu_kernels: bool, tp: Any = None,
          stage: tuple[int, int] = (0, 1)) -> dict:  # fmt: skip
    """Open the model, build this process's runner (pipeline stage `stage` = (index, count)),
    and measure (runs in the child)."""
    import gc

    import torch

    from infire.config import CacheConfig
    from infire.engine.runner import ModelRunner
    from infire.models.loader import load_model
    from infire.parallel import SINGLE, layer_ranges

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    loaded = load_model(model, dtype)
    layer_range = layer_ranges(loaded.config.num_hidden_layers, stage[1])[stage[0]]
    gc.collect()
    base, opened_peak = _status("VmRSS"), _status("VmHWM")
    runner = ModelRunner(
        loaded.config, loaded.weights, CacheConfig(num_blocks=NUM_BLOCKS), dtype,
        cpu_kernels=cpu_kernels, tp=tp or SINGLE, layer_range=layer_range,
    )  # fmt: skip
    full_bytes = sum(
        torch.Size(loaded.weights.shape(n)).numel() * dtype.itemsize for n in loaded.weights
    )
    del loaded
    gc.collect()
    fused = runner.fused.weight_bytes if runner.fused is not None else 0
    return {
        "base": base, "opened_peak": opened_peak, "final": _status("VmRSS"),
        "peak": _status("VmHWM"),
        "weights": _held_bytes(runner.model) + fused, "full_weights": full_bytes,
        "kv": runner.kv_cache.numel() * runner.kv_cache.element_size(),
        "fused": runner.fused_status, "layers": layer_range,
    }  # fmt: skip


def _single(queue: Any, model: str | None, dtype: str, cpu_kernels: bool) -> None:
    queue.put(_load(model, dtype, cpu_kernels))


def _rank(queue: Any, rank: int, tp_size: int, pp_size: int, port: int, model: str | None,
          dtype: str) -> None:  # fmt: skip
    import torch.distributed as dist

    from infire.parallel import TensorParallelGroup

    world = tp_size * pp_size
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        stages = [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(pp_size)]
        groups = [dist.new_group(ranks) if tp_size > 1 else None for ranks in stages]
        stage, tp_rank = divmod(rank, tp_size)
        tp = TensorParallelGroup(tp_rank, tp_size, groups[stage])
        result = _load(model, dtype, False, tp, (stage, pp_size))
        queue.put({"rank": rank, "stage": stage, "tp_rank": tp_rank, **result})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(ctx: Any, targets: list[tuple], timeout: float = 600) -> list[dict]:
    """Start one process per (target, args), collect one result from each, stop them all."""
    queue = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(queue, *args), daemon=True) for fn, *args in targets]
    try:
        for p in procs:
            p.start()
        results = [queue.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def main() -> None:
    """Run both tables and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x2", "3x1", "3x2"],
                        help="TxP: tensor x pipeline parallel sizes")  # fmt: skip
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")

    print(f"## Loading in one process ({args.model or 'SmolLM2-135M'}, {args.dtype})\n")
    print(
        "| path | base MB | final MB | peak MB | peak / final | (peak - base) / (final - base)"
        " | weights held MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for cpu_kernels in (True, False):
        (r,) = _run(ctx, [(_single, args.model, args.dtype, cpu_kernels)])
        name = "fused CPU forward" if r["fused"] == "active" else f"PyTorch ({r['fused']})"
        grown = (r["peak"] - r["base"]) / (r["final"] - r["base"])
        print(
            f"| {name} | {r['base'] / MB:.0f} | {r['final'] / MB:.0f} | {r['peak'] / MB:.0f} "
            f"| {r['peak'] / r['final']:.2f} | {grown:.2f} | {r['weights'] / MB:.0f} |"
        )

    print(
        f"\n## Per rank ({args.model or 'SmolLM2-135M'}, {args.dtype}, PyTorch path on every "
        f"rank, KV pool {NUM_BLOCKS} blocks)\n"
    )
    print(
        "| TxP | rank | stage | layers | weights MB | share of all | 1/(T*P) | KV MB "
        "| final RSS MB | peak RSS MB | peak / final |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        tp_size, pp_size = (int(x) for x in layout.split("x"))
        port = _free_port()
        targets = [(_rank, rank, tp_size, pp_size, port, args.model, args.dtype)
                   for rank in range(tp_size * pp_size)]  # fmt: skip
        for r in sorted(_run(ctx, targets), key=lambda r: r["rank"]):
            start, end = r["layers"]
            print(
                f"| {layout} | {r['rank']} | {r['stage']} | {start}-{end - 1} "
                f"| {r['weights'] / MB:.0f} | {r['weights'] / r['full_weights']:.3f} "
                f"| {1 / (tp_size * pp_size):.3f} | {r['kv'] / MB:.1f} "
                f"| {r['final'] / MB:.0f} | {r['peak'] / MB:.0f} "
                f"| {r['peak'] / r['final']:.2f} |"
            )


if __name__ == "__main__":
    main()
