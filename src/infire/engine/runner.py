"""ModelRunner: turns a scheduled batch into tensors, runs one forward, samples.

It owns the model and the KV block pool tensor ([layers, 2, blocks, block_size, kv_heads,
head_dim], allocated once from the memory budget). Each step it flattens the batch
(token ids, positions, slot mapping, block tables), builds the attention layout once for
all layers, computes logits only for sequences whose prompt is complete, and samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from infire.config import CacheConfig, ModelConfig
from infire.engine.request import Sequence
from infire.engine.sampling_state import SamplingState
from infire.engine.scheduler import ScheduledSequence
from infire.errors import ModelLoadError
from infire.kernels import CpuForward
from infire.layers.attention import AttentionMetadata, DecodeGroup, PrefillGroup
from infire.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from infire.models.llama import LlamaForCausalLM
from infire.parallel import SINGLE, TensorParallelGroup, kv_head_shard


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sequences that got a new token this step, in order, and what was sampled."""

    sampled_seqs: list[Sequence]
    output: SamplerOutput | None


class ModelRunner:
    """Runs the model over flattened batches against the paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        cache_config: CacheConfig,
        dtype: torch.dtype,
        device: str = "cpu",
        seed: int = 0,
        cpu_kernels: bool = True,
        palette: bool = False,
        *,
        tp: TensorParallelGroup = SINGLE,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        """Build this rank's part of the model (its tp slice of the layers in `layer_range`,
        all of them by default), load it from `weights` (a lazy WeightSource or a dict) and
        allocate its share of the KV pool."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.tp = tp
        with torch.device(self.device):
            self.model = LlamaForCausalLM(config, tp, layer_range).to(dtype)
        self.model.load_weights(weights)
        self.model.eval()
        # Every rank sizes the pool from the whole model's KV, so all agree on num_blocks
        # (one block manager serves them all); each allocates only its layers and KV heads.
        self.num_blocks = cache_config.num_blocks or self._blocks_for_budget(cache_config)
        start, end = self.model.layer_range
        local_kv_heads = kv_head_shard(config.num_key_value_heads, tp)[1]
        self.kv_cache = torch.zeros(
            end - start, 2, self.num_blocks, self.block_size,
            local_kv_heads, config.head_dim, dtype=dtype, device=self.device,
        )  # fmt: skip
        # The fused CPU forward, where it applies, tiles its own copy of the weights, so it
        # is built before oneDNN packing replaces them.
        self.fused: CpuForward | None = None
        self.fused_status = "disabled"
        sharded = tp.world_size > 1 or (end - start) < config.num_hidden_layers
        if cpu_kernels and sharded:
            self.fused_status = "unavailable: tensor/pipeline parallel ranks use the PyTorch path"
        elif cpu_kernels:
            built = CpuForward.build(self.model, self.kv_cache, dtype, palette)
            self.fused = built if isinstance(built, CpuForward) else None
            self.fused_status = "active" if self.fused else f"unavailable: {built}"
        if palette:  # weights from an Unweight palette-form folder
            held = self.fused is not None and self.fused.palette
            self.fused_status += ", palette weights" if held else ", palette weights decoded"
        if self.fused is not None and self.fused.takes_prefill:
            # every step runs fused: one copy in memory (the palette form embeds too)
            self.model.drop_matmul_weights(embedding=self.fused.palette)
        elif self.device.type == "cpu":
            self.model.pack_for_cpu()
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(seed))
        self.sampling_state = SamplingState(config.vocab_size, self.device)

    def _blocks_for_budget(self, cache_config: CacheConfig) -> int:
        per_block = (
            2 * self.config.num_hidden_layers * self.block_size
            * self.config.num_key_value_heads * self.config.head_dim * self.dtype.itemsize
        )  # fmt: skip
        num_blocks = cache_config.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ModelLoadError(
                f"--kv-cache-memory {cache_config.kv_cache_memory} bytes is less than one "
                f"KV block ({per_block} bytes)"
            )
        return num_blocks

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> StepResult:
        """One forward over the batch; samples for sequences whose known tokens are all computed.

        With the fused CPU forward, decodes (and in bf16 every item) run through it and the
        rest through the PyTorch model: a token always takes the same path, whatever its
        batch holds, so batching never changes a result.
        """
        fused = [i for i in batch if self._takes_fused(i)]
        others = [i for i in batch if not self._takes_fused(i)]
        sampled_seqs: list[Sequence] = []
        logits: list[torch.Tensor] = []
        for run, items in ((self._forward, others), (self._forward_fused, fused)):
            if items:
                seqs, rows = run(items)
                sampled_seqs += seqs
                logits += [rows] if seqs else []
        if not sampled_seqs:
            return StepResult([], None)
        rows = logits[0] if len(logits) == 1 else torch.cat(logits)
        output = self.sampler(rows, self._sampling_metadata(sampled_seqs))
        return StepResult(sampled_seqs, output)

    def _takes_fused(self, item: ScheduledSequence) -> bool:
        return self.fused is not None and (item.num_new_tokens == 1 or self.fused.takes_prefill)

    def _forward(self, batch: list[ScheduledSequence]) -> tuple[list[Sequence], torch.Tensor]:
        """PyTorch forward; logits of the sequences that sample this step."""
        return [item.seq for item in batch if _samples(item)], self.run_stage(batch, None)

    @torch.inference_mode()
    def run_stage(
        self, batch: list[ScheduledSequence], hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's part of a PyTorch forward: the hidden states for the next pipeline
        stage, or on the last stage the logits of the rows that sample (all gathered over
        the tensor-parallel group). `hidden` comes from the previous stage (None on the
        first)."""
        input_ids, positions, meta = self._prepare_inputs(batch)
        out = self.model(input_ids if hidden is None else hidden, positions, self.kv_cache, meta)
        if not self.model.is_last_stage:
            return out
        rows = _last_rows(batch)
        return self.model.compute_logits(out[_longs(rows, self.device)]) if rows else out[:0]

    @torch.inference_mode()
    def sample(self, batch: list[ScheduledSequence], logits: torch.Tensor) -> StepResult:
        """Sample the rows of `logits` (from run_stage) for the batch's sampling sequences."""
        seqs = [item.seq for item in batch if _samples(item)]
        if not seqs:
            return StepResult([], None)
        return StepResult(seqs, self.sampler(logits, self._sampling_metadata(seqs)))

    def _forward_fused(self, batch: list[ScheduledSequence]) -> tuple[list[Sequence], torch.Tensor]:
        """The same through the fused CPU forward."""
        tokens, positions, slots = self._flatten(batch)
        seq_of_token = [i for i, item in enumerate(batch) for _ in range(item.num_new_tokens)]
        tables = [item.seq.block_table for item in batch]
        logits = self.fused.forward(
            tokens, positions, slots, seq_of_token, tables, _last_rows(batch)
        )
        return [item.seq for item in batch if _samples(item)], logits

    def _flatten(self, batch: list[ScheduledSequence]) -> tuple[list[int], list[int], list[int]]:
        """Token ids, positions and pool slots of the batch's new tokens, in order."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            tokens += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        return tokens, positions, slots

    def _prepare_inputs(
        self, batch: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        tokens, positions, slots = self._flatten(batch)
        meta = AttentionMetadata(slot_mapping=_longs(slots, self.device))
        self._group_attention(batch, meta)
        return _longs(tokens, self.device), _longs(positions, self.device), meta

    def _group_attention(self, batch: list[ScheduledSequence], meta: AttentionMetadata) -> None:
        decode, prefill = [], []
        offset = 0
        for item in batch:
            row = (item, offset)
            offset += item.num_new_tokens
            if item.num_new_tokens == 1:
                decode.append(row)
            elif item.seq.num_computed_tokens == 0 and meta.fresh is None:
                meta.fresh = slice(row[1], row[1] + item.num_new_tokens)
            else:
                prefill.append(row)
        if decode:
            meta.decode = self._decode_group(decode)
            meta.only_decode = len(decode) == len(batch)
        if prefill:
            meta.prefill = self._prefill_group(prefill)

    def _block_tables(self, rows: list[tuple[ScheduledSequence, int]]) -> torch.Tensor:
        width = max(len(item.seq.block_table) for item, _ in rows)
        tables = [
            item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item, _ in rows
        ]
        return torch.tensor(tables, dtype=torch.long, device=self.device)

    def _decode_group(self, rows: list[tuple[ScheduledSequence, int]]) -> DecodeGroup:
        tables = self._block_tables(rows)
        context = torch.tensor(
            [item.seq.num_computed_tokens + 1 for item, _ in rows], device=self.device
        )
        key_pos = torch.arange(tables.shape[1] * self.block_size, device=self.device)
        mask = (key_pos.unsqueeze(0) < context.unsqueeze(1)).view(len(rows), 1, 1, -1)
        index = torch.tensor([offset for _, offset in rows], device=self.device)
        return DecodeGroup(token_index=index, block_tables=tables, mask=mask)

    def _prefill_group(self, rows: list[tuple[ScheduledSequence, int]]) -> PrefillGroup:
        tables = self._block_tables(rows)
        max_q = max(item.num_new_tokens for item, _ in rows)
        gather, valid, token_index, query_pos = [], [], [], []
        for b, (item, offset) in enumerate(rows):
            n, start = item.num_new_tokens, item.seq.num_computed_tokens
            gather += list(range(offset, offset + n)) + [offset] * (max_q - n)
            valid += range(b * max_q, b * max_q + n)
            token_index += range(offset, offset + n)
            # Padding queries sit at the last real position, so every row attends somewhere.
            query_pos.append(list(range(start, start + n)) + [start + n - 1] * (max_q - n))
        key_pos = torch.arange(tables.shape[1] * self.block_size, device=self.device)
        q_pos = torch.tensor(query_pos, device=self.device)
        mask = (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)
        return PrefillGroup(
            gather_index=_longs(gather, self.device),
            valid_index=_longs(valid, self.device),
            token_index=_longs(token_index, self.device),
            block_tables=tables,
            mask=mask,
            max_q=max_q,
        )

    def _sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        return self.sampling_state.metadata(seqs)

    def release_sequence(self, seq_id: int) -> None:
        """Free a finished or aborted sequence's sampling rows (penalties, logit bias); idempotent."""
        self.sampling_state.release(seq_id)


def _last_rows(batch: list[ScheduledSequence]) -> list[int]:
    """Rows of the flat batch whose logits are sampled: each sampling item's last token."""
    rows, end = [], 0
    for item in batch:
        end += item.num_new_tokens
        if _samples(item):
            rows.append(end - 1)
    return rows


def _samples(item: ScheduledSequence) -> bool:
    """Whether this step computes the sequence's last known token (so it samples the next)."""
    return item.seq.num_computed_tokens + item.num_new_tokens == len(item.seq.token_ids)


def _longs(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
