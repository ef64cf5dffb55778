"""The inference engine: requests, KV block pool, scheduler, model runner and the step loop.

Outside this package, code drives an engine through an EngineClient (client.py) with the
messages of messages.py, or through `LLM` / `LLMEngine` for offline use; the scheduler,
block manager and runner stay private to it.
"""

from infire.engine.client import EngineClient, InprocEngineClient, MPEngineClient
from infire.engine.messages import (
    ChoiceDelta,
    EngineStats,
    GenerateRequest,
    ModelInfo,
    RequestDelta,
    merge_delta,
)

__all__ = [
    "ChoiceDelta",
    "EngineClient",
    "EngineStats",
    "GenerateRequest",
    "InprocEngineClient",
    "MPEngineClient",
    "ModelInfo",
    "RequestDelta",
    "merge_delta",
]
