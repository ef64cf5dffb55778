"""GGUF reader: one llama.cpp model file -> (ModelConfig, weights by Hugging Face name, Tokenizer).

A GGUF file carries everything a model folder would: hyper-parameters and the tokenizer as
metadata, weights as (often quantized) tensors under llama.cpp's names. This module reads
it with the `gguf` package (no unpickling), and serves the weights as a lazy source that
dequantizes a tensor (or the rows of it a rank keeps) to `dtype` when the model asks,
under the Hugging Face name our model code loads, and undoes the one layout change llama.cpp's
converter makes (the q/k row permutation for its pairwise RoPE), so that the weights equal
what transformers produces from the same file. The tokenizer is rebuilt from the vocabulary
and merges in the metadata, with the pre-tokenizer of the model it came from.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from infire.config import ModelConfig, RopeScaling
from infire.errors import ModelLoadError, UnsupportedModelError
from infire.models.weights import WeightSource
from infire.tokenizer import Tokenizer

if TYPE_CHECKING:
    from infire.models.base import CausalLM
    from infire.models.registry import ModelFamily

# llama.cpp writes Mistral (and Llama 2/3, SmolLM, ...) with the Llama converter, which
# permutes q/k rows; Qwen2's converter leaves them as they are.
_PERMUTED_QK_ARCHITECTURES = ("llama", "mistral")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
# Experts stacked in one [experts, out, in] tensor: served as one tensor per expert.
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_UNBLOCKED = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3 RoPE scaling, folded into ModelConfig.rope_scaling

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4

# Pre-tokenizer regexes of the original tokenizer.json files, keyed by tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_NFC_PRE = ("qwen2", "deepseek-r1-qwen")  # Qwen2's tokenizer.json normalizes to NFC first


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, GGUFSource, Tokenizer]:
    """Open a GGUF file of a supported family: its config, HF-named weights (read lazily,
    as `dtype`) and tokenizer."""
    from infire.models.registry import family_of_gguf

    path = Path(path)
    reader, metadata = _open(path)
    file_arch = metadata.get("general.architecture")
    if not isinstance(file_arch, str):
        raise ModelLoadError(f"{path}: GGUF metadata has no general.architecture")
    family = family_of_gguf(file_arch, metadata, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = _model_config(metadata, tensors, file_arch, family, path)
    weights = GGUFSource(reader, tensors, config, file_arch, dtype, path, family.model_class)
    tokenizer = _load_tokenizer(metadata, config.eos_token_ids, path)
    return config, weights, tokenizer


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer and chat template of a GGUF file, without reading its weights."""
    path = Path(path)
    _, metadata = _open(path)
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return _load_tokenizer(metadata, () if eos is None else (int(eos),), path)


def _open(path: Path) -> tuple[GGUFReader, dict[str, Any]]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        reader = _PlainArrayReader(path, "r")
        return reader, {name: _field_value(field) for name, field in reader.fields.items()}
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors ... on bad bytes
        raise ModelLoadError(
            f"{path}: not a readable GGUF file (truncated or corrupt?): {e}"
        ) from None


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same bytes, still mapped.

    GGUFReader slices its `data` a few hundred thousand times to parse a vocabulary, and each
    slice of an np.memmap pays for the subclass's bookkeeping: 13 s instead of 3 s for
    SmolLM2's 49k tokens and merges. Arrays are read whole here instead of one element at
    a time: an array of numbers as one ndarray view, an array of strings as one list of
    str. That takes SmolLM2's metadata from 1.4 s to about 0.1 s. `_field_value` reads
    both forms.
    """

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs, count, item = orig_offs + 12, int(alen[0]), GGUFValueType(raw_itype[0])
        nptype = self.gguf_scalar_to_np.get(item)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return (
                12 + int(values.nbytes),
                [raw_itype, alen, values],
                [2],
                [GGUFValueType.ARRAY, item],
            )
        if item != GGUFValueType.STRING:  # nested arrays: GGUFReader's own way
            return super()._get_field_parts(orig_offs, raw_type)
        data, strings = memoryview(self._plain_data), []
        for _ in range(count):
            length = int.from_bytes(data[offs : offs + 8], "little")
            strings.append(_text(data[offs + 8 : offs + 8 + length]))
            offs += 8 + length
        return offs - orig_offs, [raw_itype, alen, strings], [2], [GGUFValueType.ARRAY, item]

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)
        self.mapping = getattr(value, "_mmap", None)  # the mmap.mmap, to release read pages


def _field_value(field: ReaderField) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or a list of them)."""
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.ARRAY:
        item = field.types[-1]
        whole = field.parts[field.data[0]] if len(field.data) == 1 else None
        if isinstance(whole, list):  # read whole by _PlainArrayReader: strings
            return whole
        if item == GGUFValueType.STRING:
            return [_text(field.parts[index]) for index in field.data]
        if item == GGUFValueType.ARRAY or not field.data:
            return []  # nested arrays: no key we read uses them
        return np.concatenate([field.parts[index] for index in field.data]).tolist()
    if kind == GGUFValueType.STRING:
        return _text(field.parts[field.data[0]])
    return field.parts[field.data[0]][0].item()


