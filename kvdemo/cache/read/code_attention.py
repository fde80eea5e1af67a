"""Decode attention over a quantized store's codes: a decode step scores the stored keys and sums the stored values
straight from their packed codes, one tile of 32 tokens at a time, and never builds a float copy of the store.

Why: de-quantizing each stored block whole (`kvdemo.cache.layers.blockwise.dequantized_reads`: a float tensor of
every stored token, written then read again by torch's flash kernel) makes a 4-bit step move more bytes than
`dynamic`'s: the codes, then 32-bit floats out and in. Here a C kernel (`code_attention.c`, compiled once per
machine by `kvdemo.cache.read.c_build`, OpenMP over ranges of tokens of each KV head) reads each block's codes, scales
and zeros, de-quantizes one tile of keys and values into a buffer on its stack (at most 2 x 32 x head_dim floats per
thread), scores the tile for every query head that shares the KV head, and keeps FlashAttention's running maximum
and sum (Dao et al. 2022, arXiv:2205.14135); the ranges are merged by log-sum-exp, as Flash-Decoding splits a long
cache (Dao, Haziza, Massa, Sizov 2023). `attend_blockwise` hands it every block and the full-precision residual
(`float_rows`) in one call, whose output is attention's; where some block is not readable it hands it the others and
merges what it returns (the output and the log-sum-exp of each query row, as torch's CPU flash kernel returns them)
with the de-quantized blocks by log-sum-exp, as before. vLLM's TurboQuant decode
(`vllm/v1/attention/ops/triton_turboquant_decode.py`) and llama.cpp's CPU flash attention (`kq_vec_dot` on quantized
rows) read their caches the same way.

The stores it reads (`Codes`, one descriptor per block; anything else returns None and the block is de-quantized as
before):

- optimum-quanto's `QBitsTensor` at 2 or 4 bits, groups along the flat tensor (`axis=0`: a group is `q_group_size`
  consecutive values), float32 scale and shift: x = code x scale - shift (`quanto_codes`);
- hqq's `(W_q, meta)` at every packing kvdemo offers (`8bit_u8`, `4bit_u8`, `3bit_32`, `2bit_u8`, `1bit_u8`), at axis 0
  or 1, float32: x = (code - zero) x scale (`hqq_codes`);
- llama.cpp's blocks (`ggml_codes`: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, the `ggml` backend's; `ggml_dequant.c`'s
  arithmetic, which this kernel includes) and its `f16` rows (`half_rows`);
- TurboQuant's keys at 2 to 4 bits (`kvdemo.cache.formats.turboquant.codes.lookup_codes`: x = centroid[code] x
  norm, or for vLLM's `_nc` keys x = (centroid[code] / |c|) x norm, |c| the norm of the row's centroids) and uniform
  values at 2 to 8 bits (`uniform_codes`: x = code x scale + zero), norms, scales and zeros in float16 or float32, in
  kvdemo's layout and in vLLM's;
- a code's value times a scale (`scaled_codes`): float8 e4m3 or e5m2 and int8 with a float32 scale per tensor or per
  token and head (the `fp8` format under every scale rule, `int8`, TurboQuant's float8 keys), and NVFP4's E2M1 codes
  with an e4m3 scale per 16 values and a float32 one per tensor (`nvfp4`); x = table[code] x scale, or
  table[code] x (block scale x tensor scale), as the formats' `codes.float() * scale` rounds.

**The same keys, another order of sums.** Each tile is de-quantized by the library's formula operation for
operation, compiled without fused multiply-add, so every key and value the kernel reads equals the library's
de-quantized one bit for bit (`dequantize_codes` is the test's handle on it), but for vLLM's `_nc` keys, whose |c| the
kernel sums in its own order (within 1e-6 relative). The scores q.k, the softmax and the
weighted sum of the values are float32 sums in another order than torch's kernel (fused multiply-adds where the CPU
has them, `expf` from the vector math library, within 4 units in the last place), so the output differs from the
de-quantize path by float rounding. The bound, checked by `tests/test_code_attention.py` on every format, bit width and
group layout against the de-quantized store read by torch's kernel: each output within 1e-5 x the largest |value|,
the log-sum-exp within 3e-5 (measured at most 1.7e-6 and 9.5e-6); through the embedded model, from the same cache
state, the same greedy token, and the logits within 1e-3 where new tokens wait in a residual (a typical step 1e-5 to
4e-5; ggml, which writes a new token as codes at once, can part further at a step where a code of it lands across a
boundary, as torch's own two reads do). Against float64 at 16,000 tokens it errs as torch's flash
kernel does (`benchmarks/code_attention.py` and docs/benchmarks.md give the logit gaps beside torch's own).

It serves float32 queries and stores on the CPU, one decode step (no mask), head_dim up to 256 and up to 64 query
rows per KV head; any other call, a store of another dtype (a bfloat16 model's), or a machine with no C compiler
(`c_build.build_problem`) takes the de-quantize path, and `kvdemo.cache.layers.attention.decode_read` says which one
each of a cache's layers takes.

**NaN and infinity.** The kernel is compiled with `-ffast-math` (for the vector `expf`), under which the compiler may
assume every float finite, so a store holding NaN or infinity (a broken model's keys) would not propagate as torch's
attention propagates it. The kernel tests every score and every output's bits (an integer test no flag folds away)
and raises `NotFinite` where one is not finite; `kvdemo.cache.layers.blockwise.attend_blockwise` then reads the store
whole with torch's sdpa, the reference (`tests/test_code_attention.py` poisons a cache of every kind).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from kvdemo.cache.read import c_build

SOURCE = Path(__file__).with_name("code_attention.c")
"""The kernel's C source."""

