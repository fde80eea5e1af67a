"""The `fp8` backend's layer: transformers' `Fp8QuantizedLayer`, whose de-quantization places each code's bits.

transformers de-quantizes the whole float8_e4m3 store at every decode step as `(q.float() * scale).to(dtype)`:
a float8 -> float32 conversion per value, which torch does on this CPU one value at a time, then a multiply.
A float8_e4m3fn code is a sign bit, 4 exponent bits (bias 7) and 3 mantissa bits; float32 has the same fields
with 8 exponent bits (bias 127) and 23 mantissa bits. So each code's value is found with integer operations over
the whole tensor (vectorised): the code, sign-extended to int32 and shifted left by 20, has the code's exponent and
mantissa in the low bits of float32's exponent and the top of its mantissa; masking keeps them and the sign
(`E4M3_TO_FLOAT32_MASK`). Read as float32, that is the code's value times 2^-120 (the biases' difference,
127 - 7), exactly, subnormal codes included (they land on float32 subnormals, also exact). One multiply by
`2^120 * scale` then gives the library's value: `2^120 * scale` is exact (a power of two times a float32 that
does not overflow), so the product is the same real number as `q.float() * scale`, rounded once, to the same bits.

The two NaN codes of e4m3fn (0x7f, 0xff; only a NaN state quantizes to them, since torch saturates larger values
to +-448) would come out as +-480 this way; a layer whose store may hold one (`_quantize` saw it) takes
transformers' own `_dequantize` from then on, as does a scale whose `2^120 * scale` overflows. `tests/test_fp8.py`
checks `torch.equal` against the library's `_dequantize` for every code at several scales and on decode steps.
The store, the quantization and the update stay transformers' own: only `_dequantize` changes, and no table,
index or other per-layer constant is added (the bytes are the library's).

Measured (`benchmarks/fp8.py`, the embedded model, 2 threads, 2026-12-03; docs/benchmarks.md "fp8 de-quantized by
bit placement"): one key store of 8,000 tokens 5.22 ms (transformers) -> 1.20 ms; a decode step ÷ `dynamic`'s
1.63 (transformers) -> 1.48 (kvdemo's earlier 256-entry table) -> 1.18 at 2,048 tokens and 2.34 -> 1.93 ->
1.24-1.28 at 8,000.
Pattern: the bitwise de-quantization of vLLM's Marlin kernels (`csrc/quantization/marlin/dequant.h`: a code's bits
shifted into a wider float's fields, then one multiply by the exponent biases' difference), written here with
torch's element-wise integer operations.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Fp8QuantizedLayer

E4M3_TO_FLOAT32_SHIFT = 20
"""float32's 23 mantissa bits less e4m3's 3: the left shift that puts a code's mantissa at the top of float32's."""

E4M3_TO_FLOAT32_MASK = -0x78100000
"""0x87F00000 as an int32: float32's sign bit, the low 4 bits of its exponent and the top 3 of its mantissa (the
bits a shifted, sign-extended code may fill; the sign extension's other bits are cleared)."""

E4M3_TO_FLOAT32_FACTOR = 2.0**120
"""2^(127 - 7): float32's exponent bias over e4m3's. A code's bits placed in float32 read as its value / 2^120."""


def has_nan_codes(codes: torch.Tensor) -> bool:
    """Whether `codes` (float8_e4m3fn, any shape) holds one of its two NaN codes (0x7f, 0xff)."""
    return bool((codes.view(torch.uint8) & 0x7F).eq_(0x7F).any())


