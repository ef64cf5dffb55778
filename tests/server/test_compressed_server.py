"""`infire serve DST` on Unweight-compressed folders: the palette form held compressed, the
distribution form decoded at load; both answer like the bf16 original over HTTP."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from harness import Server

from infire import LLM, SamplingParams
from infire.unweight.container import compress_model

QUESTIONS = ["hello", "what is two plus two?", "name a color"]


@pytest.mark.parametrize("form", ["rans", "palette"])
def test_compressed_folder_is_served(form: str, tiny_llama_bf16: Path, tmp_path: Path):
    folder = tmp_path / f"tiny-{form}"
    compress_model(tiny_llama_bf16, folder, form, progress=False)
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = LLM(str(tiny_llama_bf16), dtype="bfloat16", num_blocks=64).chat(
        [[{"role": "user", "content": q}] for q in QUESTIONS], params
    )
    args = ["--model", str(folder), "--dtype", "bfloat16", "--kv-cache-memory", "16MiB"]
    server = Server(args, tmp_path / "server.log")
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        assert [m.id for m in client.models.list().data] == [folder.name]
        for question, reference in zip(QUESTIONS, expected, strict=True):
            answer = client.chat.completions.create(
                model=folder.name, messages=[{"role": "user", "content": question}],
                temperature=0, max_tokens=12,
            )  # fmt: skip
            assert answer.choices[0].message.content == reference.outputs[0].text
            assert answer.usage.completion_tokens == len(reference.outputs[0].token_ids)
    finally:
        server.stop()
    status = "active, palette weights" if form == "palette" else "active"
    # the tiny Llama: 2 layers x K and V x 2 KV heads x 16 dims x 2 bytes (bf16) a token
    ready = re.search(rf"ready: {folder.name} \((.*)\)\n", server.log.read_text())
    assert ready is not None
    assert ready.group(1).startswith("llama, ") and ready.group(1).endswith(f"CPU kernels {status}")
    assert " KV tokens of 256 bytes" in ready.group(1)
