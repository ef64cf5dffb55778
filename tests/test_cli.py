"""The `infire` console script as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from infire import LLM, SamplingParams


def _infire(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infire.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_generate_prints_the_engines_greedy_text(tiny_llama: Path):
    result = _infire("generate", "the cat", "--model", str(tiny_llama), "--dtype", "float32",
                     "--max-tokens", "8", "--kv-cache-memory", "4MiB")  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = (
        LLM(str(tiny_llama), dtype="float32", num_blocks=16)
        .generate("the cat", SamplingParams(temperature=0, max_tokens=8))[0]
        .outputs[0]
        .text
    )
    assert result.stdout == "the cat" + expected + "\n"
    assert "ready in" in result.stderr


def test_chat_answers_each_line(tiny_llama: Path):
    result = _infire("chat", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "4",
                     stdin="hello\nagain\n")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3  # two answers, then the prompt that meets EOF
    assert result.stdout.count("\n") == 2


def test_missing_model_is_a_clear_error(tmp_path: Path):
    result = _infire("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert result.returncode == 2
    assert "missing.gguf" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_sampling_flag_is_a_clear_error(tiny_llama: Path):
    result = _infire("generate", "hi", "--model", str(tiny_llama), "--top-p", "1.5")
    assert result.returncode == 2
    assert "top_p" in result.stderr and "Traceback" not in result.stderr
