"""MLX's affine groups byte for byte: `mlx.core.quantize(w, group_size, bits)` as MLX's CPU backend computes it
(`mlx/backend/cpu/quantized.cpp`, `quantize`, MLX 0.32.4; `tests/test_mlx.py` checks the bytes against `mlx-cpu`).

Per group of `group_size` values along head_dim, in float32:
- `scale = max((max - min) / (2^bits - 1), 1e-7)`, negated unless |min| > |max|; `edge` is the larger-magnitude end
  (min or max). `q0 = rint(edge / scale)`; where q0 != 0 the scale becomes `edge / q0` and the bias `edge`, so the
  larger end is exact; else the bias is 0.
- each code is `rint((w - bias) / scale)` clamped to [0, 2^bits - 1] (rint: ties to even, as `torch.round`).
- the scale and bias are stored in the model's dtype; a value reads back as `scale * code + bias`.
Codes are packed as one little-endian bitstream, the first value in the lowest bits: 32 / bits a uint32 for 2, 4
and 8 bits, 8 values in `bits` bytes for 3, 5 and 6. kvdemo keeps the packed bytes as uint8 (mlx-lm's uint32 array
viewed as bytes is the same bytes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

EPSILON = 1e-7
"""MLX's floor on a group's scale (`eps`)."""


class AffineStore(NamedTuple):
    """One tensor's store as mlx-lm's `QuantizedKVCache` holds it (keys or values of one layer).

    Attributes:
        codes: [batch, kv_heads, tokens, head_dim * bits / 8] uint8, the packed bitstream.
        scales, biases: [batch, kv_heads, tokens, head_dim / group_size], the model's dtype.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ([..., n] integers below 2^bits, n a multiple of 8) as MLX's bitstream: [..., n * bits / 8] uint8."""
    eights = codes.reshape(*codes.shape[:-1], -1, 8).long()
    word = (eights << (torch.arange(8) * bits)).sum(dim=-1, keepdim=True)  # the 8 codes' bits do not overlap
    return ((word >> (torch.arange(bits) * 8)) & 0xFF).to(torch.uint8).flatten(-2)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack` undone: [..., n * bits / 8] uint8 -> [..., n] int64 codes."""
    chunks = packed.reshape(*packed.shape[:-1], -1, bits).long()
    word = (chunks << (torch.arange(bits) * 8)).sum(dim=-1, keepdim=True)
    return ((word >> (torch.arange(8) * bits)) & ((1 << bits) - 1)).flatten(-2)


def quantize_affine(tensor: torch.Tensor, bits: int, group_size: int) -> AffineStore:
    """`tensor` ([batch, kv_heads, tokens, head_dim], head_dim a multiple of `group_size`) as MLX's affine groups
    (module docstring): the codes packed, the scales and biases in `tensor`'s dtype."""
    groups = tensor.float().reshape(*tensor.shape[:-1], -1, group_size)
    high, low = groups.amax(dim=-1), groups.amin(dim=-1)
    levels = float((1 << bits) - 1)
    below = low.abs() > high.abs()
    scale = torch.clamp((high - low) / levels, min=EPSILON)
    scale = torch.where(below, scale, -scale)
    edge = torch.where(below, low, high)
    first = torch.round(edge / scale)
    moved = first != 0
    scale = torch.where(moved, edge / torch.where(moved, first, 1.0), scale)
    bias = torch.where(moved, edge, 0.0)
    codes = torch.round((groups - bias.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, levels)
    return AffineStore(pack(codes.flatten(-2), bits), scale.to(tensor.dtype), bias.to(tensor.dtype))


def dequantize_affine(store: AffineStore, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The store read back, [batch, kv_heads, tokens, head_dim] of `dtype`: `scale * code + bias` per group, in
    float32 (MLX's `dequantize` in the stored dtype: the same for a float32 model)."""
    codes = unpack(store.codes, bits).reshape(*store.scales.shape, group_size).float()
    values = codes * store.scales.float().unsqueeze(-1) + store.biases.float().unsqueeze(-1)
    return values.flatten(-2).to(dtype)
