"""FusedMoE against a plain per-token reference: the batched path (tokens sorted by
expert, one matmul per expert) and the one-token decode path, packed for oneDNN or not,
with output weights, input weights (Llama 4) or none, for k = 1..4 of 8 experts."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from infire.layers.moe import FusedMoE, softmax_topk

TOKENS, HIDDEN, INTER, EXPERTS = 12, 64, 48, 8


def _reference(w13, w2, x, ids, weights, input_weights) -> torch.Tensor:
    """sum over each token's experts of weight * down(silu(gate(x')) * up(x')), in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j in itertools.product(range(x.shape[0]), range(ids.shape[1])):
        e = int(ids[t, j])
        xt = x[t].double() * (input_weights[t, j].double() if input_weights is not None else 1)
        gate, up = (w13[e].double() @ xt).chunk(2)
        y = w2[e].double() @ (F.silu(gate) * up)
        out[t] += y * (weights[t, j].double() if weights is not None else 1)
    return out


@pytest.mark.parametrize(
    ("top_k", "pack", "mode"),
    list(itertools.product((1, 2, 4), (False, True), ("weights", "none", "input"))),
)
def test_batched_and_one_token_paths_equal_the_reference(top_k: int, pack: bool, mode: str):
    torch.manual_seed(top_k)
    moe = FusedMoE(EXPERTS, HIDDEN, INTER)
    torch.nn.init.normal_(moe.w13, 0, 0.2)
    torch.nn.init.normal_(moe.w2, 0, 0.2)
    w13, w2 = moe.w13.detach().clone(), moe.w2.detach().clone()
    if pack:
        assert moe.pack_for_cpu() and moe.w13.numel() == 0  # the stacked copy is freed
    x = torch.randn(TOKENS, HIDDEN)
    weights, ids = softmax_topk(torch.randn(TOKENS, EXPERTS), top_k, True)
    out_w = weights if mode == "weights" else None
    in_w = weights if mode == "input" else None
    want = _reference(w13, w2, x, ids, out_w, in_w).float()
    with torch.inference_mode():
        batched = moe(x, ids, out_w, input_weights=in_w)
        one_by_one = torch.cat([
            moe(x[t : t + 1], ids[t : t + 1], None if out_w is None else out_w[t : t + 1],
                input_weights=None if in_w is None else in_w[t : t + 1])
            for t in range(TOKENS)
        ])  # fmt: skip
    assert (batched - want).abs().max().item() < 1e-4
    assert (one_by_one - want).abs().max().item() < 1e-4
