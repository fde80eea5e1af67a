"""The `fp8` format's layers: transformers' `Fp8QuantizedLayer` de-quantizing by bit placement (`ExactFp8Layer`, the
arithmetic and its measure in `kvdemo.cache.layers.float8`), its per-token-head variant, the engines' scale rules
(`EngineFp8Layer`), each over a sliding window, and the cache of them (`fp8_cache`).

Each is an `AppendedLayer` (`kvdemo.cache.layers.appended`: transformers' fp8 update, which codes every token under
the frozen scale and appends it, written once for all of them), so a decode step where kvdemo's attention reads the
store hands it the codes (`_codes_of`), read by the decode kernel (`kvdemo.cache.read.code_attention`) as
`codes.float() * scale`, the library's de-quantization bit for bit.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig, QuantizedCache
from transformers.cache_utils import Fp8QuantizedLayer

from kvdemo.cache.layers.appended import AppendedLayer, reading_blocks
from kvdemo.cache.layers.by_kind import library_cache, sliding_windows, with_kept_layers
from kvdemo.cache.layers.float8 import (
    E4M3_TO_FLOAT32_FACTOR,
    TENSOR_E4M3,
    dequantize_e4m3,
    dequantize_per_token_head,
    has_nan_codes,
    placeable,
    quantize_per_token_head,
    write_codes,
)
from kvdemo.cache.layers.sliding import SlidingStoreWindow
from kvdemo.cache.model.layer_kinds import quantized_layers
from kvdemo.cache.policies import PROTECT_CHOICES, SLIDING_CHOICES
from kvdemo.cache.read.code_attention import StoreCodes, scaled_codes

from . import CALCULATED_RANGES, FLOAT8_FORMATS, SCALES

FLOAT8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The torch dtype of each `float8` word."""


