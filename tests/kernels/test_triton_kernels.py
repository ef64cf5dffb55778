"""The GPU path's Triton kernels against their PyTorch references, on CPU under Triton's
interpreter (kernels/triton_support.py sets TRITON_INTERPRET=1 where there is no CUDA):
paged attention (split-K decode with GQA, prefill tiles over chunked and cached context),
the fused residual + RMSNorm, SiLU * up and RoPE, and a whole engine through them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from infire.kernels.triton_support import triton_reason

pytestmark = pytest.mark.skipif(triton_reason() is not None, reason=str(triton_reason()))

BLOCKS, BS, KV_HEADS, HEADS, DIM = 24, 16, 2, 8, 32


def _pool(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(BLOCKS, BS, KV_HEADS, DIM, generator=generator)
    v = torch.randn(BLOCKS, BS, KV_HEADS, DIM, generator=generator)
    return k.to(dtype), v.to(dtype)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: list[int],
               keys: int) -> torch.Tensor:  # fmt: skip
    """q [HEADS, DIM] over the first `keys` keys of `table`, float64 SDPA."""
    slots = torch.arange(keys)
    blocks = torch.tensor(table)[slots // BS]
    kk = k[blocks, slots % BS].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    vv = v[blocks, slots % BS].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = F.scaled_dot_product_attention(
        q.double()[:, None], kk.transpose(0, 1), vv.transpose(0, 1), scale=DIM**-0.5
    )
    return out[:, 0]


TABLES = [[3, 7, 1, 12, 0, 0], [5, 2, 9, 4, 8, 11], [20]]


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_decode_attention_reads_the_blocks_in_splits(splits: int) -> None:
    """Split-K decode with GQA (4 query heads a kv head): 50, 90 and 1 keys, over 1 to 4
    splits (with 4, the first sequence's last split has no block: it weighs nothing)."""
    from infire.kernels.triton_attention import paged_decode

    k, v = _pool()
    tables = torch.tensor([t + [0] * (6 - len(t)) for t in TABLES], dtype=torch.int32)
    lengths = torch.tensor([50, 90, 1])
    q = torch.randn(3, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    out = paged_decode(q, k, v, tables, lengths, DIM**-0.5, splits)
    for b, table in enumerate(TABLES):
        want = _reference(q[b], k, v, table, int(lengths[b]))
        assert (out[b].double() - want).abs().max().item() <= 1e-5
    alone = paged_decode(q[1:2], k, v, tables[1:2], lengths[1:2], DIM**-0.5, splits)
    assert torch.equal(alone[0], out[1])  # a row does not depend on its batch


def test_prefill_attention_over_chunked_and_cached_context() -> None:
    """Tiles of up to 16 queries: a 20-token chunk after 30 cached keys, a 35-token chunk
    after 55, and a fresh 3-token prompt, each causal over its own blocks."""
    from infire.kernels.triton_attention import paged_prefill, prefill_tiles

    k, v = _pool()
    tables = torch.tensor([t + [0] * (6 - len(t)) for t in TABLES], dtype=torch.int32)
    starts, counts, rows = [30, 55, 0], [20, 35, 3], [0, 20, 55]
    q = torch.randn(58, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    tiles = prefill_tiles(rows, counts, starts, torch.device("cpu"))
    assert tiles.shape[1] == 2 + 3 + 1
    out = paged_prefill(q, k, v, tables, tiles, DIM**-0.5)
    for s, table in enumerate(TABLES):
        for i in range(counts[s]):
            want = _reference(q[rows[s] + i], k, v, table, starts[s] + i + 1)
            assert (out[rows[s] + i].double() - want).abs().max().item() <= 1e-5


def test_attention_with_a_bf16_pool() -> None:
    from infire.kernels.triton_attention import paged_decode, paged_prefill, prefill_tiles

    k, v = _pool(torch.bfloat16)
    tables = torch.tensor([TABLES[1]], dtype=torch.int32)
    q = torch.randn(20, HEADS, DIM, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = paged_decode(q[:1], k, v, tables, torch.tensor([77]), DIM**-0.5)
    assert out.dtype == torch.bfloat16
    assert (
        out[0].double() - _reference(q[0].float(), k.float(), v.float(), TABLES[1], 77)
    ).abs().max() < 2e-2
    tiles = prefill_tiles([0], [20], [40], torch.device("cpu"))
    out = paged_prefill(q, k, v, tables, tiles, DIM**-0.5)
    for i in range(20):
        want = _reference(q[i].float(), k.float(), v.float(), TABLES[1], 40 + i + 1)
        assert (out[i].double() - want).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_activation_and_rope_match_pytorch(dtype: torch.dtype) -> None:
    """bf16: bit for bit (the kernels round where PyTorch rounds); float32: to rounding."""
    from infire.kernels.triton_ops import add_rms_norm, rotary, silu_and_mul
    from infire.layers.mlp import gated_activation
    from infire.layers.norm import RMSNorm
    from infire.layers.rotary import RotaryEmbedding, apply_rotary

    generator = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(5, 96, generator=generator).to(dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=generator).to(dtype)
    out, summed = add_rms_norm(x, norm.weight, 1e-5, residual)
    want, want_sum = norm(x, residual)
    gate_up = torch.randn(7, 200, generator=generator).to(dtype)
    cos_sin = RotaryEmbedding(64, 4096, 10000.0, None).cos_sin(torch.arange(3, 9), dtype)
    qk = torch.randn(6, 5, 64, generator=generator).to(dtype)
    pairs = [(out, want), (summed, want_sum), (add_rms_norm(x, norm.weight, 1e-5), norm(x)),
             (silu_and_mul(gate_up), gated_activation(gate_up, "silu")),
             (rotary(qk, cos_sin), apply_rotary(qk, cos_sin))]  # fmt: skip
    for got, expected in pairs:
        assert got.dtype == dtype and got.shape == expected.shape
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_an_engine_through_the_triton_kernels_gives_the_pytorch_paths_tokens(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, seeded: bool
) -> None:
    """The tiny Llama (GQA 4:2) served with INFIRE_TRITON=1 on CPU (every attention, norm,
    SiLU and RoPE through the kernels, under the interpreter): continuous batching, chunked
    prefill (16-token steps) and prefix-cache hits give the PyTorch path's tokens."""
    from infire import SamplingParams
    from infire.config import CacheConfig, EngineConfig, SchedulerConfig
    from infire.engine import merge_delta
    from infire.engine.engine import LLMEngine

    shared = [(5 * j) % 200 + 3 for j in range(40)]
    prompts = [shared + [11, 12], [7, 8, 9], shared + [21], [(3 * j) % 97 + 1 for j in range(23)]]

    def run(mode: str) -> tuple[list[list[int]], LLMEngine]:
        monkeypatch.setenv("INFIRE_TRITON", mode)
        engine = LLMEngine(EngineConfig(
            model=str(tiny_llama), dtype="float32", cpu_kernels=False,
            cache=CacheConfig(num_blocks=64, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=16),
        ))  # fmt: skip
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.8 if seeded else 0, seed=i, max_tokens=6,
                                    ignore_eos=True)  # fmt: skip
            engine.add_request(f"r{i}", prompt, params)
        outputs: dict = {}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                outputs[delta.request_id] = merge_delta(outputs.get(delta.request_id), delta)
        return [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))], engine

    reference, _ = run("0")
    got, engine = run("1")
    assert engine.runner.triton  # the kernels really served
    assert got == reference
    assert engine.stats.prefix_cache_hits > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_palette_matmul_equals_decode_then_multiply_bit_for_bit(activations: torch.dtype) -> None:
    """Unweight's palette form rebuilt inside the matmul: the same products as the same
    kernel over the dense bf16 weight, to the bit, with runs whose exponents leave the
    palette (kept verbatim); and x @ W^T to float32 rounding."""
    from infire.kernels.triton_palette import (
        dense_matmul,
        pack_palette,
        palette_decode,
        palette_matmul,
    )

    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(70, 192, generator=generator) * 0.05).bfloat16()  # rows not a tile
    weight[3, 70], weight[50, 191], weight[69, 0] = 3.0, -1e-30, 200.0  # outside the palette
    packed = pack_palette(weight)
    assert int((packed.chunk_offset >= 0).sum()) == 3
    assert torch.equal(palette_decode(packed), weight)  # the decode kernel: the same bits
    assert packed.indices.numel() + packed.rest.numel() == weight.numel() * 3 // 2  # 12 bits
    x = torch.randn(19, 192, generator=generator).to(activations)
    got = palette_matmul(x, packed)
    assert got.dtype == torch.float32 and got.shape == (19, 70)
    assert torch.equal(got, dense_matmul(x, weight))
    want = x.double() @ weight.double().T
    assert ((got.double() - want).abs() / want.abs().clamp(min=1)).max().item() < 1e-5
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_palette(weight[:, :100])