def _text(raw: np.ndarray) -> str:
    # Some vocabularies hold byte tokens that are not valid UTF-8 on their own.
    return bytes(raw).decode("utf-8", errors="replace")


# --- config ------------------------------------------------------------------------------


def _model_config(
    metadata: dict[str, Any],
    tensors: dict[str, ReaderTensor],
    file_arch: str,
    family: ModelFamily,
    path: Path,
) -> ModelConfig:
    def required(key: str) -> Any:
        value = metadata.get(f"{file_arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata has no {file_arch}.{key}")
        return value

    hidden_size = _scalar(required("embedding_length"), "embedding_length", path)
    num_heads = _scalar(required("attention.head_count"), "attention.head_count", path)
    num_kv_heads = _scalar(
        metadata.get(f"{file_arch}.attention.head_count_kv", num_heads), "head_count_kv", path
    )
    head_dim = metadata.get(f"{file_arch}.attention.key_length") or hidden_size // num_heads
    rotary_dim = metadata.get(f"{file_arch}.rope.dimension_count", head_dim)
    # MLA (deepseek2) rotates only its qk_rope_head_dim part, which its family reads
    if rotary_dim != head_dim and f"{file_arch}.attention.kv_lora_rank" not in metadata:
        raise UnsupportedModelError(
            f"{path}: partial RoPE (rope.dimension_count {rotary_dim}, head_dim {head_dim}) "
            "is not supported"
        )
    rope_theta = float(metadata.get(f"{file_arch}.rope.freq_base", 10000.0))
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    eos_ids = [
        metadata.get(f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    model_class = family.model_class
    try:
        extra = model_class.gguf_config_fields(metadata, file_arch)
    except KeyError as e:
        raise ModelLoadError(f"{path}: GGUF metadata has no {e.args[0]}") from None
    try:
        return model_class.config_class(
            architecture=_served_architecture(family.architecture, metadata),
            # The embedding's row count is what the logits are sized by; it equals the token
            # count of tokenizer.ggml.tokens except in vocabularies padded for alignment.
            vocab_size=int(tensors["token_embd.weight"].shape[-1]),
            hidden_size=hidden_size,
            intermediate_size=_scalar(required("feed_forward_length"), "feed_forward_length", path),
            num_hidden_layers=required("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=required("context_length"),
            rms_norm_eps=float(metadata.get(f"{file_arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(metadata, tensors, file_arch, head_dim, rope_theta, path),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
            **extra,
        )
    except ValueError as e:
        raise ModelLoadError(f"{path}: inconsistent GGUF metadata: {e}") from None


def _served_architecture(architecture: str, metadata: dict[str, Any]) -> str:
    # llama.cpp writes Mistral models as "llama"; like transformers, tell them apart by name.
    name = str(metadata.get("general.name", "")).lower()
    return "mistral" if architecture == "llama" and "mistral" in name else architecture


def _scalar(value: Any, key: str, path: Path) -> int:
    # Some converters write per-layer arrays; ours serve only uniform layers.
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedModelError(f"{path}: per-layer {key} {value[:8]}... is not supported")
        value = value[0]
    return int(value)


def _rope_scaling(
    metadata: dict[str, Any],
    tensors: dict[str, ReaderTensor],
    file_arch: str,
    head_dim: int,
    rope_theta: float,
    path: Path,
) -> RopeScaling | None:
    if _ROPE_FREQS in tensors:
        factors = _dequantize(tensors[_ROPE_FREQS], path).astype(np.float64).reshape(-1)
        original = metadata.get(f"{file_arch}.rope.scaling.original_context_length")
        return _llama3_scaling_from_factors(factors, head_dim, rope_theta, original, path)
    kind = metadata.get(f"{file_arch}.rope.scaling.type")
    factor = metadata.get(f"{file_arch}.rope.scaling.factor", 1.0)
    if kind in (None, "none") or factor == 1.0:
        return None
    if kind == "linear":
        return RopeScaling(float(factor), kind="linear")
    if kind == "yarn":
        return _yarn_scaling(metadata, file_arch, float(factor), path)
    raise UnsupportedModelError(
        f"{path}: RoPE scaling {kind!r} is not supported (supported: llama3-style "
        "rope_freqs, linear, yarn)"
    )


def _yarn_scaling(
    metadata: dict[str, Any], file_arch: str, factor: float, path: Path
) -> RopeScaling:
    """YaRN from llama.cpp's rope.scaling keys. Its deepseek2 converter writes 0.1 *
    mscale_all_dim as yarn_log_multiplier and drops mscale, which DeepSeek-V3 and Kimi K2
    set equal to mscale_all_dim."""
    key = f"{file_arch}.rope.scaling"
    original = metadata.get(f"{key}.original_context_length")
    if original is None:
        raise ModelLoadError(f"{path}: YaRN RoPE scaling without {key}.original_context_length")
    log_mul = metadata.get(f"{key}.yarn_log_multiplier")
    mscale = log_mul / 0.1 if log_mul and file_arch == "deepseek2" else None
    return RopeScaling(
        factor=factor, original_max_position_embeddings=int(original), kind="yarn",
        beta_fast=float(metadata.get(f"{key}.yarn_beta_fast", 32.0)),
        beta_slow=float(metadata.get(f"{key}.yarn_beta_slow", 1.0)),
        mscale=mscale, mscale_all_dim=mscale,
        attention_factor=metadata.get(f"{key}.yarn_attn_factor"),
    )  # fmt: skip


def _llama3_scaling_from_factors(
    factors: np.ndarray, head_dim: int, rope_theta: float, original: int | None, path: Path
) -> RopeScaling | None:
    """The RopeScaling whose per-frequency divisors are `factors` (llama.cpp's rope_freqs).

    llama.cpp stores only the divisors, not the four parameters. They depend on the
    parameters only through factor, original/low and original/high, so low_freq_factor = 1
    (as in every Llama 3.x) loses nothing: the two other ratios are fitted on the smoothly
    interpolated frequencies, and the result is checked to reproduce the divisors.
    """
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise ModelLoadError(
            f"{path}: rope_freqs has {factors.size} values, expected {inv_freq.size}"
        )
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    wavelen = 2 * math.pi / inv_freq
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    # smooth = original / wavelen / (high - low) - low / (high - low), linear in 1 / wavelen
    smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
    scaling = RopeScaling(factor, 1.0, 4.0, int(original or 8192))  # Llama 3 defaults
    if not medium.any():  # no smoothed band: low = high frequency factor (Llama 4 Scout)
        scaling = RopeScaling(factor, 1.0, 1.0, int(original or 8192))
    elif medium.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[medium], smooth, 1)
        if intercept < 0:
            scaling = RopeScaling(
                factor=factor,
                low_freq_factor=1.0,
                high_freq_factor=round(1 - 1 / intercept, 4),
                original_max_position_embeddings=round(slope / -intercept),
            )
    if not np.allclose(_llama3_factors(scaling, wavelen), factors, rtol=1e-4):
        raise UnsupportedModelError(f"{path}: rope_freqs does not follow Llama 3 RoPE scaling")
    return scaling


def _llama3_factors(scaling: RopeScaling, wavelen: np.ndarray) -> np.ndarray:
    """llama.cpp's rope_freqs for `scaling` (its converter's formula)."""
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    with np.errstate(divide="ignore", invalid="ignore"):  # low == high: no smoothed band
        smooth = (original / wavelen - low) / (high - low)
        medium = 1 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, scaling.factor, medium)
    )


# --- weights -----------------------------------------------------------------------------

# Rows dequantized per step: bounds the float32 scratch of a read to ~16 MB whatever the
# tensor's size (gguf's dequantizers make several temporaries the size of their output).
_CHUNK_VALUES = 1 << 22


class GGUFSource(WeightSource):
    """A GGUF file's tensors under Hugging Face names, dequantized one at a time.

    A read dequantizes only the rows it returns (row slices: a rank's share of a column-
    parallel weight or of the vocabulary), in chunks, and then tells the kernel it no longer
    needs the mapped pages it read, so neither the float32 scratch nor the file's pages add
    up while a model loads.
    """

    def __init__(
        self,
        reader: GGUFReader,
        tensors: dict[str, ReaderTensor],
        config: ModelConfig,
        file_arch: str,
        dtype: torch.dtype,
        path: Path,
        model_class: type[CausalLM] | None = None,
    ) -> None:
        super().__init__(dtype)
        # Only the tensors' views of the memory map are kept, not the reader: its parsed
        # metadata (a numpy array per token and merge) would stay alive as long as we do.
        self._mapping = getattr(reader, "mapping", None)
        self._config = config
        self._permuted = file_arch in _PERMUTED_QK_ARCHITECTURES
        self._path = path
        self._transform = getattr(model_class, "gguf_tensor_transform", None)
        extra = getattr(model_class, "gguf_tensor_names", {})
        self._tensors: dict[str, ReaderTensor] = {}
        for name, tensor in tensors.items():
            for hf, expert in _hf_names(name, tensor, config.num_hidden_layers, extra, path):
                self._tensors[hf] = tensor if expert is None else _expert_view(tensor, expert)
        _check_complete(set(self._tensors), path)
        for tensor in self._tensors.values():
            _dequantize(tensor, path, 0, 1)  # refuse types we cannot dequantize now, not later

    def names(self) -> list[str]:
        """Hugging Face names, in file order."""
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """[out, in] for a linear weight (GGUF lists dimensions the other way round)."""
        return _torch_shape(self._tensors[name])

    def _read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        tensor = self._tensors[name]
        shape = _torch_shape(tensor)
        heads = self._rope_heads(name)
        if heads:  # rows are un-permuted head by head: read whole heads only
            head_dim = shape[0] // heads
            if dim == 0 and (start % head_dim or length % head_dim):
                raise ValueError(f"{name}: row slice [{start}, {start + length}) splits a head")
        rows = range(start, start + length) if dim == 0 else range(shape[0])
        cols = shape[1] if len(shape) > 1 else 1
        out = torch.empty((len(rows), length) if dim == 1 else (len(rows), *shape[1:]),
                          dtype=self.dtype)  # fmt: skip
        step = max(1, _CHUNK_VALUES // cols)
        if heads:
            step = max(head_dim, step // head_dim * head_dim)
        for first in range(rows.start, rows.stop, step):
            last = min(first + step, rows.stop)
            values = _dequantize(tensor, self._path, first, last)
            if heads:
                values = _unpermute_rope_rows(values, (last - first) // head_dim)
            part = torch.from_numpy(values)
            if self._transform is not None:  # on the float32 values, before any rounding
                part = self._transform(name, part)
            out[first - rows.start : last - rows.start] = (
                part if dim == 0 else part.narrow(1, start, length)
            )
        self._release(tensor)
        return out

    def type_counts(self) -> list[tuple[str, int, int, int]]:
        """(GGML type, tensors, weights, bytes) per type in the file, most bytes first."""
        totals: dict[str, list[int]] = {}
        seen: set[str] = set()
        for tensor in self._tensors.values():  # experts' views of a stacked tensor: one
            name = tensor.name.split("[")[0]
            row = totals.setdefault(tensor.tensor_type.name, [0, 0, 0])
            row[0] += name not in seen
            seen.add(name)
            row[1] += int(tensor.n_elements)
            row[2] += int(tensor.n_bytes)
        return sorted(((k, *v) for k, v in totals.items()), key=lambda r: -r[3])

    def quantized(self) -> bool:
        """Whether any weight is stored in a quantized GGML type (not F32, F16 or BF16)."""
        plain = (*_UNBLOCKED, GGMLQuantizationType.BF16)
        return any(t.tensor_type not in plain for t in self._tensors.values())

    def blocks(self, name: str) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
        """A 2-D weight as the file stores it: GGML type id, [rows, row_bytes] uint8 (a view
        of the memory map: nothing is read until it is used), and for q/k the stored row
        of each row in the model's order (llama.cpp's permutation moves whole rows, so a
        row's blocks stay as they are), else None. None for 1-D tensors (a family's
        gguf_tensor_transform touches only those)."""
        tensor = self._tensors[name]
        shape = _torch_shape(tensor)
        if len(shape) != 2:
            return None
        data = np.asarray(tensor.data).view(np.uint8).reshape(shape[0], -1)
        heads = self._rope_heads(name)
        index = None
        if heads:
            order = _unpermute_rope_rows(np.arange(shape[0], dtype=np.int32), heads)
            index = torch.from_numpy(order)
        with warnings.catch_warnings():  # the map is read-only, and never written
            warnings.simplefilter("ignore", UserWarning)
            return int(tensor.tensor_type), torch.from_numpy(data), index

    def _rows_per_piece(self, name: str) -> int:
        rows = super()._rows_per_piece(name)
        heads = self._rope_heads(name)
        if not heads:
            return rows
        head_dim = self.shape(name)[0] // heads
        return max(head_dim, rows // head_dim * head_dim)

    def _rope_heads(self, name: str) -> int:
        """Heads of a q/k weight llama.cpp permuted (0 for every other tensor)."""
        if not self._permuted or not name.endswith(".weight"):
            return 0
        if ".self_attn.q_proj." in name:
            return self._config.num_attention_heads
        if ".self_attn.k_proj." in name:
            return self._config.num_key_value_heads
        return 0

    def release_blocks(self, name: str) -> None:
        """Drop the file pages of tensor `name` from this process: its blocks were copied
        (a later read of them faults the pages back in)."""
        self._release(self._tensors[name])

    def _release(self, tensor: ReaderTensor) -> None:
        """Drop the file pages of `tensor` from this process (they stay in the page cache)."""
        mapping = self._mapping
        if mapping is None:
            return
        page = mmap.PAGESIZE
        begin = tensor.data_offset // page * page
        end = min(len(mapping), tensor.data_offset + tensor.n_bytes)
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def _torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first, so [in, out] there is [out, in] row-major.
    return tuple(int(dim) for dim in reversed(tensor.shape.tolist()))


def _hf_names(
    name: str, tensor: ReaderTensor, num_layers: int, extra: dict[str, str], path: Path
) -> list[tuple[str, int | None]]:
    """Hugging Face names of GGUF tensor `name` (one per expert for stacked experts, with
    the expert index; none for tensors folded into the config)."""
    if name in _GLOBAL_TENSORS:
        return [(_GLOBAL_TENSORS[name], None)]
    if name == _ROPE_FREQS:
        return []
    parts = name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and int(parts[1]) < num_layers
        and parts[3] in ("weight", "bias")
    ):
        layer = f"model.layers.{parts[1]}"
        if parts[2] in extra:
            return [(f"{layer}.{extra[parts[2]]}.{parts[3]}", None)]
        if parts[2] in _LAYER_TENSORS:
            return [(f"{layer}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}", None)]
        if parts[2] in _EXPERT_TENSORS and len(tensor.shape) == 3:
            leaf = _EXPERT_TENSORS[parts[2]]
            experts = int(tensor.shape[-1])
            return [(f"{layer}.mlp.experts.{e}.{leaf}.weight", e) for e in range(experts)]
    raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} for this architecture")


def _expert_view(tensor: ReaderTensor, expert: int) -> ReaderTensor:
    """Expert `expert`'s [out, in] matrix of a stacked [experts, out, in] tensor."""
    experts = int(tensor.shape[-1])
    n_bytes = tensor.n_bytes // experts
    return tensor._replace(
        name=f"{tensor.name}[{expert}]",
        shape=tensor.shape[:-1],
        n_elements=tensor.n_elements // experts,
        n_bytes=n_bytes,
        data_offset=tensor.data_offset + expert * n_bytes,
        data=tensor.data[expert],
    )


def _check_complete(present: set[str], path: Path) -> None:
    # The model checks every tensor it needs when it loads; these two say at once whether
    # this is a model file at all.
    missing = sorted({"model.embed_tokens.weight", "model.norm.weight"} - present)
    if missing:
        raise ModelLoadError(f"{path}: GGUF file lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _dequantize(
    tensor: ReaderTensor, path: Path, first: int = 0, last: int | None = None
) -> np.ndarray:
    """Float32 values of rows [first, last) of `tensor` (all by default), shaped as PyTorch
    expects ([rows, in] for a linear weight); always a writable array."""
    shape = _torch_shape(tensor)
    # quantized blocks run along a row: a 1-D quantized tensor cannot be cut before decoding
    whole = last is None or (len(shape) == 1 and tensor.tensor_type not in _UNBLOCKED)
    data = tensor.data if whole else tensor.data[first:last]
    try:
        values = dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"{path}: tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, "
            "which infire cannot dequantize"
        ) from None
    values = values.reshape(shape if whole else (last - first, *shape[1:]))
    if whole and last is not None:
        values = values[first:last]
    # F32 comes back as a view into the read-only memory map
    return values if values.flags.writeable else values.copy()


def _unpermute_rope_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, exactly as transformers' GGUF loader does.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... and so its converter interleaves
    the two halves of every head's rows; our RoPE (HF's rotate_half) pairs x_i with
    x_{i + head_dim/2}, so the halves must be contiguous again.
    """
    half = values.shape[0] // num_heads // 2
    heads = values.reshape(num_heads, half, 2, *values.shape[1:])
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(values.shape)


# --- tokenizer ---------------------------------------------------------------------------


def _load_tokenizer(
    metadata: dict[str, Any], eos_token_ids: tuple[int, ...], path: Path
) -> Tokenizer:
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(token_types) != len(tokens) or len(scores) != len(tokens):
        raise ModelLoadError(
            f"{path}: {len(tokens)} tokens but {len(token_types)} token types / {len(scores)} scores"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        backend = _byte_level_bpe(
            tokens, token_types, merges or [], metadata.get("tokenizer.ggml.pre")
        )
    elif model == "llama":
        add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
        unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
        unk = _token_at(tokens, unk_id)
        backend = _sentencepiece_bpe(tokens, scores, merges, add_space_prefix, unk)
    else:
        raise UnsupportedModelError(
            f"{path}: GGUF tokenizer {model!r} is not supported (supported: gpt2, llama)"
        )
    _add_special_tokens(backend, tokens, token_types)

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    bos, eos = _token_at(tokens, bos_id), _token_at(tokens, eos_id)
    # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", model == "llama") and bos is not None
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False) and eos is not None
    if add_bos or add_eos:
        single = ([bos] if add_bos else []) + ["$A"] + ([eos] if add_eos else [])
        special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
        backend.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=list(dict.fromkeys(special))
        )
    return Tokenizer(
        backend,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=eos_token_ids,
    )


def _token_at(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _byte_level_bpe(
    tokens: list[str], token_types: list[int], merges: list[str], pre: str | None
) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE (Llama 3, Qwen2, SmolLM, ...)."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        # Special tokens are stored as their raw text and matched as added tokens; a normal
        # token outside the byte alphabet is a raw string the merges spell in bytes.
        if token_type not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[byte] for byte in token.encode("utf-8"))
        vocab[token] = index
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ", 1)) for merge in merges],
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    if pre in _NFC_PRE:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # SmolLM's tokenizer.json splits digits first, then applies the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _SPLIT_BY_PRE.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece_bpe(
    tokens: list[str],
    scores: list[float],
    merges: list[str] | None,
    add_space_prefix: bool,
    unk: str | None,
) -> tokenizers.Tokenizer:
    """SentencePiece BPE with byte fallback (Llama 2, Mistral), as transformers rebuilds it."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: best-scoring result first.

    A sentencepiece GGUF stores no merges; this is transformers' `generate_merges`, kept
    identical (including its tie-breaks) so that both tokenize the same way.
    """
    merges: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        local.sort(key=lambda merge: (vocab[merge[0]], vocab[merge[1]]))
        merges.extend(local)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]
) -> None:
    """Make control / unknown tokens special and user-defined ones added, so each stays whole."""
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    ]
    # User-defined tokens (like <think>) are matched whole in text, as llama.cpp does, but are
    # not special: decoding with skip_special_tokens keeps them (transformers does the same).
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == _TOKEN_USER_DEFINED
    ]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(b for b in range(256) if b not in table):
        table[byte] = chr(256 + offset)
    return table
