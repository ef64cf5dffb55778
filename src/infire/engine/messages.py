"""Every message that crosses the EngineClient boundary, and their one wire encoding.

The front (HTTP server, `LLM`) sends GenerateRequest / AbortRequest / Shutdown to the
engine core; the core answers with EngineReady or EngineFailed once, then StepOutputs:
the deltas of the requests that changed (new token ids, text and logprobs since the last
delta, never the whole sequence) and a stats snapshot. In-process the objects are handed
over as they are; between processes `encode`/`decode` turn them into msgpack (plain
values only: nothing a client sent is ever pickled).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack

from infire.errors import InfireError
from infire.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from infire.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated request: prompt token ids and how to sample them."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the caller had one (echoed in outputs)
    # disaggregation (disagg/transfer.py): {"do_remote_decode": True} on a prefill engine,
    # a prefill engine's handle on a decode engine; None on a whole engine
    kv_transfer: dict | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request now and free its KV blocks."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    """A decode engine has its copy of a lease's blocks (or gave up): free them."""

    lease_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the engine loop (requests still running are dropped)."""


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one of a request's n sequences gained since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None  # per new token, when asked for
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # set once, on the sequence's last delta
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """A request's changes after one engine step; `finished` on its last one."""

    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # on the last delta
    # a prefill engine's handle (on its last delta); on a decode engine {"lease": id} once
    # its pull of that lease ended, so that the front can release it
    kv_transfer: dict | None = None
    error: str | None = None  # the request failed (a KV transfer): no more output
    invalid: bool = False  # the error is the request's fault (a 400), not the engine's


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's queues, KV use and counters since it started."""

    num_running: int = 0  # sequences in the batch
    num_waiting: int = 0  # sequences queued
    kv_cache_usage: float = 0.0  # fraction of KV blocks referenced
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests
    num_computed_prompt_tokens: int = 0  # prompt tokens actually run through the model
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    num_finished_requests: int = 0
    # for a balancer: what this engine still has to compute, and room in its KV pool
    num_prompt_tokens_to_compute: int = 0  # prompt tokens of queued and running sequences
    num_free_blocks: int = 0
    num_blocks: int = 0
    # disaggregation (disagg/transfer.py TransferCounters, and what is held now)
    num_leases: int = 0
    num_leased_blocks: int = 0
    num_pulling: int = 0  # decode sequences waiting for or in a KV pull
    kv_leases_granted: int = 0
    kv_leases_released: int = 0
    kv_leases_expired: int = 0
    kv_pulls: int = 0
    kv_pulls_failed: int = 0
    kv_blocks_pulled: int = 0
    kv_blocks_reused: int = 0
    kv_bytes_pulled: int = 0
    kv_pull_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the front needs to know of the model an engine serves."""

    name: str
    max_model_len: int
    vocab_size: int
    num_kv_tokens: int  # tokens the KV pool holds (blocks x block size)
    block_size: int
    dtype: str
    fused_status: str  # whether the fused CPU forward runs, and why not
    chat_template: str | None = None
    architecture: str = ""  # the model family (models/registry.py)
    kv_bytes_per_token: int = 0  # a token of context in the whole model's KV cache
    kv_role: str = "both"  # disaggregation role: both, prefill or decode
    kv_layout: str = ""  # the KV pool layout peers must share (disagg/transfer.py)
    tasks: tuple[str, ...] = ("generate",)


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The core loaded its model and takes requests."""

    info: ModelInfo


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The core could not start (or stopped); `message` says why."""

    message: str


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    """An encoder request (engine/encoder.py): embed texts or token id lists, score
    documents against a query (rerank), or label texts (classify)."""

    request_id: str
    kind: str  # embed | rerank | classify
    inputs: list  # texts, or lists of token ids (embed)
    query: str | None = None  # rerank
    pooling: str | None = None  # embed: mean or cls (None: the model's own)


@dataclass(frozen=True, slots=True)
class EncodeResult:
    """An encoder request's answer: float32 vectors (embed, `data` with `shape`), scores
    (rerank) or (label, score) pairs per text (classify); or the error that stopped it."""

    request_id: str
    tokens: int = 0
    data: bytes | None = None
    shape: list[int] | None = None
    scores: list[float] | None = None
    labels: list[list[list]] | None = None
    error: str | None = None
    invalid: bool = False  # the error is the request's fault (a 400), not the engine's


@dataclass(frozen=True, slots=True)
class EncoderReady:
    """The encoder process loaded its model."""

    name: str
    task: str
    dim: int
    max_input_tokens: int
    dtype: str


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """The deltas of one loop iteration, and the stats after it."""

    deltas: list[RequestDelta] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)


# --- engine core -> worker ranks (tensor / pipeline parallel) --------------------------


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence a worker has not seen: what it needs to compute and sample it."""

    seq_id: int
    index: int  # which of its request's n samples (seeds the generator with seed + index)
    params: SamplingParams
    prompt_token_ids: list[int]  # what penalties count as prompt, not output


