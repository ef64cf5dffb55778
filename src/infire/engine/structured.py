"""Structured outputs: a request's tokens constrained by a grammar, through llguidance.

A request's `SamplingParams.structured_output` is one of (vLLM's names):
- `{"json": SCHEMA}`: a JSON Schema (an object, or its JSON text);
- `{"json_object": true}`: any JSON object;
- `{"regex": PATTERN}`, `{"choice": [STRING, ...]}`;
- `{"grammar": TEXT}`: a Lark or GBNF grammar.

llguidance (picked over xgrammar by measurement, docs/structured-outputs.md) turns it
into a grammar and a matcher that follows the tokenizer's tokens. A GrammarCache per
tokenizer compiles each spec once and keeps a template matcher; every sequence gets a
copy. Each step the sampler asks the running sequences' matchers for the tokens allowed
next (one bitmask row each, filled in one call) and masks the others out of the logits
before penalties, temperature and top-k/p. A sampled token is fed back to its matcher;
once the grammar is complete the matcher stops and the sequence finishes ("stop"). JSON
is compact: no whitespace between tokens, so that a small model cannot wander off into
blank lines.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from infire.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_COMPACT = {"whitespace_flexible": False}


def spec_kind(spec: dict) -> tuple[str, Any]:
    """The one (kind, value) of a structured_output spec; InvalidRequestError otherwise."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise InvalidRequestError(
            f"structured_output takes exactly one of {', '.join(KINDS)}",
            param="structured_output",
        )
    return next(iter(spec.items()))


def grammar_text(spec: dict) -> str:
    """llguidance's grammar for a spec (no tokenizer needed); InvalidRequestError when the
    spec is malformed."""
    import llguidance

    kind, value = spec_kind(spec)
    try:
        if kind == "json":
            schema = value if isinstance(value, str) else json.dumps(value)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_COMPACT)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                 overrides=_COMPACT)  # fmt: skip
        if kind == "choice":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) for c in value)
            ):
                raise InvalidRequestError("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", json.dumps(value))
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{kind} must be a non-empty string")
        return llguidance.grammar_from("regex" if kind == "regex" else "grammar", value)
    except InvalidRequestError:
        raise
    except (ValueError, TypeError) as e:  # llguidance's own message names the problem
        raise InvalidRequestError(f"invalid {kind}: {e}") from None


class GrammarCache:
    """Compiled grammars of one tokenizer, by spec: a template matcher each (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_entries: int = 256) -> None:
        self.tokenizer = tokenizer  # infire's Tokenizer (its `backend` is a tokenizers one)
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are refused
        self.max_entries = max_entries
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once (a few hundred ms)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                eos = list(self.tokenizer.eos_token_ids)
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._ll_tokenizer

    def check(self, spec: dict) -> None:
        """Compile the spec (cached); InvalidRequestError naming what is wrong with it."""
        self._template(spec)

    def matcher(self, spec: dict) -> Any:
        """A fresh matcher for one sequence (a copy of the cached template)."""
        return self._template(spec).deep_copy()

    def _template(self, spec: dict) -> Any:
        import llguidance

        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            if key in self._templates:
                self._templates.move_to_end(key)
                return self._templates[key]
        grammar = grammar_text(spec)
        tokenizer = self.ll_tokenizer()
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise InvalidRequestError(f"cannot compile the {spec_kind(spec)[0]}: {problem}")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"cannot compile the {spec_kind(spec)[0]}: "
                                      f"{template.get_error()}")  # fmt: skip
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > self.max_entries:
                self._templates.popitem(last=False)
        return template


def token_bitmask(matchers: list[Any], vocab_size: int, parallel: bool = False) -> np.ndarray:
    """int32 [len(matchers), words]: llguidance's bitmask of the tokens each matcher allows
    next (bit t % 32 of word t // 32).

    `parallel` fills the rows on llguidance's thread pool. Only for a forward that leaves
    the CPU idle (a GPU's): its threads spin a while after each fill, and on a CPU whose
    cores run the forward's threads that spinning slows the masking, sampling and next
    forward (batch 16 on 2 cores: 0.88 of unconstrained throughput with it, 0.95 without).
    """
    import llguidance.numpy as llnp

    bitmask = llnp.allocate_token_bitmask(len(matchers), vocab_size)
    if parallel and len(matchers) > 1:
        llnp.fill_next_token_bitmask_par(_executor(), list(zip(matchers, range(len(matchers)),
                                                               strict=True)), bitmask)  # fmt: skip
    else:
        for row, matcher in enumerate(matchers):
            llnp.fill_next_token_bitmask(matcher, bitmask, row)
    return bitmask


def forbidden_tokens(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool: the tokens a token_bitmask forbids (inverted and unpacked
    by NumPy: a tenth of the time of a torch unpack)."""
    forbidden = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(forbidden[:, :vocab_size]).view(torch.bool)


def disallowed_tokens(matchers: list[Any], vocab_size: int, parallel: bool = False) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: the tokens each matcher forbids next."""
    return forbidden_tokens(token_bitmask(matchers, vocab_size, parallel), vocab_size)


_EXECUTOR: Any = None


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def advance(matcher: Any, token: int) -> bool:
    """Feed a sampled token to its matcher; True when the grammar is complete (or the
    matcher can go no further), and the sequence should stop."""
    if not matcher.is_stopped():
        matcher.consume_token(token)
    return matcher.is_stopped() or matcher.is_error()
