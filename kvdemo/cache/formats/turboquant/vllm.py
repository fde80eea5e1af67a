"""vLLM's TurboQuant store, byte for byte (`turboquant` with `layout=vllm`, the presets under vLLM's names).

Source: vLLM's `vllm/model_executor/layers/quantization/turboquant/` (`config.py`: `TQ_PRESETS`, `key_packed_size`,
`value_packed_size`, `slot_size_aligned`, `get_boundary_skip_layers`; `centroids.py`: `solve_lloyd_max`) and its
store kernel `vllm/v1/attention/ops/triton_turboquant_store.py`, as of the removal of the random signs (vLLM PR
#40194, 2026-04). Where kvdemo's own layout (`kvdemo.cache.formats.turboquant.layers`) differs:

- **Rotation**: the plain Sylvester Hadamard matrix H / sqrt(d), one for every layer, no random signs (kvdemo: (k D) H
  with seeded signs). The key is divided by its norm first: y = (k / (|k| + 1e-8)) H.
- **Codebook**: Lloyd-Max for N(0, 1/d), solved as vLLM solves it (`vllm_centroids`: 200 Lloyd iterations at most
  from uniform starts over +-3.5 sigma, cell edges at +-10.5 sigma, each integral a 200-interval trapezoid sum, in
  float64, then float32); a coordinate takes the index of the first float32 midpoint above it (`searchsorted`,
  ties upward). kvdemo: the exact marginal of a unit vector's coordinate.
- **Norm correction** (`_nc`) stores nothing: the norm is |k| in float16 either way, and the read divides the
  centroids by their own norm (c / sqrt(|c|^2 + 1e-16)). kvdemo divides the stored norm once.
- **k8v4 keys**: a raw float8_e4m3fn cast of the key, saturated at +-448, no scale (kvdemo: a float32 scale per token
  and head).
- **Values**: scale = max((max - min) / (2^bits - 1), 1e-8) and codes floor((v - min) / scale + 0.5) from the float32
  scale and minimum, then scale and minimum stored in float16 (kvdemo rounds them to float16 first and codes from the
  rounded ones, half to even).
- **Slot**: per token and KV head, [key codes | norm f16 | value codes | scale f16 | zero f16], padded to an even size
  (`vllm_slots`): 70 bytes for `4bit_nc` at head_dim 64, 134 at 128; no padding for a power-of-two head_dim.
- **Boundary layers**: `protect=vllm` (`kvdemo.cache.policies.VLLM_PROTECT`): decoder layers 0, 1, L-2, L-1 on a
  model without state layers, none on a hybrid one. vLLM quantizes sliding-window layers too (`sliding=quantize`).
- **No residual**: vLLM writes every token as it comes (`residual_length=1`).

What cannot be the same on a CPU: vLLM's GPU kernels compute the rotation with a float32 cuBLAS product and may
lower a float32 division to an approximate one; a code whose value sits within a rounding of a midpoint can differ
there. The stored layout, the codebook and every rule are vLLM's.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch

from kvdemo.cache.layers.rotation import hadamard

from .lloyd_max import decode_integers, pack_codes, unpack_codes

FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: vLLM's Triton cast saturates there (`satfinite`)."""

NORM_EPS = 1e-8
"""vLLM adds this to a key's norm before dividing by it."""

SCALE_FLOOR = 1e-8
"""vLLM's smallest value scale."""


def _trapezoid(function, a: float, b: float, intervals: int = 200) -> float:
    """The trapezoid rule of `function` over [a, b] with `intervals` equal intervals, summed left to right in float64
    as vLLM's `_trapz` sums."""
    step = (b - a) / intervals
    total = 0.5 * (function(a) + function(b))
    for i in range(1, intervals):
        total += function(a + i * step)
    return total * step


