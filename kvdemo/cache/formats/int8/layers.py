"""The `int8` format's codes and layer: vLLM's `int8_per_token_head` cache, one float32 scale per token and KV head
and int8 codes, every token coded as it is written (no residual, never flushes), over a sliding window where the layer
has one, and the cache of them.

The arithmetic is vLLM's own reference for its cache (`_quantize_per_token_head_ref` in
tests/quantization/test_per_token_kv_cache.py, vllm#38378): `scale = max(amax over head_dim / 127, 1e-6)` in float32,
codes `round(states * (1 / scale))` clamped to [-128, 127] (round: half to even, `torch.round`); a value reads back as
`code * scale`. That test checks vLLM's Triton kernel against the reference within 0.1, not bit for bit, and notes
that the kernel's int8 stores truncate: where a deployment's bytes differ from kvdemo's, it is by that rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from kvdemo.cache.layers.appended import AppendedLayer, reading_blocks
from kvdemo.cache.layers.by_kind import sliding_windows, with_kept_layers
from kvdemo.cache.layers.float8 import ROW_INT8, write_codes
from kvdemo.cache.layers.sliding import SlidingStoreWindow
from kvdemo.cache.model.layer_kinds import quantized_layers
from kvdemo.cache.read.code_attention import StoreCodes, scaled_codes

INT8_MAX = 127.0
"""The scale's divisor (vLLM's `quant_max`); codes are clamped to [-128, 127]."""

SCALE_FLOOR = 1e-6
"""vLLM's floor on a scale, so an all-zero token and head gives codes 0."""


class Int8Store(NamedTuple):
    """One tensor's store: `codes` [batch, kv_heads, tokens, head_dim] int8 and `scales` [batch, kv_heads, tokens, 1]
    float32 (head_dim + 4 bytes a token and head: vLLM's row with its scale inline)."""

    codes: torch.Tensor
    scales: torch.Tensor


def quantize_int8(states: torch.Tensor) -> Int8Store:
    """`states` ([batch, kv_heads, tokens, head_dim], any float dtype) as vLLM's int8 per token and head (module
    docstring)."""
    written = write_codes(ROW_INT8, states)  # one C pass, the same bytes (`kvdemo.cache.layers.row_codes.c`)
    if written is not None and written.scales is not None:
        return Int8Store(written.codes, written.scales)
    scales = (states.float().abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=SCALE_FLOOR)
    codes = torch.round(states.float() * (1.0 / scales)).clamp(-128, 127).to(torch.int8)
    return Int8Store(codes, scales)


def dequantize_int8(store: Int8Store, dtype: torch.dtype) -> torch.Tensor:
    """`codes * scale` in float32, rounded once to `dtype`: [batch, kv_heads, tokens, head_dim]."""
    return (store.codes.float() * store.scales).to(dtype)


class Int8Layer(AppendedLayer):
    """One decoder layer's keys and values as `Int8Store`s, each token coded as it is written
    (`kvdemo.cache.layers.appended`)."""

    def _code(self, states: torch.Tensor, keys: bool, store: Int8Store | None) -> Int8Store:
        return quantize_int8(states)

    def _dequantize(self, q_tensor: Int8Store) -> torch.Tensor:
        assert self.keys is not None  # set by the first update
        return dequantize_int8(q_tensor, self.keys.dtype)

    def _codes_of(self, q_tensor: Int8Store) -> StoreCodes | None:
        """The store as the decode kernel reads it: `codes.float() * scales`."""
        return scaled_codes(q_tensor.codes, row_scale=q_tensor.scales)


class SlidingInt8Layer(SlidingStoreWindow, Int8Layer):
    """`Int8Layer` over a sliding window (`kvdemo.cache.layers.sliding.SlidingStoreWindow`)."""


def int8_cache(config: PreTrainedConfig, sliding: str, protect: str) -> Cache:
    """A transformers `Cache` whose quantized layers (`kvdemo.cache.model.layer_kinds`: `sliding`, `protect`) are
    `Int8Layer`s, a sliding one over its window; the others as `DynamicCache(config=...)` builds them."""
    windows = sliding_windows(config)
    layers: list = [None] * len(windows)  # the layers kept at full precision: `with_kept_layers`
    for index in quantized_layers(config, sliding, protect):
        window = windows[index]
        layers[index] = Int8Layer() if window is None else SlidingInt8Layer(sliding_window=window)
    return with_kept_layers(Cache(layers=reading_blocks(layers, config)), config, sliding, protect)
