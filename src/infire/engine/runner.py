"""ModelRunner: turns a scheduled batch into tensors, runs one forward, samples.

It owns the model (the class the registry names for its architecture) and the KV block
pool: one tensor per local layer, shaped by the layer's attention (K and V planes of
[blocks, block_size, kv_heads, head_dim], or MLA's one latent plane), allocated once from
the memory budget, each KV group (layers/kv_spec.py) with its own number of blocks. Each
step it flattens the batch (token ids, positions, slot mappings, block tables), builds
the attention layout once per KV group for all its layers, computes logits only for
sequences whose prompt is complete, and samples.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from infire.config import CacheConfig, ModelConfig, SchedulerConfig
from infire.engine.cuda_graphs import DecodeGraphs
from infire.engine.request import Sequence
from infire.engine.sampling_state import Grammar, SamplingState
from infire.engine.scheduler import ScheduledSequence
from infire.errors import ModelLoadError
from infire.kernels import CpuForward
from infire.kernels.cpu_forward import (
    Blocks,
    gguf_blocks_reason,
    gguf_weight_names,
    load_library,
    unsupported_reason,
)
from infire.kernels.triton_support import use_triton
from infire.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedAttention,
    PrefillGroup,
    TritonGroups,
)
from infire.layers.kv_spec import AttentionWindow
from infire.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from infire.models.registry import family_named
from infire.native import bound_heap_retention, release_free_heap
from infire.parallel import SINGLE, TensorParallelGroup


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
        blocks: Blocks | None = None,
        tp: TensorParallelGroup = SINGLE,
        layer_range: tuple[int, int] | None = None,
        scheduler_config: SchedulerConfig | None = None,
        enforce_eager: bool = False,
    ) -> None:
        """Build this rank's part of the model (its tp slice of the layers in `layer_range`,
        all of them by default), load it from `weights` (a lazy WeightSource or a dict) and
        allocate its share of the KV pool (windowed groups sized for `scheduler_config`'s
        batch limits). With `blocks` (a quantized GGUF's) the matmul weights and the
        embedding are held as the file's blocks and never dequantized: by the fused forward,
        or where the PyTorch path runs (tensor/pipeline parallel ranks, a family the fused
        forward does not run), by each linear, its tp slice cut on block boundaries."""
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cpu":
            bound_heap_retention()  # freed tensors go back to the system
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.tp = tp
        # the GPU path's Triton attention (a CUDA device; INFIRE_TRITON=1 on CPU for tests):
        # its prefill kernel takes blocks of 16 slots or more
        self.triton = use_triton(self.device) and self.block_size >= 16
        model_class = family_named(config.architecture).model_class
        # With GGUF blocks the model's matmul weights are never written (their pages never
        # touched), so they are created in `dtype` at once: a cast would write a copy.
        default = torch.get_default_dtype()
        try:
            if blocks is not None:
                torch.set_default_dtype(dtype)
            with torch.device(self.device):
                self.model = model_class(config, tp, layer_range).to(dtype)
        finally:
            torch.set_default_dtype(default)
        start, end = self.model.layer_range
        sharded = tp.world_size > 1 or (end - start) < config.num_hidden_layers
        self.quant_status = ""
        skip = None
        module_blocks, modules_why = None, ""  # the PyTorch path's linears hold the blocks
        if blocks is not None:
            place, reason = self._blocks_place(cpu_kernels, sharded, weights, blocks)
            if place == "fused":
                skip = set(gguf_weight_names(config, list(weights))).__contains__
            elif place == "modules":
                self.quant_status = ", GGUF blocks in the PyTorch path's linears"
                module_blocks, blocks, modules_why = blocks, None, reason
            else:
                self.quant_status = f", GGUF blocks dequantized ({reason})"
                blocks = None
        self.model.load_weights(weights, skip, module_blocks)
        self.model.eval()
        self.kv_spec = self.model.kv_spec
        # every attention through the Triton kernels (none latent): the full-attention
        # group then needs only their metadata, not the PyTorch path's masks
        self.triton_only = self.triton and not any(
            isinstance(a, PagedAttention) and a.latent_values
            for m in self.model.modules() for a in vars(m).values()
        )  # fmt: skip
        self.windows: tuple[AttentionWindow, ...] = self.kv_spec.windows
        # Every rank sizes the pool from the whole model's KV, so all agree on num_blocks
        # (one block manager serves them all); each allocates only its layers and KV heads.
        self.group_num_blocks = self._blocks_per_group(
            cache_config, scheduler_config or SchedulerConfig()
        )
        self.num_blocks = self.group_num_blocks[0]
        self.kv_caches, pools = self._allocate_pool()
        # One pool for every layer (a Llama-shaped model): the fused forward's [layers, ...]
        self.kv_cache: torch.Tensor | None = pools[0] if len(pools) == 1 else None
        # The fused CPU forward, where it applies, tiles its own copy of the weights, so it
        # is built before oneDNN packing replaces them.
        self.fused: CpuForward | None = None
        self.fused_status = "disabled"
        if cpu_kernels and sharded:
            self.fused_status = "unavailable: tensor/pipeline parallel ranks use the PyTorch path"
        elif cpu_kernels and not model_class.supports_fused_cpu:
            self.fused_status = f"unavailable: {config.architecture} runs the PyTorch path"
        elif cpu_kernels and self.windows:
            self.fused_status = "unavailable: sliding-window attention runs the PyTorch path"
        elif cpu_kernels and module_blocks is not None:  # the linears hold the weights
            self.fused_status = f"unavailable: {modules_why}"
        elif cpu_kernels:
            release = getattr(weights, "release_blocks", None)  # a GGUFSource's
            built = CpuForward.build(self.model, self.kv_cache, dtype, palette, blocks, release)
            self.fused = built if isinstance(built, CpuForward) else None
            self.fused_status = "active" if self.fused else f"unavailable: {built}"
        if blocks is not None and self.fused is None:  # checked before loading: not expected
            raise ModelLoadError(f"GGUF blocks cannot be served: {self.fused_status}")
        if blocks is not None:
            self.fused_status += ", GGUF blocks"
            if self.fused.interleaved:
                self.fused_status += f" ({self.fused.interleaved} tensors in groups of 16 rows)"
        self.fused_status += self.quant_status
        if palette:  # weights from an Unweight palette-form folder
            held = self.fused is not None and self.fused.palette
            if not held and self.triton and dtype == torch.bfloat16:
                self.fused_status += self._hold_palette()
            else:
                self.fused_status += ", palette weights" if held else ", palette weights decoded"
        if self.fused is not None and self.fused.takes_prefill:
            # every step runs fused: one copy in memory (the palette form and GGUF blocks
            # embed too)
            self.model.drop_matmul_weights(embedding=self.fused.palette or self.fused.quantized)
        elif self.device.type == "cpu":
            self.model.pack_for_cpu()
        self.sampler = Sampler(
            torch.Generator(self.device).manual_seed(seed), kernel_argmax=self.fused is not None
        )
        self.sampling_state = SamplingState(config.vocab_size, self.device)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not enforce_eager and self.triton and not sharded:
            self._capture_graphs(scheduler_config or SchedulerConfig())
        release_free_heap()  # the load's freed scratch

    def _blocks_place(
        self, cpu_kernels: bool, sharded: bool, weights: object, blocks: Blocks
    ) -> tuple[str, str]:
        """Where a quantized GGUF's blocks are served: "fused" (by the fused CPU forward),
        "modules" (by the PyTorch path's linears, through the same kernel) or "dequantized",
        with why they are not served fused."""
        if not cpu_kernels:
            return "dequantized", "the CPU kernels are off"
        if self.device.type != "cpu":
            return "dequantized", f"the kernel runs on the CPU, not {self.device.type}"
        lib = load_library()
        if isinstance(lib, str):
            return "dequantized", lib
        model_class = type(self.model)
        if sharded:
            return "modules", "tensor/pipeline parallel ranks run the PyTorch path"
        if not model_class.supports_fused_cpu or self.model.kv_spec.windows:
            return "modules", f"{self.config.architecture} runs the PyTorch path"
        reason = unsupported_reason(self.config, self.dtype, self.device)
        if reason is not None:
            return "modules", reason
        names = list(weights)  # type: ignore[call-overload]
        reason = gguf_blocks_reason(self.config, names, blocks)
        return ("fused", "") if reason is None else ("dequantized", reason)

    def _allocate_pool(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One KV tensor per local layer, and the pools they are views of: the layers with
        one shape share a [layers, ...] tensor."""
        shapes = self.model.cache_shapes(self.group_num_blocks, self.block_size)
        caches: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
        pools = []
        for shape in dict.fromkeys(shapes):
            same = [i for i, s in enumerate(shapes) if s == shape]
            pools.append(torch.zeros(len(same), *shape, dtype=self.dtype, device=self.device))
            for i, view in zip(same, pools[-1], strict=True):
                caches[i] = view
        return caches, pools

    @property
    def kv_bytes_per_token(self) -> int:
        """What a token of context costs in the whole model's KV (the full-attention
        layers'; windowed layers hold at most their window)."""
        return self.kv_spec.bytes_per_token(self.dtype)

    def _blocks_per_group(self, cache: CacheConfig, limits: SchedulerConfig) -> list[int]:
        """Blocks of each KV group. A windowed group gets what `max_num_seqs` windows and
        a step's chunk can use, at most half the budget (shrunk in proportion when that
        is too little); the full-attention group gets the rest."""
        groups = self.kv_spec.groups
        if cache.num_blocks:
            return [cache.num_blocks] * len(groups)
        itemsize, bs, budget = self.dtype.itemsize, self.block_size, cache.kv_cache_memory
        per_block = [g.elements_per_token * bs * itemsize for g in groups]
        windows = [g.window for g in groups[1:]]
        wanted = [
            w.pool_blocks(limits.max_num_seqs, limits.max_num_batched_tokens, bs) for w in windows
        ]  # fmt: skip
        wanted_bytes = sum(n * b for n, b in zip(wanted, per_block[1:], strict=True))
        share = budget if not per_block[0] else budget // 2  # what the windows may take
        if wanted_bytes > share:
            wanted = [n * share // wanted_bytes for n in wanted]
        used = sum(n * b for n, b in zip(wanted, per_block[1:], strict=True))
        if per_block[0]:
            full = (budget - used) // per_block[0]
        else:  # no full-attention layer: group 0 only counts blocks, it holds no tensor
            context = limits.max_model_len or self.config.max_position_embeddings
            full = limits.max_num_seqs * -(-context // bs)
        least = [w.max_blocks(limits.max_num_batched_tokens, bs) for w in windows]
        if full < 1 or any(n < m for n, m in zip(wanted, least, strict=True)):
            raise ModelLoadError(
                f"--kv-cache-memory {budget} bytes is too small: it needs one KV block of the "
                f"full-attention layers ({per_block[0]} bytes) and, per windowed group, the "
                f"blocks of one window and one step's {limits.max_num_batched_tokens} tokens"
            )
        return [int(full), *(int(n) for n in wanted)]

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> StepResult:
        """One forward over the batch; samples for sequences whose known tokens are all computed.

        With the fused CPU forward, decodes (and in bf16 every item) run through it and the
        rest through the PyTorch model: a token always takes the same path, whatever its
        batch holds, so batching never changes a result.
        """
        fused = [i for i in batch if self._takes_fused(i)]
        others = [i for i in batch if not self._takes_fused(i)]
        # the rows that sample, in the order of their logits below (others, then fused);
        # their parameters go to the device before the forward is queued: on a GPU a copy
        # from the host queued after it would hold the host until the forward had run
        sampled_seqs = [i.seq for i in (*others, *fused) if _samples(i)]
        meta = self._sampling_metadata(sampled_seqs) if sampled_seqs else None
        logits: list[torch.Tensor] = []
        for run, items in ((self._forward, others), (self._forward_fused, fused)):
            if items:
                seqs, rows = run(items)
                logits += [rows] if seqs else []
        if meta is None:
            return StepResult([], None)
        rows = logits[0] if len(logits) == 1 else torch.cat(logits)
        return StepResult(sampled_seqs, self.sampler(rows, meta))

    def _takes_fused(self, item: ScheduledSequence) -> bool:
        return self.fused is not None and (item.num_new_tokens == 1 or self.fused.takes_prefill)

    def _forward(self, batch: list[ScheduledSequence]) -> tuple[list[Sequence], torch.Tensor]:
        """PyTorch forward (a decode step replayed from its CUDA graph where one was
        captured); logits of the sequences that sample this step."""
        if self.graphs is not None and (bucket := self.graphs.bucket(batch)) is not None:
            return [item.seq for item in batch], self.graphs.run(batch, bucket)
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
        out = self.model(input_ids if hidden is None else hidden, positions, self.kv_caches, meta)
        if not self.model.is_last_stage:
            return out
        rows = _last_rows(batch)
        return self.model.compute_logits(out[_longs(rows, self.device)]) if rows else out[:0]

    @torch.inference_mode()
    def sample(
        self, batch: list[ScheduledSequence], logits: torch.Tensor, grammar: Grammar | None = None
    ) -> StepResult:
        """Sample the rows of `logits` (from run_stage) for the batch's sampling sequences
        (`grammar`: the masks rank 0 computed, on a pipeline's sampling rank)."""
        seqs = [item.seq for item in batch if _samples(item)]
        if not seqs:
            return StepResult([], None)
        return StepResult(seqs, self.sampler(logits, self._sampling_metadata(seqs, grammar)))

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
        self._group_attention(batch, meta, None)
        windowed = []
        for index, window in enumerate(self.windows):
            tables = [item.seq.window_block_tables[index] for item in batch]
            group = AttentionMetadata(slot_mapping=self._slots(batch, tables))
            self._group_attention(batch, group, window, tables)
            windowed.append(group)
        meta.windows = tuple(windowed)
        return _longs(tokens, self.device), _longs(positions, self.device), meta

    def _slots(self, batch: list[ScheduledSequence], tables: list[list[int]]) -> torch.Tensor:
        """Pool slots of the batch's new tokens through other block tables (a windowed group's)."""
        bs, slots = self.block_size, []
        for item, table in zip(batch, tables, strict=True):
            start = item.seq.num_computed_tokens
            slots += [
                table[p // bs] * bs + p % bs for p in range(start, start + item.num_new_tokens)
            ]
        return _longs(slots, self.device)

    def _group_attention(
        self,
        batch: list[ScheduledSequence],
        meta: AttentionMetadata,
        window: AttentionWindow | None,
        tables: list[list[int]] | None = None,
    ) -> None:
        tables = tables or [item.seq.block_table for item in batch]
        if self.triton and window is None:
            meta.triton = self._triton_groups(batch, tables)
            if self.triton_only:
                return
        decode, prefill = [], []
        offset = 0
        for item, table in zip(batch, tables, strict=True):
            row = (item, offset, table)
            offset += item.num_new_tokens
            if item.num_new_tokens == 1:
                decode.append(row)
            elif item.seq.num_computed_tokens == 0 and meta.fresh is None:
                meta.fresh = slice(offset - item.num_new_tokens, offset)
                if window is not None:
                    q = torch.arange(item.num_new_tokens, device=self.device)
                    first = window.first_visible_tensor(q)
                    meta.fresh_mask = (q.view(1, -1) <= q.view(-1, 1)) & (
                        q.view(1, -1) >= first.view(-1, 1)
                    )
            else:
                prefill.append(row)
        if decode:
            meta.decode = self._decode_group(decode, window)
            meta.only_decode = len(decode) == len(batch)
        if prefill:
            meta.prefill = self._prefill_group(prefill, window)

    def _capture_graphs(self, limits: SchedulerConfig) -> None:
        """Decode steps from CUDA graphs (engine/cuda_graphs.py), where every attention
        runs through the Triton kernels: the pool's last block becomes the padding rows'
        sink, taken from the block manager."""
        if self.windows or len(self.group_num_blocks) != 1 or self.num_blocks < 2:
            return
        context = limits.max_model_len or self.config.max_position_embeddings
        self.num_blocks -= 1  # the block manager never hands out the sink
        self.graphs = DecodeGraphs(self, limits.max_num_seqs, -(-context // self.block_size),
                                   sink=self.num_blocks)  # fmt: skip
        self.graphs.capture()

    def _hold_palette(self) -> str:
        """The matmul weights back in the palette form, multiplied by the Triton kernel
        (or decoded to bf16 for cuBLAS at the batch sizes where that measured faster;
        INFIRE_PALETTE_MATMUL=fused|decode|auto, default auto)."""
        from infire.kernels.triton_palette import PaletteChoice

        choice = PaletteChoice(os.environ.get("INFIRE_PALETTE_MATMUL", "auto"))
        held, linears = self.model.hold_palette_weights(choice)
        if self.device.type == "cuda":
            choice.measure([m.palette for m in self.model.modules() if getattr(m, "palette", None)])
        return (
            f", palette weights in the Triton matmul ({held} of {linears} linears, {choice.mode})"
        )

    def _triton_groups(
        self, batch: list[ScheduledSequence], tables: list[list[int]]
    ) -> TritonGroups:
        """Decode rows (one new token) and prefill tiles (the other rows) for the Triton
        kernels: block tables, keys seen, positions."""
        from infire.kernels.triton_attention import prefill_tiles

        decode: list[tuple[int, list[int], int]] = []
        prefill: list[tuple[int, int, int, list[int]]] = []
        offset = 0
        for item, table in zip(batch, tables, strict=True):
            n, start = item.num_new_tokens, item.seq.num_computed_tokens
            if n == 1:
                decode.append((offset, table, start + 1))
            else:
                prefill.append((offset, n, start, table))
            offset += n
        groups = TritonGroups(None, None, None, None, None)
        if decode:
            groups.decode_index = _longs([row for row, _, _ in decode], self.device)
            groups.decode_tables = _table_tensor([t for _, t, _ in decode], self.device)
            groups.decode_lengths = _ints([n for _, _, n in decode], self.device)
        if prefill:
            groups.prefill_tables = _table_tensor([t for *_, t in prefill], self.device)
            groups.prefill_tiles = prefill_tiles([r for r, *_ in prefill], [n for _, n, _, _ in prefill],
                                                 [p for _, _, p, _ in prefill], self.device)  # fmt: skip
        return groups

    def _block_tables(
        self, rows: list[tuple[ScheduledSequence, int, list[int]]], window: AttentionWindow | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded block tables of the rows (from the first block in the window, if any),
        and the absolute position of every key slot they cover [B, blocks * block_size]."""
        bs = self.block_size
        firsts = [
            window.first_visible(item.seq.num_computed_tokens) // bs if window else 0
            for item, _, _ in rows
        ]  # fmt: skip
        cut = [table[first:] for (_, _, table), first in zip(rows, firsts, strict=True)]
        width = max(len(table) for table in cut)
        padded = [table + [0] * (width - len(table)) for table in cut]
        tables = torch.tensor(padded, dtype=torch.long, device=self.device)
        key_pos = torch.arange(width * bs, device=self.device).unsqueeze(0)
        if window is not None:
            key_pos = key_pos + torch.tensor(firsts, device=self.device).unsqueeze(1) * bs
        return tables, key_pos

    def _decode_group(
        self, rows: list[tuple[ScheduledSequence, int, list[int]]], window: AttentionWindow | None
    ) -> DecodeGroup:
        tables, key_pos = self._block_tables(rows, window)
        query = torch.tensor(
            [item.seq.num_computed_tokens for item, _, _ in rows], device=self.device
        ).unsqueeze(1)
        mask = key_pos <= query
        if window is not None:
            mask &= key_pos >= window.first_visible_tensor(query)
        index = torch.tensor([offset for _, offset, _ in rows], device=self.device)
        return DecodeGroup(
            token_index=index, block_tables=tables, mask=mask.view(len(rows), 1, 1, -1)
        )

    def _prefill_group(
        self, rows: list[tuple[ScheduledSequence, int, list[int]]], window: AttentionWindow | None
    ) -> PrefillGroup:
        tables, key_pos = self._block_tables(rows, window)
        max_q = max(item.num_new_tokens for item, _, _ in rows)
        gather, valid, token_index, query_pos = [], [], [], []
        for b, (item, offset, _) in enumerate(rows):
            n, start = item.num_new_tokens, item.seq.num_computed_tokens
            gather += list(range(offset, offset + n)) + [offset] * (max_q - n)
            valid += range(b * max_q, b * max_q + n)
            token_index += range(offset, offset + n)
            # Padding queries sit at the last real position, so every row attends somewhere.
            query_pos.append(list(range(start, start + n)) + [start + n - 1] * (max_q - n))
        q_pos = torch.tensor(query_pos, device=self.device).unsqueeze(-1)  # [B, max_q, 1]
        keys = key_pos.unsqueeze(1)  # [B, 1, K]
        mask = keys <= q_pos
        if window is not None:
            mask &= keys >= window.first_visible_tensor(q_pos)
        return PrefillGroup(
            gather_index=_longs(gather, self.device),
            valid_index=_longs(valid, self.device),
            token_index=_longs(token_index, self.device),
            block_tables=tables,
            mask=mask.unsqueeze(1),
            max_q=max_q,
        )

    def _sampling_metadata(
        self, seqs: list[Sequence], grammar: Grammar | None = None
    ) -> SamplingMetadata:
        return self.sampling_state.metadata(seqs, grammar)

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


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables padded to the longest, int32 [len(tables), width]."""
    width = max(len(table) for table in tables)
    return _ints([b for table in tables for b in table + [0] * (width - len(table))], device).view(
        len(tables), width
    )