MAX_DIM, MAX_ROWS = 256, 64
"""The kernel's limits: head_dim, and query rows per KV head (query heads per KV head x new tokens)."""

AFFINE, LOOKUP, UNIFORM, FLOAT, GGML, HALF, SCALED = 0, 1, 2, 3, 4, 5, 6
"""`Codes.kind`: group-wise integer codes (quanto, hqq), TurboQuant's keys, TurboQuant's values, float32 rows (the
residual), llama.cpp's blocks, float16 rows (llama.cpp's f16), a code's value times a scale (float8, int8, NVFP4)."""

FIELDS = (
    "kind", "bits", "codes", "word_bytes", "shift0", "shift_step", "by_row", "zero_first", "half", "rows", "cols",
    "step", "row_bytes", "scale", "zero", "table", "row_scale", "row_zero", "tokens", "first", "stride", "unit",
)  # fmt: skip
"""The C `Codes` descriptor's fields, in order, each an int64 (pointers as addresses; `code_attention.c`)."""


@dataclass(frozen=True)
class StoreCodes:
    """One block of a store as the kernel reads it.

    Attributes:
        row: the C descriptor's fields (`FIELDS`), pointers into `tensors`.
        shape: the block's [batch, kv_heads, tokens, head_dim].
        tensors: the tensors the pointers point into, held while the descriptor lives.
    """

    row: tuple[int, ...]
    shape: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]

    def window(self, first: int, tokens: int) -> StoreCodes:
        """The block's tokens [first, first + tokens) of each head, read in place (a sliding window's visible part of
        a store that holds more): [batch, kv_heads, tokens, head_dim].

        Raises:
            ValueError: the range is not within the block's tokens."""
        stored = self.shape[2]
        if first < 0 or tokens < 1 or first + tokens > stored:
            raise ValueError(f"tokens [{first}, {first + tokens}) are not within the block's {stored}")
        row = list(self.row)
        row[_FIELD["first"]], row[_FIELD["stride"]], row[_FIELD["tokens"]] = first, stored, tokens
        return StoreCodes(tuple(row), (*self.shape[:2], tokens, self.shape[3]), self.tensors)


_FIELD = {name: index for index, name in enumerate(FIELDS)}


def store_codes(shape: tuple[int, ...], pointers: dict[str, torch.Tensor], **fields: int) -> StoreCodes | None:
    """A `StoreCodes` of `fields` and the addresses of `pointers` (field -> tensor), or None where a tensor is not
    a contiguous CPU tensor or the shape is outside the kernel's (a copy would cost what the kernel saves). Made
    for every block at every decode step: plain loops, about 10 us."""
    if len(shape) != 4 or shape[-1] > MAX_DIM:
        return None
    row = [0] * len(FIELDS)
    for name, value in fields.items():
        row[_FIELD[name]] = value
    for name, tensor in pointers.items():
        if not tensor.is_cpu or not tensor.is_contiguous():
            return None
        row[_FIELD[name]] = tensor.data_ptr()
    row[_FIELD["tokens"]] = shape[2]
    return StoreCodes(tuple(row), shape, tuple(pointers.values()))


