"""benchmarks/gpu_check.py, the GPU session's prepared script, kept whole: its --smoke run
(CPU, a tiny shape, the Triton kernels under the interpreter) builds the models, runs
every check and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infire.kernels.triton_support import INSTALLED

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(not INSTALLED, reason="triton is not installed")
def test_gpu_check_smoke_run_passes_every_check(tmp_path: Path) -> None:
    tokenizer, out = tmp_path / "tokenizer", tmp_path / "out"
    subprocess.run(
        [sys.executable, SCRIPT, "--export-tokenizer", tokenizer], check=True, timeout=300
    )
    assert (tokenizer / "tokenizer.json").exists() and not (tokenizer / "config.json").exists()
    done = subprocess.run([sys.executable, SCRIPT, "--tokenizer", tokenizer, "--out", out, "--smoke"],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["device"] == "cpu"
    assert result["checks"] == {
        "tiny: fp32 greedy = transformers": True,
        "tiny: bf16 graph replay = eager": True,
        "tiny: bf16 batched = alone": True,
    }
