"""The checks a request passes once, at the edge, before it is queued anywhere.

EngineClients run them in `generate` (so a bad request is refused before anything is
sent to the engine core) and `LLMEngine.add_request` runs them for callers that hand it
text; the engine loop itself trusts what it is given.
"""

from __future__ import annotations

from infire.engine.messages import ModelInfo
from infire.errors import ContextLengthError, InvalidRequestError
from infire.sampling_params import SamplingParams


def check_prompt(ids: list[int], info: ModelInfo) -> None:
    """Refuse an empty prompt, ids outside the vocabulary, or one that cannot fit."""
    if not ids:
        raise InvalidRequestError("prompt is empty")
    vocab = info.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
    if len(ids) >= info.max_model_len:
        raise ContextLengthError(
            f"prompt has {len(ids)} tokens but the model's context is {info.max_model_len} "
            "tokens (prompt plus at least one generated token must fit)"
        )
    if len(ids) + 1 > info.num_kv_tokens:
        raise ContextLengthError(
            f"prompt has {len(ids)} tokens but the KV cache holds only {info.num_kv_tokens}; "
            "raise --kv-cache-memory"
        )


def check_params(params: SamplingParams, info: ModelInfo) -> None:
    """What SamplingParams cannot check alone: token ids against this model's vocabulary."""
    vocab = info.vocab_size
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("stop_token_ids", params.stop_token_ids)):  # fmt: skip
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"{name} token ids must be in [0, {vocab})", param=name)
