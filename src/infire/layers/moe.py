"""Mixture of experts: routing rules and the routed experts' grouped matmuls.

Each family routes its own way (`softmax_topk`: Mixtral, Qwen3-MoE; `grouped_topk`:
DeepSeek-V3 / Kimi K2; `sigmoid_topk`: Llama 4) into the same (expert ids, weights) per
token. `FusedMoE` then sorts the step's (token, expert) pairs by expert and runs one
gate/up and one down matmul per expert that has tokens, never a loop over tokens; the
weighted outputs are summed back per token with one index_add.

Tensor parallelism splits every expert's intermediate features across ranks, as for a
dense MLP: each rank holds a slice of all experts and the partial sums are all-reduced.
A quantized GGUF's experts may be held as their blocks (`load_blocks`), each expert's
gate|up and down a QuantWeight of this rank's slice, multiplied by the CPU kernel.
Expert parallelism (whole experts per rank) would need an all-to-all of tokens and
balances only as well as the router does; splitting the features keeps every rank's
work identical whatever the routing, which is what a CPU or a single-host group wants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from infire.layers.linear import PACK_BATCH_HINT
from infire.layers.mlp import gated_activation
from infire.parallel import SINGLE, TensorParallelGroup

if TYPE_CHECKING:
    from infire.kernels.cpu_forward import GGUFBlocks, QuantWeight
    from infire.models.weights import LazyTensor

ALL_SHARDS = -1  # load_shard's index for a tensor that holds every expert at once


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen3-MoE: softmax over all experts (float32), keep the top k, optionally
    renormalized to sum to one. (weights [T, k] float32, ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; experts are chosen (with a per-expert bias) only within
    the `topk_groups` groups whose two best biased scores sum highest; the unbiased scores
    of the chosen are the weights, optionally renormalized, times `scaling_factor`.
    (weights [T, k] float32, ids [T, k])."""
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    # -inf, not 0: a biased score can be negative and must still beat the excluded groups
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def sigmoid_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4: the top k logits, each squashed by a sigmoid (no normalization)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.sigmoid(values.float()), ids


