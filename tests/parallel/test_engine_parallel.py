"""The engine over tensor- and pipeline-parallel worker ranks (gloo, real processes):
outputs token-identical to one rank (greedy and seeded, with chunked prefill, prefix-cache
hits and preemption), refusals that name the constraint, no worker left behind, and two
"hosts" joined by env rendezvous."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infire import LLM, SamplingParams
from infire.errors import ModelLoadError
from infire.serverproc import free_port
from processes import child_pids

SHAPES = [(2, 1), (1, 2), (2, 2)]


def _workers(llm: LLM) -> list[subprocess.Popen]:
    return llm.engine.executor.workers if hasattr(llm.engine.executor, "workers") else []


def _all_gone(workers: list[subprocess.Popen], seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(w.poll() is not None for w in workers)


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded requests; two share a 40-token prefix (a prefix-cache hit)."""
    shared = [(3 * i) % 200 + 1 for i in range(40)]
    prompts = [shared + [5, 6, 7], list(range(20, 57)), shared + [9], [11] * 3, list(range(1, 60))]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10,
                                     ignore_eos=True, repetition_penalty=1.2)]  # fmt: skip
    return prompts, [params[i % 2] for i in range(len(prompts))]


def _run(model: Path, tp: int = 1, pp: int = 1, **kwargs: object) -> list[list[int]]:
    prompts, params = _workload()
    # A 32-token budget: chunked prefill; 9 blocks of 16 for 4 x ~60 tokens: preemption.
    with LLM(str(model), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
             max_num_batched_tokens=32, num_blocks=9, **kwargs) as llm:  # fmt: skip
        workers = _workers(llm)
        assert len(workers) == tp * pp - 1
        # the shared prefix is computed once, then found in the cache
        first = llm.generate(prompts[:1], params[:1])
        outs = first + llm.generate(prompts[1:], params[1:])
        stats = llm.engine.stats
        assert stats.prefix_cache_hits >= 32 and stats.num_preemptions > 0, stats
    assert _all_gone(workers)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_tp_pp_outputs_are_token_identical(fixture: str, request: pytest.FixtureRequest):
    model = request.getfixturevalue(fixture)
    reference = _run(model)
    for tp, pp in SHAPES:
        assert _run(model, tp, pp) == reference, (tp, pp)


def test_smollm2_pipeline_and_tensor_parallel(smollm2_path: Path):
    """With grammars too: on a pipeline, rank 0's matchers send the masks to the last
    stage, which samples."""
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Call me at", "Is water wet?"]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    phone = SamplingParams(temperature=0.8, seed=2, max_tokens=12,
                           structured_output={"regex": "[0-9]{3}-[0-9]{4}"})  # fmt: skip
    choice = SamplingParams(
        temperature=0, max_tokens=12, structured_output={"choice": ["yes", "no"]}
    )
    params = [plain, plain, phone, choice]

    def run(tp: int, pp: int) -> list[list[int]]:
        # dequantized: ranks of a pipeline or tensor-parallel group do not serve GGUF blocks
        with LLM(dtype="float32", num_blocks=64, tensor_parallel_size=tp,
                 pipeline_parallel_size=pp, quantization="none") as llm:  # fmt: skip
            outputs = llm.generate(prompts, params)
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", outputs[2].outputs[0].text)
        assert outputs[3].outputs[0].text in ("yes", "no")
        return [o.outputs[0].token_ids for o in outputs]

    reference = run(1, 1)
    assert run(1, 2) == reference
    # 9 heads and 3 KV heads: 3 shards of 3 heads and 1 KV head each (TP=2 is refused)
    assert run(3, 1) == reference
    assert run(3, 2) == reference


def test_a_model_that_cannot_be_cut_is_refused_before_any_process(tiny_llama: Path):
    before = child_pids()
    with pytest.raises(ModelLoadError, match="num_attention_heads 4 is not divisible by "
                       "tensor_parallel_size 3"):  # fmt: skip
        LLM(str(tiny_llama), dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ModelLoadError, match="more than the model's 2 layers"):
        LLM(str(tiny_llama), dtype="float32", pipeline_parallel_size=3)
    assert child_pids() <= before


def test_workers_end_with_shutdown_and_with_garbage_collection(tiny_llama: Path):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=16, tensor_parallel_size=2)
    workers = _workers(llm)
    assert len(workers) == 1 and workers[0].poll() is None
    llm.shutdown()
    assert _all_gone(workers)
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=16, pipeline_parallel_size=2)
    workers = _workers(llm)
    assert len(workers) == 1 and workers[0].poll() is None
    del llm
    gc.collect()
    assert _all_gone(workers)


def test_two_hosts_by_env_rendezvous(tiny_llama: Path, tmp_path: Path):
    """Two launches on one host, each a "node" with one rank, meeting at a master port."""
    port = str(free_port())
    single = [sys.executable, "-m", "infire.cli", "generate", "the cat", "--model",
              str(tiny_llama), "--dtype", "float32", "--max-tokens", "8", "--kv-cache-memory",
              "8MiB"]  # fmt: skip
    common = [*single, "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", port]
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]  # noqa: SIM115
    nodes = [subprocess.Popen([*common, "--node-rank", str(i)], stdout=subprocess.PIPE,
                              stderr=logs[i], text=True) for i in (1, 0)]  # fmt: skip
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
        codes = [node.returncode for node in nodes]
    finally:
        for node in nodes:
            node.kill()
        for log in logs:
            log.close()
    assert codes == [0, 0], [(tmp_path / f"node{i}.log").read_text()[-2000:] for i in range(2)]
    alone = subprocess.run(single, capture_output=True, text=True, timeout=120, check=True)
    assert outputs[1] == alone.stdout and outputs[1].startswith("the cat")
