"""Executors: how the engine core runs a scheduled batch, on one rank or on T x P ranks.

UniprocExecutor is the ModelRunner itself. MultiprocExecutor makes the engine core rank 0
of a torch.distributed group (gloo on CPU, NCCL on CUDA) of tensor_parallel_size x
pipeline_parallel_size ranks: rank r is pipeline stage r // T, tensor shard r % T. Each
step the core sends every rank a StepInput (new sequences, then per scheduled sequence only
its new token ids and block ids; msgpack over point-to-point sends, never pickle); every
rank keeps its own mirror of the running sequences (token history, block table, seeded
generator, penalty rows), so nothing is rebuilt per step. A stage hands its hidden states
to the next stage; the last stage's first tensor shard samples and sends the tokens back.
With P > 1 the engine keeps P micro-batches in flight (disjoint sequences), so while a
later stage computes one batch the earlier stages already compute the next.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from infire.config import EngineConfig, ParallelConfig
from infire.engine.link import stop_processes
from infire.engine.messages import (
    Message,
    NewSequence,
    SampledTokens,
    ScheduledItem,
    Shutdown,
    StepInput,
    decode,
    encode,
)
from infire.engine.request import Sequence
from infire.engine.runner import ModelRunner, StepResult
from infire.engine.scheduler import ScheduledSequence
from infire.engine.structured import token_bitmask
from infire.layers.sampler import SamplerOutput
from infire.models.loader import LoadedModel, gguf_blocks, load_model
from infire.models.registry import check_split
from infire.parallel import TensorParallelGroup, layer_ranges

logger = logging.getLogger("infire.engine.executor")

TAG_STEP, TAG_HIDDEN, TAG_SAMPLED = 1, 2, 3
# A rank waits this long for the others at startup and in a collective before it fails;
# a rank that dies is noticed at once (its peers' sockets close), not after this.
DIST_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a rank sits: its pipeline stage and tensor shard."""

    rank: int
    tp_size: int
    pp_size: int

    @property
    def stage(self) -> int:
        """Pipeline stage."""
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        """Tensor-parallel shard within the stage."""
        return self.rank % self.tp_size

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank's stage computes logits."""
        return self.stage == self.pp_size - 1

    @property
    def sampling_rank(self) -> int:
        """The rank that samples: the last stage's first shard."""
        return (self.pp_size - 1) * self.tp_size


