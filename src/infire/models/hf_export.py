"""Write a loaded model's config and tokenizer as a Hugging Face folder (GGUF -> folder).

`write_hf_files` writes config.json, tokenizer.json and tokenizer_config.json (chat
template, special tokens) so that infire, transformers and other HF readers can open the
folder; the weights are the caller's (plain safetensors, or Unweight's container).
"""

from __future__ import annotations

import json
from pathlib import Path

from infire.config import ModelConfig
from infire.errors import UnsupportedModelError
from infire.tokenizer import Tokenizer

_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM"}  # fmt: skip


def hf_config(c: ModelConfig, dtype: str) -> dict:
    """config.json of a ModelConfig (the Llama family's: a GGUF of another family cannot be
    written as a folder yet)."""
    if c.architecture not in _CLASSES or c.rope_scaling and c.rope_scaling.kind != "llama3":
        raise UnsupportedModelError(
            f"writing a {c.architecture} model as a Hugging Face folder is not supported "
            f"(supported: {', '.join(_CLASSES)}); serve its GGUF file as it is"
        )
    config = {
        "architectures": [_CLASSES[c.architecture]], "model_type": c.architecture,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias, "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids), "torch_dtype": dtype, "hidden_act": "silu",
    }  # fmt: skip
    if c.rope_scaling is not None:
        s = c.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }  # fmt: skip
    return config


def write_hf_files(config: ModelConfig, tokenizer: Tokenizer, folder: Path, dtype: str) -> None:
    """config.json, tokenizer.json and tokenizer_config.json into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=1))
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=1))  # fmt: skip