def dequantize_e4m3(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(codes.float() * scale).to(dtype)` bit for bit, by placing each code's bits in a float32 (module
    docstring), for codes that hold no NaN code and a scale with `2^120 * scale` finite.

    Args:
        codes: float8_e4m3fn, any shape, e.g. [batch, kv_heads, tokens, head_dim].
        scale: a float32 scalar tensor (transformers' per-tensor scale).
        dtype: the result's dtype (the model's).

    Returns:
        float tensor of `codes`' shape: 4 bytes per code written once (one int32 tensor, reused as the result).
    """
    bits = codes.view(torch.int8).to(torch.int32)  # sign-extended
    bits.bitwise_left_shift_(E4M3_TO_FLOAT32_SHIFT).bitwise_and_(E4M3_TO_FLOAT32_MASK)
    return bits.view(torch.float32).mul_(scale * E4M3_TO_FLOAT32_FACTOR).to(dtype)


class ExactFp8Layer(Fp8QuantizedLayer):
    """transformers' `Fp8QuantizedLayer` de-quantizing by bit placement (see the module docstring).

    Attributes:
        _nan_codes: whether a NaN code may be in the store (set by `_quantize` when it makes one; an attribute of
            the layer, so `kvdemo.cache.snapshot.restore` puts it back with the store it describes).
    """

    _nan_codes = False

    def _quantize(self, tensor, scale=None):
        """transformers' quantization (`(q, scale)`); notes a NaN code in `q` (a NaN in `tensor`)."""
        quant_tensor, scale = super()._quantize(tensor, scale)
        if not self._nan_codes and has_nan_codes(quant_tensor):
            self._nan_codes = True
        return quant_tensor, scale

    def _dequantize(self, qtensor):
        """The store `(q, scale)` de-quantized, [batch, kv_heads, tokens, head_dim] of the model's dtype, by
        `dequantize_e4m3`; with a NaN code in the store or an overflowing scale, by transformers' own path."""
        quant_tensor, scale = qtensor
        if self._nan_codes or not torch.isfinite(scale * E4M3_TO_FLOAT32_FACTOR):
            return super()._dequantize(qtensor)
        return dequantize_e4m3(quant_tensor, scale, self.keys.dtype)


def quantize_per_token_head(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3 codes of `tensor` with one scale per token and head: amax over head_dim / 448, as vLLM's
    per-token-head dynamic KV scales (vLLM #38378) and transformers' own per-tensor formula
    (`Fp8QuantizedLayer._quantize`) applied to each vector.

    Args:
        tensor: [batch, kv_heads, tokens, head_dim], any float dtype.

    Returns:
        (codes [batch, kv_heads, tokens, head_dim] float8_e4m3fn, scales [batch, kv_heads, tokens, 1] float32): 1 byte
        per value and 4 bytes per token and head.
    """
    fp8_max = torch.finfo(Fp8QuantizedLayer.fp8_dtype).max
    scale = (tensor.abs().amax(dim=-1, keepdim=True).float() / fp8_max).clamp(min=torch.finfo(torch.float32).tiny)
    return (tensor.float() / scale).to(Fp8QuantizedLayer.fp8_dtype), scale


def placeable(codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `dequantize_e4m3` gives the library's bits for these codes and scales (any shapes that broadcast): no
    NaN code, and `2^120 * scale` finite. Checked once where codes are made, so that no read scans the store."""
    return not has_nan_codes(codes) and bool(torch.isfinite(scale * E4M3_TO_FLOAT32_FACTOR).all())


def dequantize_per_token_head(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, by_bits: bool = True
) -> torch.Tensor:
    """`(codes.float() * scale).to(dtype)` with a scale per token and head ([..., tokens, 1], float32), bit for bit:
    by bit placement (`dequantize_e4m3`) where `by_bits` (every code and scale of the store was `placeable` when it was
    made), else by the library's arithmetic."""
    if not by_bits:
        return (codes.float() * scale).to(dtype)
    return dequantize_e4m3(codes, scale, dtype)


class PerTokenHeadFp8Layer(ExactFp8Layer):
    """`fp8,scale=per_token_head`: transformers' fp8 layer with a scale per token and KV head instead of one per tensor
    frozen at the first update (the finer variant transformers' `Fp8QuantizedLayer` docstring leaves room for). Every
    update quantizes its new tokens with their own scales and appends codes and scales (new tensors, so the snapshot's
    `vars(layer).copy()` restores it); no residual, never flushes. An outlier token no longer sets the step of every
    other token, and a later token larger than the prefill's largest is not clipped at 448 x the frozen scale.

    The store is `(codes [batch, kv_heads, tokens, head_dim] float8_e4m3fn, scales [batch, kv_heads, tokens, 1]
    float32)` for the keys and for the values: 1 byte per value plus 4 bytes per token and head, which the byte formula
    (`kvdemo.cache.layouts.fp8_bytes`) counts.
    """

    def _quantize(self, tensor, scale=None):
        """`quantize_per_token_head(tensor)`; a `scale` passed in (transformers' frozen one) is not used. Notes codes
        or scales that bit placement cannot read (`placeable`) in `_nan_codes`, as `ExactFp8Layer` notes NaN codes."""
        codes, scale = quantize_per_token_head(tensor)
        if not self._nan_codes and not placeable(codes, scale):
            self._nan_codes = True
        return codes, scale

    def _dequantize(self, qtensor):
        """The store de-quantized, [batch, kv_heads, tokens, head_dim] of the model's dtype."""
        codes, scale = qtensor
        return dequantize_per_token_head(codes, scale, self.keys.dtype, by_bits=not self._nan_codes)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens ([batch, kv_heads, new tokens, head_dim]) quantized with their own scales; returns
        every stored token de-quantized (the prefill: the new states as given), as transformers' fp8 update does."""
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            return key_states, value_states
        stores = []
        for store, states in ((self._quantized_keys, key_states), (self._quantized_values, value_states)):
            codes, scale = self._quantize(states)
            stores.append((torch.cat([store[0], codes], dim=-2), torch.cat([store[1], scale], dim=-2)))
        self._quantized_keys, self._quantized_values = stores
        return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)
