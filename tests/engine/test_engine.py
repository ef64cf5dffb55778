"""Engine behaviour end to end on a tiny random Llama: batching, prefix cache, chunking,
preemption and bad input. Outputs are compared token for token against solo runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infire import LLM, SamplingParams
from infire.config import CacheConfig, EngineConfig, SchedulerConfig
from infire.engine import merge_delta
from infire.engine.engine import LLMEngine
from infire.errors import ContextLengthError, InvalidRequestError

PROMPT_LENGTHS = [5, 17, 33, 3, 48, 20, 9, 64]
ARRIVAL_STEPS = [0, 0, 1, 2, 2, 5, 7, 11]


def _engine(model: Path, **kwargs: object) -> LLMEngine:
    cache = CacheConfig(num_blocks=kwargs.pop("num_blocks", 256), block_size=16,
                        enable_prefix_caching=kwargs.pop("prefix", True))  # fmt: skip
    scheduler = SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    return LLMEngine(
        EngineConfig(model=str(model), dtype="float32", cache=cache, scheduler=scheduler)
    )


def _prompts(n: int = len(PROMPT_LENGTHS)) -> list[list[int]]:
    return [
        [(7 * i + 13 * j) % 250 + 1 for j in range(length)]
        for i, length in enumerate(PROMPT_LENGTHS[:n])
    ]


def _params(seeded: bool, i: int, max_tokens: int = 12) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i,
                              max_tokens=max_tokens, ignore_eos=True)  # fmt: skip
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _run_all(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams, int]]
) -> dict[str, list[int]]:
    """Add each request at its arrival step and step until all finish."""
    results: dict[str, list[int]] = {}
    outputs = {}
    step = 0
    while len(results) < len(requests):
        for rid, (prompt, params, arrival) in requests.items():
            if arrival == step:
                engine.add_request(rid, prompt, params)
        for delta in engine.step():
            out = outputs[delta.request_id] = merge_delta(outputs.get(delta.request_id), delta)
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    return results


def _solo(
    model: Path, prompts: list[list[int]], seeded: bool, max_tokens: int = 12, **kwargs: object
) -> list[list[int]]:
    engine = _engine(model, **kwargs)
    return [
        _run_all(engine, {"solo": (p, _params(seeded, i, max_tokens), 0)})["solo"]
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_continuous_batching_matches_solo_runs(tiny_llama: Path, seeded: bool):
    prompts = _prompts()
    solo = _solo(tiny_llama, prompts, seeded, prefix=False)
    engine = _engine(tiny_llama, prefix=False)
    requests = {f"r{i}": (p, _params(seeded, i), ARRIVAL_STEPS[i]) for i, p in enumerate(prompts)}
    batched = _run_all(engine, requests)
    assert [batched[f"r{i}"] for i in range(len(prompts))] == solo
    assert engine.stats.num_steps < sum(len(s) for s in solo)  # they really ran together
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_skips_shared_prefix(tiny_llama: Path):
    engine = _engine(tiny_llama)
    shared = [(5 * j) % 200 + 3 for j in range(64)]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    out1 = _run_all(engine, {"a": (first, _params(False, 0), 0)})["a"]
    computed_before = engine.stats.num_computed_prompt_tokens
    out2 = _run_all(engine, {"b": (second, _params(False, 0), 0)})["b"]
    computed_second = engine.stats.num_computed_prompt_tokens - computed_before
    assert len(second) - computed_second >= 48
    assert engine.stats.prefix_cache_hits >= 48
    fresh = _engine(tiny_llama, prefix=False)
    assert out2 == _run_all(fresh, {"b": (second, _params(False, 0), 0)})["b"]
    assert out1 == _run_all(fresh, {"a": (first, _params(False, 0), 0)})["a"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_chunked_prefill_with_small_budget_matches(tiny_llama: Path, seeded: bool):
    prompts = _prompts()
    reference = _solo(tiny_llama, prompts, seeded, prefix=False)
    engine = _engine(tiny_llama, max_num_batched_tokens=16, prefix=False)
    requests = {f"r{i}": (p, _params(seeded, i), ARRIVAL_STEPS[i]) for i, p in enumerate(prompts)}
    batched = _run_all(engine, requests)
    assert [batched[f"r{i}"] for i in range(len(prompts))] == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_preemption_with_tiny_pool_matches(tiny_llama: Path, seeded: bool):
    prompts = _prompts()
    reference = _solo(tiny_llama, prompts, seeded, max_tokens=40, prefix=False)
    engine = _engine(tiny_llama, num_blocks=7)
    requests = {
        f"r{i}": (p, _params(seeded, i, 40), ARRIVAL_STEPS[i]) for i, p in enumerate(prompts)
    }
    batched = _run_all(engine, requests)
    assert engine.stats.num_preemptions > 0
    assert [batched[f"r{i}"] for i in range(len(prompts))] == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks_at_once(tiny_llama: Path):
    engine = _engine(tiny_llama)
    engine.add_request("long", list(range(1, 40)), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("other", list(range(2, 30)), _params(False, 0))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    delta = engine.abort_request("long")
    assert delta is not None and delta.finished
    assert [c.finish_reason for c in delta.choices] == ["abort"]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_requests_raise_and_engine_keeps_serving(tiny_llama: Path):
    engine = _engine(tiny_llama, max_model_len=128)
    engine.add_request("good", [1, 2, 3, 4], _params(False, 0))
    with pytest.raises(ContextLengthError, match="200 tokens"):
        engine.add_request("too-long", list(range(1, 201)), _params(False, 0))
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request("bad-t", [1, 2], SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match="seed: must fit in 64 bits"):
        SamplingParams(seed=2**64 - 1, n=2)  # would overflow the generator: the engine stays up
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], _params(False, 0))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", [1], _params(False, 0))
    output = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            output = merge_delta(output, delta)
    assert output.finished and len(output.outputs[0].token_ids) == 12


def test_llm_api_shapes_like_vllm(tiny_llama: Path):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    outs = llm.generate(
        ["the cat", "in the hat"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert [o.prompt for o in outs] == ["the cat", "in the hat"]
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length"
        assert len(completion.token_ids) == 5
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    two = llm.generate(
        "the cat", SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    )
    assert [c.index for c in two[0].outputs] == [0, 1]
    assert two[0].outputs[0].token_ids != two[0].outputs[1].token_ids


def test_a_cpu_engine_does_not_import_triton(tiny_llama: Path):
    """triton (installed with the test extras) costs ~90 MiB resident where it is imported:
    an engine that serves on the CPU never takes its kernels, so never imports it (the
    catalog's memory budget counts every engine process's resident bytes)."""
    code = (
        "import sys; from infire import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama)!r}, dtype='float32')\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "print(len(out[0].outputs[0].token_ids), sorted(m for m in sys.modules if m.startswith('triton')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["4", "[]"]
