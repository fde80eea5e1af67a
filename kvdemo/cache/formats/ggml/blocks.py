"""llama.cpp's KV cache block types, byte for byte: q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl, each a block of 32
values with a float16 scale (and a float16 minimum for the `_1` types), quantized as ggml's reference quantizer writes
them and de-quantized as ggml reads them.

Source: ggml's `ggml-common.h` (the block structs) and `ggml-quants.c` (`quantize_row_q4_0_ref` and the others,
`dequantize_row_*`), ggml as vendored by llama-cpp-python 0.3.36 (llama.cpp commit 0c1e570, 2026-10-01). The `gguf`
package's numpy quantizers (`gguf.quants`, "bit-exact same results as reference implementation in ggml-quants.c") are
the tests' oracle for the first five, and its de-quantizer for iq4_nl (`tests/test_ggml_blocks.py`).

A row of `width` values (one token's head, width a multiple of 32) is `width / 32` blocks of `BLOCK_BYTES[type]` bytes:

    q8_0   d f16, qs int8[32]                      34 bytes   x = d * q
    q4_0   d f16, qs u8[16] (two 4-bit codes)      18 bytes   x = d * (q - 8)
    q4_1   d f16, m f16, qs u8[16]                 20 bytes   x = d * q + m
    q5_0   d f16, qh u32 (5th bits), qs u8[16]     22 bytes   x = d * (q - 16)
    q5_1   d f16, m f16, qh u32, qs u8[16]         24 bytes   x = d * q + m
    iq4_nl d f16, qs u8[16] (indices into 16 values) 18 bytes x = d * KVALUES_IQ4NL[q]

The byte `qs[j]` holds code j in its low nibble and code j + 16 in its high one; bit j of `qh` is code j's fifth bit.
Every scale is computed in float32 as the C code computes it, then stored as float16 (round to nearest even).

One difference from what a CPU build of llama.cpp writes: its q8_0 KV writes go through `quantize_row_q8_0` of
ggml-cpu, which on AVX2 multiplies by 127 / amax and rounds half to even, where the reference multiplies by
1 / (amax / 127) and rounds half away from zero; a code may differ by one where the product falls within a rounding
of a half. The other five types are written by the reference on every CPU.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvdemo.cache.read import c_build

from . import BLOCK_BYTES  # the card's table (ggml-common.h's sizes), one table for the bytes and the blocks

BLOCK = 32
"""Values per block (QK8_0 = QK4_0 = ... = QK4_NL = 32)."""

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""iq4_nl's 16 non-uniform values (`kvalues_iq4nl` of ggml-common.h)."""

GROUP_MAX_EPS = 1e-15
"""iq4_nl: a block whose largest magnitude is below this is stored as zeros (ggml-quants.c)."""


def row_bytes(block_type: str, width: int) -> int:
    """Bytes of one row of `width` values (a multiple of 32) stored as `block_type`."""
    return width // BLOCK * BLOCK_BYTES[block_type]


def _roundf(tensor: torch.Tensor) -> torch.Tensor:
    """C's `roundf`, half away from zero (torch.round rounds half to even), as gguf's `np_roundf` computes it."""
    a = tensor.abs()
    floored = a.floor()
    return torch.sign(tensor) * (floored + (2 * (a - floored)).floor())


def _half_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] rounded to float16, as its two little-endian bytes: uint8 [..., 2]."""
    return tensor.to(torch.float16).contiguous().view(torch.uint8)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., 32] (0-15 in their low bits) packed two to a byte: [..., 16], code j low, code j + 16 high."""
    low, high = codes[..., :16] & 0x0F, codes[..., 16:] & 0x0F
    return (low | (high << 4)).to(torch.uint8)


def _fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 codes [..., 32] as a little-endian uint32: uint8 [..., 4]."""
    bits = ((codes >> 4) & 1).to(torch.int64).view(*codes.shape[:-1], 4, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int64, device=codes.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def _symmetric(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0 and q5_0: d = max / -levels (max the signed value of largest magnitude, the first of ties), codes
    trunc(x / d + levels + 0.5) clipped to [0, 2 levels - 1]."""
    index = blocks.abs().argmax(dim=-1, keepdim=True)
    top = blocks.gather(-1, index)
    top = torch.where(top == 0, torch.zeros_like(top), top)  # C's `max` stays +0.0 where every value is a zero
    d = top / -levels
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.trunc(blocks * inverse + (levels + 0.5)).clamp(0, 2 * levels - 1).to(torch.int32)
    return d, codes


