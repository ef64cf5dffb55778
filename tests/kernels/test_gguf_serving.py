"""Quantized GGUFs served as their blocks (EngineConfig.quantization "auto"), against the
same file dequantized to float32 ("none"): a tiny random Llama written in K-quants and
legacy types, and SmolLM2's Q4_1/Q8_0 file; the memory they take."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from emulated import native, use_emulated
from gguf_writer import (
    common_metadata,
    hf_config,
    hf_tensors,
    llama_like_tensors,
    write_gguf,
    write_tiny_k_quant,
    write_tiny_mixtral_q8,
)
from greedy_verdicts import compare_greedy
from infire import LLM, SamplingParams
from infire.kernels.cpu_forward import available
from infire.models.loader import default_model_path
from tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(not available(), reason="no fused CPU kernel here")


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_k_quant(tmp_path_factory.mktemp("tiny-k"), 256)


def _greedy(path: Path | None, quantization: str, prompts: list, tokens: int) -> tuple[list, str]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    with LLM(None if path is None else str(path), dtype="float32", quantization=quantization,
             num_blocks=64) as llm:  # fmt: skip
        outputs = llm.generate(prompts, params)
        return [o.outputs[0] for o in outputs], llm.engine.runner.fused_status


def test_a_k_quant_model_gives_its_dequantized_twins_tokens(k_quant_gguf: Path) -> None:
    prompts = [[(5 * i + 11 * j) % 200 + 3 for j in range(n)] for i, n in enumerate([4, 17, 40])]
    got, status = _greedy(k_quant_gguf, "auto", prompts, 24)
    want, plain = _greedy(k_quant_gguf, "none", prompts, 24)
    assert "GGUF blocks" in status and "GGUF blocks" not in plain
    verdicts = compare_greedy(got, want)
    print("per prompt:", verdicts)


def test_batching_chunking_and_the_prefix_cache_change_no_token(k_quant_gguf: Path) -> None:
    """The blocks path computes each (row, token) product the same way in any batch: one
    request at a time equals all at once under a 16-token step budget (chunked prefill)
    with a shared prefix (a prefix-cache hit), token for token."""
    shared = [(13 * j) % 200 + 3 for j in range(40)]
    prompts = [shared + [7, 8], shared + [9], [5] * 3, list(range(20, 57))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(k_quant_gguf), dtype="float32", num_blocks=64) as llm:
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    with LLM(str(k_quant_gguf), dtype="float32", num_blocks=64,
             max_num_batched_tokens=16) as llm:  # fmt: skip
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.stats.prefix_cache_hits > 0
        assert "GGUF blocks" in llm.engine.runner.fused_status
    assert together == alone


def test_a_mixtral_gguf_serves_its_experts_as_blocks(tmp_path: Path) -> None:
    """Routed experts (stacked [experts, out, in] tensors) as blocks: each expert's
    gate|up and down are QuantWeights of their rows."""
    path = write_tiny_mixtral_q8(tmp_path)
    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate([5, 23])]
    got, status = _greedy(path, "auto", prompts, 16)
    want, _ = _greedy(path, "none", prompts, 16)
    assert "GGUF blocks" in status
    print("per prompt:", compare_greedy(got, want))


def test_a_type_the_kernel_does_not_read_is_dequantized(tmp_path: Path) -> None:
    """A Q3_K tensor (not read by the kernel): the file is served dequantized, and the
    ready status names the tensor."""
    folder = write_tiny_model(tmp_path / "q3", "llama", seed=4, hidden_size=256,
                              intermediate_size=256)  # fmt: skip
    config = hf_config(folder)
    tensors = llama_like_tensors(hf_tensors(folder), config, permute=True)
    types = {name: T.Q8_0 for name, value in tensors.items() if value.ndim == 2}
    # ffn_down of layer 0 as Q3_K blocks: 110 bytes each (hmask, qs, scales, then a
    # float16 d, kept small), the rest random
    down = tensors["blk.0.ffn_down.weight"]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (down.shape[0], down.shape[1] // 256, 110), dtype=np.uint8)
    blocks[..., 108:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    tensors["blk.0.ffn_down.weight"] = blocks.reshape(down.shape[0], -1)
    types["blk.0.ffn_down.weight"] = T.Q3_K
    path = write_gguf(folder, tmp_path / "q3.gguf", "llama", common_metadata(config, "llama"),
                      tensors, types)  # fmt: skip
    outputs, status = _greedy(path, "auto", [[5, 6, 7]], 4)
    assert "GGUF blocks dequantized (model.layers.0.mlp.down_proj.weight is GGML type 11" in status
    assert len(outputs[0].token_ids) == 4


def test_inspect_lists_the_types_and_the_resident_size(k_quant_gguf: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "infire.cli", "inspect", str(k_quant_gguf)],
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    kinds = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()[1:-1]}
    assert kinds == {"Q4_K": 8, "Q6_K": 5, "Q5_K": 2, "Q8_0": 1, "F32": 5}, out
    assert "resident weights:" in out and "served as GGUF blocks" in out


def test_smollm2_q4_1_greedy_against_the_dequantized_fp32_path(record_property) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there",
               "The three primary colors are", "Water boils at a temperature of"]  # fmt: skip
    got, status = _greedy(None, "auto", prompts, 32)
    want, _ = _greedy(None, "none", prompts, 32)
    assert "GGUF blocks" in status
    verdicts = compare_greedy(got, want)
    record_property("per_prompt", json.dumps(verdicts))
    print("per prompt:", verdicts)


MEMORY_PROBE = """
import json, sys
import os
os.environ["INFIRE_NO_REPACK"] = "1" if sys.argv[3] == "file" else "0"
from infire import LLM, SamplingParams
from infire.models.gguf import load_gguf_tokenizer
from infire.models.loader import default_model_path
gguf = str(default_model_path().resolve())
def resident():
    # the process's anonymous pages and the GGUF's mapped pages; shared libraries' code,
    # faulted in by the first load and the first step, is left out
    total, path = 0, None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if not head[0].endswith(":") or not head[0][0].isupper():
            path = head[5] if len(head) > 5 else ""
        elif head[0] == "Rss:" and (path == gguf or not path.startswith("/")):
            total += int(head[1]) * 1024
    return total
