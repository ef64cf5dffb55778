"""infire: LLM inference with continuous batching, a paged KV cache and prefix caching."""

from infire.engine.async_engine import AsyncLLMEngine
from infire.engine.engine import LLMEngine
from infire.engine.llm import LLM
from infire.outputs import CompletionOutput, Logprob, RequestOutput
from infire.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
