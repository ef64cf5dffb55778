"""SamplingState: what the sampler needs about each sequence, kept across steps.

Penalties need, per sequence, which vocabulary tokens it has seen (prompt and output) and
how often each was generated; logit_bias needs its bias row. Rebuilding those [N, vocab]
tensors from every sequence's full token list each step costs tens of milliseconds, so
the ModelRunner keeps them here instead: one row per sequence in preallocated tables
(doubling when full), leased by `seq_id`, updated with only the tokens appended since the
sequence was last sampled (a sequence's tokens only grow; preemption recomputes its KV but
keeps its tokens). Each step gathers the batch's rows with `index_select` into buffers
that the next step reuses (the sampler consumes them at once) and builds the step's
`SamplingMetadata`. Only sequences that use penalties or a logit bias get a row; the
others read row 0, which stays zero. The engine calls `release` when a sequence ends;
finished sequences it never released are reclaimed when the tables would otherwise grow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from infire.engine.request import Sequence
from infire.engine.structured import forbidden_tokens, token_bitmask
from infire.layers.sampler import SamplingMetadata

_ZERO_ROW = 0  # read by sequences without a lease: no penalty, no bias


@dataclass(slots=True)
class _Lease:
    seq: Sequence  # held to tell a reused seq_id from its owner, and to reclaim when finished
    slot: int
    num_absorbed: int = 0  # leading tokens of seq.token_ids already in the rows


class _RowPool:
    """Rows of [capacity + 1, vocab] tables lent to sequences by seq_id; row 0 stays zero."""

    def __init__(
        self, vocab_size: int, dtypes: tuple[torch.dtype, ...], device: torch.device,
        capacity: int,
    ) -> None:  # fmt: skip
        self.tables = [
            torch.zeros(capacity + 1, vocab_size, dtype=dtype, device=device) for dtype in dtypes
        ]
        self.leases: dict[int, _Lease] = {}
        self.free = list(range(capacity, 0, -1))  # popped from the end: lowest slot first
        # A step's gathered rows land in these, reused: a fresh [N, vocab] tensor per step
        # would cost a pass of page faults on CPU.
        self.gathered = [table[:0].clone() for table in self.tables]

    @property
    def capacity(self) -> int:
        """Rows that can be lent without growing."""
        return self.tables[0].shape[0] - 1

    def lease(self, seq: Sequence, batch: list[Sequence]) -> tuple[_Lease, bool]:
        """The sequence's lease, and whether it is new (then its rows are all zero)."""
        lease = self.leases.get(seq.seq_id)
        if lease is not None and lease.seq is seq:
            return lease, False
        self.release(seq.seq_id)  # a new Sequence object under a known id starts afresh
        if not self.free:
            self._reclaim(batch)
        if not self.free:
            self._grow()
        slot = self.free.pop()
        for table in self.tables:
            table[slot].zero_()
        lease = self.leases[seq.seq_id] = _Lease(seq, slot)
        return lease, True

    def release(self, seq_id: int) -> None:
        """Give the sequence's rows back; nothing if it holds none."""
        lease = self.leases.pop(seq_id, None)
        if lease is not None:
            self.free.append(lease.slot)

    def gather(self, slots: list[int]) -> list[torch.Tensor]:
        """Each table's rows for these slots, in order (valid until the next gather)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.tables[0].device)
        if self.gathered[0].shape[0] < len(slots):
            rows = max(len(slots), 2 * self.gathered[0].shape[0])
            self.gathered = [table.new_empty(rows, table.shape[1]) for table in self.tables]
        return [
            torch.index_select(table, 0, index, out=out[: len(slots)])
            for table, out in zip(self.tables, self.gathered, strict=True)
        ]

    def _reclaim(self, batch: list[Sequence]) -> None:
        # Sequences the engine never released (tests driving a runner directly, or a path
        # that forgot) would otherwise hold their rows forever.
        in_batch = {seq.seq_id for seq in batch}
        for seq_id, lease in list(self.leases.items()):
            if lease.seq.finished and seq_id not in in_batch:
                self.release(seq_id)

    def _grow(self) -> None:
        old = self.capacity
        self.tables = [torch.cat([table, torch.zeros_like(table[1:])]) for table in self.tables]
        self.free += range(2 * old, old, -1)


# The rows of a step's sampled sequences that a grammar constrains, and their token_bitmask
Grammar = tuple[list[int], np.ndarray]


class SamplingState:
    """Per-sequence penalty and logit-bias rows, and each step's SamplingMetadata."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # seen: in prompt or output (repetition penalty); counts: in output (frequency /
        # presence), float32 as the sampler multiplies them.
        self.penalties = _RowPool(vocab_size, (torch.bool, torch.float32), device, capacity)
        self.biases = _RowPool(vocab_size, (torch.float32,), device, capacity)

    def metadata(self, seqs: list[Sequence], grammar: Grammar | None = None) -> SamplingMetadata:
        """This step's sampling parameters, a row per sequence; valid until the next call.

        The grammar masks come from the sequences' matchers, or on a pipeline's sampling
        rank (whose sequences have none) from `grammar`: rank 0's (rows, token_bitmask)."""
        params = [seq.params for seq in seqs]
        meta = SamplingMetadata(
            temperature=self._floats([p.temperature for p in params]),
            top_k=None,
            top_p=None,
            min_p=None,
            generators=[seq.generator for seq in seqs],
            all_greedy=all(p.greedy for p in params),
        )
        if any(p.top_k > 0 for p in params):
            meta.top_k = torch.tensor([p.top_k for p in params], device=self.device)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = self._floats([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = self._floats([p.min_p for p in params])
        if any(p.uses_penalties for p in params):
            meta.repetition_penalty = self._floats([p.repetition_penalty for p in params])[:, None]
            meta.frequency_penalty = self._floats([p.frequency_penalty for p in params])[:, None]
            meta.presence_penalty = self._floats([p.presence_penalty for p in params])[:, None]
            meta.seen_mask, meta.output_counts = self._penalty_rows(seqs)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else None
        if any(p.logit_bias for p in params):
            meta.logit_bias = self._bias_rows(seqs)
        constrained, bitmask = grammar if grammar is not None else ([], None)
        if not constrained:
            constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
            matchers = [seqs[i].matcher for i in constrained]
            if matchers:
                bitmask = token_bitmask(matchers, self.vocab_size, self.device.type != "cpu")
        if constrained:
            meta.disallowed = forbidden_tokens(bitmask, self.vocab_size).to(self.device)
            if len(constrained) < len(seqs):
                meta.disallowed_rows = self._longs(constrained)
        return meta

    def release(self, seq_id: int) -> None:
        """Free a finished or aborted sequence's rows; idempotent."""
        self.penalties.release(seq_id)
        self.biases.release(seq_id)

    def _penalty_rows(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Seen mask and output counts [N, vocab], after absorbing the tokens new since last time."""
        slots, rows, tokens, output_rows, output_tokens = [], [], [], [], []
        for seq in seqs:
            if not seq.params.uses_penalties:
                # Neutral penalties leave a row's logits exact whatever its mask and counts.
                slots.append(_ZERO_ROW)
                continue
            lease, _ = self.penalties.lease(seq, seqs)
            new = seq.token_ids[lease.num_absorbed :]
            if new:
                rows += [lease.slot] * len(new)
                tokens += new
                outputs = new[max(0, seq.num_prompt_tokens - lease.num_absorbed) :]
                output_rows += [lease.slot] * len(outputs)
                output_tokens += outputs
                lease.num_absorbed += len(new)
            slots.append(lease.slot)
        seen, counts = self.penalties.tables
        if tokens:
            seen.index_put_((self._longs(rows), self._longs(tokens)), seen.new_ones(()))
        if output_tokens:
            ones = counts.new_ones(len(output_tokens))
            counts.index_put_((self._longs(output_rows), self._longs(output_tokens)), ones, True)
        seen_mask, output_counts = self.penalties.gather(slots)
        return seen_mask, output_counts

    def _bias_rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logit bias [N, vocab]; a sequence's row is written once, when it is first seen."""
        slots = []
        for seq in seqs:
            bias = seq.params.logit_bias
            if not bias:
                slots.append(_ZERO_ROW)
                continue
            lease, new = self.biases.lease(seq, seqs)
            if new:
                table = self.biases.tables[0]
                table[lease.slot, self._longs(list(bias))] = self._floats(list(bias.values()))
            slots.append(lease.slot)
        return self.biases.gather(slots)[0]

    def _longs(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _floats(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)
