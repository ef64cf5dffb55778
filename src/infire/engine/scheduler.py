"""Continuous batching: which sequences run this step, and how many tokens each.

Every step spends a token budget (`max_num_batched_tokens`): first on running sequences
(one token for a decode, a chunk for an unfinished prefill), oldest first, then on
waiting sequences in arrival order, up to `max_num_seqs` running. A long prompt is split
into chunks across steps (chunked prefill). When the block pool runs dry, the newest
running sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from infire.config import SchedulerConfig
from infire.engine.kv_cache import BlockManager
from infire.engine.request import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """A sequence and the number of its tokens to compute this step."""

    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """This step's batch."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # could never fit the pool
    preempted: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache this step
    num_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache this step

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the model computes this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue and the running list; asks the BlockManager for blocks."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self, in_flight: frozenset[int] = frozenset()) -> SchedulerOutput:
        """Pick this step's batch within the token budget and the block pool.

        Sequences in `in_flight` (ids of sequences in a pipeline micro-batch whose tokens
        are not back yet) are neither scheduled nor preempted."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, in_flight)
        self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, in_flight: frozenset) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in in_flight:
                i += 1
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                if victim.seq_id in in_flight:
                    # The newest holds blocks but is in flight: wait for it rather than
                    # preempt an older sequence (which would then take turns with it).
                    return 0
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq itself was the newest and got preempted
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.acquire_cached_prefix(seq)
            seq.num_computed_tokens = cached
            num_new = min(len(seq.token_ids) - cached, budget)
            if not self.block_manager.allocate(seq, cached + num_new):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                if not self.running:
                    # Nothing will ever free a block: the pool cannot hold this sequence.
                    self.waiting.popleft()
                    seq.finish("length")
                    out.finished.append(seq)
                    continue
                break  # arrival order is kept: nobody overtakes the head of the queue
            self.waiting.popleft()
            out.num_queried_tokens += len(seq.token_ids)
            out.num_cached_tokens += cached
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

    def admit_running(self, seq: Sequence) -> None:
        """Run a sequence whose prompt KV is in its blocks already (pulled by a decode
        engine from a prefill engine): it decodes from its next step on."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free seq's blocks and send it back to the front of the queue to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence from the queues and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
