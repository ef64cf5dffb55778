"""The fused forward's AVX512-VNNI and AVX-VNNI paths on CPUs without them: cpu_forward.c
built with tests/kernels/emulated_avx512.h, each 512-bit intrinsic emulated in AVX2 by
SIMDe (Debian's libsimde-dev, which .ci/run installs). Slower than the real instructions,
the same integers and float operations: a CI machine without AVX-512 still runs them."""

from __future__ import annotations

import ctypes
import hashlib
from functools import cache
from pathlib import Path

import pytest

from infire.kernels import cpu_forward
from infire.native import compile_library

SHIM = Path(__file__).parent / "kernels" / "emulated_avx512.h"
SIMDE = Path("/usr/include/simde/x86/avx512.h")
# the products' instruction sets, emulated (quant_isa's names)
EMULATED_ISAS = ("avx512-vnni", "avx-vnni")


@cache
def emulated_library() -> ctypes.CDLL | str:
    """cpu_forward.c with the AVX-512 and AVX-VNNI paths emulated, or why not."""
    if not SIMDE.exists():
        return f"no {SIMDE} (Debian's libsimde-dev)"
    key = hashlib.sha256(SHIM.read_bytes()).hexdigest()[:12]
    flags = (*cpu_forward.CFLAGS, f"-DINFIRE_EMULATED={key}", "-include", str(SHIM))
    return cpu_forward.declare(compile_library(cpu_forward.SOURCE, flags))


def native(isa: str) -> bool:
    """Whether this CPU runs `isa`'s products itself."""
    runs = cpu_forward.quant_isa(isa) == isa
    cpu_forward.quant_isa()  # back to the best
    return runs


def use_emulated(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Route every kernel call of this test to the emulated build, products in `isa`."""
    lib = emulated_library()
    if isinstance(lib, str):
        pytest.skip(lib)
    monkeypatch.setattr(cpu_forward, "load_library", lambda: lib)
    assert cpu_forward.quant_isa(isa) == isa
