"""Paged attention in Triton, reading the KV pool through the block tables (no gather).

The pool of one layer is k and v [blocks, block_size, kv_heads, head_dim]; a sequence's
key j sits at slot table[j // block_size] * block_size + j % block_size. The new tokens'
k and v are in the pool before attention runs (PagedAttention writes them first), so both
kernels read every key from it.

- `paged_decode`: one query a sequence (decode), split-K (flash-decoding): the program
  (sequence, kv head, split) takes a run of the sequence's blocks for every query head of
  that kv head's group (GQA: the group's queries share each loaded key block), keeps an
  online softmax (running max, sum, weighted values) and writes it partial; a second
  kernel merges the splits. Long contexts spread over many programs at batch 1.
- `paged_prefill`: queries in tiles of up to BLOCK_M consecutive tokens of one sequence
  (prefill, chunked prefill, prefix-cache hits alike: the tile's first position says
  where it starts), each program one tile and one query head, causal within the
  sequence, over the pool's blocks up to the tile's last position.

Scores, softmax and sums are float32 whatever the pool's dtype; with a float32 pool the
products are IEEE float32 (no TF32), so float32 runs match PyTorch's to rounding. With a
bf16 pool the prefill's products run on bf16 inputs (the softmax weights rounded to bf16
before they meet the values, as flash attention does).
"""

from __future__ import annotations

import os

import torch

from infire.kernels.triton_lang import round_to, tl, triton
from infire.kernels.triton_support import next_power_of_2

# queries a prefill program takes, and the most splits a decode takes
BLOCK_M = 16
MAX_SPLITS = 16
SPLIT_BLOCKS = 16  # a split takes at least this many blocks before another is made


