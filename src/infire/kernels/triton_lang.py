"""triton and triton.language for the kernels' modules (None where triton is not
installed), and the helpers their kernels share. Importing this imports triton: only the
kernels' modules do, and only code that `triton_support.use_triton` sent there imports
them (triton_support sets TRITON_INTERPRET first on a machine without CUDA)."""

from __future__ import annotations

from types import ModuleType

import infire.kernels.triton_support  # noqa: F401  (sets TRITON_INTERPRET before the import)

triton: ModuleType | None
tl: ModuleType | None
round_to: object
try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves (and the kernels' modules define no kernel)
    triton = tl = round_to = None


if triton is not None:

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """float32 x to `dtype`, rounded to nearest even (bf16 by its bits: Triton's
        interpreter truncates in its cast, where a GPU rounds; both get this)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)