@dataclass(frozen=True, slots=True)
class ScheduledItem:
    """One sequence of a step: its new tokens and blocks since the worker last saw it."""

    seq_id: int
    num_computed_tokens: int  # where this step starts
    num_new_tokens: int  # tokens computed this step
    new_token_ids: list[int]  # appended to the sequence since the last step it was in
    block_table_start: int  # the worker's tables are cut here (0 after preemption) ...
    new_block_ids: list[int]  # ... and these appended
    new_window_block_ids: list[list[int]] = field(default_factory=list)  # per windowed group


@dataclass(frozen=True, slots=True)
class StepInput:
    """One step for every rank: new sequences, the batch in order, sequences to forget."""

    step_id: int
    new: list[NewSequence]
    scheduled: list[ScheduledItem]
    finished: list[int]  # seq ids finished or aborted since the last step
    # with pipeline stages: the rows of the step's sampled sequences that a grammar
    # constrains, and their token bitmask (int32 words, row-major), for the sampling rank
    grammar_rows: list[int] = dataclasses.field(default_factory=list)
    grammar_mask: bytes = b""


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """The sampling rank's answer to a StepInput: a SamplerOutput's fields, row by row."""

    step_id: int
    token_ids: list[int]
    sampled_logprobs: list[float] | None = None
    sampled_ranks: list[int] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


Message = (
    GenerateRequest | AbortRequest | ReleaseKV | Shutdown | EngineReady | EngineFailed | StepOutputs
    | StepInput | SampledTokens | EncodeRequest | EncodeResult | EncoderReady
)  # fmt: skip


class WireError(InfireError):
    """A message on the wire is not one this version understands."""


def merge_delta(output: RequestOutput | None, delta: RequestDelta) -> RequestOutput:
    """Apply a delta to the request's accumulated output (a new one for the first delta)."""
    if output is None:
        output = RequestOutput(delta.request_id, None, [], [], False)
    by_index = {c.index: c for c in output.outputs}
    for change in delta.choices:
        choice = by_index.get(change.index)
        if choice is None:
            logprobs = [] if change.logprobs is not None else None
            choice = by_index[change.index] = CompletionOutput(
                change.index, "", [], None, None, logprobs
            )
        choice.text += change.text
        choice.token_ids += change.token_ids
        if change.logprobs is not None and choice.logprobs is not None:
            choice.logprobs += change.logprobs
        if change.cumulative_logprob is not None:
            choice.cumulative_logprob = change.cumulative_logprob
        choice.finish_reason = change.finish_reason or choice.finish_reason
        choice.stop_reason = change.stop_reason if change.finish_reason else choice.stop_reason
    output.outputs = [by_index[i] for i in sorted(by_index)]
    output.finished = delta.finished
    output.num_cached_tokens = delta.num_cached_tokens
    output.metrics = delta.metrics or output.metrics
    output.kv_transfer_params = delta.kv_transfer or output.kv_transfer_params
    return output


# --- the wire: msgpack of [tag, fields...], each message spelled out below ---------------

