"""The `fp8` backend's layer: transformers' `Fp8QuantizedLayer`, whose de-quantization reads a 256-entry table.

transformers de-quantizes the whole float8_e4m3 store at every decode step as `(q.float() * scale).to(dtype)`:
a float8 -> float32 conversion per value, which this CPU does in software, then a multiply. Its scale is frozen at
the first update (one per layer and tensor), so every one of the 256 codes has one de-quantized value for the
life of the layer: `table = (codes.float() * scale).to(dtype)`, computed once, with the same float32 operations
per element as transformers' own, so `torch.take(table, q.view(uint8))` gives the same bits (NaN codes give NaN
as they do there; `tests/test_fp8.py` checks `torch.equal` against the library's `_dequantize`). The store,
the quantization and the update stay transformers' own: only `_dequantize` changes.

Measured (`benchmarks/fp8.py`, the embedded model, 2 threads): a decode step 173.9 -> 145.7 ms at 2,048 tokens and
491.2 -> 383.6 ms at 8,000 (`dynamic`: 99.1 and 181.1 ms); the rest is the whole store still de-quantized per step.

The tables are real memory, counted by `kvdemo.cache.telemetry.kv_memory` (the layer's `_dequantize_tables`)
and by the byte formula: 256 values of the model's dtype per layer and tensor (1 KiB in float32; 60 KiB for the
embedded model's 30 layers). Pattern: a lookup table for a small code book, as llama.cpp de-quantizes its
codebook types (`kvalues_iq4nl` in ggml-quants.c) and as bitsandbytes' NF4 code book does.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Fp8QuantizedLayer

FP8_CODES = 256
"""The codes of an 8-bit float: one table entry each."""


def dequantize_table(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The de-quantized value of every float8_e4m3 code at `scale` (a float32 scalar tensor), [256] of `dtype`:
    `(code.float() * scale).to(dtype)`, element by element the operations of `Fp8QuantizedLayer._dequantize`."""
    codes = torch.arange(FP8_CODES, dtype=torch.uint8, device=scale.device).view(Fp8QuantizedLayer.fp8_dtype)
    return (codes.float() * scale).to(dtype)


class TableFp8Layer(Fp8QuantizedLayer):
    """transformers' `Fp8QuantizedLayer` de-quantizing by table (see the module docstring).

    Attributes:
        _dequantize_tables: (keys' table, values' table), each [256] of the model's dtype, made at the first update
            from the frozen scales.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """transformers' first update (dtype, device, the frozen scales), then the two tables."""
        super().lazy_initialization(key_states, value_states)
        self._dequantize_tables = tuple(
            dequantize_table(store[1], key_states.dtype) for store in (self._quantized_keys, self._quantized_values)
        )

    def _dequantize(self, qtensor):
        """The store `(q, scale)` de-quantized, [batch, kv_heads, tokens, head_dim] of the model's dtype: each
        code's entry in the table of its scale (the keys' or the values'); another scale (never in kvdemo) takes
        transformers' own path."""
        quant_tensor, scale = qtensor
        for store, table in zip((self._quantized_keys, self._quantized_values), self._dequantize_tables):
            if scale is store[1]:
                return torch.take(table, quant_tensor.view(torch.uint8).long())
        return super()._dequantize(qtensor)
