"""Write a tiny Hugging Face model folder as a GGUF file, the way llama.cpp's converter does.

`write_gguf` takes the architecture's metadata and the tensors already under llama.cpp's
names and transforms (each family's test builds those, reading convert_hf_to_gguf.py),
and adds what every file has: general.architecture and name, the folder's byte-level BPE
tokenizer (vocabulary, token types, merges), its special token ids and chat template.
`common_metadata` fills the hyper-parameters every llama.cpp architecture writes, and
`llama_like_tensors` maps the Llama-shaped parts (attention, norms, dense and expert MLPs)
that most families share.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

CONTROL, NORMAL = 3, 1  # tokenizer.ggml.token_type values


def hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors, as float32 numpy arrays."""
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            tensors[name] = tensor.to(torch.float32).numpy()
    return tensors


def hf_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json."""
    return json.loads((Path(folder) / "config.json").read_text())


def common_metadata(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """The hyper-parameters llama.cpp's converter writes for every architecture."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
    return {
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": config.get("num_key_value_heads") or heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": float(theta),
        f"{arch}.rope.dimension_count": head_dim,
    }


def permute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: interleave the halves of every head's rows."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
_EXPERT = {
    "gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps",
    "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
    "down_proj": "ffn_down_exps", "w2": "ffn_down_exps",
}  # fmt: skip


def llama_like_tensors(
    hf: dict[str, np.ndarray], config: dict[str, Any], permute: bool
) -> dict[str, np.ndarray]:
    """llama.cpp names of a Llama-shaped checkpoint: q/k permuted for the "llama"
    architecture, per-expert weights stacked into [experts, out, in]; names it does not
    know are left out (the family's test adds them)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in hf.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = tensor
        elif name == "model.norm.weight":
            out["output_norm.weight"] = tensor
        elif name == "lm_head.weight":
            out["output.weight"] = tensor
        elif name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            base, _, kind = rest.rpartition(".")
            parts = base.split(".")
            if len(parts) == 4 and parts[1] == "experts":  # mlp.experts.E.gate_proj
                experts.setdefault((int(layer), _EXPERT[parts[3]]), {})[int(parts[2])] = tensor
            elif base in _LAYER:
                if permute and base == "self_attn.q_proj":
                    tensor = permute_qk(tensor, heads)
                elif permute and base == "self_attn.k_proj":
                    tensor = permute_qk(tensor, kv_heads)
                out[f"blk.{layer}.{_LAYER[base]}.{kind}"] = tensor
    for (layer, gguf_name), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        out[f"blk.{layer}.{gguf_name}.weight"] = stacked
    return out


def write_gguf(
    folder: Path,
    out: Path,
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, np.ndarray],
    quantize: tuple[str, ...] | dict[str, gguf.GGMLQuantizationType] = (),
) -> Path:
    """Write `tensors` (llama.cpp names; float32, or quantized for names in `quantize`: Q8_0
    for a tuple of names, each its own type for a dict; a uint8 tensor is taken as blocks
    of its name's type) with `metadata` and the folder's tokenizer as a GGUF file of
    architecture `arch`."""
    types = quantize if isinstance(quantize, dict) else dict.fromkeys(quantize, Q8_0)
    folder = Path(folder)
    config = hf_config(folder)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny {arch}")
    for key, value in metadata.items():
        writer.add_key_value(key, value, _value_type(value), _sub_type(value))
    _add_tokenizer(writer, folder, config)
    for name, tensor in tensors.items():
        if tensor.dtype == np.uint8:  # blocks already in types[name]'s layout
            writer.add_tensor(name, np.ascontiguousarray(tensor), raw_dtype=types[name])
            continue
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if name in types:
            kind = types[name]
            writer.add_tensor(name, quantize_as(tensor, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


Q8_0 = gguf.GGMLQuantizationType.Q8_0


def quantize_as(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """[rows, cols] float32 as `kind`'s blocks: the gguf package's quantizer for the legacy
    types, the tests' own (kquants.py) for the K-quants."""
    from kquants import K_TYPES
    from kquants import quantize as quantize_k

    if kind in K_TYPES:
        return quantize_k(values.reshape(-1, values.shape[-1]), kind).reshape(
            *values.shape[:-1], -1
        )
    return gguf.quants.quantize(values, kind)


def _value_type(value: Any) -> gguf.GGUFValueType:
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.ARRAY


def _sub_type(value: Any) -> gguf.GGUFValueType | None:
    if not isinstance(value, list) or not value:
        return None
    first = value[0]
    if isinstance(first, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(first, int):
        return gguf.GGUFValueType.INT32
    return _value_type(first)


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, config: dict[str, Any]) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    types = [CONTROL if token in special else NORMAL for token in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])
    eos = config.get("eos_token_id")
    if eos is not None:
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        writer.add_chat_template(template)


def q4_k_m_like(name: str) -> gguf.GGMLQuantizationType | None:
    """A Q4_K_M-like type per tensor: Q6_K for v, down and the head, Q5_K for the attention
    output, Q4_K for the other layer weights, a Q8_0 embedding (None: kept as it is)."""
    kinds = gguf.GGMLQuantizationType
    if name == "token_embd.weight":
        return kinds.Q8_0
    if name == "output.weight" or ".attn_v." in name or ".ffn_down." in name:
        return kinds.Q6_K
    if ".attn_output." in name:
        return kinds.Q5_K
    if name.endswith(".weight") and name.startswith("blk.") and "norm" not in name:
        return kinds.Q4_K
    return None


def write_tiny_k_quant(folder: Path, hidden: int) -> Path:
    """A tiny random Llama (4 heads, 2 KV heads, intermediate 2 x hidden) written as a
    Q4_K_M-like GGUF in `folder`."""
    from tiny_models import write_tiny_model

    write_tiny_model(folder, "llama", seed=5, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config = hf_config(folder)
    tensors = llama_like_tensors(hf_tensors(folder), config, permute=True)
    types = {name: kind for name in tensors if (kind := q4_k_m_like(name)) is not None}
    return write_gguf(folder, folder / "tiny-q4km.gguf", "llama",
                      common_metadata(config, "llama"), tensors, types)  # fmt: skip


def write_tiny_mixtral_q8(folder: Path) -> Path:
    """A tiny random Mixtral (4 experts, 2 a token, hidden 64, intermediate 128) written in
    `folder` as a GGUF of Q8_0 matrices, its experts stacked as llama.cpp stores them."""
    from tiny_models import write_tiny_model

    model = write_tiny_model(folder / "moe", "mixtral", seed=3)
    config = hf_config(model)
    tensors = llama_like_tensors(hf_tensors(model), config, permute=True)
    types = {name: gguf.GGMLQuantizationType.Q8_0 for name, v in tensors.items() if v.ndim >= 2}
    metadata = common_metadata(config, "llama") | {
        "llama.expert_count": config["num_local_experts"],
        "llama.expert_used_count": config["num_experts_per_tok"],
    }
    return write_gguf(model, folder / "moe-q8.gguf", "llama", metadata, tensors, types)
