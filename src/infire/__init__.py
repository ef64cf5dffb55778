"""infire: LLM inference with continuous batching, a paged KV cache and prefix caching.

The names below are imported on first use (PEP 562), not with the package: `infire.gateway`
and the `infire` command line import `infire` without the engine, and the gateway's own
distribution (infire-gateway, gateway-dist/) installs without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers and editors see them
    from infire.engine.client import EngineClient as EngineClient
    from infire.engine.client import InprocEngineClient as InprocEngineClient
    from infire.engine.client import MPEngineClient as MPEngineClient
    from infire.engine.engine import LLMEngine as LLMEngine
    from infire.engine.llm import LLM as LLM
    from infire.engine.messages import GenerateRequest as GenerateRequest
    from infire.engine.messages import RequestDelta as RequestDelta
    from infire.outputs import CompletionOutput as CompletionOutput
    from infire.outputs import Logprob as Logprob
    from infire.outputs import RequestOutput as RequestOutput
    from infire.sampling_params import SamplingParams as SamplingParams

_MODULES = {
    "LLM": "infire.engine.llm",
    "CompletionOutput": "infire.outputs",
    "EngineClient": "infire.engine.client",
    "GenerateRequest": "infire.engine.messages",
    "InprocEngineClient": "infire.engine.client",
    "LLMEngine": "infire.engine.engine",
    "Logprob": "infire.outputs",
    "MPEngineClient": "infire.engine.client",
    "RequestDelta": "infire.engine.messages",
    "RequestOutput": "infire.outputs",
    "SamplingParams": "infire.sampling_params",
}
__all__ = list(_MODULES)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`infire.LLM` and the other exports, imported when first asked for."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'infire' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULES})
