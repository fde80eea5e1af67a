"""TurboQuant's stores as the decode kernel reads them (`kvdemo.cache.read.code_attention`): the keys' Lloyd-Max codes
and norms (`lookup_codes`) and the values' uniform codes (`uniform_codes`), in kvdemo's layout and in vLLM's; both
layouts pack `bits`-bit codes densely along head_dim, least significant bit first (`lloyd_max.pack_codes`)."""

from __future__ import annotations

import torch

from kvdemo.cache.read.code_attention import LOOKUP, UNIFORM, StoreCodes, float32_table, row_values, store_codes


def lookup_codes(
    codes: torch.Tensor, norms: torch.Tensor, bits: int, table: torch.Tensor, unit: bool = False
) -> StoreCodes | None:
    """TurboQuant's keys: `codes` [batch, kv_heads, tokens, head_dim x bits / 8] uint8 (`lloyd_max.pack_codes`),
    `norms` [batch, kv_heads, tokens, 1], `table` the 2^bits centroids; x = float32(centroid) x norm, or with `unit`
    (vLLM's `_nc` keys, whose stored norm is the key's own) x = (centroid / |c|) x norm, |c| the norm of the row's
    centroids. None for bits outside 1-4 or another dtype."""
    rows = row_values(norms)
    if rows is None or not 1 <= bits <= 4 or codes.dtype != torch.uint8:
        return None
    shape = (*codes.shape[:-1], codes.shape[-1] * 8 // bits)
    fields = dict(kind=LOOKUP, bits=bits, half=rows[1], row_bytes=codes.shape[-1], unit=int(unit))
    return store_codes(shape, {"codes": codes, "row_scale": rows[0][0], "table": float32_table(table)}, **fields)


def uniform_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> StoreCodes | None:
    """TurboQuant's values: `codes` as `lookup_codes`'s, `scale` and `zero` [batch, kv_heads, tokens, 1]; x = code x
    scale + zero. None for bits outside 1-4 and 8, or another dtype."""
    rows = row_values(scale, zero)
    if rows is None or not (1 <= bits <= 4 or bits == 8) or codes.dtype != torch.uint8:
        return None
    shape = (*codes.shape[:-1], codes.shape[-1] * 8 // bits)
    fields = dict(kind=UNIFORM, bits=bits, half=rows[1], row_bytes=codes.shape[-1])
    return store_codes(shape, {"codes": codes, "row_scale": rows[0][0], "row_zero": rows[0][1]}, **fields)