def test_a_palette_folder_is_served_through_the_triton_matmul(
    tiny_llama_bf16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`INFIRE_TRITON=1` (on CPU, the interpreter) with the fused CPU forward off: an
    Unweight palette folder keeps its matmul weights in the palette form (no dense copy).
    Decoded for the matmul ("decode then multiply") it gives the bf16 original's tokens,
    and through the fused kernel too; the choice per batch bucket follows the timings it
    is given (on CUDA, measured at startup)."""
    from infire import LLM, SamplingParams
    from infire.kernels.triton_palette import PaletteChoice, pack_palette
    from infire.layers.linear import LinearBase
    from infire.unweight.container import compress_model

    compress_model(tiny_llama_bf16, tmp_path / "palette", "palette", progress=False)
    monkeypatch.setenv("INFIRE_TRITON", "1")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = ["hello there", "the quick brown fox jumps"]

    def run(folder: Path, mode: str) -> tuple[list[list[int]], LLM]:
        monkeypatch.setenv("INFIRE_PALETTE_MATMUL", mode)
        llm = LLM(str(folder), dtype="bfloat16", num_blocks=32, cpu_kernels=False)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm

    original, _ = run(tiny_llama_bf16, "auto")
    decoded, llm = run(tmp_path / "palette", "decode")
    assert decoded == original
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert all(m.palette is not None and m.weight.numel() == 0 for m in linears)
    assert "palette weights in the Triton matmul" in llm.engine.runner.fused_status
    fused, _ = run(tmp_path / "palette", "fused")
    # float32 sums of the same bf16 products in the kernel's order: the same greedy tokens
    # here (a near tie could part them, as any two matmuls' orders can)
    assert fused == original
    # the choice: decode at the buckets where the timer says decoding is faster
    choice = PaletteChoice("auto")
    weight = pack_palette(torch.randn(32, 64).bfloat16())
    choice.measure([weight], timer=lambda run: run() is None or 1.0)  # runs both, all equal
    assert not choice.decodes(weight, 1)  # a tie keeps the fused kernel
    choice.decode_faster[(32, 64, 16)] = True
    assert (
        choice.decodes(weight, 9) and choice.decodes(weight, 16) and not choice.decodes(weight, 17)
    )


@pytest.mark.parametrize("chunk", [64, 104])
def test_rans_form_decodes_to_the_weights_bits_and_refuses_damage(chunk: int) -> None:
    """The distribution form's kernel: every chunk (the last one short) decodes to the
    bf16 weights' bits; a flipped stream byte is refused, as by the CPU decoder."""
    import numpy as np

    from infire.kernels.triton_rans import decode_bf16
    from infire.unweight import rans

    weight = (torch.randn(3000, generator=torch.Generator().manual_seed(6)) * 0.05).bfloat16()
    weight[7] = 1e30  # a rare exponent
    bits = weight.view(torch.int16).numpy().view(np.uint16)
    exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
    rest = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    encoded = rans.encode(exponent, chunk=chunk)
    assert len(encoded.offsets) - 1 == -(-3000 // chunk)
    assert torch.equal(decode_bf16(encoded, rest, "cpu"), weight)
    assert np.array_equal(rans.decode(encoded), exponent)  # the CPU decoder agrees
    damaged = rans.Encoded(encoded.frequencies, encoded.stream.copy(), encoded.offsets,
                           encoded.count, encoded.chunk)  # fmt: skip
    damaged.stream[len(damaged.stream) // 2] ^= 0x55
    with pytest.raises(rans.CorruptStreamError, match="does not decode"):
        decode_bf16(damaged, rest, "cpu", "w")
    one = torch.full((10,), 0.5).bfloat16()  # one exponent: no stream
    one_bits = one.view(torch.int16).numpy().view(np.uint16)
    single = rans.encode(((one_bits >> 7) & 0xFF).astype(np.uint8))
    assert torch.equal(decode_bf16(single, np.zeros(10, np.uint8), "cpu"), one)


def test_decode_steps_through_the_graph_buffers_give_the_eager_tokens(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA graphs cannot be captured on CPU; this runs everything around them: decode
    steps go through DecodeGraphs' static buffers (one packed copy of the step's inputs,
    the bucket's padding rows writing to a sink block no sequence holds) with a stand-in
    whose replay runs the captured forward eagerly. Tokens equal the plain eager engine's,
    with batches of 1-3 decodes in buckets of 1, 2 and 4."""
    from infire import SamplingParams
    from infire.config import CacheConfig, EngineConfig, SchedulerConfig
    from infire.engine import merge_delta
    from infire.engine.cuda_graphs import DecodeGraphs, buckets
    from infire.engine.engine import LLMEngine

    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64] and buckets(6) == [1, 2, 4, 6]
    monkeypatch.setenv("INFIRE_TRITON", "1")
    prompts = [[5, 6, 7, 8, 9], [(3 * j) % 97 + 1 for j in range(20)], [11, 12]]

    class Replay:  # stands in for torch.cuda.CUDAGraph: the same forward, run eagerly
        def __init__(self, graphs: DecodeGraphs, b: int) -> None:
            self.graphs, self.b = graphs, b

        def replay(self) -> None:
            self.graphs.logits[self.b].copy_(self.graphs._forward(self.b))

    def run(graphed: bool) -> tuple[list[list[int]], int]:
        engine = LLMEngine(EngineConfig(
            model=str(tiny_llama), dtype="float32", cpu_kernels=False,
            cache=CacheConfig(num_blocks=32, block_size=16, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=4),
        ))  # fmt: skip
        runner, replays = engine.runner, [0]
        if graphed:
            sink = engine.block_manager.pool.take()  # never a sequence's
            graphs = DecodeGraphs(runner, 4, 8, sink)
            for b in graphs.buckets:
                graphs.graphs[b] = Replay(graphs, b)  # type: ignore[assignment]
                graphs.logits[b] = torch.empty(b, runner.config.vocab_size)
            runner.graphs = graphs
            original = graphs.run

            def counted(batch: list, b: int) -> torch.Tensor:
                replays[0] += 1
                return original(batch, b)

            graphs.run = counted  # type: ignore[method-assign]
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params)
        outputs: dict = {}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                outputs[delta.request_id] = merge_delta(outputs.get(delta.request_id), delta)
        tokens = [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]
        return tokens, replays[0]

    eager, _ = run(False)
    graphed, replays = run(True)
    assert graphed == eager
    assert replays >= 8  # the decode steps really went through the buffers


def test_an_unweight_source_decodes_rans_tensors_on_the_weights_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the Triton kernels serve the device the weights go to (here the CPU under the
    interpreter, INFIRE_TRITON=1), an Unweight folder's bf16 rANS tensors are decoded there
    by the kernel: the original bits; other forms and dtypes take the CPU decoder; a
    damaged stream is refused naming the tensor."""
    from infire.unweight import UnweightError, compress_tensor
    from infire.unweight.container import UnweightSource, open_weights, save

    generator = torch.Generator().manual_seed(7)
    tensors = {
        "a.weight": (torch.randn(24, 80, generator=generator) * 0.05).bfloat16(),
        "b.weight": (torch.randn(40, 16, generator=generator) * 0.05).bfloat16(),
        "norm.weight": torch.randn(16, generator=generator),  # float32: the CPU decoder
    }
    compressed = {name: compress_tensor(t, "rans") for name, t in tensors.items()}
    folder, damaged = tmp_path / "folder", tmp_path / "damaged"
    save(compressed, folder)
    monkeypatch.setenv("INFIRE_TRITON", "1")
    source = open_weights(folder, None, device="cpu")
    assert source.decode_device == "cpu"
    for name, tensor in tensors.items():
        got = source.decode(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor)
    stream = compressed["a.weight"].arrays["stream"]
    stream[len(stream) // 2] ^= 0x55
    save(compressed, damaged)
    with pytest.raises(UnweightError, match="a.weight"):
        UnweightSource(damaged, None, "cpu").decode("a.weight")
    monkeypatch.setenv("INFIRE_TRITON", "0")
    assert UnweightSource(folder, None, "cpu").decode_device is None  # the CPU decoder
