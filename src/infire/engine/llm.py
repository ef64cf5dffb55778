"""LLM: the offline batch API, shaped like vLLM's `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from infire.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from infire.engine.engine import LLMEngine
from infire.engine.messages import merge_delta
from infire.engine.validation import check_params
from infire.outputs import RequestOutput
from infire.sampling_params import SamplingParams

DEFAULT_KV_CACHE_MEMORY = 512 * 1024**2


class LLM:
    """Generate for a batch of prompts; `LLM()` serves the default model (SmolLM2-135M).

    With tensor_parallel_size x pipeline_parallel_size > 1 this process is rank 0 and the
    other ranks are worker processes: `shutdown()` (or leaving a `with` block) stops them,
    as do garbage collection and interpreter exit."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        seed: int = 0,
        block_size: int = 16,
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        cpu_kernels: bool = True,
        enforce_eager: bool = False,
        quantization: str = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            seed=seed,
            cpu_kernels=cpu_kernels,
            enforce_eager=enforce_eager,
            quantization=quantization,
            cache=CacheConfig(block_size, kv_cache_memory, num_blocks, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len),
            parallel=ParallelConfig(tensor_parallel_size, pipeline_parallel_size),
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the worker ranks (a no-op for one rank); the LLM cannot generate after."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self):  # noqa: ANN201 (re-exported type)
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in input order (prompts may be token ids)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = _per_prompt(sampling_params, len(prompts))
        ids = [str(next(self._ids)) for _ in prompts]
        # Validate every prompt before queueing any, so one bad prompt changes nothing.
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        for p in params:
            check_params(p, self.engine.model_info)
            if p.structured_output is not None:
                self.engine.grammars.check(p.structured_output)  # a bad grammar raises now
        outputs = {}
        for request_id, prompt, token_ids, p in zip(ids, prompts, tokenized, params, strict=True):
            self.engine.add_request(request_id, prompt, p, prompt_token_ids=token_ids)
            text = prompt if isinstance(prompt, str) else None
            outputs[request_id] = RequestOutput(request_id, text, token_ids, [], False)
        return self._run(outputs, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them, via the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [tokenizer.encode_chat(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, outputs: dict[str, RequestOutput], use_tqdm: bool) -> list[RequestOutput]:
        bar = tqdm(total=len(outputs), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                merge_delta(outputs[delta.request_id], delta)
                bar.update(int(delta.finished))
        bar.close()
        return list(outputs.values())


def _per_prompt(
    params: SamplingParams | Seq[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