class ExactFp8Layer(AppendedLayer, Fp8QuantizedLayer):
    """transformers' `Fp8QuantizedLayer` de-quantizing by bit placement (see the module docstring): the first update's
    amax / 448 is the scale of every later token (its `_quantize`).

    Attributes:
        _nan_codes: whether a NaN code may be in the store (set by `_quantize` when it makes one; an attribute of
            the layer, so `kvdemo.cache.state.snapshot.restore` puts it back with the store it describes).
    """

    _nan_codes = False

    def _code(self, states: torch.Tensor, keys: bool, store: tuple | None) -> tuple:
        """`(codes, scale)` of `states` under the store's scale (the first update: its own)."""
        return self._quantize(states, None if store is None else store[1])

    def _quantize(self, tensor, scale=None):
        """transformers' quantization (`(q, scale)`): under a given scale (a decode step's tokens) in one C pass where
        it serves (`_written`), else (the first update, whose amax sets the scale) the library's own; notes a NaN
        code in `q` (a NaN in `tensor`)."""
        codes = None if scale is None else self._written(tensor, scale)
        if codes is not None:
            return codes, scale
        codes, scale = Fp8QuantizedLayer._quantize(self, tensor, scale)
        self._note_nan_codes(codes)
        return codes, scale

    def _written(self, tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """e4m3 codes of `tensor / scale`, saturated, by the C writer (`write_codes`: torch's bytes), noting a NaN
        code; None where the writer does not serve the call."""
        written = write_codes(TENSOR_E4M3, tensor, scale)
        if written is not None and written.nan_codes:  # an attribute only where set: a restore drops it with the store
            self._nan_codes = True
        return None if written is None else written.codes

    def _note_nan_codes(self, codes: torch.Tensor) -> None:
        """Set `_nan_codes` where `codes` (float8_e4m3fn) hold a NaN code."""
        if not self._nan_codes and has_nan_codes(codes):
            self._nan_codes = True

    def _dequantize(self, qtensor):
        """The store `(q, scale)` de-quantized, [batch, kv_heads, tokens, head_dim] of the model's dtype, by
        `dequantize_e4m3`; with a NaN code in the store or an overflowing scale, by transformers' own path."""
        quant_tensor, scale = qtensor
        if self._nan_codes or not torch.isfinite(scale * E4M3_TO_FLOAT32_FACTOR):
            return super()._dequantize(qtensor)
        return dequantize_e4m3(quant_tensor, scale, self.keys.dtype)

    def _codes_of(self, q_tensor) -> StoreCodes | None:
        """The store as the decode kernel reads it: `codes.float() * scale`."""
        codes, scale = q_tensor
        return scaled_codes(codes, tensor_scale=scale)


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

    def _code(self, states: torch.Tensor, keys: bool, store: tuple | None) -> tuple:
        """`(codes, scales)` of `states`, each token and head with its own scale."""
        return self._quantize(states)

    def _dequantize(self, qtensor):
        """The store de-quantized, [batch, kv_heads, tokens, head_dim] of the model's dtype."""
        codes, scale = qtensor
        return dequantize_per_token_head(codes, scale, self.keys.dtype, by_bits=not self._nan_codes)

    def _codes_of(self, q_tensor) -> StoreCodes | None:
        """The store as the decode kernel reads it: `codes.float() * scales`, a scale per token and head."""
        codes, scale = q_tensor
        return scaled_codes(codes, row_scale=scale)


class EngineFp8Layer(ExactFp8Layer):
    """fp8 as vLLM and SGLang store it: one float32 scale per layer and tensor, 1.0 (`rule="one"`) or vLLM's
    `--calculate-kv-scales` at the first update (`rule="calculated"`: amax / 200 of the keys, amax / 100 of the values,
    `CALCULATED_RANGES`), then frozen; codes `states / scale` saturated at the format's largest value (vLLM's
    `scaled_fp8_conversion`, `__NV_SATFINITE`), e4m3 or e5m2 (`float8`). The store is transformers' `(codes, scale)`.
    """

    def __init__(self, rule: str = "one", float8: str = FLOAT8_FORMATS[0]) -> None:
        super().__init__()
        self.rule, self.float8 = rule, float8

    def _code(self, states: torch.Tensor, keys: bool, store: tuple | None) -> tuple:
        """`(codes, scale)` of `states` under the store's scale; the first update's under the rule's."""
        if store is None:
            return self._quantize(states, self._first_scale(states, CALCULATED_RANGES[0 if keys else 1]))
        return self._quantize(states, store[1])

    def _first_scale(self, states: torch.Tensor, calculated_range: float) -> torch.Tensor:
        """1.0, or vLLM's `torch.abs(states).max() / range` (floored at float32's smallest normal: an all-zero
        tensor gives no zero scale), as a float32 scalar tensor."""
        if self.rule == SCALES[2]:
            return torch.tensor(1.0, device=states.device)
        return (states.abs().amax().float() / calculated_range).clamp(min=torch.finfo(torch.float32).tiny)

    def _quantize(self, tensor, scale=None):
        """`(codes, scale)`: `tensor / scale` clamped to the format's range and rounded to it (`scale`: the store's)."""
        dtype = FLOAT8_DTYPES[self.float8]
        e4m3 = dtype == torch.float8_e4m3fn
        codes = self._written(tensor, scale) if e4m3 else None  # the writer saturates at +-448, as the clamp does
        if codes is None:
            top = torch.finfo(dtype).max
            codes = (tensor.float() / scale).clamp(-top, top).to(dtype)
            if e4m3:
                self._note_nan_codes(codes)  # a NaN state
        return codes, scale

    def _dequantize(self, qtensor):
        """e4m3 by bit placement (`ExactFp8Layer`); e5m2 by the library's arithmetic."""
        if self.float8 == FLOAT8_FORMATS[0]:
            return super()._dequantize(qtensor)
        codes, scale = qtensor
        return (codes.float() * scale).to(self.keys.dtype)

    _codes_of = ExactFp8Layer._codes_of  # e4m3 or e5m2 codes, beside this class's `_dequantize` (`code_reader`)


class SlidingFp8Layer(SlidingStoreWindow, ExactFp8Layer):
    """transformers' `Fp8QuantizedLayer` (de-quantizing by bit placement, `kvdemo.cache.formats.fp8.layers`) over the
    window: its update (scale frozen at the first update, new codes appended), then the last `sliding_window - 1`
    codes kept, a scale per token and head with its tokens (`kvdemo.cache.layers.sliding.SlidingStoreWindow`)."""


class SlidingPerTokenHeadFp8Layer(SlidingFp8Layer, PerTokenHeadFp8Layer):
    """`fp8,scale=per_token_head` over the window (`kvdemo.cache.formats.fp8.layers.PerTokenHeadFp8Layer`): the last
    `sliding_window - 1` codes kept with their scales."""


class SlidingEngineFp8Layer(SlidingFp8Layer, EngineFp8Layer):
    """`EngineFp8Layer` over the window (`SlidingFp8Layer`'s update keeps the last `sliding_window - 1` codes)."""

    def __init__(self, sliding_window: int, rule: str, float8: str) -> None:
        super().__init__(sliding_window)
        self.rule, self.float8 = rule, float8


def fp8_cache(
    config: PreTrainedConfig,
    sliding: str = SLIDING_CHOICES[0],
    protect: str = PROTECT_CHOICES[0],
    scale: str = SCALES[0],
    float8: str = FLOAT8_FORMATS[0],
) -> QuantizedCache:
    """transformers' `QuantizedCache("fp8", config)` built by layer kind (`kvdemo.cache.layers.by_kind`): each quantized
    layer an `ExactFp8Layer` (`scale=per_tensor`), a `PerTokenHeadFp8Layer` (`per_token_head`) or an `EngineFp8Layer`
    (`one`, `calculated`; e4m3 or e5m2), a sliding one over its window; the others as `sliding` and `protect` say.

    Raises:
        ValueError: `scale` is not one of `SCALES`, or `float8` not one of `FLOAT8_FORMATS`."""
    if scale not in SCALES or float8 not in FLOAT8_FORMATS:
        raise ValueError(f"scale={scale!r}, float8={float8!r}: scale is one of {', '.join(SCALES)}, float8 e4m3|e5m2")
    cache = library_cache("fp8", config)
    windows = sliding_windows(config)
    layers: list = list(cache.layers)
    for index in quantized_layers(config, sliding, protect):
        window = windows[index]
        if scale == SCALES[0]:
            layers[index] = ExactFp8Layer() if window is None else SlidingFp8Layer(window)
        elif scale == SCALES[1]:
            layers[index] = PerTokenHeadFp8Layer() if window is None else SlidingPerTokenHeadFp8Layer(window)
        else:
            layers[index] = (
                EngineFp8Layer(scale, float8) if window is None else SlidingEngineFp8Layer(window, scale, float8)
            )
    cache.layers = reading_blocks(layers, config)
    return with_kept_layers(cache, config, sliding, protect)