def init_rank(parallel: ParallelConfig, rank: int, device: str) -> tuple[TensorParallelGroup, Any]:
    """Join the process group as `rank`: this rank's tensor-parallel group, and the group
    that carries messages (None: the default group; a gloo group beside NCCL, since NCCL
    moves GPU tensors only)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:  # torchrun's rendezvous
        dist.init_process_group(backend, timeout=DIST_TIMEOUT)
    else:
        init = f"tcp://{parallel.master_addr}:{parallel.master_port}"
        dist.init_process_group(
            backend, init_method=init, rank=rank, world_size=parallel.world_size,
            timeout=DIST_TIMEOUT,
        )  # fmt: skip
    tp = parallel.tensor_parallel_size
    # Every rank creates every stage's group, in the same order (torch.distributed's rule).
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(parallel.pipeline_parallel_size)]  # fmt: skip
    place = RankPlace(rank, tp, parallel.pipeline_parallel_size)
    messages = dist.new_group(backend="gloo") if backend == "nccl" else None
    return TensorParallelGroup(place.tp_rank, tp, groups[place.stage] if tp > 1 else None), messages


def build_rank_runner(
    config: EngineConfig, dtype: torch.dtype, rank: int, loaded: LoadedModel | None = None
) -> tuple[ModelRunner, LoadedModel, Any]:
    """Join the group and load this rank's shard of the model (only its slice is read)
    and its KV share; the runner, the model's config, tokenizer and name, and the group
    messages go through."""
    parallel = config.parallel
    place = RankPlace(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    loaded = loaded or load_model(config.model, dtype)  # weights are read lazily, below
    check_split(loaded.config, place.tp_size, place.pp_size)
    device = config.device
    if device == "cuda":  # one GPU per local rank
        device = f"cuda:{rank % (parallel.world_size // parallel.nnodes)}"
        torch.cuda.set_device(device)
    config = dataclasses.replace(config, device=device)
    tp, messages = init_rank(parallel, rank, config.device)
    stage_range = layer_ranges(loaded.config.num_hidden_layers, place.pp_size)[place.stage]
    runner = ModelRunner(
        loaded.config, loaded.weights, config.cache, dtype, config.device, config.seed,
        config.cpu_kernels, palette=loaded.palette, tp=tp, layer_range=stage_range,
        blocks=gguf_blocks(loaded, config.quantization), scheduler_config=config.scheduler,
        enforce_eager=config.enforce_eager,
    )  # fmt: skip
    return runner, loaded, messages


# --- bytes and tensors between ranks --------------------------------------------------------


def send_message(message: Message, dst: int, tag: int, group: Any = None) -> list:
    """Start sending a message (length, then msgpack bytes); the works to wait on."""
    payload = torch.frombuffer(bytearray(encode(message)), dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    sends = [dist.isend(t, dst, group=group, tag=tag) for t in (length, payload)]
    return [*sends, payload, length]


def recv_message(src: int, tag: int, group: Any = None) -> Message:
    """Receive one message sent by send_message."""
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src, group=group, tag=tag)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group, tag=tag)
    return decode(payload.numpy().tobytes())


def wait_all(works: Iterable) -> None:
    """Wait for the sends started by send_message (tensors in the list are kept alive)."""
    for work in works:
        if isinstance(work, dist.Work):
            work.wait()


def sampled_message(step_id: int, out: SamplerOutput) -> SampledTokens:
    """A SamplerOutput as a message."""
    return SampledTokens(step_id, out.token_ids, out.sampled_logprobs, out.sampled_ranks,
                         out.top_token_ids, out.top_logprobs)  # fmt: skip


def sampler_output(message: SampledTokens) -> SamplerOutput:
    """The SamplerOutput a SampledTokens carries."""
    return SamplerOutput(message.token_ids, message.sampled_logprobs, message.sampled_ranks,
                         message.top_token_ids, message.top_logprobs)  # fmt: skip


# --- the two executors ----------------------------------------------------------------------


class UniprocExecutor:
    """One rank: the runner runs the batch at once (submit) and wait hands the result over."""

    pipeline_depth = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_blocks = runner.num_blocks
        self.fused_status = runner.fused_status

    def submit(self, batch: list[ScheduledSequence]) -> StepResult:
        """Run the batch now."""
        return self.runner.execute(batch) if batch else StepResult([], None)

    def preempted(self, seqs: list[Sequence]) -> None:
        """Nothing to tell: the runner reads the sequences themselves."""

    def wait(self, handle: StepResult) -> StepResult:
        """The submitted batch's result."""
        return handle

    def release(self, seq_ids: list[int]) -> None:
        """Forget finished sequences' sampling state."""
        for seq_id in seq_ids:
            self.runner.release_sequence(seq_id)

    def shutdown(self) -> None:
        """Nothing to stop."""


@dataclass(slots=True)
class _Sent:
    """What the workers know of one sequence."""

    num_tokens: int
    num_blocks: int


@dataclass(slots=True)
class _InFlight:
    step_id: int
    sampled_seqs: list[Sequence]  # in the order the sampling rank samples them
    works: list = field(default_factory=list)
    result: StepResult | None = None


