"""Tokenizer: text <-> token ids, the model's chat template, and incremental detokenization.

Wraps a `tokenizers.Tokenizer` (from tokenizer.json, or rebuilt from GGUF metadata by the
loader) with the special tokens and chat template that the model ships. The chat template
is rendered in a sandboxed Jinja2 environment, as Hugging Face does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infire.errors import InvalidRequestError, ModelLoadError


def read_tokenizer_json(folder: Path) -> tokenizers.Tokenizer:
    """An HF folder's tokenizer.json; ModelLoadError naming the file if it is missing or
    unreadable."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (infire needs a fast tokenizer)")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise ModelLoadError(f"{path}: cannot read tokenizer: {e}") from None


class Tokenizer:
    """A model's tokenizer with its special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids)
        if eos_token is not None:
            eos_id = backend.token_to_id(eos_token)
            if eos_id is not None and eos_id not in ids:
                ids.append(eos_id)
        self.eos_token_ids = tuple(ids)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_hf_folder(cls, folder: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template of an HF folder."""
        backend = read_tokenizer_json(folder)
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            eos_token_ids=eos_token_ids,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens (BOS) added as the tokenizer's post-processor says."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render chat `messages` ({"role", "content"} dicts) into the model's prompt text."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed: {e}") from None

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat (`kwargs`: more template variables, such as
        `tools`); the template itself places any BOS token."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None


def _token_content(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"invalid chat template: {e}") from None


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decodes only a short window of recent tokens per step (prefix_offset..end), the way
    vLLM does, so the cost per token stays constant as the output grows.
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    prefix_offset: int = 0
    read_offset: int = 0

    def step(self, token_ids: list[int]) -> str:
        """The new text that `token_ids` (all output tokens so far) adds since the last call."""
        prefix = self.tokenizer.decode(
            token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = self.tokenizer.decode(token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
            return full[len(prefix) :]
        return ""
