"""bf16 weights held in Unweight's palette form by the fused CPU forward: the same logits,
bit for bit, as the bf16 tiles, with a quarter less weight memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_cpu_forward import _fused_logits

from infire import LLM, SamplingParams
from infire.config import CacheConfig
from infire.engine.kv_cache import BlockManager
from infire.engine.request import Sequence
from infire.engine.runner import ModelRunner
from infire.kernels import cpu_forward
from infire.models.loader import load_model
from infire.outputs import RequestMetrics
from infire.tokenizer import IncrementalDetokenizer
from infire.unweight.container import compress_model

pytestmark = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")),
    reason="the fused forward needs AVX2",
)


def _decode_reference(arrays: dict[str, torch.Tensor], rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] bf16 weight back from palette_tile_weight's arrays, in NumPy: the
    format as documented, independent of the C kernel."""
    a = {k: v.numpy() for k, v in arrays.items()}
    chunks = a["chunks"].reshape(-1, 96)
    index = np.empty((len(chunks), 64), dtype=np.uint8)
    for half in range(2):
        packed = chunks[:, 16 * half : 16 * half + 16]
        index[:, 32 * half : 32 * half + 16] = packed & 0x0F
        index[:, 32 * half + 16 : 32 * half + 32] = packed >> 4
    exponent = a["palette"][index].astype(np.uint16)
    exponent[a["flags"].astype(bool)] = a["verbatim"]
    rest = chunks[:, 32:].astype(np.uint16)
    stored = ((rest & 0x80) << 8) | (exponent << 7) | (rest & 0x7F)
    tile_order = np.empty_like(stored)
    tile_order[:, cpu_forward._PALETTE_ORDER] = stored
    padded = -(-rows // 4) * 4
    full = tile_order.reshape(padded // 4, cols // 16, 4, 16).transpose(0, 2, 1, 3)
    bits = full.reshape(padded, cols)[:rows]
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)


def _spread(weight: torch.Tensor, seed: int) -> torch.Tensor:
    """Scale every weight by its own power of two: most 4x16 chunks leave any palette."""
    g = torch.Generator().manual_seed(seed)
    return (weight.float() * 2.0 ** torch.randint(-30, 30, weight.shape, generator=g)).to(
        torch.bfloat16
    )


@pytest.mark.parametrize("case", ["normal", "spread", "one exponent", "rows not a multiple of 4"])
def test_palette_tile_weight_keeps_every_bit(case: str):
    g = torch.Generator().manual_seed(1)
    rows = 30 if case == "rows not a multiple of 4" else 32
    weight = torch.randn(rows, 48, generator=g).to(torch.bfloat16)
    if case == "spread":
        weight = _spread(weight, 2)
    if case == "one exponent":
        signs = torch.randint(0, 2, (rows, 48), generator=g) * 2 - 1
        weight = (signs * (1 + torch.rand(rows, 48, generator=g) * 0.99)).to(torch.bfloat16)
    weight[0, :3] = torch.tensor([float("inf"), -0.0, float("nan")])
    arrays = cpu_forward.palette_tile_weight(weight)
    flags = arrays["flags"].numpy()
    assert len(flags) == (-(-rows // 4)) * 3 and arrays["chunks"].shape == (len(flags), 96)
    if case == "spread":
        assert flags.mean() > 0.9
    if case == "one exponent":
        assert not flags.any()  # exponents 127, 0 (-0.0) and 255 (inf, nan): all in the palette
        assert arrays["palette"].tolist() == [0, 127, 255] + [0] * 13
    assert len(arrays["verbatim"]) == flags.sum()
    decoded = _decode_reference(arrays, rows, 48)
    assert torch.equal(decoded.view(torch.int16), weight.view(torch.int16))


def _runner(weights: dict[str, torch.Tensor], folder: Path, palette: bool) -> ModelRunner:
    config = load_model(folder, torch.bfloat16).config
    runner = ModelRunner(config, weights, CacheConfig(num_blocks=64), torch.bfloat16,
                         palette=palette)  # fmt: skip
    assert runner.fused_status == ("active, palette weights" if palette else "active")
    return runner


def _logits(runner: ModelRunner, folder: Path, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Logits of a prefill of prompt, then of `steps` greedy decodes, fused."""
    seq = Sequence(
        seq_id=0, request_id="r", index=0, prompt_token_ids=list(prompt),
        params=SamplingParams(temperature=0), metrics=RequestMetrics(0.0),
        detokenizer=IncrementalDetokenizer(load_model(folder, torch.bfloat16).tokenizer),
    )  # fmt: skip
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    out = [_fused_logits(runner, blocks, seq, len(prompt))]
    for _ in range(steps):
        seq.token_ids.append(int(out[-1].argmax()))
        out.append(_fused_logits(runner, blocks, seq, 1))
    return out


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])  # untied; tied with biases
@pytest.mark.parametrize("spread", [False, True])
def test_palette_forward_equals_bf16_bit_for_bit(
    fixture: str, spread: bool, request: pytest.FixtureRequest
):
    folder = request.getfixturevalue(fixture)
    weights = load_model(folder, torch.bfloat16).weights
    if spread:
        weights = {k: _spread(v, i) if v.dim() == 2 else v for i, (k, v) in
                   enumerate(weights.items())}  # fmt: skip
    prompt = list(range(7, 41))  # 34 tokens: a block of 32 (scratch tiles), then 2 (registers)
    dense = _runner(dict(weights), folder, palette=False)
    held = _runner(dict(weights), folder, palette=True)
    for a, b in zip(
        _logits(dense, folder, prompt, 6), _logits(held, folder, prompt, 6), strict=True
    ):
        assert torch.equal(a, b)
    # the palette runner keeps no bf16 copy of the matmuls or the embedding
    assert held.model.embed_tokens.weight.numel() == 0
    assert held.model.layers[0].mlp.down_proj.weight.numel() == 0
    if not spread:
        assert held.fused.weight_bytes < 0.8 * dense.fused.weight_bytes


def test_palette_folder_is_served_compressed(tmp_path: Path, tiny_llama_bf16: Path):
    """`LLM(folder)` of a palette-form folder holds the palette form and generates the same
    tokens as the bf16 original; served in float32 it is decoded at load."""
    compress_model(tiny_llama_bf16, tmp_path / "palette", "palette", progress=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["hello there", "the quick brown fox"]
    tokens = {}
    for folder in (tiny_llama_bf16, tmp_path / "palette"):
        llm = LLM(str(folder), dtype="bfloat16", num_blocks=64)
        tokens[folder] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        status = llm.engine.runner.fused_status
        assert status == ("active" if folder == tiny_llama_bf16 else "active, palette weights")
    assert tokens[tmp_path / "palette"] == tokens[tiny_llama_bf16]
    llm = LLM(str(tmp_path / "palette"), dtype="float32", num_blocks=64)
    assert llm.engine.runner.fused_status == "active, palette weights decoded"