_TAGS = {
    GenerateRequest: 1, AbortRequest: 2, Shutdown: 3, EngineReady: 4, EngineFailed: 5,
    StepOutputs: 6, StepInput: 7, SampledTokens: 8, ReleaseKV: 9, EncodeRequest: 10,
    EncodeResult: 11, EncoderReady: 12,
}  # fmt: skip
_TYPES = {tag: cls for cls, tag in _TAGS.items()}


def encode(message: Message) -> bytes:
    """The message as msgpack bytes."""
    return msgpack.packb([_TAGS[type(message)], *_fields(message)], use_bin_type=True)


def decode(data: bytes) -> Message:
    """The message that `encode` wrote; raises WireError on anything else."""
    try:
        tag, *values = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return _build(_TYPES[tag], values)
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
        raise WireError(f"malformed engine message: {e!r}") from None


def _fields(message: Message) -> list:
    if isinstance(message, GenerateRequest):
        params = dataclasses.asdict(message.params)
        return [message.request_id, message.prompt_token_ids, params, message.prompt,
                message.kv_transfer]  # fmt: skip
    if isinstance(message, EngineReady):
        return list(dataclasses.astuple(message.info))
    if isinstance(message, StepOutputs):
        stats = list(dataclasses.astuple(message.stats))
        return [[_delta_fields(d) for d in message.deltas], stats]
    if isinstance(message, StepInput):
        new = [
            [n.seq_id, n.index, dataclasses.asdict(n.params), n.prompt_token_ids]
            for n in message.new
        ]
        scheduled = [list(dataclasses.astuple(item)) for item in message.scheduled]
        return [message.step_id, new, scheduled, message.finished, message.grammar_rows,
                message.grammar_mask]  # fmt: skip
    return [getattr(message, f.name) for f in dataclasses.fields(message)]


def _build(cls: type, values: list) -> Message:
    if cls is GenerateRequest:
        request_id, ids, params, prompt, kv_transfer = values
        return GenerateRequest(request_id, ids, SamplingParams(**params), prompt, kv_transfer)
    if cls is EngineReady:
        *head, tasks = values
        return EngineReady(ModelInfo(*head, tuple(tasks)))
    if cls is StepOutputs:
        deltas, stats = values
        return StepOutputs([_build_delta(d) for d in deltas], EngineStats(*stats))
    if cls is StepInput:
        step_id, new, scheduled, finished, grammar_rows, grammar_mask = values
        new_seqs = [NewSequence(i, x, SamplingParams(**p), ids) for i, x, p, ids in new]
        items = [ScheduledItem(*v) for v in scheduled]
        return StepInput(step_id, new_seqs, items, finished, grammar_rows, grammar_mask)
    return cls(*values)


def _delta_fields(delta: RequestDelta) -> list:
    choices = [
        [c.index, c.text, c.token_ids, _logprob_fields(c.logprobs), c.cumulative_logprob,
         c.finish_reason, c.stop_reason]
        for c in delta.choices
    ]  # fmt: skip
    metrics = dataclasses.astuple(delta.metrics) if delta.metrics else None
    return [delta.request_id, choices, delta.finished, delta.num_prompt_tokens,
            delta.num_cached_tokens, metrics, delta.kv_transfer, delta.error, delta.invalid]  # fmt: skip


def _build_delta(values: list) -> RequestDelta:
    request_id, choices, finished, num_prompt, num_cached, metrics, kv, error, invalid = values
    built = [
        ChoiceDelta(index, text, ids, _build_logprobs(lps), cumulative, reason, stop)
        for index, text, ids, lps, cumulative, reason, stop in choices
    ]
    return RequestDelta(
        request_id, built, finished, num_prompt, num_cached,
        RequestMetrics(*metrics) if metrics else None, kv, error, invalid,
    )  # fmt: skip


def _logprob_fields(steps: list[dict[int, Logprob]] | None) -> list | None:
    if steps is None:
        return None
    return [[[e.token_id, e.logprob, e.rank, e.decoded_token] for e in s.values()] for s in steps]


def _build_logprobs(steps: list | None) -> list[dict[int, Logprob]] | None:
    if steps is None:
        return None
    return [{e[0]: Logprob(*e) for e in step} for step in steps]
