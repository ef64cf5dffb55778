"""Tokenizer wrapper: chat templates and UTF-8-safe incremental detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest

from infire.errors import InvalidRequestError
from infire.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_hf_folder(tiny_llama)


def test_incremental_detokenizer_never_emits_broken_utf8(tokenizer: Tokenizer):
    text = "naïve café → 日本語 🎉 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # held back mid-character


def test_chat_template_renders_and_encodes_specials(tokenizer: Tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == tokenizer.backend.token_to_id("<|im_start|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.eos_token_ids == (tokenizer.backend.token_to_id("<|im_end|>"),)


def test_chat_template_errors_are_request_errors(tokenizer: Tokenizer):
    broken = Tokenizer(tokenizer.backend, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(InvalidRequestError, match="no system role"):
        broken.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer(tokenizer.backend).apply_chat_template([])
