"""LLMEngine: the synchronous step loop that ties scheduler, block pool and runner together.

`add_request` validates and queues; each `step()` schedules a batch, runs one forward,
appends the sampled tokens, detokenizes, checks stop conditions and frees the blocks of
finished sequences, then reports every request that changed. The asyncio front
(AsyncLLMEngine) and the offline API (LLM) both drive this class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from infire.config import EngineConfig, resolve_dtype
from infire.engine.kv_cache import BlockManager
from infire.engine.request import Sequence
from infire.engine.runner import ModelRunner, StepResult
from infire.engine.scheduler import Scheduler, SchedulerOutput
from infire.engine.stop import append_token
from infire.errors import ContextLengthError, InvalidRequestError
from infire.kernels import cpu_forward
from infire.models.loader import load_model
from infire.outputs import CompletionOutput, RequestMetrics, RequestOutput
from infire.sampling_params import SamplingParams
from infire.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started (the server exports them as metrics)."""

    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests
    num_computed_prompt_tokens: int = 0  # prompt tokens actually run through the model
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    num_finished_requests: int = 0


class LLMEngine:
    """Generates for many requests at once; not thread-safe (one caller drives step())."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        fused_bf16 = config.cpu_kernels and config.device == "cpu" and cpu_forward.available()
        self.dtype = resolve_dtype(config.dtype, config.device, fused_bf16)
        loaded = load_model(config.model, self.dtype)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        context = self.model_config.max_position_embeddings
        self.max_model_len = min(config.scheduler.max_model_len or context, context)
        self.runner = ModelRunner(
            loaded.config,
            loaded.weights,
            config.cache,
            self.dtype,
            config.device,
            config.seed,
            config.cpu_kernels,
            palette=loaded.palette,
        )
        del loaded
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}
        self.stats = EngineStats()
        self._next_seq_id = 0

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the vocabulary and context."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                "tokens (prompt plus at least one generated token must fit)"
            )
        if self.block_manager.blocks_needed(len(ids) + 1) > self.block_manager.num_blocks:
            raise ContextLengthError(
                f"prompt has {len(ids)} tokens but the KV cache holds only "
                f"{self.block_manager.num_blocks * self.block_manager.block_size}; "
                "raise --kv-cache-memory"
            )
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this model's vocabulary."""
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("stop_token_ids", params.stop_token_ids)):  # fmt: skip
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"{name} token ids must be in [0, {vocab})", param=name)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Validate and queue a request; raises InvalidRequestError without side effects."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        self.check_params(params)
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize_prompt(prompt)
        metrics = RequestMetrics(arrival_time=time.monotonic())
        seqs = [self._new_sequence(request_id, i, ids, params, metrics) for i in range(params.n)]
        self.requests[request_id] = seqs
        self.prompts[request_id] = prompt if isinstance(prompt, str) else None
        self.stats.num_prompt_tokens += len(ids) * params.n
        for seq in seqs:
            self.scheduler.add(seq)

    def _new_sequence(
        self,
        request_id: str,
        index: int,
        ids: list[int],
        params: SamplingParams,
        metrics: RequestMetrics,
    ) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.runner.device).manual_seed(params.seed + index)
        self._next_seq_id += 1
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        return Sequence(
            seq_id=self._next_seq_id, request_id=request_id, index=index,
            prompt_token_ids=ids, params=params, detokenizer=detokenizer,
            metrics=metrics, generator=generator,
        )  # fmt: skip

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; None if it is unknown or done."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        for seq in seqs:
            if not seq.finished:
                seq.finish("abort")
                self.scheduler.finish(seq)
        return self._pop_output(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns the requests that changed."""
        batch = self.scheduler.schedule()
        result = self.runner.execute(batch.scheduled) if batch.scheduled else StepResult([], None)
        changed = self._update(batch, result)
        return [self._pop_output(rid) if self._done(rid) else self._output(rid) for rid in changed]

    def _update(self, batch: SchedulerOutput, result: StepResult) -> dict[str, None]:
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions += batch.num_preempted
        stats.prefix_cache_queries += batch.num_queried_tokens
        stats.prefix_cache_hits += batch.num_cached_tokens
        changed: dict[str, None] = {}
        for item in batch.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            stats.num_computed_prompt_tokens += max(
                0, min(seq.num_prompt_tokens - start, item.num_new_tokens)
            )
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
        now = time.monotonic()
        for i, seq in enumerate(result.sampled_seqs):
            append_token(seq, result.output, i, self.tokenizer, self.max_model_len)
            stats.num_generation_tokens += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if seq.finished:
                self.scheduler.finish(seq)
            changed[seq.request_id] = None
        for seq in batch.finished:
            changed[seq.request_id] = None
        return changed

    def _done(self, request_id: str) -> bool:
        return all(seq.finished for seq in self.requests[request_id])

    def _pop_output(self, request_id: str) -> RequestOutput:
        output = self._output(request_id)
        output.metrics.finished_time = time.monotonic()
        del self.requests[request_id]
        del self.prompts[request_id]
        self.stats.num_finished_requests += 1
        return output

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        completions = [
            CompletionOutput(
                index=seq.index,
                text=seq.text[: seq.num_emitted_chars],
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            )
            for seq in seqs
        ]
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompts[request_id],
            prompt_token_ids=seqs[0].prompt_token_ids,
            outputs=completions,
            finished=all(seq.finished for seq in seqs),
            num_cached_tokens=seqs[0].num_cached_tokens,
            metrics=seqs[0].metrics,
        )
