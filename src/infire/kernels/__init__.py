"""Hand-written kernels for hot paths that PyTorch ops run slowly (the CPU forward)."""

from infire.kernels import cpu_forward
from infire.kernels.cpu_forward import CpuForward

__all__ = ["CpuForward", "cpu_forward"]
