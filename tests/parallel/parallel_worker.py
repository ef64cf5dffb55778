"""What each rank of the tensor/pipeline-parallel tests runs, and the parent's side of it.

`run_world` spawns WORLD_SIZE real processes (one thread each) that join a gloo process
group over TCP on 127.0.0.1 and run every layout in LAYOUTS on every model: each rank
builds a ModelRunner with its tensor-parallel group and layer range, and the batch
script in `drive` (two sequences: a fresh and a second prefill chunk, then decodes
through the paged KV cache) runs with hidden states handed between pipeline stages by
dist.send / dist.recv. Each rank saves its parameters, and the last stage its logits, to
files the parent compares with a one-process run of the same script. Whoever starts the
processes stops them: every path through `run_world` joins or kills all of them.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

WORLD_SIZE = 4
PROMPT_A, PROMPT_B = 30, 12
DECODE_STEPS = 4
NUM_BLOCKS, BLOCK_SIZE = 16, 8
TIMEOUT_S = 180


@dataclass(frozen=True, slots=True)
class Layout:
    """Which global ranks run a case: stages[s] lists stage s's tensor-parallel ranks."""

    name: str
    stages: tuple[tuple[int, ...], ...]

    @property
    def tp_size(self) -> int:
        """Ranks per stage."""
        return len(self.stages[0])

    @property
    def pp_size(self) -> int:
        """Pipeline stages."""
        return len(self.stages)


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("tp2", ((0, 1),)),
        Layout("pp2", ((0,), (1,))),
        Layout("tp2pp2", ((0, 1), (2, 3))),
        Layout("tp4", ((0, 1, 2, 3),)),
        Layout("tp3", ((0, 1, 2),)),  # SmolLM2-135M: 9 heads, 3 KV heads
    )
}


@dataclass(slots=True)
class _Seq:
    """The fields of engine.request.Sequence that the runner's input preparation reads."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int = 0
    window_block_tables: list[list[int]] = field(default_factory=list)  # same ids, own pools


@dataclass(slots=True)
class _Item:
    """A ScheduledSequence stand-in: a sequence and how many of its tokens run this step."""

    seq: _Seq
    num_new_tokens: int


@dataclass(slots=True)
class Script:
    """Token ids of the two sequences: prompts, then the tokens fed one per decode step."""

    prompt_a: list[int]
    prompt_b: list[int]
    decode_a: list[int] = field(default_factory=list)
    decode_b: list[int] = field(default_factory=list)


def script(vocab_size: int, seed: int = 0) -> Script:
    """Random token ids from a fixed seed, so every process feeds the same tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (PROMPT_A + PROMPT_B + 2 * DECODE_STEPS,), generator=g)
    ids = ids.tolist()
    a, rest = ids[:PROMPT_A], ids[PROMPT_A:]
    b, rest = rest[:PROMPT_B], rest[PROMPT_B:]
    return Script(a, b, rest[:DECODE_STEPS], rest[DECODE_STEPS:])


def steps(s: Script) -> list[list[tuple[str, int]]]:
    """The batches: (sequence, new tokens). A: a fresh 20-token chunk, then 10 more with
    context in the pool; B: a 12-token prefill, then decodes; both decode at the end."""
    first = PROMPT_A - 10
    plan = [[("a", first), ("b", PROMPT_B)], [("a", 10), ("b", 1)]]
    plan += [[("a", 1), ("b", 1)] for _ in range(DECODE_STEPS - 1)]
    return plan


def drive(runner, s: Script, recv_from: int | None, send_to: int | None) -> list[torch.Tensor]:
    """Run the script through this rank's runner; logits of every row per step (last
    stage), else an empty list. Hidden states come from / go to other ranks by send/recv."""
    import torch.distributed as dist

    blocks_per_seq = NUM_BLOCKS // 2
    tables = {"a": list(range(blocks_per_seq)), "b": list(range(blocks_per_seq, NUM_BLOCKS))}
    windows = len(runner.windows)
    seqs = {
        key: _Seq(list(p), tables[key], window_block_tables=[tables[key]] * windows)
        for key, p in (("a", s.prompt_a), ("b", s.prompt_b))
    }
    fed = {"a": iter(s.decode_a), "b": iter(s.decode_b)}
    out = []
    with torch.inference_mode():
        for step in steps(s):
            for key, n in step:
                seq = seqs[key]
                if seq.num_computed_tokens + n > len(seq.token_ids):
                    seq.token_ids.append(next(fed[key]))
            batch = [_Item(seqs[key], n) for key, n in step]
            ids, positions, meta = runner._prepare_inputs(batch)
            if recv_from is None:
                hidden = runner.model(ids, positions, runner.kv_caches, meta)
            else:
                incoming = torch.empty(len(ids), runner.config.hidden_size)
                dist.recv(incoming, src=recv_from)
                hidden = runner.model(incoming, positions, runner.kv_caches, meta)
            if send_to is not None:
                dist.send(hidden.contiguous(), dst=send_to)
            else:
                out.append(runner.model.compute_logits(hidden))
            for key, n in step:
                seqs[key].num_computed_tokens += n
    return out