def _affine(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_1 and q5_1: d = (max - min) / levels, m = min, codes trunc((x - min) / d + 0.5) clipped to [0, levels]."""
    low, high = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
    first_zero = blocks.gather(-1, (blocks == 0).to(torch.int8).argmax(dim=-1, keepdim=True))
    low = torch.where(low == 0, first_zero, low)  # C keeps the first of equal values: a zero's own sign
    high = torch.where(high == 0, first_zero, high)
    d = (high - low) / levels
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.trunc((blocks - low) * inverse + 0.5).clamp(0, levels).to(torch.int32)
    return d, low, codes


def _best_index(scaled: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ggml's `best_index_int8`: the index of the value nearest `scaled` (the lower one of a tie), the first below
    the smallest value, the last above the largest."""
    upper = torch.searchsorted(values, scaled.contiguous(), right=True).clamp(1, len(values) - 1)
    below, above = values[upper - 1], values[upper]
    index = torch.where(scaled - below < above - scaled, upper - 1, upper)
    index = torch.where(scaled <= values[0], torch.zeros_like(index), index)
    return torch.where(scaled >= values[-1], torch.full_like(index, len(values) - 1), index)


def _iq4_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """iq4_nl as `quantize_row_iq4_nl_ref` writes it (`quantize_row_iq4_nl_impl` with ntry = -1: no search):
    d0 = max / -127, each code the nearest of `KVALUES_IQ4NL` to x / d0, then the least-squares scale
    d = sum(w q x) / sum(w q^2) with w = x^2, summed in float32 in the C loop's order."""
    values = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=blocks.device)
    index = blocks.abs().argmax(dim=-1, keepdim=True)
    top = blocks.gather(-1, index)
    live = top.abs() >= GROUP_MAX_EPS
    d0 = torch.where(live, top / values[0], torch.ones_like(top))
    codes = _best_index(blocks * (1 / d0), values)
    q = values[codes]
    sum_qx = torch.zeros_like(top)
    sum_q2 = torch.zeros_like(top)
    for j in range(BLOCK):  # float32 sums in the C loop's order: the scale is rounded to float16 after
        w, qj, xj = blocks[..., j : j + 1] * blocks[..., j : j + 1], q[..., j : j + 1], blocks[..., j : j + 1]
        sum_qx = sum_qx + w * qj * xj
        sum_q2 = sum_q2 + w * qj * qj
    d = torch.where(sum_q2 > 0, sum_qx / torch.where(sum_q2 > 0, sum_q2, torch.ones_like(sum_q2)), 0)
    d = torch.where(live, d, torch.zeros_like(d))
    codes = torch.where(live, codes, torch.zeros_like(codes))
    return d, codes.to(torch.int32)


def quantize_rows(tensor: torch.Tensor, block_type: str) -> torch.Tensor:
    """`tensor` [..., width] (width a multiple of 32; any float dtype, computed in float32) as ggml blocks: uint8
    [..., width / 32 * BLOCK_BYTES[block_type]], the bytes `ggml_quantize_chunk` writes for each row. On the CPU by
    ggml's reference C (`quantizer`, one pass: a decode step's token in microseconds), else `torch_quantize_rows`:
    the same bytes.

    Raises:
        ValueError: an unknown block type, or a width that is not a multiple of 32.
    """
    if block_type not in BLOCK_BYTES:
        raise ValueError(f"{block_type!r} is not a ggml block type; choose one of {', '.join(BLOCK_BYTES)}")
    width = tensor.shape[-1]
    if width % BLOCK:
        raise ValueError(f"ggml blocks hold {BLOCK} values, so a row of {width} cannot be stored as {block_type}")
    function = quantizer() if tensor.device.type == "cpu" else None
    if function is None:
        return torch_quantize_rows(tensor, block_type)
    values = tensor.float().contiguous()
    out = torch.empty(*tensor.shape[:-1], row_bytes(block_type, width), dtype=torch.uint8)
    rows = values.numel() // width
    function(KERNEL_TYPES.index(block_type), values.data_ptr(), out.data_ptr(), rows, width, out.shape[-1])
    return out


