"""A worker rank (`python -m infire.engine.worker`): one tensor shard of one pipeline stage.

It joins the process group, loads only its slice of the weights and its share of the KV
pool, then serves StepInputs from rank 0 until Shutdown: it updates its mirror of the
running sequences (tokens, block tables, seeded generators), runs its stage (hidden
states in from the previous stage, out to the next), and, as the last stage's first
shard, samples and sends the tokens to rank 0. It exits when rank 0 goes away (its
sockets close, or its parent process is gone).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from infire.config import EngineConfig, resolve_dtype
from infire.engine.executor import (
    TAG_HIDDEN,
    TAG_SAMPLED,
    TAG_STEP,
    RankPlace,
    build_rank_runner,
    recv_message,
    sampled_message,
    send_message,
    set_rank_threads,
    wait_all,
)
from infire.engine.link import stop_processes
from infire.engine.messages import SampledTokens, StepInput
from infire.engine.request import Sequence, SequenceStatus
from infire.engine.runner import ModelRunner
from infire.engine.scheduler import ScheduledSequence

logger = logging.getLogger("infire.engine.worker")


class SequenceMirror:
    """A worker's copy of the running sequences, kept up to date by StepInputs."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.seqs: dict[int, Sequence] = {}

    def apply(self, step: StepInput) -> list[ScheduledSequence]:
        """Update the mirror; the step's batch over it."""
        for seq_id in step.finished:
            self.seqs.pop(seq_id, None)
            self.runner.release_sequence(seq_id)
        for new in step.new:
            generator = None
            if new.params.seed is not None:
                generator = torch.Generator(self.runner.device).manual_seed(
                    new.params.seed + new.index
                )
            self.seqs[new.seq_id] = Sequence(
                seq_id=new.seq_id, request_id="", index=new.index,
                prompt_token_ids=new.prompt_token_ids, params=new.params, detokenizer=None,
                metrics=None, generator=generator, status=SequenceStatus.RUNNING,
            )  # type: ignore[arg-type]  # fmt: skip
        batch = []
        for item in step.scheduled:
            seq = self.seqs[item.seq_id]
            seq.token_ids += item.new_token_ids
            del seq.block_table[item.block_table_start :]
            seq.block_table += item.new_block_ids
            if item.new_window_block_ids and not seq.window_block_tables:
                seq.window_block_tables = [[] for _ in item.new_window_block_ids]
            for table, new_ids in zip(
                seq.window_block_tables, item.new_window_block_ids, strict=True
            ):
                del table[item.block_table_start :]
                table += new_ids
            seq.num_computed_tokens = item.num_computed_tokens
            batch.append(ScheduledSequence(seq, item.num_new_tokens))
        return batch


def serve(runner: ModelRunner, place: RankPlace, messages: Any = None) -> None:
    """Run steps until rank 0 says Shutdown (`messages`: the group messages go through)."""
    mirror = SequenceMirror(runner)
    pending: list = []
    hidden_size = runner.config.hidden_size
    while True:
        message = recv_message(0, TAG_STEP, messages)
        if not isinstance(message, StepInput):
            break
        batch = mirror.apply(message)
        hidden = None
        if place.stage > 0:
            num_tokens = sum(item.num_new_tokens for item in batch)
            hidden = torch.empty(num_tokens, hidden_size, dtype=runner.dtype, device=runner.device)
            dist.recv(hidden, place.rank - place.tp_size, tag=TAG_HIDDEN)
        out = runner.run_stage(batch, hidden)
        wait_all(pending)  # the previous step's sends are through before new ones start
        pending = []
        if not place.is_last_stage:
            pending = [dist.isend(out, place.rank + place.tp_size, tag=TAG_HIDDEN), out]
        elif place.rank == place.sampling_rank:
            grammar = None
            if message.grammar_rows:  # rank 0's masks for the rows a grammar constrains
                mask = np.frombuffer(message.grammar_mask, dtype=np.int32)
                grammar = (message.grammar_rows, mask.reshape(len(message.grammar_rows), -1))
            output = runner.sample(batch, out, grammar).output
            sampled = sampled_message(message.step_id, output) if output else None
            sampled = sampled or SampledTokens(message.step_id, [])
            pending = send_message(sampled, 0, TAG_SAMPLED, messages)
    wait_all(pending)


def run_node_ranks(config: EngineConfig) -> int:
    """On a host other than node 0: start its ranks and wait; stops them on Ctrl-C."""
    from infire.engine.executor import spawn_local_workers

    dtype = resolve_dtype(config.dtype, config.device)
    workers = spawn_local_workers(config, dtype, config.parallel.node_rank)
    try:
        codes = [worker.wait() for worker in workers]
    except KeyboardInterrupt:
        codes = [1]
    finally:
        stop_processes(workers)
    return max(codes, default=0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker rank."""
    from infire.engine.core import config_from_json, die_with_parent

    parser = argparse.ArgumentParser(prog="infire-worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's process decides when we stop
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = config_from_json(args.config)
    return run_rank(config, resolve_dtype(args.dtype, config.device), args.rank)


def run_rank(config: EngineConfig, dtype: torch.dtype, rank: int) -> int:
    """Be worker rank `rank` (RANK from torchrun's environment wins) until rank 0 stops."""
    set_rank_threads(config.parallel)
    rank = int(os.environ.get("RANK", rank))
    parallel = config.parallel
    place = RankPlace(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    try:
        runner, _, messages = build_rank_runner(config, dtype, rank)
        with torch.inference_mode():
            serve(runner, place, messages)
    except RuntimeError as e:  # rank 0 went away (its sockets closed)
        logger.info("rank %d: stopping: %s", rank, str(e).splitlines()[0])
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
