"""Tiny random Hugging Face models (weights, config, real tokenizer) built on the fly."""

from __future__ import annotations

import json
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
    common.update(overrides)
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
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
