"""Prefill and decode engines handing KV over, in one process, through Mooncake's transfer
engine (TCP on 127.0.0.1) and through the test-only in-process connector: token identity
with a whole engine, the prefix cache on the decode side, leases, checksums and failures,
with every block back in its pool at the end."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from infire import SamplingParams
from infire.config import CacheConfig, DisaggConfig, EngineConfig
from infire.engine import GenerateRequest, merge_delta
from infire.engine.engine import LLMEngine
from infire.outputs import RequestOutput

PROMPTS = [[(7 * i + 13 * j) % 250 + 1 for j in range(length)]
           for i, length in enumerate([5, 16, 37, 64, 21])]  # fmt: skip


def _engine(
    model: Path, role: str = "both", lease: float = 30.0, connector: str = "mooncake"
) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model), dtype="float32",
        cache=CacheConfig(num_blocks=64, block_size=16),
        disagg=DisaggConfig(role=role, connector=connector, lease_seconds=lease),
    ))  # fmt: skip


@pytest.fixture(scope="module", params=["mooncake", "inproc"])
def engines(tiny_llama: Path, request: pytest.FixtureRequest):
    whole, prefill, decode = (_engine(tiny_llama, r, connector=request.param)
                              for r in ("both", "prefill", "decode"))  # fmt: skip
    yield whole, prefill, decode
    for engine in (whole, prefill, decode):
        engine.shutdown()


ERRORS: dict[str, str] = {}  # request id -> the error its last delta carried


def _run(engine: LLMEngine, request: GenerateRequest) -> RequestOutput:
    ERRORS.pop(request.request_id, None)
    engine.add(request)
    output = None
    for _ in range(500):
        for delta in engine.step():
            if delta.request_id == request.request_id:
                output = merge_delta(output, delta)
                if delta.error is not None:
                    ERRORS[request.request_id] = delta.error
                if output.finished:
                    return output
    raise AssertionError("the request did not finish")


def _split(prefill: LLMEngine, decode: LLMEngine, rid: str, ids: list[int],
           params: SamplingParams) -> tuple[RequestOutput, RequestOutput]:  # fmt: skip
    first = _run(prefill, GenerateRequest(rid, ids, params, kv_transfer={"do_remote_decode": True}))
    handle = first.kv_transfer_params
    assert handle is not None and handle["first"]["token"] == first.outputs[0].token_ids[0]
    second = _run(decode, GenerateRequest(rid, ids, params, kv_transfer=handle))
    if handle.get("lease"):
        assert prefill.release_kv(handle["lease"])
    return first, second


def _params(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7 + i, max_tokens=10,
                              ignore_eos=True, logprobs=2, presence_penalty=0.5)  # fmt: skip
    return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def _assert_idle(*engines: LLMEngine) -> None:
    for engine in engines:
        stats = engine.stats_snapshot()
        assert stats.num_free_blocks == stats.num_blocks, "a KV block leaked"
        assert stats.num_leases == 0 and stats.num_pulling == 0
        assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_split_request_equals_a_whole_engine(engines, seeded: bool) -> None:
    whole, prefill, decode = engines
    for i, ids in enumerate(PROMPTS):
        params = _params(i, seeded)
        expected = _run(whole, GenerateRequest(f"w{seeded}{i}", ids, params)).outputs[0]
        first, got = _split(prefill, decode, f"s{seeded}{i}", ids, params)
        assert got.outputs[0].token_ids == expected.token_ids, i
        assert got.outputs[0].text == expected.text
        assert [list(s) for s in got.outputs[0].logprobs] == [list(s) for s in expected.logprobs]
        for mine, theirs in zip(got.outputs[0].logprobs, expected.logprobs, strict=True):
            for token, entry in mine.items():
                assert entry.logprob == pytest.approx(theirs[token].logprob, abs=1e-5)
        assert first.outputs[0].token_ids == expected.token_ids[:1]
    _assert_idle(prefill, decode)


def test_a_grammar_carries_across_the_split(engines) -> None:
    """The prefill engine samples the first token under the grammar; the decode engine
    compiles its own matcher, feeds it that token and goes on: as one whole engine."""
    whole, prefill, decode = engines
    regex = "[a-z]{2,4}( [a-z]{2,4}){3,5}"
    for i, seed in enumerate((None, 11)):
        params = SamplingParams(temperature=0 if seed is None else 0.9, seed=seed,
                                max_tokens=30, structured_output={"regex": regex})  # fmt: skip
        expected = _run(whole, GenerateRequest(f"wg{i}", PROMPTS[i], params)).outputs[0]
        _, got = _split(prefill, decode, f"sg{i}", PROMPTS[i], params)
        assert got.outputs[0].token_ids == expected.token_ids
        assert re.fullmatch(regex, got.outputs[0].text), got.outputs[0].text
        assert got.outputs[0].finish_reason == expected.finish_reason == "stop"
    _assert_idle(prefill, decode)


def test_first_token_that_ends_the_request_needs_no_transfer(engines) -> None:
    whole, prefill, decode = engines
    params = SamplingParams(temperature=0, max_tokens=1)
    pulls = decode.stats_snapshot().kv_pulls
    first, got = _split(prefill, decode, "one", PROMPTS[2], params)
    assert first.kv_transfer_params.get("lease") is None
    assert got.outputs[0].token_ids == first.outputs[0].token_ids
    assert got.outputs[0].finish_reason == "length"
    assert decode.stats_snapshot().kv_pulls == pulls
    _assert_idle(prefill, decode)


def test_decode_side_prefix_cache_pulls_only_missing_blocks(engines) -> None:
    _, prefill, decode = engines
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    system = [(3 * j) % 200 + 5 for j in range(48)]  # three full blocks shared
    before = decode.stats_snapshot()
    _split(prefill, decode, "p1", system + [9, 8, 7], params)
    middle = decode.stats_snapshot()
    assert middle.kv_blocks_pulled - before.kv_blocks_pulled == 4  # 51 tokens: 4 blocks
    _split(prefill, decode, "p2", system + [1, 2], params)
    after = decode.stats_snapshot()
    assert after.kv_blocks_pulled - middle.kv_blocks_pulled == 1  # only the partial block
    assert after.kv_blocks_reused - middle.kv_blocks_reused == 3
    _assert_idle(prefill, decode)


def test_lease_expires_and_frees_the_blocks(tiny_llama: Path) -> None:
    prefill = _engine(tiny_llama, "prefill", lease=0.2)
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        out = _run(prefill, GenerateRequest("x", PROMPTS[3], params,
                                            kv_transfer={"do_remote_decode": True}))  # fmt: skip
        stats = prefill.stats_snapshot()
        assert stats.num_leases == 1 and stats.num_leased_blocks == 4
        assert stats.num_free_blocks < stats.num_blocks  # 4 blocks held, cached
        assert out.kv_transfer_params["lease_seconds"] == 0.2
        time.sleep(0.25)
        assert prefill.idle_timeout() == 0.0  # expired and freed: the loop goes round once
        assert prefill.idle_timeout() is None  # and then waits for commands
        stats = prefill.stats_snapshot()
        assert stats.num_leases == 0 and stats.kv_leases_expired == 1
        assert stats.num_free_blocks == stats.num_blocks
        assert not prefill.release_kv(out.kv_transfer_params["lease"])  # too late: unknown
    finally:
        prefill.shutdown()


def test_corrupted_block_fails_the_request_and_frees_everything(engines) -> None:
    _, prefill, decode = engines
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [11 + j for j in range(40)]
    first = _run(prefill, GenerateRequest("c", ids, params, kv_transfer={"do_remote_decode": True}))
    handle = first.kv_transfer_params
    # one byte of the second block's first layer plane changes after the checksum was taken
    plane = prefill.runner.kv_caches[0][0]
    plane[handle["block_ids"][1]].view(-1)[0] += 1.0
    got = _run(decode, GenerateRequest("c", ids, params, kv_transfer=handle))
    assert "checksum" in ERRORS["c"]
    assert len(got.outputs[0].token_ids) == 1  # the first token, streamed before the pull
    assert decode.stats_snapshot().kv_pulls_failed == 1
    assert prefill.release_kv(handle["lease"])
    _assert_idle(prefill, decode)
    decode.block_manager.reset_prefix_cache()


def test_dead_prefill_engine_fails_the_pull(tiny_llama: Path, engines) -> None:
    _, _, decode = engines
    prefill = _engine(tiny_llama, "prefill", connector=decode.transfer.connector.name)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [21 + j for j in range(30)]
    first = _run(prefill, GenerateRequest("d", ids, params, kv_transfer={"do_remote_decode": True}))
    prefill.shutdown()  # its connector leaves: nothing can be read from it
    got = _run(decode, GenerateRequest("d", ids, params, kv_transfer=first.kv_transfer_params))
    assert got.outputs[0].token_ids == first.outputs[0].token_ids  # the first token only
    assert ERRORS["d"]  # Mooncake: the range is no longer registered; in-process: no peer
    _assert_idle(decode)


def test_abort_on_the_decode_side_before_the_pull(engines) -> None:
    _, prefill, decode = engines
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [31 + j for j in range(20)]
    first = _run(prefill, GenerateRequest("a", ids, params, kv_transfer={"do_remote_decode": True}))
    decode.add(GenerateRequest("a", ids, params, kv_transfer=first.kv_transfer_params))
    delta = decode.abort_request("a")
    assert delta.finished and delta.choices[0].finish_reason == "abort"
    for _ in range(5):
        decode.step()
    assert prefill.release_kv(first.kv_transfer_params["lease"])
    _assert_idle(prefill, decode)


def test_abort_of_a_leased_prefill_request_frees_the_lease(engines) -> None:
    _, prefill, _ = engines
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [41 + j for j in range(20)]
    _run(prefill, GenerateRequest("z", ids, params, kv_transfer={"do_remote_decode": True}))
    assert prefill.stats_snapshot().num_leases == 1
    assert prefill.abort_request("z") is None  # the request itself had ended
    _assert_idle(prefill)


def test_signed_handles_and_forgeries(tiny_llama: Path) -> None:
    from infire.disagg.transfer import check_kv_params
    from infire.errors import InvalidRequestError

    prefill = LLMEngine(EngineConfig(
        model=str(tiny_llama), dtype="float32", cache=CacheConfig(num_blocks=16, block_size=16),
        disagg=DisaggConfig(role="prefill", connector="inproc", secret="s3cret"),
    ))  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        ids = PROMPTS[2]
        handle = _run(prefill, GenerateRequest("g", ids, params,
                                               kv_transfer={"do_remote_decode": True})).kv_transfer_params  # fmt: skip
        layout, vocab = prefill.model_info.kv_layout, prefill.model_info.vocab_size
        check_kv_params("decode", handle, ids, 1, layout, secret="s3cret", vocab_size=vocab)
        # the balancer's prefill_url is outside the signature
        check_kv_params("decode", handle | {"prefill_url": "http://x"}, ids, 1, layout,
                        secret="s3cret", vocab_size=vocab)  # fmt: skip
        forged = [handle | {"engine": "10.0.0.1:15000"}, handle | {"checksums": [0] * 3},
                  {k: v for k, v in handle.items() if k != "signature"}]  # fmt: skip
        for bad in forged:
            with pytest.raises(InvalidRequestError, match="not signed"):
                check_kv_params("decode", bad, ids, 1, layout, secret="s3cret", vocab_size=vocab)
        with pytest.raises(InvalidRequestError, match="not signed"):  # another deployment's
            check_kv_params("decode", handle, ids, 1, layout, secret="other", vocab_size=vocab)
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            check_kv_params("decode", handle | {"first": {"token": vocab}}, ids, 1, layout,
                            vocab_size=vocab)  # fmt: skip
        with pytest.raises(InvalidRequestError, match="layout"):
            check_kv_params("decode", handle | {"bases": handle["bases"][:-1]}, ids, 1, layout)
        with pytest.raises(InvalidRequestError, match="logprobs"):
            check_kv_params("decode", handle, ids, 1, layout, logprobs=True)
        assert prefill.release_kv(handle["lease"])
    finally:
        prefill.shutdown()


def test_fully_cached_prompt_releases_its_lease_at_once(engines) -> None:
    _, prefill, decode = engines
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = [(5 * j) % 200 + 3 for j in range(32)]  # two full blocks, both cached after once
    _split(prefill, decode, "f1", ids, params)
    pulls = decode.stats_snapshot().kv_pulls
    first = _run(
        prefill, GenerateRequest("f2", ids, params, kv_transfer={"do_remote_decode": True})
    )
    decode.add(GenerateRequest("f2", ids, params, kv_transfer=first.kv_transfer_params))
    released = []
    while decode.has_unfinished_requests():
        released += [d.kv_transfer for d in decode.step() if d.kv_transfer]
    assert released == [{"lease": first.kv_transfer_params["lease"]}]
    assert decode.stats_snapshot().kv_pulls == pulls  # nothing was pulled
    assert prefill.release_kv(first.kv_transfer_params["lease"])
    _assert_idle(prefill, decode)


def test_prompt_the_decode_pool_cannot_hold_ends_with_length(tiny_llama: Path, engines) -> None:
    _, prefill, _ = engines
    small = LLMEngine(EngineConfig(
        model=str(tiny_llama), dtype="float32", cache=CacheConfig(num_blocks=2, block_size=16),
        disagg=DisaggConfig(role="decode", connector=prefill.transfer.connector.name),
    ))  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        ids = [(7 * j) % 200 + 3 for j in range(40)]  # 3 blocks: more than the pool
        first = _run(prefill, GenerateRequest("big", ids, params,
                                              kv_transfer={"do_remote_decode": True}))  # fmt: skip
        got = _run(small, GenerateRequest("big", ids, params, kv_transfer=first.kv_transfer_params))
        assert got.outputs[0].finish_reason == "length" and len(got.outputs[0].token_ids) == 1
        assert prefill.release_kv(first.kv_transfer_params["lease"])
        _assert_idle(prefill, small)
    finally:
        small.shutdown()