base = resident()
tokenizer = load_gguf_tokenizer(default_model_path())  # kept: what one tokenizer takes
with_tokenizer = resident()
llm = LLM(dtype=sys.argv[1], quantization="auto", kv_cache_memory=int(sys.argv[2]))
loaded = resident()
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
           if line.startswith("VmHWM"))  # the high-water mark of this process image
rss_loaded = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                  if line.startswith("VmRSS"))
llm.generate(["Tell me about the sea."], SamplingParams(max_tokens=16))
runner = llm.engine.runner
tables = [runner.fused.cos, runner.fused.sin, *runner.sampling_state.penalties.tables,
          *runner.sampling_state.biases.tables]
print(json.dumps({"tokenizer": with_tokenizer - base, "before": with_tokenizer, "loaded": loaded,
                  "tables": sum(t.numel() * t.element_size() for t in tables),
                  "peak": peak, "rss_loaded": rss_loaded, "served": resident(),
                  "status": llm.engine.runner.fused_status,
                  "proc": {line.split(":")[0]: int(line.split()[1]) * 1024
                           for line in open("/proc/self/status") if line.startswith("Rss")}}))
"""


@pytest.mark.parametrize("rows", ["file", "groups"], ids=["as in the file", "in groups of 16"])
def test_smollm2_served_as_blocks_takes_the_file_and_its_kv(rows: str) -> None:
    """Resident memory of a served model above the process's baseline (after imports,
    before the load) is at most the file + the KV reservation + 10%, plus the tokenizer
    (its vocabulary and merges, rebuilt from the file's metadata: measured alone in the
    same process) and the runtime's tables (RoPE cos/sin for every position, the
    sampler's penalty rows). Resident memory here is the process's anonymous pages and
    the GGUF's mapped pages: the shared libraries' code that the first load and step fault
    in (13 MiB of torch, tokenizers and Python here; more where the kernel maps larger
    folios) is not the model's. The load's high-water mark (the whole RSS) never goes
    above what it keeps by more than one tensor. Rows copied into groups of 16 take the
    place of the file's pages; the process's RssAnon and RssFile are in the message."""
    kv = 64 << 20
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, "bfloat16", str(kv), rows],
                         capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert "GGUF blocks" in probe["status"]
    assert ("groups of 16 rows" in probe["status"]) == (rows != "file")
    file_bytes = default_model_path().stat().st_size
    grown = probe["served"] - probe["before"]
    assert grown <= 1.1 * (file_bytes + kv) + probe["tokenizer"] + probe["tables"], probe
    assert probe["peak"] <= probe["rss_loaded"] + 49152 * 576 * 4, probe  # the embedding, fp32


@pytest.mark.parametrize("products", ["this CPU's", "AVX512-VNNI"])
def test_smollm2_rows_in_groups_of_16_give_the_same_tokens_in_any_batch(
    products: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Q4_1/Q8_0 rows copied into groups of 16, multiplied by this CPU's products and
    by AVX512-VNNI's (emulated where the CPU lacks them): greedy tokens against the
    dequantized fp32 path under the same rule, and each prompt's tokens the same alone
    as in a batch. INFIRE_NO_REPACK=1 keeps the rows as in the file."""
    if products == "AVX512-VNNI":
        if native("avx512-vnni"):
            pytest.skip("this CPU runs AVX512-VNNI's products itself: the case before")
        use_emulated(monkeypatch, "avx512-vnni")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    got, status = _greedy(None, "auto", prompts, 24)
    assert "tensors in groups of 16 rows" in status, status
    print("per prompt:", compare_greedy(got, _greedy(None, "none", prompts, 24)[0]))
    alone = [_greedy(None, "auto", [p], 24)[0][0].token_ids for p in prompts[1:]]
    assert alone == [o.token_ids for o in got[1:]]
    monkeypatch.setenv("INFIRE_NO_REPACK", "1")
    assert "groups of 16" not in _greedy(None, "auto", prompts[:1], 2)[1]
