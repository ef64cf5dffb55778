"""GGUF loading: SmolLM2 against transformers' own GGUF loader, and tiny files written here."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from infire.config import RopeScaling
from infire.errors import ModelLoadError, UnsupportedModelError
from infire.models.gguf import load_gguf

# --- SmolLM2-135M-Instruct (the default model) vs transformers -----------------------------

TEXTS = [
    "Hello world",
    "12345",
    "The year 2024 had 366 days.",
    "def f(x):\n    return x**2  # square\n",
    "héllo 😀 日本語 — naïve café",
    "<|im_start|>user\nhi<|im_end|>\n",
    "   leading spaces and trailing  ",
    "tabs\tand\r\nnewlines\n\n\nend",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path):
    return load_gguf(smollm2_path, torch.float32)


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_path: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name
    )


def test_smollm2_weights_equal_transformers(smollm2, smollm2_reference):
    _, weights, _ = smollm2
    reference = smollm2_reference.state_dict()
    # Tied head: transformers lists lm_head.weight (the embedding); we leave it out.
    assert set(weights) == set(reference) - {"lm_head.weight"}
    different = [name for name in weights if not torch.equal(weights[name], reference[name])]
    assert different == []
    assert torch.equal(reference["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_smollm2_config_matches_transformers(smollm2, smollm2_reference):
    config, _, _ = smollm2
    ref = smollm2_reference.config
    rope_theta = getattr(ref, "rope_theta", None) or ref.rope_parameters["rope_theta"]
    assert config.architecture == "llama"
    assert config.hidden_size == ref.hidden_size == 576
    assert config.intermediate_size == ref.intermediate_size
    assert config.num_hidden_layers == ref.num_hidden_layers == 30
    assert config.num_attention_heads == ref.num_attention_heads
    assert config.num_key_value_heads == ref.num_key_value_heads
    assert config.head_dim == ref.head_dim
    assert config.vocab_size == ref.vocab_size == 49152
    assert config.max_position_embeddings == ref.max_position_embeddings
    assert config.rope_theta == rope_theta
    assert config.rms_norm_eps == ref.rms_norm_eps
    assert config.tie_word_embeddings is ref.tie_word_embeddings is True
    assert config.rope_scaling is None and config.attention_bias is False
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_matches_transformers(smollm2, reference_tokenizer, text):
    _, _, tokenizer = smollm2
    ids = tokenizer.encode(text)
    assert ids == reference_tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_smollm2_splits_digits_like_the_original_tokenizer(smollm2):
    # SmolLM2's tokenizer.json pre-tokenizes with Digits(individual_digits=True) before the
    # GPT-2 regex (llama.cpp's "smollm" pre-tokenizer does the same). transformers' GGUF
    # converter drops the Digits step, which changes the result only where spaces run into a
    # digit: "a  1" becomes a, Ġ, Ġ, 1 there, but a, ĠĠ, 1 in the original (the run of spaces
    # is its own pre-token, and "Ġ Ġ" is a merge). So these are checked against the original.
    _, _, tokenizer = smollm2
    expected = {
        "a  1": ["a", "ĠĠ", "1"],
        "x    12 apples": ["x", "ĠĠĠĠ", "1", "2", "Ġapples"],
        "v2.10": ["v", "2", ".", "1", "0"],
    }
    for text, pieces in expected.items():
        ids = tokenizer.encode(text)
        assert [tokenizer.backend.id_to_token(i) for i in ids] == pieces
        assert tokenizer.decode(ids) == text


def test_smollm2_special_tokens_and_chat_template(smollm2, reference_tokenizer):
    _, _, tokenizer = smollm2
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.decode([1, 4093, 2]) == "user"  # specials skipped by default
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


# --- errors ----------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path: Path):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _write(writer)
    with pytest.raises(UnsupportedModelError, match="'falcon'") as info:
        load_gguf(path, torch.float32)
    assert "model.gguf" in str(info.value) and "llama" in str(info.value)


def test_garbage_file(tmp_path: Path):
    path = tmp_path / "x.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="x.gguf") as info:
        load_gguf(path, torch.float32)
    assert type(info.value) is ModelLoadError


@pytest.mark.parametrize("fraction", [None, 0.5])  # None: the first 1 MB (inside the metadata)
def test_truncated_file(tmp_path: Path, smollm2_path: Path, fraction: float | None):
    data = smollm2_path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: 1024**2] if fraction is None else data[: int(len(data) * fraction)])
    with pytest.raises(ModelLoadError, match="cut.gguf") as info:
        load_gguf(path, torch.float32)
    assert type(info.value) is ModelLoadError


def test_missing_file(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf", torch.float32)


def test_unsupported_tensor_type(tmp_path: Path):
    path = tmp_path / "ints.gguf"
    _write_tiny(path, embed_dtype=np.int32)
    with pytest.raises(UnsupportedModelError, match="token_embd.weight.*I32"):
        load_gguf(path, torch.float32)


# --- tiny files written with GGUFWriter ------------------------------------------------

HIDDEN, FFN, LAYERS = 64, 96, 2
TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
    "h", "e", "l", "o", "w", "r", "d", "Ġ", "he", "ll", "hell", "hello", "Ġw",
]  # fmt: skip
TOKEN_TYPES = [3, 3, 3, 4] + [1] * (len(TOKENS) - 4)
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
# A sentencepiece (Llama 2 style) vocabulary: no merges, scores rank the pieces, and
# <0xNN> byte tokens (type 6) catch everything else.
SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "▁h", "he", "ll", "▁he", "hell", "▁hell", "▁hello"]
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
SPM_TOKEN_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
SPM_SCORES = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]


def _permute_like_llama_cpp(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _llama3_rope_freqs(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """llama.cpp's converter: one divisor per rotary frequency."""
    original, low, high = (
        scaling.original_max_position_embeddings,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
    )
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(scaling.factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_tiny(
    path: Path,
    arch: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tied: bool = True,
    bias: bool = False,
    rope_theta: float = 10000.0,
    rope_freqs: np.ndarray | None = None,
    embed_dtype: type = np.float32,
    sentencepiece: bool = False,
    name: str = "tiny",
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF the way llama.cpp's converter would; return its HF-layout weights."""
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // num_heads

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(rope_theta)
    if sentencepiece:
        tokens = SPM_TOKENS
        writer.add_tokenizer_model("llama")
        writer.add_token_list(SPM_TOKENS)
        writer.add_token_types(SPM_TOKEN_TYPES)
        writer.add_token_scores(SPM_SCORES)
        writer.add_unk_token_id(0)
    else:
        tokens = TOKENS
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(TOKENS)
        writer.add_token_types(TOKEN_TYPES)
        writer.add_token_merges(MERGES)
        writer.add_add_bos_token(True)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")

    hf = {"model.embed_tokens.weight": rand(len(tokens), HIDDEN)}
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"].astype(embed_dtype))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        q, k = rand(num_heads * head_dim, HIDDEN), rand(num_kv_heads * head_dim, HIDDEN)
        v = rand(num_kv_heads * head_dim, HIDDEN).astype(np.float16)
        if arch == "llama":  # Qwen2's converter does not permute
            q_stored, k_stored = (
                _permute_like_llama_cpp(q, num_heads),
                _permute_like_llama_cpp(k, num_kv_heads),
            )
        else:
            q_stored, k_stored = q, k
        writer.add_tensor(f"blk.{i}.attn_q.weight", q_stored)
        writer.add_tensor(f"blk.{i}.attn_k.weight", k_stored)
        writer.add_tensor(f"blk.{i}.attn_v.weight", v)  # F16
        hf |= {f"{prefix}.self_attn.q_proj.weight": q, f"{prefix}.self_attn.k_proj.weight": k}
        hf[f"{prefix}.self_attn.v_proj.weight"] = v.astype(np.float32)
        if bias:
            for name, rows in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
                hf[f"{prefix}.self_attn.{name}_proj.bias"] = b = rand(rows * head_dim)
                writer.add_tensor(f"blk.{i}.attn_{name}.bias", b)
        down = rand(HIDDEN, FFN)
        writer.add_tensor(
            f"blk.{i}.ffn_down.weight",
            gguf.quants.quantize(down, gguf.GGMLQuantizationType.Q8_0),
            raw_dtype=gguf.GGMLQuantizationType.Q8_0,
        )
        hf[f"{prefix}.mlp.down_proj.weight"] = down  # approximate: Q8_0
        for gguf_name, hf_name, shape in (
            ("attn_output", "self_attn.o_proj", (HIDDEN, num_heads * head_dim)),
            ("ffn_gate", "mlp.gate_proj", (FFN, HIDDEN)),
            ("ffn_up", "mlp.up_proj", (FFN, HIDDEN)),
            ("attn_norm", "input_layernorm", (HIDDEN,)),
            ("ffn_norm", "post_attention_layernorm", (HIDDEN,)),
        ):
            hf[f"{prefix}.{hf_name}.weight"] = tensor = rand(*shape)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", tensor)
    hf["model.norm.weight"] = rand(HIDDEN)
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if not tied:
        hf["lm_head.weight"] = rand(len(tokens), HIDDEN)
        writer.add_tensor("output.weight", hf["lm_head.weight"])
    _write(writer)
    return hf


@pytest.mark.parametrize(
    ("arch", "tied", "bias"),
    [("llama", True, False), ("llama", False, False), ("qwen2", True, True)],
)
def test_tiny_model_config_and_weights(tmp_path: Path, arch: str, tied: bool, bias: bool):
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny(path, arch=arch, tied=tied, bias=bias)
    config, weights, _ = load_gguf(path, torch.float32)

    assert config.architecture == arch
    assert (config.vocab_size, config.hidden_size) == (len(TOKENS), HIDDEN)
    assert (config.num_hidden_layers, config.intermediate_size) == (LAYERS, FFN)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.max_position_embeddings == 128 and config.rope_theta == 10000.0
    assert config.rms_norm_eps == pytest.approx(1e-6)
    assert config.tie_word_embeddings is tied and config.attention_bias is bias
    assert config.rope_scaling is None
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)

    assert set(weights) == set(expected)
    for name, values in expected.items():
        assert weights[name].shape == values.shape, name
        if "down_proj" in name:  # Q8_0: one scale per 32 values, error below scale / 2
            assert torch.allclose(weights[name], torch.from_numpy(values), atol=0.03), name
        else:  # F32 / F16 (and the q/k un-permutation): exact
            assert torch.equal(weights[name], torch.from_numpy(values)), name


def test_mistral_is_told_apart_by_name(tmp_path: Path):
    # llama.cpp writes Mistral as architecture "llama" (q/k permuted like Llama).
    path = tmp_path / "mistral.gguf"
    expected = _write_tiny(path, name="Mistral 7B Instruct v0.3")
    config, weights, _ = load_gguf(path, torch.float32)
    assert config.architecture == "mistral"
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(weights[q], torch.from_numpy(expected[q]))


def test_tiny_model_converts_to_dtype(tmp_path: Path):
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    _, full, _ = load_gguf(path, torch.float32)
    _, half, _ = load_gguf(path, torch.bfloat16)
    assert all(torch.equal(half[name], full[name].to(torch.bfloat16)) for name in full)


def test_tiny_model_tokenizer(tmp_path: Path):
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    _, _, tokenizer = load_gguf(path, torch.float32)
    ids = tokenizer.encode("hello world")
    pieces = [tokenizer.backend.id_to_token(i) for i in ids]
    assert pieces == ["<|im_start|>", "hello", "Ġw", "o", "r", "l", "d"]  # BOS added: add_bos_token
    assert tokenizer.decode(ids) == "hello world"
    # Control tokens are special and whole; user-defined <think> is whole but not special.
    assert tokenizer.encode("<|im_end|><think>hello", add_special_tokens=False) == [2, 3, 15]
    assert tokenizer.decode([2, 3, 15]) == "<think>hello"
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi"


@pytest.mark.parametrize("num_heads", [1, 4])  # head_dim 64: fitted; head_dim 16: defaults
def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path, num_heads: int):
    path = tmp_path / "llama3.gguf"
    scaling = RopeScaling(8.0, 1.0, 4.0, 8192)
    freqs = _llama3_rope_freqs(HIDDEN // num_heads, 500000.0, scaling)
    _write_tiny(path, num_heads=num_heads, num_kv_heads=1, rope_theta=500000.0, rope_freqs=freqs)
    config, weights, _ = load_gguf(path, torch.float32)
    assert config.rope_scaling == scaling
    assert "rope_freqs.weight" not in weights


def test_tiny_sentencepiece_tokenizer_matches_transformers(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "spm.gguf"
    _write_tiny(path, sentencepiece=True)
    _, _, tokenizer = load_gguf(path, torch.float32)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello", "hello hello world", " hello", "héllo\n", "</s>hell"]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert ids[0] == 1  # no add_bos_token key: sentencepiece files add BOS, as llama.cpp does
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("chunk", [None, 64])  # 64 values: many chunks per tensor
def test_slices_equal_the_whole_tensor(tmp_path: Path, chunk: int | None, monkeypatch):
    """A rank's rows (whole heads of a permuted q/k, Q8_0 rows) or columns, dequantized
    alone and in chunks, are exactly the rows or columns of the whole tensor."""
    from infire.models import gguf as infire_gguf

    path = tmp_path / "tiny.gguf"
    _write_tiny(path, bias=True)
    _, whole, _ = load_gguf(path, torch.float32)
    full = {name: whole[name] for name in whole}
    if chunk:
        from infire.models import weights as weights_module

        monkeypatch.setattr(infire_gguf, "_CHUNK_VALUES", chunk)
        monkeypatch.setattr(weights_module, "PIECE_VALUES", chunk)
    _, weights, _ = load_gguf(path, torch.float32)
    head_dim = HIDDEN // 4
    for name, tensor in full.items():
        rows = tensor.shape[0]
        step = head_dim if rows % head_dim == 0 else 1
        for start in range(0, rows, max(step, rows // 2)):
            part = weights.read(name, 0, start, min(step, rows - start))
            assert torch.equal(part, tensor[start : start + part.shape[0]]), name
        out = torch.empty_like(tensor)
        weights.read_into(out, name)  # in pieces of whole heads for q and k
        assert torch.equal(out, tensor), name
        if tensor.dim() == 2:
            assert torch.equal(weights.read(name, 1, 8, 24), tensor[:, 8:32]), name
            out = torch.empty(rows, 24)
            weights.read_into(out, name, 1, 8, 24)
            assert torch.equal(out, tensor[:, 8:32]), name
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="splits a head"):
        weights.read(q, 0, 1, head_dim)


def test_blocks_are_the_stored_rows_in_the_models_order(tmp_path: Path):
    """GGUFSource.blocks: a 2-D weight's blocks as stored (q/k rows un-permuted as whole
    rows), which decode to exactly the tensor the source reads; none for 1-D tensors."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = tmp_path / "tiny.gguf"
    _write_tiny(path, bias=True)
    _, weights, _ = load_gguf(path, torch.float32)
    kinds = set()
    for name in weights.names():
        found = weights.blocks(name)
        if len(weights.shape(name)) != 2:
            assert found is None, name
            continue
        kind, data, index = found
        kinds.add(GGMLQuantizationType(kind))
        assert (index is not None) == (".q_proj." in name or ".k_proj." in name), name
        rows = data.numpy() if index is None else data.numpy()[index.numpy()]
        decoded = dequantize(rows, GGMLQuantizationType(kind))
        assert torch.equal(
            torch.from_numpy(decoded.reshape(weights.shape(name))), weights.read(name)
        )
    assert GGMLQuantizationType.Q8_0 in kinds
