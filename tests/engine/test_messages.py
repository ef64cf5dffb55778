"""Every message of engine/messages.py survives the wire (msgpack) unchanged, garbage is
refused with WireError, and deltas merge into the whole output."""

from __future__ import annotations

import msgpack
import pytest

from infire.engine.messages import (
    AbortRequest,
    ChoiceDelta,
    EngineFailed,
    EngineReady,
    EngineStats,
    GenerateRequest,
    ModelInfo,
    NewSequence,
    RequestDelta,
    SampledTokens,
    ScheduledItem,
    Shutdown,
    StepInput,
    StepOutputs,
    WireError,
    decode,
    encode,
    merge_delta,
)
from infire.outputs import Logprob, RequestMetrics
from infire.sampling_params import SamplingParams

PARAMS = SamplingParams(n=2, temperature=0.7, seed=3, stop=["\n"], logit_bias={5: -2.5},
                        logprobs=1, max_tokens=None)  # fmt: skip
LOGPROBS = [{7: Logprob(7, -0.1, 1, "a"), 9: Logprob(9, -2.5, 2, "é")}]
DELTA = RequestDelta(
    "r1", [ChoiceDelta(0, "a", [7], LOGPROBS, -0.1), ChoiceDelta(1, "", [], None, None, "stop", "\n")],
    True, 12, 4, RequestMetrics(1.0, 2.0, 3.0, 4.0),
)  # fmt: skip
MESSAGES = [
    GenerateRequest("r1", [1, 2, 3], PARAMS, "hi"),
    GenerateRequest("r2", [4], SamplingParams()),
    AbortRequest("r1"),
    Shutdown(),
    EngineReady(
        ModelInfo("m", 2048, 49152, 4096, 16, "float32", "active", "{{ x }}", "qwen3", 4608)
    ),
    EngineFailed("no such model"),
    StepOutputs([DELTA], EngineStats(1, 2, 0.5, 3, 4, 5, 6, 7, 8, 9, 10)),
    StepOutputs(),
    StepInput(3, [NewSequence(8, 1, PARAMS, [1, 2])], [ScheduledItem(8, 0, 2, [], 0, [4, 5])], [2]),
    SampledTokens(3, [7, 8], [-0.5, -1.0], [1, 3], [[7], [2]], [[-0.5], [-0.2]]),
    SampledTokens(4, []),
]  # fmt: skip


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object):
    assert decode(encode(message)) == message


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb([99, 1]), msgpack.packb([2])])
def test_garbage_is_refused(data: bytes):
    with pytest.raises(WireError, match="malformed engine message"):
        decode(data)


def test_deltas_merge_into_the_whole_output():
    first = RequestDelta("r", [ChoiceDelta(0, "Hel", [1, 2], LOGPROBS * 2, -0.2)], False, 5)
    second = RequestDelta("r", [ChoiceDelta(0, "lo", [3], LOGPROBS, -0.3, "length")], True, 5, 2)
    output = merge_delta(merge_delta(None, first), second)
    choice = output.outputs[0]
    assert (choice.text, choice.token_ids, choice.finish_reason) == ("Hello", [1, 2, 3], "length")
    assert len(choice.logprobs) == 3 and choice.cumulative_logprob == -0.3
    assert output.finished and output.num_cached_tokens == 2
