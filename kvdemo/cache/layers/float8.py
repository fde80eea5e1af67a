"""float8_e4m3 codes read by placing each code's bits, and scales per token and head: the arithmetic of the fp8
format (`kvdemo.cache.formats.fp8`) and of TurboQuant's 8-bit keys (`kvdemo.cache.formats.turboquant`).

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

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch
from transformers.cache_utils import Fp8QuantizedLayer

from kvdemo.cache.read import c_build

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


PER_TOKEN_HEAD_FLOOR = 1e-6
"""vLLM's floor on a per-token-head scale (`tl.maximum(absmax / QUANT_MAX, 1e-6)`)."""


ROW_CODES = Path(__file__).with_name("row_codes.c")
"""The C writer of a decode step's codes (`write_codes`)."""

TENSOR_E4M3, ROW_E4M3, ROW_INT8 = 0, 1, 2
"""`write_codes`' modes: float8 e4m3 under a tensor scale, e4m3 with a scale per row, int8 with a scale per row."""


class Written(NamedTuple):
    """What `write_codes` wrote: `codes` [..., head_dim] float8_e4m3fn or int8, `scales` [..., 1] float32 (a per-row
    mode; None under a tensor scale), and whether a code is one of e4m3's NaN codes (`nan_codes`: a NaN state)."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    nan_codes: bool


def _row_writer(name: str, arguments: list, tensor: torch.Tensor, scale: torch.Tensor | None):
    """The C function `name` of `row_codes.c`, where it serves `tensor` (a float32 CPU tensor, rows of at least one
    value) under `scale` (None, or a float32 CPU scalar tensor); else None, as where no compiler built it."""
    if not tensor.is_cpu or tensor.dtype != torch.float32 or tensor.shape[-1] < 1:
        return None
    if scale is not None and (not scale.is_cpu or scale.dtype != torch.float32 or scale.numel() != 1):
        return None
    return c_build.function(ROW_CODES, name, ctypes.c_int, arguments)


def write_codes(mode: int, tensor: torch.Tensor, scale: torch.Tensor | None = None) -> Written | None:
    """`tensor` [..., head_dim] coded in one C pass (`row_codes.c`), the bytes torch's operations write (module
    docstring of `row_codes.c`; `tests/test_fp8.py` compares them). `scale`: the tensor scale of `TENSOR_E4M3`, a
    float32 scalar tensor. None where the C writer does not serve the call (another device or dtype than a float32
    CPU tensor and scale, or no C compiler: `c_build.build_problem(ROW_CODES)`): the caller codes with torch.
    """
    if mode == TENSOR_E4M3 and scale is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    arguments = [ctypes.c_int, pointer, size, size, pointer, size, pointer, size, pointer]
    function = _row_writer("write_codes", arguments, tensor, scale)
    if function is None:
        return None
    values = tensor.contiguous()
    dim = values.shape[-1]
    rows = values.numel() // dim
    codes = torch.empty(values.shape, dtype=torch.uint8)
    scales = None if mode == TENSOR_E4M3 else torch.empty(*values.shape[:-1], 1, dtype=torch.float32)
    nan_codes = function(
        mode, values.data_ptr(), rows, dim, codes.data_ptr(), dim, 0 if scales is None else scales.data_ptr(), 1,
        0 if scale is None else scale.data_ptr(),
    )  # fmt: skip
    return Written(codes.view(torch.int8 if mode == ROW_INT8 else torch.float8_e4m3fn), scales, nan_codes > 0)


def write_nvfp4(tensor: torch.Tensor, tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """NVFP4 blocks of `tensor` [..., head_dim] (head_dim a multiple of 16) under `tensor_scale` with the max/6 rule,
    in one C pass (`row_codes.c`'s `write_nvfp4`: the bytes of `kvdemo.cache.formats.nvfp4.blocks.quantize_nvfp4`'s
    torch arithmetic, `tests/test_nvfp4.py`): (codes [..., head_dim / 2] uint8, block scales [..., head_dim / 16]
    float8_e4m3fn), or None where the C writer does not serve the call."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    function = _row_writer("write_nvfp4", [pointer, size, size, pointer, pointer, pointer], tensor, tensor_scale)
    if function is None:
        return None
    values = tensor.contiguous()
    dim = values.shape[-1]
    codes = torch.empty(*values.shape[:-1], dim // 2, dtype=torch.uint8)
    scales = torch.empty(*values.shape[:-1], dim // 16, dtype=torch.uint8)
    function(
        values.data_ptr(), values.numel() // dim, dim, codes.data_ptr(), scales.data_ptr(), tensor_scale.data_ptr()
    )
    return codes, scales.view(torch.float8_e4m3fn)


def quantize_per_token_head(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3 codes of `tensor` with one scale per token and head, as vLLM's `fp8_per_token_head` cache writes
    them (vllm#38378; its reference `_quantize_per_token_head_ref`, tests/quantization/test_per_token_kv_cache.py):
    `scale = max(amax over head_dim / 448, 1e-6)` in float32, codes `tensor * (1 / scale)` clamped to +-448.

    Args:
        tensor: [batch, kv_heads, tokens, head_dim], any float dtype.

    Returns:
        (codes [batch, kv_heads, tokens, head_dim] float8_e4m3fn, scales [batch, kv_heads, tokens, 1] float32): 1 byte
        per value and 4 bytes per token and head.
    """
    written = write_codes(ROW_E4M3, tensor)
    if written is not None and written.scales is not None:
        return written.codes, written.scales
    fp8_max = torch.finfo(Fp8QuantizedLayer.fp8_dtype).max
    scale = (tensor.float().abs().amax(dim=-1, keepdim=True) / fp8_max).clamp(min=PER_TOKEN_HEAD_FLOOR)
    codes = (tensor.float() * (1.0 / scale)).clamp(-fp8_max, fp8_max).to(Fp8QuantizedLayer.fp8_dtype)
    return codes, scale


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