class MultiprocExecutor:
    """Rank 0 of T x P ranks: sends steps out, runs stage 0's shard, gathers sampled tokens."""

    def __init__(self, config: EngineConfig, dtype: torch.dtype) -> None:
        parallel = config.parallel
        self.place = RankPlace(0, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.world_size = parallel.world_size
        self.pipeline_depth = parallel.pipeline_parallel_size
        self.workers: list[subprocess.Popen] = []
        self._sent: dict[int, _Sent] = {}
        self._released: list[int] = []
        self._step_id = 0
        self._closed = False
        self._messages: Any = None
        config = _with_port(config)
        set_rank_threads(config.parallel)
        loaded = load_model(config.model, dtype)
        # A model that cannot be cut this way is refused before any process starts.
        check_split(loaded.config, self.place.tp_size, self.place.pp_size)
        try:
            self.workers = spawn_local_workers(config, dtype, node_rank=0)
            self.runner, self.loaded, self._messages = build_rank_runner(config, dtype, 0, loaded)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = self.runner.num_blocks
        self.fused_status = self.runner.fused_status

    def preempted(self, seqs: list[Sequence]) -> None:
        """These sequences lost their blocks: their next step resends the whole table."""
        for seq in seqs:
            if seq.seq_id in self._sent:
                self._sent[seq.seq_id].num_blocks = 0

    def submit(self, batch: list[ScheduledSequence]) -> _InFlight:
        """Send the step to every rank, run stage 0 here, and pass its output on."""
        self._step_id += 1
        step = self._step_input(
            batch, self._grammar(batch) if self.place.pp_size > 1 else ([], b"")
        )
        flight = _InFlight(self._step_id, [item.seq for item in batch if _samples(item)])
        for rank in range(1, self.world_size):
            flight.works += send_message(step, rank, TAG_STEP, self._messages)
        if self.place.pp_size == 1:
            logits = self.runner.run_stage(batch, None)
            flight.result = self.runner.sample(batch, logits)
        else:
            hidden = self.runner.run_stage(batch, None)
            flight.works += [dist.isend(hidden, self.place.tp_size, tag=TAG_HIDDEN), hidden]
        return flight

    def wait(self, flight: _InFlight) -> StepResult:
        """The sampled tokens of a submitted step."""
        wait_all(flight.works)
        if flight.result is not None:
            return flight.result
        message = recv_message(self.place.sampling_rank, TAG_SAMPLED, self._messages)
        if not isinstance(message, SampledTokens) or message.step_id != flight.step_id:
            raise RuntimeError(f"step {flight.step_id}: the sampling rank answered {message!r}")
        seqs = flight.sampled_seqs
        return StepResult(seqs, sampler_output(message) if seqs else None)

    def release(self, seq_ids: list[int]) -> None:
        """Finished sequences: forgotten here now, by the workers with the next step."""
        for seq_id in seq_ids:
            self.runner.release_sequence(seq_id)
            if self._sent.pop(seq_id, None) is not None:
                self._released.append(seq_id)

    def shutdown(self) -> None:
        """Tell the workers to stop, then make sure they did."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            try:
                works = []
                for rank in range(1, self.world_size):
                    works += send_message(Shutdown(), rank, TAG_STEP, self._messages)
                wait_all(works)
            except RuntimeError:
                pass  # a worker is already gone
        stop_processes(self.workers)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _step_input(
        self, batch: list[ScheduledSequence], grammar: tuple[list[int], bytes] = ([], b"")
    ) -> StepInput:
        new, items = [], []
        for entry in batch:
            seq = entry.seq
            sent = self._sent.get(seq.seq_id)
            if sent is None:
                new.append(NewSequence(seq.seq_id, seq.index, seq.params,
                                       seq.prompt_token_ids))  # fmt: skip
                sent = self._sent[seq.seq_id] = _Sent(len(seq.prompt_token_ids), 0)
            table_start = min(sent.num_blocks, len(seq.block_table))
            items.append(ScheduledItem(
                seq.seq_id, seq.num_computed_tokens, entry.num_new_tokens,
                seq.token_ids[sent.num_tokens :], table_start, seq.block_table[table_start:],
                [table[table_start:] for table in seq.window_block_tables],
            ))  # fmt: skip
            sent.num_tokens, sent.num_blocks = len(seq.token_ids), len(seq.block_table)
        finished, self._released = self._released, []
        return StepInput(self._step_id, new, items, finished, *grammar)

    def _grammar(self, batch: list[ScheduledSequence]) -> tuple[list[int], bytes]:
        """The rows of the step's sampled sequences that a grammar constrains, and their
        token bitmask: the sampling rank of a pipeline has no matchers of its own."""
        sampled = [entry.seq for entry in batch if _samples(entry)]
        rows = [i for i, seq in enumerate(sampled) if seq.matcher is not None]
        if not rows:
            return [], b""
        matchers = [sampled[i].matcher for i in rows]
        return rows, token_bitmask(matchers, self.runner.config.vocab_size).tobytes()


def _samples(item: ScheduledSequence) -> bool:
    return item.seq.num_computed_tokens + item.num_new_tokens == len(item.seq.token_ids)


def _with_port(config: EngineConfig) -> EngineConfig:
    """The config with a free master port picked, where none is given."""
    if config.parallel.master_port or "MASTER_PORT" in os.environ:
        return config
    from dataclasses import replace

    from infire.serverproc import free_port

    return replace(config, parallel=replace(config.parallel, master_port=free_port()))


def set_rank_threads(parallel: ParallelConfig) -> None:
    """Share this machine's cores among its ranks (one thread each on 2 cores x 2 ranks)."""
    local = parallel.world_size // parallel.nnodes
    threads = parallel.threads_per_rank or max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)


def spawn_local_workers(
    config: EngineConfig, dtype: torch.dtype, node_rank: int
) -> list[subprocess.Popen]:
    """Start this node's worker ranks (all but rank 0 on node 0) as processes."""
    from infire.engine.core import config_to_json

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return []  # torchrun started every rank itself
    parallel = config.parallel
    local = parallel.world_size // parallel.nnodes
    first = node_rank * local
    workers = []
    for rank in range(max(first, 1), first + local):
        command = [
            sys.executable, "-m", "infire.engine.worker", "--rank", str(rank),
            "--dtype", str(dtype).removeprefix("torch."), "--parent-pid", str(os.getpid()),
            "--config", config_to_json(config),
        ]  # fmt: skip
        workers.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
    return workers
