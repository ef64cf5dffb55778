"""What a catalog entry's engine is: its settings, and the bytes it is expected to take.

The estimate is checked against the measured footprint after each load (manager.py)
and replaced by it; it only has to be close enough to make room before a first load.
It counts the weights at the dtype they are served in (read from the checkpoint's
headers, nothing loaded), the KV reservation of a generative model, and the runtime of
each engine process (Python, torch and their libraries: 219 MiB resident for a bare
`import torch` on the development machine).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from infire.catalog.config import CatalogEntry
from infire.config import EngineConfig, ParallelConfig, resolve_dtype

RUNTIME_BYTES = 256 * 2**20  # one engine process before its weights
GENERATIVE = "text-generation"
SPEECH = "automatic-speech-recognition"


def engine_config_for(entry: CatalogEntry, base: EngineConfig) -> EngineConfig:
    """The server's engine settings with the entry's own ([model.engine]) on top."""
    engine = entry.engine
    cache = base.cache
    if "kv_cache_memory" in engine:
        cache = dataclasses.replace(cache, kv_cache_memory=engine["kv_cache_memory"])
    scheduler = base.scheduler
    if "max_model_len" in engine:
        scheduler = dataclasses.replace(scheduler, max_model_len=engine["max_model_len"])
    parallel: ParallelConfig = base.parallel
    if "tensor_parallel_size" in engine:
        parallel = dataclasses.replace(
            parallel, tensor_parallel_size=engine["tensor_parallel_size"]
        )
    if "threads" in engine:
        parallel = dataclasses.replace(parallel, threads_per_rank=engine["threads"])
    return dataclasses.replace(
        base, model=str(entry.path), dtype=engine.get("dtype", base.dtype), cache=cache,
        scheduler=scheduler, parallel=parallel,
        quantization=engine.get("quantization", base.quantization),
    )  # fmt: skip


def inspect_entry(entry: CatalogEntry, base: EngineConfig) -> tuple[int, dict[str, int]]:
    """Bytes the entry's engine processes are expected to take once loaded, and the
    properties the catalog API shows (context_window; max_input_tokens and
    output_dimensions of an encoder), read from the checkpoint's headers."""
    config = engine_config_for(entry, base)
    fused = config.cpu_kernels and config.device == "cpu"
    dtype = resolve_dtype(
        config.dtype, config.device, fused_cpu_bf16=fused and entry.task == GENERATIVE
    )
    if entry.task == GENERATIVE:
        from infire.models.loader import load_model, weight_bytes

        loaded = load_model(config.model, dtype)  # headers only
        ranks = config.parallel.world_size // config.parallel.nnodes
        kv = config.cache.kv_cache_memory
        # GGUF blocks are served as they are on one rank (ranks of a group dequantize)
        quantization = config.quantization if ranks == 1 and fused else "none"
        size = weight_bytes(loaded, dtype, quantization) + kv + RUNTIME_BYTES * ranks
        window = loaded.config.max_position_embeddings
        if config.scheduler.max_model_len:
            window = min(window, config.scheduler.max_model_len)
        return size, {"context_window": window}
    if entry.task == SPEECH:  # float32 weights, no KV reservation (a window's is small)
        from infire.models.whisper import whisper_bytes

        return whisper_bytes(Path(config.model)) + RUNTIME_BYTES, {}
    from infire.models import bert
    from infire.models.checkpoint import safetensors_files
    from infire.models.weights import SafetensorsSource

    weights = SafetensorsSource(safetensors_files(Path(config.model)), dtype)
    properties = bert.describe(config.model)
    if entry.task != "text-embeddings":
        properties.pop("output_dimensions")
    return _numel(weights) * dtype.itemsize + RUNTIME_BYTES, properties


def _numel(weights: object) -> int:
    return sum(math.prod(weights.shape(name)) for name in weights.names())
