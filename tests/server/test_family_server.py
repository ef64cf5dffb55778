"""`infire serve` on the new families (the engine core in its own process): a mixture of
experts with multi-head latent attention (DeepSeek-V3) and a windowed model (Gemma 3)
answer over HTTP through the openai client as the offline API does, streamed or not,
and the ready line names the family and its KV bytes per token."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest
from harness import Server

from infire import LLM, SamplingParams
from tiny_models import write_tiny_model

QUESTIONS = ["hello", "what is two plus two? tell me in many words, please"]


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma3_text"])
def test_new_families_are_served(model_type: str, tmp_path: Path):
    folder = write_tiny_model(tmp_path / model_type, model_type, seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(folder), dtype="float32", num_blocks=64) as llm:
        expected = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
        bytes_per_token = llm.engine.model_info.kv_bytes_per_token
    args = ["--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "8MiB"]
    server = Server(args, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        for question, reference in zip(QUESTIONS, expected, strict=True):
            messages = [{"role": "user", "content": question}]
            answer = client.chat.completions.create(
                model=folder.name, messages=messages, temperature=0, max_tokens=24,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert answer.choices[0].message.content == reference.outputs[0].text
            stream = client.chat.completions.create(
                model=folder.name, messages=messages, temperature=0, max_tokens=24,
                extra_body={"ignore_eos": True}, stream=True,
            )  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == reference.outputs[0].text
    finally:
        server.stop()
    ready = re.search(rf"ready: {folder.name} \((.*)\)\n", server.log.read_text())
    assert ready is not None
    family = {"deepseek_v3": "deepseek_v3", "gemma3_text": "gemma3"}[model_type]
    assert ready.group(1).startswith(f"{family}, ")
    assert f" KV tokens of {bytes_per_token} bytes" in ready.group(1)
