"""A small quantizer for GGML's K-quant types (Q4_K, Q5_K, Q6_K), for the tests only.

The `gguf` package dequantizes every type but quantizes only the legacy ones; these write
blocks in llama.cpp's layouts (what gguf.quants dequantizes), with a plain round-to-nearest
per sub-block rather than llama.cpp's error-minimizing search.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256
K_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> [rows, cols / 256 * block bytes] uint8."""
    rows, cols = values.shape
    blocks = values.astype(np.float32).reshape(-1, QK_K)
    packed = {GGMLQuantizationType.Q4_K: _q4_k, GGMLQuantizationType.Q5_K: _q5_k,
              GGMLQuantizationType.Q6_K: _q6_k}[qtype](blocks)  # fmt: skip
    return packed.reshape(rows, -1)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _scale_min(blocks: np.ndarray, levels: int) -> tuple:
    """Per 32-value sub-block: 6-bit scales and mins, the block's d and dmin, and q."""
    sub = blocks.reshape(len(blocks), 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)  # a min <= 0: the value is d*sc*q - dmin*m
    scale = (sub.max(axis=-1) - low) / levels
    d = scale.max(axis=-1) / 63
    dmin = -low.min(axis=-1) / 63
    d16, dmin16 = (
        d.astype(np.float16).astype(np.float32),
        dmin.astype(np.float16).astype(np.float32),
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.round(scale / d16[:, None]), 0).clip(0, 63)
        m = np.where(dmin16[:, None] > 0, np.round(-low / dmin16[:, None]), 0).clip(0, 63)
        step = d16[:, None] * sc
        offset = dmin16[:, None] * m
        q = np.where(step[..., None] > 0, np.round((sub + offset[..., None]) / step[..., None]), 0)
    return sc.astype(np.uint8), m.astype(np.uint8), d, dmin, q.clip(0, levels).astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 6-bit scales and mins (Q4_K.get_scale_min's layout)."""
    out = np.zeros((len(sc), 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """8 sub-blocks of 32 4-bit values -> 128 bytes: pair (2g, 2g + 1) in byte run g."""
    q = q.reshape(len(q), 4, 2, 32)
    return ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(len(q), 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    sc, m, d, dmin, q = _scale_min(blocks, 15)
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales(sc, m), _nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    sc, m, d, dmin, q = _scale_min(blocks, 31)
    high = (q >> 4).reshape(len(q), 8, 32)
    qh = np.zeros((len(q), 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    parts = [_f16(d), _f16(dmin), _pack_scales(sc, m), qh, _nibbles(q & 15)]
    return np.concatenate(parts, axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(len(blocks), 16, 16)
    amax = np.abs(sub).max(axis=-1)
    scale = amax / 31
    d = np.abs(scale).max(axis=-1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.round(scale / d16[:, None]), 0).clip(-128, 127)
        step = d16[:, None] * sc
        q = np.where(step[..., None] > 0, np.round(sub / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(len(blocks), 2, 4, 32)
    # element h*128 + k*32 + l: low nibble in ql[h*64 + (k%2)*32 + l] >> 4*(k//2), two high
    # bits in qh[h*32 + l] >> 2k
    ql = np.zeros((len(blocks), 2, 64), dtype=np.uint8)
    qh = np.zeros((len(blocks), 2, 32), dtype=np.uint8)
    for k in range(4):
        ql[:, :, (k % 2) * 32 : (k % 2) * 32 + 32] |= (q[:, :, k] & 15) << (4 * (k // 2))
        qh |= (q[:, :, k] >> 4) << (2 * k)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16(d)]
    return np.concatenate(parts, axis=1)
