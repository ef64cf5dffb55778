"""Decode steps replayed from CUDA graphs (the GPU path; `--enforce-eager` turns them off).

A decode step's work is the same kernels whatever its tokens, so it is captured once per
batch-size bucket (1, 2, 4, 8, 16, 32, 64, ... up to max_num_seqs) over static input
buffers: token ids, positions, pool slots, block tables [bucket, blocks a sequence may
have] and lengths. A step of n decodes takes the smallest bucket >= n: its inputs are
copied into the buffers (one host-to-device copy each, no sync), the graph replays the
model and the logits head, and the sampler runs on the first n rows. The bucket's other
rows decode a dummy token into a sink block the block manager never hands out (the pool's
last), so they touch no sequence's KV.

Graphs are captured where every layer's attention goes through the Triton kernels (no
latent attention, no windowed groups), on one rank (no tensor or pipeline parallelism).
After capturing, each graph is replayed once against the eager forward on the same
inputs; a graph that does not give the same logits bit for bit is dropped (the step
runs eagerly), and so is a capture that fails, with the reason logged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from infire.layers.attention import AttentionMetadata, TritonGroups

if TYPE_CHECKING:
    from infire.engine.runner import ModelRunner
    from infire.engine.scheduler import ScheduledSequence

logger = logging.getLogger("infire.engine.cuda_graphs")


def buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 in powers of two, up to max_num_seqs (included)."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return [*out, max_num_seqs]


class DecodeGraphs:
    """One CUDA graph per batch bucket of a runner's decode step."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_blocks: int, sink: int) -> None:
        self.runner = runner
        self.sink = sink  # a block no sequence holds: the padding rows write there
        device = runner.device
        self.buckets = buckets(max_num_seqs)
        top = self.buckets[-1]
        # every input in one buffer, a row each (the tables' rows after), so that a step's
        # inputs are one host-to-device copy of its first columns
        self.inputs = torch.zeros(4 + max_blocks, top, dtype=torch.long, device=device)
        self.width = max_blocks
        self.rows = torch.arange(top, device=device)
        self._fill(self._pad_columns(top), top)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _pad_columns(self, count: int) -> torch.Tensor:
        """Inputs of `count` padding rows: token 0 at position 0, written to the sink."""
        pad = torch.zeros(4 + self.width, count, dtype=torch.long)
        pad[2] = self.sink * self.runner.block_size
        pad[3] = 1
        pad[4:] = self.sink
        return pad

    def _fill(self, columns: torch.Tensor, b: int) -> None:
        self.inputs[:, :b].copy_(columns, non_blocking=True)

    def _meta(self, b: int) -> AttentionMetadata:
        inputs = self.inputs[:, :b]
        groups = TritonGroups(self.rows[:b], inputs[4:].T, inputs[3], None, None)
        return AttentionMetadata(slot_mapping=inputs[2], only_decode=True, triton=groups)

    def _forward(self, b: int) -> torch.Tensor:
        model = self.runner.model
        tokens, positions = self.inputs[0, :b], self.inputs[1, :b]
        hidden = model(tokens, positions, self.runner.kv_caches, self._meta(b))
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (one memory pool), and check each."""
        for b in reversed(self.buckets):
            try:
                self._forward(b)  # compiles the kernels, outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits = self._forward(b)
                self.pool = graph.pool()
                graph.replay()
                if not torch.equal(logits, self._forward(b)):
                    logger.warning("CUDA graph of batch %d differs from the eager step: dropped", b)
                    continue
            except Exception as e:  # a capture that fails: the step runs eagerly
                logger.warning("CUDA graph of batch %d not captured: %s", b, e)
                continue
            self.graphs[b], self.logits[b] = graph, logits
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batches %s", sorted(self.graphs))

    def bucket(self, batch: list[ScheduledSequence]) -> int | None:
        """The graph bucket of a step, or None where it runs eagerly (not every item a
        decode that samples, a batch larger than the buckets, a table longer than the
        buffers, a bucket whose graph was dropped)."""
        # every item one token, its last known (a prompt's 1-token chunk does not sample)
        if any(item.num_new_tokens != 1 or item.seq.num_computed_tokens + 1 != len(item.seq.token_ids)
               for item in batch):  # fmt: skip
            return None
        if any(len(item.seq.block_table) > self.width for item in batch):
            return None
        return next((b for b in self.buckets if b >= len(batch) and b in self.graphs), None)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSequence], b: int) -> torch.Tensor:
        """The logits [len(batch), vocab] of a decode step, replayed from bucket b's graph."""
        n, bs = len(batch), self.runner.block_size
        columns = self._pad_columns(b)
        for i, item in enumerate(batch):
            seq, p = item.seq, item.seq.num_computed_tokens
            table = seq.block_table
            columns[:4, i] = torch.tensor(
                [seq.token_ids[p], p, table[p // bs] * bs + p % bs, p + 1]
            )
            columns[4 : 4 + len(table), i] = torch.tensor(table)
        self._fill(columns, b)  # the step's one host-to-device copy
        self.graphs[b].replay()
        return self.logits[b][:n]