class FusedMoE(nn.Module):
    """`num_experts` gated MLPs with stacked weights: w13 [E, 2 I, H] (gate rows, then up
    rows) and w2 [E, H, I], I being this rank's slice of the intermediate features. After
    loading, `pack_for_cpu` may replace them by one oneDNN-packed matrix per expert and
    projection (a [1, H] GEMV on plain bf16 weights streams at a third of the rate)."""

    packed_w13: list[torch.Tensor] | None = None
    packed_w2: list[torch.Tensor] | None = None
    # each expert's projections as GGUF blocks (then w13 and w2 are empty)
    quant_w13: list[QuantWeight] | None = None
    quant_w2: list[QuantWeight] | None = None
    _block_parts: dict[tuple[str, int], GGUFBlocks] | None = None  # until every expert's
    blocks_params = ("w13", "w2")  # what load_blocks takes

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallelGroup = SINGLE,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.activation = activation
        self.full_intermediate = intermediate_size
        self.start, self.size = tp.shard(intermediate_size, "moe intermediate size")
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * self.size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.size), requires_grad=False
        )

    def forward(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor | None,
        reduce: bool = True,
        input_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x); x [T, H], expert_ids and
        weights [T, k]. weights None: unweighted outputs; input_weights [T, k]: each
        (token, expert) pair's input is scaled instead (Llama 4: expert(weight * x))."""
        if x.shape[0] == 1:  # one sequence decoding: no sort, gather or scatter
            out = self._one_token(x, expert_ids[0].tolist(), weights, input_weights)
            return self.tp.all_reduce(out) if reduce else out
        top_k = expert_ids.shape[1]
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // top_k
        inputs = x[token_of]
        if input_weights is not None:
            inputs = inputs * input_weights.flatten()[order].unsqueeze(1).to(inputs.dtype)
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                gate_up = self._project(inputs[rows], self.w13, self.packed_w13, expert,
                                        self.quant_w13)  # fmt: skip
                hidden = gated_activation(gate_up, self.activation)
                outputs[rows] = self._project(hidden, self.w2, self.packed_w2, expert,
                                              self.quant_w2)  # fmt: skip
                start += count
        if weights is not None:
            outputs = outputs * weights.flatten()[order].unsqueeze(1).to(outputs.dtype)
        # the k experts' outputs are summed in float32, as DeepSeek's reference does
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out = out.index_add_(0, token_of, outputs.float()).to(x.dtype)
        return self.tp.all_reduce(out) if reduce else out

    def _one_token(
        self,
        x: torch.Tensor,
        ids: list[int],
        weights: torch.Tensor | None,
        input_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """forward of a single token with the batched path's bits: its experts' outputs
        summed in ascending expert order in float32, rounded once."""
        out = None
        for j in sorted(range(len(ids)), key=ids.__getitem__):
            inputs = x if input_weights is None else x * input_weights[:, j : j + 1].to(x.dtype)
            gate_up = self._project(inputs, self.w13, self.packed_w13, ids[j], self.quant_w13)
            y = self._project(
                gated_activation(gate_up, self.activation), self.w2, self.packed_w2, ids[j],
                self.quant_w2,
            )  # fmt: skip
            if weights is not None:
                y = y * weights[:, j : j + 1].to(y.dtype)
            out = y.float() if out is None else out.add_(y)
        assert out is not None
        return out.to(x.dtype)

    def pack_for_cpu(self) -> bool:
        """Replace w13 and w2 by oneDNN-packed copies, one per expert, freeing the stacked
        tensors (memory does not double); False where oneDNN cannot pack them."""
        if self.quant_w13 is not None:
            return True  # the blocks are the kernel's own layout
        try:
            packed_w13 = [_pack(w) for w in self.w13.data]
            packed_w2 = [_pack(w) for w in self.w2.data]
        except (RuntimeError, AttributeError):
            return False
        self.packed_w13, self.packed_w2 = packed_w13, packed_w2
        dtype = self.w13.dtype
        self.w13 = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        return True

    @staticmethod
    def _project(
        x: torch.Tensor,
        stacked: torch.Tensor,
        packed: list[torch.Tensor] | None,
        expert: int,
        quant: list[QuantWeight] | None = None,
    ) -> torch.Tensor:
        """x times one expert's projection (transposed), packed, as blocks or plain."""
        if quant is not None:
            from infire.kernels.cpu_forward import quant_linear

            return quant_linear(quant[expert], x).to(x.dtype)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed[expert], None, "none", [None], "")
        return F.linear(x, stacked[expert])

    def shard_count(self, name: str) -> int:
        """How many loads make up parameter `name` (one per expert and projection)."""
        return 2 * self.num_experts if name == "w13" else self.num_experts

    def load_shard(self, name: str, loaded: LazyTensor, shard_index: int = 0) -> None:
        """Read this rank's slice of one expert's projection (w13: shard 2e is expert e's
        gate [I, H], 2e + 1 its up; w2: shard e its down [H, I]), or with ALL_SHARDS
        a stacked tensor of every expert ("gate_up" [E, H, 2I] and "down" [E, I, H], the
        transposed layout Llama 4 checkpoints use)."""
        hidden = self.w13.shape[2]
        if shard_index == ALL_SHARDS:
            self._load_stacked(name, loaded)
        elif name == "w13":
            expect_shape(loaded, (self.full_intermediate, hidden))
            expert, part = divmod(shard_index, 2)
            target = self.w13.data[expert, part * self.size : (part + 1) * self.size]
            loaded.read_into(target, 0, self.start, self.size)
        elif name == "w2":
            expect_shape(loaded, (hidden, self.full_intermediate))
            loaded.read_into(self.w2.data[shard_index], 1, self.start, self.size)
        else:
            raise KeyError(f"experts have no {name}")

    def load_blocks(self, name: str, part: GGUFBlocks, shard_index: int = 0) -> None:
        """Hold this rank's slice of one expert's projection as GGUF blocks (shards as
        load_shard's): gate and up rows, down's whole blocks of columns (a ValueError where
        the slice would split a block). With every expert's, the experts are served so."""
        from infire.kernels.cpu_forward import QuantWeight, block_columns, block_rows
        from infire.layers.linear import check_blocks

        hidden = self.w13.shape[2]
        if name == "w13":
            check_blocks(part, self.full_intermediate, hidden)
            held = block_rows(part, self.start, self.size)
        elif name == "w2":
            check_blocks(part, hidden, self.full_intermediate)
            held = block_columns(part, self.start, self.size)
        else:
            raise KeyError(f"experts have no {name} blocks")
        parts = self._block_parts = self._block_parts or {}
        parts[name, shard_index] = held
        if len(parts) < 3 * self.num_experts:
            return
        self.quant_w13 = [QuantWeight([parts["w13", 2 * e], parts["w13", 2 * e + 1]])
                          for e in range(self.num_experts)]  # fmt: skip
        self.quant_w2 = [QuantWeight([parts["w2", e]]) for e in range(self.num_experts)]
        self._block_parts = None
        dtype = self.w13.dtype
        self.w13 = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def finish_blocks(self) -> None:
        """Where only some projections came as blocks (another's type the kernel does not
        read), decode those into the float weights."""
        from infire.layers.linear import decode_blocks

        for (name, shard), part in (self._block_parts or {}).items():
            if name == "w13":
                expert, half = divmod(shard, 2)
                rows = decode_blocks(part, self.w13.shape[2])
                self.w13.data[expert, half * self.size : (half + 1) * self.size] = rows
            else:
                self.w2.data[shard] = decode_blocks(part, self.size)
        self._block_parts = None

    def _load_stacked(self, name: str, loaded: LazyTensor) -> None:
        experts, hidden, inter = self.num_experts, self.w13.shape[2], self.full_intermediate
        if name == "w13":
            expect_shape(loaded, (experts, hidden, 2 * inter))
            for part in range(2):
                values = loaded.read(2, part * inter + self.start, self.size)
                self.w13.data[:, part * self.size : (part + 1) * self.size] = values.transpose(1, 2)
        elif name == "w2":
            expect_shape(loaded, (experts, inter, hidden))
            self.w2.data.copy_(loaded.read(1, self.start, self.size).transpose(1, 2))
        else:
            raise KeyError(f"experts have no {name}")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def expect_shape(loaded: LazyTensor, shape: tuple[int, ...]) -> None:
    """Refuse (ValueError) a checkpoint tensor of another shape."""
    if tuple(loaded.shape) != shape:
        raise ValueError(f"expected shape {list(shape)}, got {list(loaded.shape)}")
