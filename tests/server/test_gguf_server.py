"""`infire serve` on a quantized GGUF: the engine process serves the file's blocks."""

from __future__ import annotations

import re
from pathlib import Path

import openai
from harness import Server

from infire import LLM, SamplingParams
from infire.config import EngineConfig
from infire.engine.core import config_from_json, config_to_json


def test_infire_serve_serves_the_default_model_as_its_blocks(tmp_path: Path) -> None:
    """`infire serve` with no arguments: the engine process holds SmolLM2's blocks (its
    ready line says so) and answers as an in-process LLM on the same settings does."""
    question = [{"role": "user", "content": "Name three colors."}]
    with LLM(kv_cache_memory=64 << 20) as llm:
        want = llm.chat(question, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    server = Server(["--kv-cache-memory", "64MiB"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=question, temperature=0, max_tokens=16
        )
        assert answer.choices[0].message.content == want
    finally:
        server.stop()
    ready = r"ready: .*CPU kernels active, GGUF blocks \(211 tensors in groups of 16 rows\)\)"
    assert re.search(ready, server.log.read_text())
    config = EngineConfig(quantization="none")  # what crosses to the engine process
    assert config_from_json(config_to_json(config)).quantization == "none"
