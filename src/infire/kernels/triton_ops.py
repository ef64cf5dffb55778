"""Fused elementwise kernels of the GPU path in Triton, one launch where PyTorch takes
several: the residual add with RMSNorm, SiLU(gate) * up, and RoPE on q and k together.

Each computes in float32 and rounds where its PyTorch reference (layers/norm.py, mlp.py,
rotary.py) rounds, so they agree with it to float32 rounding (the norm's sum of squares
and SiLU's exp are computed in another order or another way), in bf16 too.
"""

from __future__ import annotations

import torch

from infire.kernels.triton_lang import round_to, tl, triton
from infire.kernels.triton_support import next_power_of_2

if triton is not None:

    @triton.jit
    def _add_rms_norm(x, residual, weight, out, new_residual, eps, N: tl.constexpr,
                      N_P: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        i = tl.arange(0, N_P)
        ok = i < N
        h = tl.load(x + row * N + i, mask=ok, other=0.0)
        if ADD:
            r = tl.load(residual + row * N + i, mask=ok, other=0.0)
            h = round_to(h.to(tl.float32) + r.to(tl.float32), h.dtype)  # rounds as torch's add
            tl.store(new_residual + row * N + i, h, mask=ok)
        f = h.to(tl.float32)
        normed = f * tl.rsqrt(tl.sum(f * f, axis=0) / N + eps)
        w = tl.load(weight + i, mask=ok, other=0.0)
        y = round_to(normed, h.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(out + row * N + i, round_to(y, out.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul(gate_up, out, N: tl.constexpr, BLOCK: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)
        i = part * BLOCK + tl.arange(0, BLOCK)
        ok = i < N
        gate = tl.load(gate_up + row * 2 * N + i, mask=ok, other=0.0)
        up = tl.load(gate_up + row * 2 * N + N + i, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        silu = round_to(g / (1.0 + tl.exp(-g)), gate.dtype)
        y = silu.to(tl.float32) * up.to(tl.float32)
        tl.store(out + row * N + i, round_to(y, out.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotary(x, cos_sin, out, stride_ct, stride_cs, HEADS: tl.constexpr,
                HALF: tl.constexpr, HALF_P: tl.constexpr):  # fmt: skip
        token, head = tl.program_id(0), tl.program_id(1)
        i = tl.arange(0, HALF_P)
        ok = i < HALF
        base = (token * HEADS + head) * 2 * HALF
        lo = tl.load(x + base + i, mask=ok, other=0.0)
        hi = tl.load(x + base + HALF + i, mask=ok, other=0.0)
        c = token * stride_ct
        cos_lo = tl.load(cos_sin + c + i, mask=ok, other=0.0)
        cos_hi = tl.load(cos_sin + c + HALF + i, mask=ok, other=0.0)
        sin_lo = tl.load(cos_sin + stride_cs + c + i, mask=ok, other=0.0)
        sin_hi = tl.load(cos_sin + stride_cs + c + HALF + i, mask=ok, other=0.0)
        # x * cos + rotate_half(x) * sin, each product rounded to x's dtype as torch does
        dt = lo.dtype
        a_lo = round_to(lo.to(tl.float32) * cos_lo.to(tl.float32), dt)
        b_lo = round_to(-(hi.to(tl.float32)) * sin_lo.to(tl.float32), dt)
        a_hi = round_to(hi.to(tl.float32) * cos_hi.to(tl.float32), dt)
        b_hi = round_to(lo.to(tl.float32) * sin_hi.to(tl.float32), dt)
        tl.store(out + base + i, round_to(a_lo.to(tl.float32) + b_lo.to(tl.float32), dt), mask=ok)
        tl.store(
            out + base + HALF + i, round_to(a_hi.to(tl.float32) + b_hi.to(tl.float32), dt), mask=ok
        )


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """RMSNorm.forward in one launch: weight * rms_norm(x [+ residual]); with a residual,
    also the sum (the next residual)."""
    n = x.shape[-1]
    flat = x.reshape(-1, n).contiguous()
    out = torch.empty_like(flat)
    add = residual is not None
    summed = torch.empty_like(flat) if add else flat
    res = residual.reshape(-1, n).contiguous() if add else flat  # type: ignore[union-attr]
    _add_rms_norm[(flat.shape[0],)](flat, res, weight, out, summed, eps, N=n,
                                    N_P=next_power_of_2(n), ADD=add)  # fmt: skip
    out = out.view(x.shape)
    return (out, summed.view(x.shape)) if add else out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up of [..., 2 * I] (gate then up) in one launch."""
    n = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * n).contiguous()
    out = torch.empty(flat.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(n))
    _silu_mul[(flat.shape[0], -(-n // block))](flat, out, N=n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary (half-split RoPE) on x [T, heads, D] with cos_sin [2, T, 1, D]."""
    tokens, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    cos_sin = cos_sin.reshape(2, tokens, dim)
    if cos_sin.stride(2) != 1:
        cos_sin = cos_sin.contiguous()
    _rotary[(tokens, heads)](x, cos_sin, out, cos_sin.stride(1), cos_sin.stride(0), HEADS=heads,
                             HALF=dim // 2, HALF_P=next_power_of_2(dim // 2))  # fmt: skip
    return out
