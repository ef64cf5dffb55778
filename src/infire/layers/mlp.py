"""The gated feed-forward block every supported family uses: down(act(gate(x)) * up(x)).

SwiGLU (act = SiLU: Llama, Qwen, Mixtral's and DeepSeek's experts) or GeGLU (act = GELU,
tanh approximation: Gemma). gate and up are one merged column-parallel matmul, down is
row-parallel: under tensor parallelism each rank holds a slice of the intermediate
features and the partial outputs are summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infire.kernels.triton_support import use_triton
from infire.layers.linear import ColumnParallelLinear, RowParallelLinear
from infire.parallel import SINGLE, TensorParallelGroup


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a [..., 2 * I] tensor holding gate then up."""
    if activation == "silu" and use_triton(gate_up):  # one launch
        from infire.kernels.triton_ops import silu_and_mul

        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def activation_of(name: str) -> str:
    """Our name of a config's hidden_act (refusing the ones we do not run)."""
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_fast", "gelu_new"):
        return "gelu_tanh"
    raise ValueError(f"activation {name!r} is not supported (silu, gelu_pytorch_tanh)")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), tensor-parallel over the intermediate features."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallelGroup = SINGLE,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.activation = activation
        size = intermediate_size
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [size, size], tp=tp)
        self.down_proj = RowParallelLinear(size, hidden_size, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.activation))
