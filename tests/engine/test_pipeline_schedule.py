"""Pipeline micro-batches under KV pressure, on one process: rank 0's bookkeeping of
MultiprocExecutor with a worker's SequenceMirror fed through the wire (a test-only
stand-in for the ranks, beside the real ones in tests/parallel). The mirror's block tables
never diverge from rank 0's, preemption never livelocks, nothing is left behind, and the
tokens equal a one-rank run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infire.config import CacheConfig, EngineConfig, SchedulerConfig
from infire.engine.engine import LLMEngine
from infire.engine.executor import MultiprocExecutor
from infire.engine.messages import decode, encode
from infire.engine.worker import SequenceMirror
from infire.sampling_params import SamplingParams


class _NoRunner:
    device = torch.device("cpu")

    def release_sequence(self, seq_id: int) -> None:
        pass


class _WirePipeline:
    """Depth-2 pipeline: StepInputs cross msgpack into a worker mirror; rank 0 computes."""

    pipeline_depth = 2
    _step_input = MultiprocExecutor._step_input
    preempted = MultiprocExecutor.preempted

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = engine.runner
        self._sent: dict = {}
        self._released: list[int] = []
        self._step_id = 0
        self.mirror = SequenceMirror(_NoRunner())  # type: ignore[arg-type]
        self.divergences = 0

    def submit(self, batch: list) -> object:
        self._step_id += 1
        mirrored = self.mirror.apply(decode(encode(self._step_input(batch))))
        for ours, theirs in zip(batch, mirrored, strict=True):
            same = (ours.seq.block_table, ours.seq.token_ids, ours.seq.num_computed_tokens) == (
                theirs.seq.block_table, theirs.seq.token_ids, theirs.seq.num_computed_tokens)  # fmt: skip
            self.divergences += not same
        return self.runner.execute(batch)

    def wait(self, handle: object) -> object:
        return handle

    def release(self, seq_ids: list[int]) -> None:
        MultiprocExecutor.release(self, seq_ids)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        pass


def _engine(model: Path, num_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model), dtype="float32", cpu_kernels=False,
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(5, 8, None),
    ))  # fmt: skip


@pytest.mark.parametrize("num_blocks", [5, 6, 9])
def test_micro_batches_under_kv_pressure(tiny_llama: Path, num_blocks: int):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1 + i, 2, 3, 4, 5] for i in range(4)]
    results = []
    for pipelined in (False, True):
        engine = _engine(tiny_llama, num_blocks)
        if pipelined:
            wire = engine.executor = _WirePipeline(engine)  # type: ignore[assignment]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for delta in engine.step():
                tokens.setdefault(delta.request_id, [])
                tokens[delta.request_id] += [t for c in delta.choices for t in c.token_ids]
        assert not engine.has_unfinished_requests(), "no progress (livelock)"
        results.append(tokens)
        assert engine.block_manager.num_free_blocks == num_blocks
    assert results[1] == results[0]
    assert wire.divergences == 0
    assert not wire._sent  # every finished sequence was released ...
    assert set(wire.mirror.seqs) <= set(wire._released)  # ... and goes with the next step
