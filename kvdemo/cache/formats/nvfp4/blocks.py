"""NVFP4 blocks byte for byte, and the float8 keys of `fp8_k_nvfp4_v`: the arithmetic of the `nvfp4` format.

An NVFP4 block is 16 values along head_dim: each an E2M1 code (a sign bit, 2 exponent bits, 1 mantissa bit: the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two a byte with the even value in the low nibble, and one float8_e4m3fn
scale; one float32 scale per tensor multiplies every block scale. A value reads back as
`E2M1[code] * float(block_scale) * tensor_scale`: per 64 values 32 bytes of codes and 4 of scales.

Quantization follows torchao's reference, `torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize` with a
per-tensor scale (torchao 0.18.0; `tests/test_nvfp4.py` checks the bytes against it): the block's scale is
`amax / 6 / tensor_scale` clamped to [2^-6, 448] and rounded to e4m3; the values are multiplied by
`(1 / tensor_scale) / float(block_scale)`, clamped to +-6 and rounded to the nearest E2M1 magnitude, ties to the even
code (the sign kept, so -0.1 is the code 0x8). `block_rule="4over6"` (vLLM's `nvfp4_4over6`, vllm#45187; "Four Over
Six", arXiv:2512.02010) also makes each block with its scale from `amax / 4` and keeps, per block, the one whose
de-quantized values err less (the sum of squared errors; ties keep `amax / 6`): a scale from max/4 never uses the
code 6, and spends the grid's steps on the block's range instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvdemo.cache.layers.float8 import TENSOR_E4M3, write_codes, write_nvfp4

from . import BLOCK, BLOCK_RULES

E2M1_MAX = 6.0
"""The largest E2M1 magnitude."""

E4M3_MAX = 448.0
"""The largest float8_e4m3fn value: a block scale's ceiling, and the amax / (6 x 448) of the computed tensor scale."""

E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny
"""2^-6, the smallest normal e4m3: the floor torchao clamps block scales to (`E4M3_EPS`)."""

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""Each of the 16 E2M1 codes' value (bit 3 the sign)."""

PAIRS = torch.stack([E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)], dim=-1)
"""[256, 2] float32: a packed byte's two values, low nibble (the even value) first."""


class Nvfp4Store(NamedTuple):
    """One tensor's NVFP4 store (keys or values of one layer).

    Attributes:
        codes: [batch, kv_heads, tokens, head_dim / 2] uint8, two E2M1 codes a byte (even value low).
        block_scales: [batch, kv_heads, tokens, head_dim / 16] float8_e4m3fn.
        tensor_scale: a float32 scalar tensor (0-d).
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    tensor_scale: torch.Tensor


class Fp8Store(NamedTuple):
    """One tensor's float8_e4m3 store with one scale per tensor, as vLLM's fp8 cache writes it (`fp8_k_nvfp4_v`'s
    keys): `codes` [batch, kv_heads, tokens, head_dim] float8_e4m3fn and `tensor_scale`, a float32 scalar tensor."""

    codes: torch.Tensor
    tensor_scale: torch.Tensor


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Each float32 value of `scaled` (already within +-6) rounded to its nearest E2M1 code, ties to the even code,
    the sign bit from the value's sign (uint8, same shape). A tie at 0.25, 1.25, 2.5 or 5 goes down (to the codes 0,
    2, 4, 6), at 0.75, 1.75 or 3.5 up (to 2, 4, 6): the even code either way."""
    mag = scaled.abs()
    code = (mag > 0.25).to(torch.uint8)
    for threshold, tie_up in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        code += (mag >= threshold) if tie_up else (mag > threshold)
    return code | (torch.signbit(scaled).to(torch.uint8) << 3)