def affine_codes(
    words: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    shape: tuple[int, ...],
    bits: int,
    cols: int,
    shifts: tuple[int, int],
    by_row: bool,
    zero_first: bool,
) -> StoreCodes | None:
    """Group-wise integer codes packed along the rows of the libraries' [rows, cols] matrix (`code_attention.c`).

    Args:
        words: [step, cols] uint8 or int32, the packed matrix; scale, zero: float32, one per group (row or column).
        shape: the store's [batch, kv_heads, tokens, head_dim]. bits: bits per code. cols: the matrix's columns.
        shifts: (bit of the first row chunk, step to the next). by_row: a group is a row (else a column).
        zero_first: x = (code - zero) x scale, hqq's (else x = code x scale - zero, quanto's).

    Returns:
        The descriptor, or None for a dtype or layout the kernel does not read.
    """
    if words.dtype not in (torch.uint8, torch.int32) or scale.dtype != torch.float32 or zero.dtype != torch.float32:
        return None
    numel = math.prod(shape)
    rows = numel // cols
    groups = rows if by_row else cols
    if words.dim() != 2 or words.shape[1] != cols or scale.numel() != groups or zero.numel() != groups:
        return None
    per_word = 10 if words.dtype == torch.int32 else 8 // bits  # codes a word holds (hqq's 3-bit: 10 in 32 bits)
    if numel % cols or words.shape[0] * per_word < rows:  # not the libraries' packing: read it the libraries' way
        return None
    fields = dict(kind=AFFINE, bits=bits, word_bytes=words.element_size(), shift0=shifts[0], shift_step=shifts[1])
    fields |= dict(by_row=int(by_row), zero_first=int(zero_first), rows=rows, cols=cols, step=words.shape[0])
    return store_codes(shape, {"codes": words, "scale": scale, "zero": zero}, **fields)


def row_values(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], int] | None:
    """Per-row scales (norms, zeros) as the kernel reads them: all float16 (1) or all float32 (0), else None."""
    if all(t.dtype == torch.float16 for t in tensors):
        return tensors, 1
    if all(t.dtype == torch.float32 for t in tensors):
        return tensors, 0
    return None