@lru_cache(maxsize=32)
def vllm_centroids(dimension: int, bits: int) -> torch.Tensor:
    """vLLM's Lloyd-Max centroids for N(0, 1/dimension) at `bits` bits (`solve_lloyd_max`, module docstring): [2^bits]
    float32, increasing. About a second the first time (plain Python floats, as vLLM computes them), then cached."""
    levels, variance = 2**bits, 1.0 / dimension
    sigma = math.sqrt(variance)

    def density(x: float) -> float:
        return math.exp(-x * x / (2 * variance)) / math.sqrt(2 * math.pi * variance)

    def moment(x: float) -> float:
        return x * density(x)

    low, high = -3.5 * sigma, 3.5 * sigma
    centroids = [low + (high - low) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(200):
        edges = [low * 3, *((centroids[i] + centroids[i + 1]) / 2.0 for i in range(levels - 1)), high * 3]
        updated = []
        for i in range(levels):
            mass = _trapezoid(density, edges[i], edges[i + 1])
            updated.append(_trapezoid(moment, edges[i], edges[i + 1]) / mass if mass > 1e-15 else centroids[i])
        if max(abs(new - old) for new, old in zip(updated, centroids)) < 1e-10:
            break  # vLLM keeps the iterate before the converged one
        centroids = updated
    return torch.tensor(centroids, dtype=torch.float32)


@lru_cache(maxsize=32)
def vllm_midpoints(dimension: int, bits: int) -> torch.Tensor:
    """The float32 midpoints between neighbouring centroids, as vLLM computes its thresholds on the device (cached:
    read-only)."""
    centroids = vllm_centroids(dimension, bits)
    return (centroids[:-1] + centroids[1:]) / 2


class VllmKeys(NamedTuple):
    """vLLM's MSE key store: `codes` [batch, kv_heads, tokens, head_dim x bits / 8] uint8 (LSB first), `norms`
    [batch, kv_heads, tokens, 1] float16 (|k|)."""

    codes: torch.Tensor
    norms: torch.Tensor


class VllmFp8Keys(NamedTuple):
    """vLLM's `k8v4` key store: `codes` [batch, kv_heads, tokens, head_dim] float8_e4m3fn, no scale."""

    codes: torch.Tensor


class VllmValues(NamedTuple):
    """vLLM's value store: `codes` [batch, kv_heads, tokens, head_dim x bits / 8] uint8, `scale` and `zero` [batch,
    kv_heads, tokens, 1] float16: value = code x scale + zero."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def quantize_keys(keys: torch.Tensor, bits: int) -> VllmKeys | VllmFp8Keys:
    """vLLM's key store of `keys` [batch, kv_heads, tokens, head_dim] in the model's basis (module docstring); bits 8:
    the raw float8 cast."""
    x = keys.float()
    if bits == 8:
        return VllmFp8Keys(x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
    norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    rotated = (x / (norms + NORM_EPS)) @ hadamard(x.shape[-1], torch.float32)
    indices = torch.searchsorted(vllm_midpoints(x.shape[-1], bits), rotated.contiguous(), right=True)
    return VllmKeys(pack_codes(indices.to(torch.uint8), bits), norms.to(torch.float16))


def rotated_keys(store: VllmKeys, bits: int, norm_correction: bool) -> torch.Tensor:
    """A Lloyd-Max key store read back in the rotated basis, as the decode kernel reads it: centroid x norm (with
    `norm_correction`, the centroids over their own norm first), [batch, kv_heads, tokens, head_dim] float32."""
    indices = unpack_codes(store.codes, bits)
    centroids = vllm_centroids(indices.shape[-1], bits)[indices]
    if norm_correction:
        centroids = centroids / torch.sqrt((centroids * centroids).sum(-1, keepdim=True) + 1e-16)
    return centroids * store.norms.float()


def dequantize_keys(
    store: VllmKeys | VllmFp8Keys, bits: int, norm_correction: bool, dtype: torch.dtype
) -> torch.Tensor:
    """A key store read back in the model's basis: [batch, kv_heads, tokens, head_dim] of `dtype` (the rotation undone:
    H is its own inverse)."""
    if isinstance(store, VllmFp8Keys):
        return store.codes.to(dtype)
    rotated = rotated_keys(store, bits, norm_correction)
    return (rotated @ hadamard(rotated.shape[-1], torch.float32)).to(dtype)


def quantize_values(values: torch.Tensor, bits: int) -> VllmValues:
    """vLLM's value store of `values` [batch, kv_heads, tokens, head_dim] (module docstring)."""
    x = values.float()
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    levels = 2**bits - 1
    scale = (high - low) / levels
    scale = torch.where(scale > SCALE_FLOOR, scale, torch.full_like(scale, SCALE_FLOOR))
    codes = torch.floor((x - low) / scale + 0.5).clamp_(0, levels).to(torch.uint8)
    return VllmValues(pack_codes(codes, bits), scale.to(torch.float16), low.to(torch.float16))


def dequantize_values(store: VllmValues, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """`quantize_values` undone: code x scale + zero, [batch, kv_heads, tokens, head_dim] of `dtype`."""
    values = decode_integers(store.codes, bits, torch.float32)
    return (values * store.scale.float() + store.zero.float()).to(dtype)


def _half_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """float16 [..., 1] as its two little-endian bytes, [..., 2] uint8."""
    return tensor.contiguous().view(torch.uint8)


def vllm_slots(keys: VllmKeys | VllmFp8Keys, values: VllmValues) -> torch.Tensor:
    """The stores as vLLM's cache slots: uint8 [batch, kv_heads, tokens, slot bytes], each [key codes | norm | value
    codes | scale | zero] padded with a zero byte to an even size (`TurboQuantConfig.slot_size_aligned`)."""
    if isinstance(keys, VllmFp8Keys):
        key_part = keys.codes.view(torch.uint8)
    else:
        key_part = torch.cat([keys.codes, _half_bytes(keys.norms)], dim=-1)
    slot = torch.cat([key_part, values.codes, _half_bytes(values.scale), _half_bytes(values.zero)], dim=-1)
    if slot.shape[-1] % 2:
        slot = torch.cat([slot, torch.zeros_like(slot[..., :1])], dim=-1)
    return slot