def _blocks(tensor: torch.Tensor, tensor_scale: torch.Tensor, block_max: float):
    """One try at every block of `tensor` ([..., head_dim] -> [..., head_dim / 16, 16] float32) with its scale from
    `amax / block_max`: (codes [..., blocks, 16] uint8, scales [..., blocks] e4m3, values read back [..., blocks,
    16])."""
    blocks = tensor.float().reshape(*tensor.shape[:-1], -1, BLOCK)
    block_scale = blocks.abs().amax(dim=-1) / block_max
    scales = (block_scale / tensor_scale).clamp(min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = (1.0 / tensor_scale) / scales.float()
    codes = e2m1_codes((blocks * reciprocal.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    read = E2M1_VALUES[codes.long()] * (scales.float() * tensor_scale).unsqueeze(-1)
    return codes, scales, read


def quantize_nvfp4(tensor: torch.Tensor, tensor_scale: torch.Tensor, block_rule: str = BLOCK_RULES[0]) -> Nvfp4Store:
    """`tensor` ([batch, kv_heads, tokens, head_dim], head_dim a multiple of 16, any float dtype) as NVFP4 blocks under
    `tensor_scale` (a float32 scalar tensor) and `block_rule` (`BLOCK_RULES`; module docstring).

    Raises:
        ValueError: head_dim is not a multiple of 16, or `block_rule` is not one of `BLOCK_RULES`."""
    if tensor.shape[-1] % BLOCK:
        width = tensor.shape[-1]
        raise ValueError(f"NVFP4 stores blocks of {BLOCK} values, so head_dim must be a multiple of 16, not {width}")
    if block_rule not in BLOCK_RULES:
        raise ValueError(f"block_rule={block_rule!r} is not one of {', '.join(BLOCK_RULES)}")
    written = write_nvfp4(tensor, tensor_scale) if block_rule == BLOCK_RULES[0] else None  # one C pass, same bytes
    if written is not None:
        return Nvfp4Store(*written, tensor_scale)
    codes, scales, read = _blocks(tensor, tensor_scale, E2M1_MAX)
    if block_rule == BLOCK_RULES[1]:
        codes4, scales4, read4 = _blocks(tensor, tensor_scale, 4.0)
        blocks = tensor.float().reshape(read.shape)
        better = (read4 - blocks).square().sum(-1) < (read - blocks).square().sum(-1)
        codes = torch.where(better.unsqueeze(-1), codes4, codes)
        scales = torch.where(better, scales4.float(), scales.float()).to(torch.float8_e4m3fn)
    codes = codes.flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Nvfp4Store(packed, scales, tensor_scale)


def dequantize_nvfp4(store: Nvfp4Store, dtype: torch.dtype) -> torch.Tensor:
    """The store read back, [batch, kv_heads, tokens, head_dim] of `dtype`: `E2M1[code] * block_scale *
    tensor_scale`, in float32, then rounded once to `dtype`."""
    codes, scales, tensor_scale = store
    values = PAIRS[codes.long()].reshape(*codes.shape[:-1], -1, BLOCK)
    return (values * (scales.float() * tensor_scale).unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_fp8(tensor: torch.Tensor, tensor_scale: torch.Tensor) -> Fp8Store:
    """`tensor` / `tensor_scale` clamped to +-448 and rounded to float8_e4m3fn, as vLLM's fp8 cache writes it (its
    `scaled_fp8_conversion` saturates: `__NV_SATFINITE`); any shape."""
    written = write_codes(TENSOR_E4M3, tensor, tensor_scale)  # one C pass, the same bytes
    if written is not None:
        return Fp8Store(written.codes, tensor_scale)
    codes = (tensor.float() / tensor_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return Fp8Store(codes, tensor_scale)


def dequantize_fp8(store: Fp8Store, dtype: torch.dtype) -> torch.Tensor:
    """`codes * tensor_scale` in float32, rounded once to `dtype`."""
    return (store.codes.float() * store.tensor_scale).to(dtype)


def amax_scale(tensor: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The computed tensor scale (`tensor_scale=prefill`): amax / (6 x 448) for NVFP4 (torchao's
    `per_tensor_amax_to_scale`; ModelOpt's `get_weights_scaling_factor_2`), amax / 448 for float8 keys (vLLM's
    `calculate_kv_scales`), floored at float32's smallest normal so an all-zero tensor gives no zero scale."""
    divisor = E4M3_MAX if fp8 else E4M3_MAX * E2M1_MAX
    return (tensor.abs().amax().float() / divisor).clamp(min=torch.finfo(torch.float32).tiny)
