"""The `fp8` format's layers: transformers' `Fp8QuantizedLayer` de-quantizing by bit placement (`ExactFp8Layer`, the
arithmetic and its measure in `kvdemo.cache.layers.float8`), its per-token-head variant, both over a sliding window,
and the cache of them (`fp8_cache`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig, QuantizedCache
from transformers.cache_utils import Fp8QuantizedLayer

from kvdemo.cache.layers.by_kind import library_cache, sliding_windows, with_kept_layers
from kvdemo.cache.layers.float8 import (
    E4M3_TO_FLOAT32_FACTOR,
    dequantize_e4m3,
    dequantize_per_token_head,
    has_nan_codes,
    placeable,
    quantize_per_token_head,
)
from kvdemo.cache.layers.sliding import SlidingWindowMask
from kvdemo.cache.model.layer_kinds import quantized_layers
from kvdemo.cache.policies import FP8_SCALES, PROTECT_CHOICES, SLIDING_CHOICES


class ExactFp8Layer(Fp8QuantizedLayer):
    """transformers' `Fp8QuantizedLayer` de-quantizing by bit placement (see the module docstring).

    Attributes:
        _nan_codes: whether a NaN code may be in the store (set by `_quantize` when it makes one; an attribute of
            the layer, so `kvdemo.cache.state.snapshot.restore` puts it back with the store it describes).
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


class SlidingFp8Layer(SlidingWindowMask, ExactFp8Layer):
    """transformers' `Fp8QuantizedLayer` (de-quantizing by bit placement, `kvdemo.cache.formats.fp8.layers`) over the
    window."""

    def __init__(self, sliding_window: int) -> None:
        super().__init__()
        self.sliding_window = sliding_window

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' fp8 update (scale frozen at the first update, new codes appended) keeping the last
        `sliding_window - 1` codes; returns what `DynamicSlidingWindowLayer.update` returns, de-quantized (the
        prefill's first chunk: the new states as given)."""
        keep = self.sliding_window - 1
        first = not self.is_initialized
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        stores = []
        for store in (self._quantized_keys, self._quantized_values):
            codes, scale = store
            if codes.shape[-2] > keep:
                codes = codes[..., -keep:, :].clone()  # compact: the longer codes are not pinned
                if scale.dim() == codes.dim():  # a scale per token and head: kept with its tokens
                    scale = scale[..., -keep:, :].clone()
            stores.append((codes, scale))
        self._quantized_keys, self._quantized_values = stores
        if first:
            return keys, values
        visible = keep + key_states.shape[-2]
        return keys[..., -visible:, :], values[..., -visible:, :]


class SlidingPerTokenHeadFp8Layer(SlidingFp8Layer, PerTokenHeadFp8Layer):
    """`fp8,scale=per_token_head` over the window (`kvdemo.cache.formats.fp8.layers.PerTokenHeadFp8Layer`): the last
    `sliding_window - 1` codes kept with their scales."""


def fp8_cache(
    config: PreTrainedConfig,
    sliding: str = SLIDING_CHOICES[0],
    protect: str = PROTECT_CHOICES[0],
    scale: str = FP8_SCALES[0],
) -> QuantizedCache:
    """transformers' `QuantizedCache("fp8", config)` built by layer kind (`kvdemo.cache.layers.by_kind`): each quantized
    layer an `ExactFp8Layer` (`scale=per_tensor`) or a `PerTokenHeadFp8Layer` (`per_token_head`), a sliding one over
    its window; the others as `sliding` and `protect` say.

    Raises:
        ValueError: `scale` is not one of `FP8_SCALES`."""
    if scale not in FP8_SCALES:
        raise ValueError(f"scale={scale!r} is not one of {', '.join(FP8_SCALES)}")
    cache = library_cache("fp8", config)
    windows, per_tensor = sliding_windows(config), scale == FP8_SCALES[0]
    layers: list = list(cache.layers)
    for index in quantized_layers(config, sliding, protect):
        window = windows[index]
        if per_tensor:
            layers[index] = ExactFp8Layer() if window is None else SlidingFp8Layer(window)
        else:
            layers[index] = PerTokenHeadFp8Layer() if window is None else SlidingPerTokenHeadFp8Layer(window)
    cache.layers = layers
    return with_kept_layers(cache, config, sliding, protect)