@lru_cache(maxsize=64)
def _cached_table(levels: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(levels, dtype=torch.float64).to(torch.float32)


def float32_table(levels: torch.Tensor) -> torch.Tensor:
    """`levels` in float32, one tensor per distinct table (cached: the descriptor is made at every decode step)."""
    return _cached_table(tuple(levels.tolist()))


def float_rows(tensor: torch.Tensor) -> StoreCodes | None:
    """Full-precision keys or values (the residual), [batch, kv_heads, tokens, head_dim] float32, as the kernel
    reads them with the store, or None for another dtype, layout or an empty tensor."""
    if tensor.dtype != torch.float32 or tensor.dim() != 4 or tensor.shape[2] < 1:
        return None
    return store_codes(tuple(tensor.shape), {"codes": tensor}, kind=FLOAT, bits=32, row_bytes=4 * tensor.shape[-1])


@lru_cache(maxsize=8)
def byte_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] float32: the value of each byte read as `dtype` (float8_e4m3fn, float8_e5m2, int8), exact (every such
    value is a float32), NaN codes included: the table `scaled_codes` reads 8-bit codes through."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def scaled_codes(
    codes: torch.Tensor,
    table: torch.Tensor | None = None,
    *,
    row_scale: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
    block_scales: torch.Tensor | None = None,
) -> StoreCodes | None:
    """A store of one code per value times a scale, as the kernel reads it (`code_attention.c`, kind 6).

    Args:
        codes: [batch, kv_heads, tokens, head_dim] of a 1-byte dtype (float8, int8, uint8: a code a byte), or
            [batch, kv_heads, tokens, head_dim / 2] uint8 with `block_scales` (E2M1: two codes a byte, the even value
            in the low nibble).
        table: float32, each code's value: NVFP4's 16 E2M1 values; None, the value of each byte read as `codes`'
            dtype (`byte_table`).
        row_scale: [batch, kv_heads, tokens, 1] float32: x = table[code] x row_scale (fp8, int8 per token and head).
        tensor_scale: a float32 scalar tensor: x = table[code] x tensor_scale; with `block_scales` [batch, kv_heads,
            tokens, blocks] float8_e4m3fn, x = table[code] x (float(block_scale) x tensor_scale) (NVFP4). None: 1.

    Returns:
        The descriptor, or None for a dtype or layout the kernel does not read.
    """
    table = byte_table(codes.dtype) if table is None else table
    if codes.dim() != 4 or codes.element_size() != 1 or table.dtype != torch.float32:
        return None
    nibbles = block_scales is not None and table.numel() == 16
    dim = codes.shape[-1] * (2 if nibbles else 1)
    shape = (*codes.shape[:-1], dim)
    pointers = {"codes": codes.view(torch.uint8), "table": table}
    fields = dict(kind=SCALED, bits=4 if nibbles else 8, row_bytes=codes.shape[-1])
    if not nibbles:  # the kernel's faster reads of a byte (its table otherwise): e4m3's bits placed, int8 converted
        fields["shift0"] = {torch.float8_e4m3fn: 1, torch.int8: 2}.get(codes.dtype, 0)
    if row_scale is not None:
        if row_scale.dtype != torch.float32 or row_scale.shape != (*codes.shape[:-1], 1):
            return None
        pointers["row_scale"] = row_scale
    if tensor_scale is not None:
        if tensor_scale.dtype != torch.float32 or tensor_scale.numel() != 1:
            return None
        pointers["scale"] = tensor_scale
    if block_scales is not None:
        blocks = block_scales.shape[-1]
        if block_scales.dtype != torch.float8_e4m3fn or blocks < 1 or dim % blocks or (dim // blocks) % 2:
            return None
        pointers |= {"zero": block_scales.view(torch.uint8), "row_zero": byte_table(torch.float8_e4m3fn)}
        fields["cols"] = dim // blocks
    elif table.numel() != 256:
        return None
    return store_codes(shape, pointers, **fields)


def kernel():
    """The C function `code_attention` (compiled once per machine), or None where it cannot be built
    (`c_build.build_problem(SOURCE)` says why)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    arguments = [pointer, pointer, size, size, size, size, ctypes.c_float, pointer, pointer, ctypes.c_int]
    return c_build.function(SOURCE, "code_attention", ctypes.c_int, arguments)


class NotFinite(ArithmeticError):
    """The kernel met a score or an output that is not finite (a store holding NaN or infinity): the caller reads the
    store whole with torch, whose NaN and infinities are the reference's."""


def attend_codes(
    grouped: torch.Tensor, stores: Sequence[tuple[StoreCodes, StoreCodes]], scaling: float | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of the query rows over blocks of codes (module docstring), as torch's CPU flash kernel gives it
    over the same blocks de-quantized and joined.

    Args:
        grouped: [batch, kv_heads, rows, head_dim] float32: the query rows that share each KV head.
        stores: (keys, values) of each block, each [batch, kv_heads, block tokens, head_dim].
        scaling: the softmax scale (None: 1/sqrt(head_dim)).

    Returns:
        (output [batch, kv_heads, rows, head_dim], log-sum-exp [batch, kv_heads, rows]), float32; None where the
        kernel does not take the call (no compiler, another dtype or shape): the caller de-quantizes instead.

    Raises:
        NotFinite: a score or an output is not finite (module docstring).
    """
    batch, kv_heads, rows, dim = grouped.shape
    if grouped.dtype != torch.float32 or rows > MAX_ROWS or not stores:
        return None
    for keys, values in stores:
        if keys.shape != values.shape or keys.shape[:2] != (batch, kv_heads) or keys.shape[-1] != dim:
            return None
    function = kernel()
    if function is None:
        return None
    query = grouped.contiguous()
    out = torch.empty_like(query)
    lse = torch.empty(batch, kv_heads, rows, dtype=torch.float32)
    descriptors = torch.tensor([store.row for pair in stores for store in pair], dtype=torch.int64)
    scale = dim**-0.5 if scaling is None else scaling
    done = function(
        query.data_ptr(), descriptors.data_ptr(), len(stores), batch * kv_heads, rows, dim, scale, out.data_ptr(),
        lse.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if done == -3:
        raise NotFinite("a key or value of the store is NaN or infinite")
    return (out, lse) if done == 0 else None


def dequantize_codes(store: StoreCodes) -> torch.Tensor:
    """The whole store de-quantized by the kernel's tile reader (`code_dequantize`), [batch, kv_heads, tokens,
    head_dim] float32: the values attention reads, which equal the library's `_dequantize` bit for bit
    (`tests/test_code_attention.py`).

    Raises:
        RuntimeError: no C compiler built the kernel (the reason).
    """
    function = c_build.function(
        SOURCE, "code_dequantize", ctypes.c_int, [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p]
    )
    if function is None:
        raise RuntimeError(f"the decode kernel is not built: {c_build.build_problem(SOURCE)}")
    batch, heads, tokens, dim = store.shape
    out = torch.empty(store.shape, dtype=torch.float32)
    row = torch.tensor(store.row, dtype=torch.int64)
    if function(row.data_ptr(), 0, batch * heads * tokens, dim, out.data_ptr()) != 0:
        raise RuntimeError(f"head_dim {dim} is above the kernel's {MAX_DIM}")
    return out
