"""kernels/triton_support.py decides whether the Triton kernels serve without importing
triton where they would not (a CPU engine), and keeps the PyTorch path where an installed
triton fails to import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHECK = """
import sys, torch
from infire.kernels import triton_support as ts
cpu = ts.use_triton(torch.device("cpu"))
print(ts.INSTALLED, cpu, "triton" in sys.modules)
print(ts.use_triton(torch.device("cuda")), ts.triton_reason())
"""


def test_an_installed_triton_that_does_not_import_leaves_the_pytorch_path(tmp_path: Path):
    # a test-only stand-in, first on the path: an installed triton whose import fails
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('this triton is broken')\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.splitlines()
    # installed (found), not used on the CPU, and not imported to say so
    assert first == "True False False"
    # asked for a device where it would run, it is imported, fails, and is not used
    assert second == "False triton is installed but does not import"


def test_without_triton_the_kernels_modules_import_and_nothing_uses_them():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # as where triton is not installed
        "import torch\n"
        "from infire.kernels import triton_support as ts\n"
        "from infire.kernels import triton_attention, triton_ops, triton_palette, triton_rans\n"
        "print(ts.INSTALLED, ts.use_triton(torch.device('cuda')), ts.triton_reason())"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False False triton is not installed"