def torch_quantize_rows(tensor: torch.Tensor, block_type: str) -> torch.Tensor:
    """`quantize_rows` in torch operations (any device): ggml's reference arithmetic, one operation per step of its
    loop; `block_type` and the width already checked."""
    width = tensor.shape[-1]
    blocks = tensor.float().reshape(*tensor.shape[:-1], width // BLOCK, BLOCK)
    if block_type == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        codes = _roundf(blocks * inverse).to(torch.int8).view(torch.uint8)
        parts = [_half_bytes(d), codes]
    elif block_type in ("q4_0", "q5_0"):
        d, codes = _symmetric(blocks, 8 if block_type == "q4_0" else 16)
        high = [_fifth_bits(codes)] if block_type == "q5_0" else []
        parts = [_half_bytes(d), *high, _nibbles(codes)]
    elif block_type in ("q4_1", "q5_1"):
        d, low, codes = _affine(blocks, 15 if block_type == "q4_1" else 31)
        high = [_fifth_bits(codes)] if block_type == "q5_1" else []
        parts = [_half_bytes(d), _half_bytes(low), *high, _nibbles(codes)]
    else:
        d, codes = _iq4_nl(blocks)
        parts = [_half_bytes(d), _nibbles(codes)]
    return torch.cat(parts, dim=-1).reshape(*tensor.shape[:-1], -1)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block [..., n, bytes], as float32 [..., n, 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _codes(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The 32 4-bit codes packed from byte `start` (16 bytes), as int32 [..., n, 32]: low nibbles, then high."""
    packed = blocks[..., start : start + 16].to(torch.int32)
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _with_fifth_bits(codes: torch.Tensor, blocks: torch.Tensor, start: int) -> torch.Tensor:
    """`codes` [..., n, 32] with bit 4 of each set from the little-endian uint32 at byte `start`."""
    shifts = torch.arange(8, device=blocks.device, dtype=torch.int32)
    bits = (blocks[..., start : start + 4].to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return codes | (bits.reshape(*codes.shape) << 4)


SOURCE = Path(__file__).parents[2] / "read" / "ggml_dequant.c"
"""The C kernel that de-quantizes blocks in one pass (`kernel`); the same values as `torch_dequantize_rows`."""

KERNEL_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
"""The kernel's type numbers: the index in this tuple."""


QUANTIZE_SOURCE = Path(__file__).with_name("quantize.c")
"""ggml's reference block quantizers in C (`ggml_quantize`)."""


def quantizer():
    """The C function `ggml_quantize` (`quantize.c`, compiled once per machine by `kvdemo.cache.read.c_build`), or
    None where no C compiler built it (`c_build.build_problem(QUANTIZE_SOURCE)` says why)."""
    arguments = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return c_build.function(QUANTIZE_SOURCE, "ggml_quantize", ctypes.c_int, arguments)


def kernel():
    """The C function `ggml_dequantize` (`ggml_dequant.c`, compiled once per machine by `kvdemo.cache.read.c_build`),
    its argument types set; None where no C compiler built it (`c_build.build_problem(SOURCE)` says why)."""
    arguments = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    return c_build.function(SOURCE, "ggml_dequantize", ctypes.c_int, arguments)


def dequantize_rows(rows: torch.Tensor, block_type: str, width: int) -> torch.Tensor:
    """`quantize_rows` undone as ggml's `dequantize_row_*` computes it (float32 products of the float16 scale and
    the code): uint8 [..., row_bytes(block_type, width)] -> float32 [..., width]. One pass of the C kernel on the CPU
    (`kernel`, torch's threads), else `torch_dequantize_rows` (a CUDA tensor, no compiler): the same values."""
    function = kernel() if rows.device.type == "cpu" else None
    if function is None:
        return torch_dequantize_rows(rows, block_type, width)
    rows = rows.contiguous()
    out = torch.empty(*rows.shape[:-1], width, dtype=torch.float32)
    count = rows.numel() // max(rows.shape[-1], 1)
    function(KERNEL_TYPES.index(block_type), rows.data_ptr(), out.data_ptr(), count, width, torch.get_num_threads())
    return out


def torch_dequantize_rows(rows: torch.Tensor, block_type: str, width: int) -> torch.Tensor:
    """`dequantize_rows` in torch operations (several passes over the store; any device)."""
    blocks = rows.reshape(*rows.shape[:-1], width // BLOCK, BLOCK_BYTES[block_type])
    d = _half(blocks, 0)
    if block_type == "q8_0":
        values = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    elif block_type == "q4_0":
        values = (_codes(blocks, 2) - 8).float() * d
    elif block_type == "q5_0":
        values = (_with_fifth_bits(_codes(blocks, 6), blocks, 2) - 16).float() * d
    elif block_type == "q4_1":
        values = _codes(blocks, 4).float() * d + _half(blocks, 2)
    elif block_type == "q5_1":
        values = _with_fifth_bits(_codes(blocks, 8), blocks, 4).float() * d + _half(blocks, 2)
    else:
        table = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=rows.device)
        values = table[_codes(blocks, 2)] * d
    return values.reshape(*rows.shape[:-1], width)
