"""Whether the GPU path's Triton kernels (triton_attention.py, triton_ops.py, ...) serve.

This module does not import triton: a process that never takes the kernels (every CPU
engine) does not pay triton's import (~90 MiB resident). The kernels' modules import it
through triton_lang.py, and only code that has asked `use_triton` imports them.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1,
set here before triton is imported, since `triton.jit` reads it when a kernel is
defined): NumPy runs each program, slowly but with the kernel's own arithmetic. That is
how the tests check every kernel against its PyTorch reference on CPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

# triton imported before the variable was set (by transformers, say) built its language's
# own helpers for a GPU: the interpreter cannot run kernels in that process
_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INSTALLED = importlib.util.find_spec("triton") is not None
_imports: bool | None = None  # whether triton imported, once something asked to use it


def _importable() -> bool:
    """Whether triton imports (it is imported here the first time a kernel would run: an
    installed triton that fails to import leaves the PyTorch path serving)."""
    global _imports
    if _imports is None:
        from infire.kernels import triton_lang

        _imports = triton_lang.triton is not None
    return _imports


def triton_reason() -> str | None:
    """Why the Triton kernels cannot run here, or None (imports triton where installed)."""
    if not INSTALLED:
        return "triton is not installed"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device, and TRITON_INTERPRET is not 1"
    if not torch.cuda.is_available() and _LATE:
        return "triton was imported before TRITON_INTERPRET=1 was set: no interpreter here"
    if not _importable():
        return "triton is installed but does not import"
    return None


def use_triton(device: torch.device | torch.Tensor) -> bool:
    """Whether the GPU path's Triton kernels serve a tensor (or device): on CUDA where
    triton is installed, unless INFIRE_TRITON=0; INFIRE_TRITON=1 runs them on CPU too,
    under the interpreter (the tests' way to run a whole model through them). On the CPU
    by default it answers without importing triton."""
    if not INSTALLED:
        return False
    mode = os.environ.get("INFIRE_TRITON", "auto")
    if mode == "0":
        return False
    if _device(device).type == "cuda":
        return _importable()
    return mode == "1" and triton_reason() is None


def _device(x: torch.device | torch.Tensor) -> torch.device:
    return x.device if isinstance(x, torch.Tensor) else torch.device(x)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