def reference(folder: Path | None) -> list[torch.Tensor]:
    """The script's logits in this process, unsplit (the PyTorch path, as the ranks run);
    folder None: the default model."""
    from infire.config import CacheConfig
    from infire.engine.runner import ModelRunner
    from infire.models.loader import load_model

    loaded = load_model(folder, torch.float32)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    runner = ModelRunner(loaded.config, loaded.weights, cache, torch.float32, cpu_kernels=False)
    return drive(runner, script(loaded.config.vocab_size), None, None)


def _rank_main(rank: int, port: int, cases: list[tuple[str, str, str]], out_dir: str) -> None:
    """One rank: join the group, run every (layout, model, folder) case it takes part in,
    save what it holds."""
    import torch.distributed as dist

    from infire.parallel import TensorParallelGroup

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=TIMEOUT_S / 2),
    )  # fmt: skip
    try:
        # every rank creates every group, in the same order (new_group is collective)
        groups = {}
        for layout in LAYOUTS.values():
            for ranks in layout.stages:
                if ranks not in groups:
                    groups[ranks] = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        for name, model, folder in cases:
            layout = LAYOUTS[name]
            stage = next((i for i, r in enumerate(layout.stages) if rank in r), None)
            if stage is not None:
                ranks = layout.stages[stage]
                tp = TensorParallelGroup(ranks.index(rank), len(ranks), groups[ranks])
                _run_case(layout, stage, tp, rank, model, folder, Path(out_dir))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_case(layout, stage, tp, rank, model, folder, out_dir) -> None:  # noqa: ANN001
    from infire.config import CacheConfig
    from infire.engine.runner import ModelRunner
    from infire.models.loader import load_model
    from infire.models.registry import family_named
    from infire.parallel import check_parallel, layer_ranges

    loaded = load_model(folder or None, torch.float32)
    config = loaded.config
    check_parallel(config, layout.tp_size, layout.pp_size)
    layer_range = layer_ranges(config.num_hidden_layers, layout.pp_size)[stage]
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    runner = ModelRunner(config, loaded.weights, cache, torch.float32, tp=tp,
                         layer_range=layer_range)  # fmt: skip
    params = {}
    if folder:  # tiny models: the runner packs its matmul weights for oneDNN, so read what
        # a rank loads from a model that keeps them as they were loaded
        unpacked = family_named(config.architecture).model_class(config, tp, layer_range)
        unpacked.load_weights(loaded.weights)
        params = dict(unpacked.named_parameters())
    tp_rank = tp.rank
    recv_from = layout.stages[stage - 1][tp_rank] if stage > 0 else None
    send_to = layout.stages[stage + 1][tp_rank] if stage + 1 < layout.pp_size else None
    logits = drive(runner, script(config.vocab_size), recv_from, send_to)
    record = {
        "params": params,
        "packed": any(getattr(m, "packed", None) is not None for m in runner.model.modules()),
        "kv_cache_shape": (len(runner.kv_caches), *runner.kv_caches[0].shape),
        "fused_status": runner.fused_status,
        "layer_range": layer_range,
        "tp_rank": tp_rank,
        "logits": logits,
    }  # fmt: skip
    torch.save(record, out_dir / f"{layout.name}-{model}-rank{rank}.pt")


def _entry(rank: int, port: int, cases: list[tuple[str, str, str]], out_dir: str) -> None:
    try:
        _rank_main(rank, port, cases, out_dir)
    except BaseException:
        Path(out_dir, f"error-rank{rank}.txt").write_text(traceback.format_exc())
        raise


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(cases: list[tuple[str, str, Path | None]], out_dir: Path) -> None:
    """Spawn the ranks to run the (layout name, model name, folder; None: the default
    model) cases, wait for all of them (TIMEOUT_S at most) and stop every one that is left
    on any path; raises with the ranks' tracebacks if one failed."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    args = ([(layout, model, str(folder or "")) for layout, model, folder in cases], str(out_dir))
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by the children at start, before torch sets its pools
    procs = [ctx.Process(target=_entry, args=(rank, port, *args), daemon=True)
             for rank in range(WORLD_SIZE)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = sorted(out_dir.glob("error-rank*.txt"))
    codes = [p.exitcode for p in procs]
    if errors or any(code != 0 for code in codes):
        details = "\n".join(e.read_text() for e in errors)
        raise RuntimeError(f"ranks exited with {codes}:\n{details}")