def decode_splits(max_blocks: int) -> int:
    """How many splits a decode batch whose longest table has `max_blocks` blocks takes."""
    return max(1, min(MAX_SPLITS, -(-max_blocks // SPLIT_BLOCKS)))


if triton is not None:

    @triton.jit
    def _load_block(k_cache, v_cache, tables, seq, block, limit, kv_head, stride_kb, stride_ks,
                    stride_kh, stride_tb, s, d, d_ok, e, e_ok, BS: tl.constexpr):  # fmt: skip
        """Block `block` of a sequence's table: its keys and values (0 past `limit`), their
        positions, and which are below `limit`."""
        slot = tl.load(tables + seq * stride_tb + block)
        pos = block * BS + s
        ok = pos < limit
        base = slot * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh
        keys = tl.load(k_cache + base + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        values = tl.load(v_cache + base + e[None, :], mask=ok[:, None] & e_ok[None, :], other=0.0)
        return keys, values, pos, ok

    @triton.jit
    def _decode_split(
        q, k_cache, v_cache, tables, lengths, part_acc, part_max, part_sum,
        stride_kb, stride_ks, stride_kh, stride_tb, blocks_per_split, scale,
        HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        DIM: tl.constexpr, DIM_P: tl.constexpr, VDIM: tl.constexpr, VDIM_P: tl.constexpr,
        BS: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(lengths + seq)
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, tl.cdiv(length, BS))
        g, d, e, s = (
            tl.arange(0, GROUP_P),
            tl.arange(0, DIM_P),
            tl.arange(0, VDIM_P),
            tl.arange(0, BS),
        )
        heads = kv_head * GROUP + g
        g_ok, d_ok, e_ok = g < GROUP, d < DIM, e < VDIM
        qv = tl.load(q + (seq * HEADS + heads)[:, None] * DIM + d[None, :],
                     mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        running_max = tl.full([GROUP_P], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, VDIM_P], tl.float32)
        for block in range(first, last):
            keys, values, pos, ok = _load_block(k_cache, v_cache, tables, seq, block, length,
                                                kv_head, stride_kb, stride_ks, stride_kh,
                                                stride_tb, s, d, d_ok, e, e_ok, BS)  # fmt: skip
            scores = tl.sum(qv[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2) * scale
            scores = tl.where(ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            alpha = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(
                p[:, :, None] * values.to(tl.float32)[None, :, :], axis=1
            )
            running_max = new_max
        at = (seq * HEADS + heads) * SPLITS + split
        tl.store(part_max + at, running_max, mask=g_ok)
        tl.store(part_sum + at, running_sum, mask=g_ok)
        tl.store(
            part_acc + at[:, None] * VDIM + e[None, :], acc, mask=g_ok[:, None] & e_ok[None, :]
        )

    @triton.jit
    def _decode_merge(
        part_acc, part_max, part_sum, out,
        VDIM: tl.constexpr, VDIM_P: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)  # sequence * heads + head
        i, e = tl.arange(0, SPLITS_P), tl.arange(0, VDIM_P)
        i_ok, e_ok = i < SPLITS, e < VDIM
        maxes = tl.load(part_max + row * SPLITS + i, mask=i_ok, other=float("-inf"))
        sums = tl.load(part_sum + row * SPLITS + i, mask=i_ok, other=0.0)
        accs = tl.load(part_acc + (row * SPLITS + i)[:, None] * VDIM + e[None, :],
                       mask=i_ok[:, None] & e_ok[None, :], other=0.0)  # fmt: skip
        top = tl.max(maxes, axis=0)
        weight = tl.where(sums > 0, tl.exp(maxes - top), 0.0)  # an empty split weighs nothing
        total = tl.sum(weight * sums, axis=0)
        merged = tl.sum(weight[:, None] * accs, axis=0) / total
        tl.store(out + row * VDIM + e, round_to(merged, out.dtype.element_ty), mask=e_ok)

    @triton.jit
    def _prefill_tile(
        q, k_cache, v_cache, out, tables, tile_seq, tile_row, tile_count, tile_pos,
        stride_kb, stride_ks, stride_kh, stride_tb, scale,
        HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
        VDIM: tl.constexpr, VDIM_P: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        tile, head = tl.program_id(0), tl.program_id(1)
        kv_head = head // GROUP
        seq = tl.load(tile_seq + tile)
        row = tl.load(tile_row + tile)
        count = tl.load(tile_count + tile)
        first_pos = tl.load(tile_pos + tile)
        i, d, e, s = (
            tl.arange(0, BLOCK_M),
            tl.arange(0, DIM_P),
            tl.arange(0, VDIM_P),
            tl.arange(0, BS),
        )
        i_ok, d_ok, e_ok = i < count, d < DIM, e < VDIM
        q_pos = first_pos + i
        end = first_pos + count  # keys visible to the tile's last query
        queries = tl.load(q + ((row + i) * HEADS + head)[:, None] * DIM + d[None, :],
                          mask=i_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, VDIM_P], tl.float32)
        for block in range(0, tl.cdiv(end, BS)):
            keys, values, k_pos, ok = _load_block(k_cache, v_cache, tables, seq, block, end,
                                                  kv_head, stride_kb, stride_ks, stride_kh,
                                                  stride_tb, s, d, d_ok, e, e_ok, BS)  # fmt: skip
            if IEEE:
                scores = tl.dot(queries.to(tl.float32), tl.trans(keys.to(tl.float32)),
                                input_precision="ieee")  # fmt: skip
            else:
                scores = tl.dot(queries, tl.trans(keys))
            # a padding row (i >= count) sees the sequence's keys: key 0 keeps its max finite
            visible = (k_pos[None, :] <= q_pos[:, None]) & ok[None, :]
            scores = tl.where(visible, scores * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            alpha = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(
                    p, values.to(tl.float32), input_precision="ieee"
                )
            else:
                acc = acc * alpha[:, None] + tl.dot(round_to(p, values.dtype), values)
            running_max = new_max
        result = acc / running_sum[:, None]
        tl.store(out + ((row + i) * HEADS + head)[:, None] * VDIM + e[None, :],
                 round_to(result, out.dtype.element_ty), mask=i_ok[:, None] & e_ok[None, :])  # fmt: skip


def _pool_strides(k_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.stride(3) != 1:
        raise ValueError("the pool's head_dim must be contiguous")
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                 splits: int | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of one query a sequence, q [B, heads, head_dim], over the first
    lengths[b] keys of its blocks tables[b] ([B, max_blocks] int32) -> [B, heads, v dim]."""
    batch, heads, dim = q.shape
    _, block_size, kv_heads, vdim = v_cache.shape
    group = heads // kv_heads
    splits = splits or decode_splits(tables.shape[1])
    blocks_per_split = -(-tables.shape[1] // splits)
    q, tables, lengths = (
        q.contiguous(),
        tables.to(torch.int32).contiguous(),
        lengths.to(torch.int32),
    )
    part_acc = torch.empty(batch, heads, splits, vdim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    stride_kb, stride_ks, stride_kh = _pool_strides(k_cache)
    if v_cache.stride()[:3] != (stride_kb, stride_ks, stride_kh):
        raise ValueError("k and v pools of one layout")
    _decode_split[(batch, kv_heads, splits)](
        q, k_cache, v_cache, tables, lengths, part_acc, part_max, part_sum,
        stride_kb, stride_ks, stride_kh, tables.stride(0), blocks_per_split, scale,
        HEADS=heads, GROUP=group, GROUP_P=max(next_power_of_2(group), 1),
        DIM=dim, DIM_P=next_power_of_2(dim), VDIM=vdim, VDIM_P=next_power_of_2(vdim),
        BS=block_size, SPLITS=splits,
    )  # fmt: skip
    out = torch.empty(batch, heads, vdim, dtype=q.dtype, device=q.device)
    _decode_merge[(batch * heads,)](
        part_acc, part_max, part_sum, out, VDIM=vdim, VDIM_P=next_power_of_2(vdim),
        SPLITS=splits, SPLITS_P=next_power_of_2(splits),
    )  # fmt: skip
    return out


def prefill_tiles(rows: list[int], counts: list[int], positions: list[int],
                  device: torch.device) -> torch.Tensor:  # fmt: skip
    """int32 [4, tiles]: (sequence, first row, count, first position) of every tile of up
    to BLOCK_M queries, for sequences whose `counts[s]` new tokens start at flat row
    rows[s] and position positions[s] (their index in the block tables: s)."""
    tiles: list[tuple[int, int, int, int]] = []
    for seq, (row, count, pos) in enumerate(zip(rows, counts, positions, strict=True)):
        for at in range(0, count, BLOCK_M):
            tiles.append((seq, row + at, min(BLOCK_M, count - at), pos + at))
    return torch.tensor(tiles, dtype=torch.int32, device=device).T.contiguous()


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tables: torch.Tensor, tiles: torch.Tensor, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Causal attention of the tiles' queries (rows of q [T, heads, head_dim]) over their
    sequences' blocks, written to the same rows of `out` ([T, heads, v dim], new if None;
    other rows untouched)."""
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, vdim = v_cache.shape
    if block_size < 16:
        raise ValueError("the prefill kernel takes blocks of at least 16 slots")
    q, tables = q.contiguous(), tables.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(tokens, heads, vdim, dtype=q.dtype, device=q.device)
    stride_kb, stride_ks, stride_kh = _pool_strides(k_cache)
    # float32 products where the pool is float32, and under the interpreter (its dot of
    # bf16 is not bf16 arithmetic); on a GPU, bf16 products into float32 sums
    ieee = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _prefill_tile[(tiles.shape[1], heads)](
        q, k_cache, v_cache, out, tables, tiles[0], tiles[1], tiles[2], tiles[3],
        stride_kb, stride_ks, stride_kh, tables.stride(0), scale,
        HEADS=heads, GROUP=heads // kv_heads, DIM=dim, DIM_P=max(next_power_of_2(dim), 16),
        VDIM=vdim, VDIM_P=max(next_power_of_2(vdim), 16), BS=block_size, BLOCK_M=BLOCK_M,
        IEEE=ieee,
    )  # fmt: skip
    return out
