"""infire: LLM inference with continuous batching, a paged KV cache and prefix caching."""

from infire.engine.client import EngineClient, InprocEngineClient, MPEngineClient
from infire.engine.engine import LLMEngine
from infire.engine.llm import LLM
from infire.engine.messages import GenerateRequest, RequestDelta
from infire.outputs import CompletionOutput, Logprob, RequestOutput
from infire.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineClient",
    "GenerateRequest",
    "InprocEngineClient",
    "LLMEngine",
    "Logprob",
    "MPEngineClient",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
