"""The `nvfp4` format's layers: NVFP4 blocks for keys and values (or float8 keys, `fp8_k_nvfp4_v`), every token coded
as it is written (no residual, never flushes), over a sliding window where the layer has one, and the cache of them.

The prefill attends in full precision and hands the whole context over in one update per layer
(`kvdemo.qa.prefill.hand_over`), which sets each tensor's scale (`tensor_scale=one`: 1.0; `prefill`: from that
update's amax) and codes it; each decode step codes its new token under the same tensor scale, with its own block
scales, and appends it (`kvdemo.cache.layers.appended`), as the engines write a token into their paged cache
(`kvdemo.cache.formats.nvfp4.blocks`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from kvdemo.cache.layers.appended import AppendedLayer, reading_blocks
from kvdemo.cache.layers.by_kind import sliding_windows, with_kept_layers
from kvdemo.cache.layers.sliding import SlidingStoreWindow
from kvdemo.cache.model.layer_kinds import quantized_layers
from kvdemo.cache.read.code_attention import StoreCodes, scaled_codes

from . import BLOCK_RULES, KEY_FORMATS, TENSOR_SCALES
from .blocks import (
    E2M1_VALUES,
    Fp8Store,
    Nvfp4Store,
    amax_scale,
    dequantize_fp8,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_nvfp4,
)

Store = Nvfp4Store | Fp8Store


class Nvfp4Layer(AppendedLayer):
    """One decoder layer's keys and values as NVFP4 blocks (see the module docstring).

    Attributes:
        key_format, block_rule, tensor_rule: the card's `KEY_FORMATS`, `BLOCK_RULES`, `TENSOR_SCALES` words
            (`kvdemo.cache.formats.nvfp4`).
        _quantized_keys, _quantized_values: an `Nvfp4Store` each (the keys an `Fp8Store` with `key_format=e4m3`).
    """

    def __init__(
        self, key_format: str = KEY_FORMATS[0], block_rule: str = BLOCK_RULES[0], tensor_rule: str = TENSOR_SCALES[0]
    ):
        super().__init__()
        self.key_format, self.block_rule, self.tensor_rule = key_format, block_rule, tensor_rule

    def _code(self, states: torch.Tensor, keys: bool, store: Store | None) -> Store:
        """`states` ([batch, kv_heads, tokens, head_dim]) coded as this layer stores keys (`keys`) or values, under the
        store's tensor scale or, at the first update, the one `tensor_rule` gives."""
        fp8 = keys and self.key_format == KEY_FORMATS[1]
        if store is not None:
            scale = store.tensor_scale
        elif self.tensor_rule == TENSOR_SCALES[0]:
            scale = torch.tensor(1.0, device=states.device)
        else:
            scale = amax_scale(states, fp8)
        return quantize_fp8(states, scale) if fp8 else quantize_nvfp4(states, scale, self.block_rule)

    def _dequantize(self, q_tensor: Store) -> torch.Tensor:
        """The store read back, [batch, kv_heads, tokens, head_dim] of the model's dtype."""
        assert self.keys is not None  # set by the first update
        if isinstance(q_tensor, Fp8Store):
            return dequantize_fp8(q_tensor, self.keys.dtype)
        return dequantize_nvfp4(q_tensor, self.keys.dtype)

    def _codes_of(self, q_tensor: Store) -> StoreCodes | None:
        """The store as the decode kernel reads it: `E2M1[code] * (block_scale * tensor_scale)`, or the float8
        keys' `codes * tensor_scale`."""
        if isinstance(q_tensor, Fp8Store):
            return scaled_codes(q_tensor.codes, tensor_scale=q_tensor.tensor_scale)
        return scaled_codes(
            q_tensor.codes, E2M1_VALUES, tensor_scale=q_tensor.tensor_scale, block_scales=q_tensor.block_scales
        )


class SlidingNvfp4Layer(SlidingStoreWindow, Nvfp4Layer):
    """`Nvfp4Layer` over a sliding window (`kvdemo.cache.layers.sliding.SlidingStoreWindow`)."""


def nvfp4_cache(
    config: PreTrainedConfig,
    keys: str = KEY_FORMATS[0],
    block_rule: str = BLOCK_RULES[0],
    tensor_scale: str = TENSOR_SCALES[0],
    sliding: str = "quantize",
    protect: str = "0:0",
) -> Cache:
    """A transformers `Cache` whose quantized layers (`kvdemo.cache.model.layer_kinds`: `sliding`, `protect`) are
    `Nvfp4Layer`s, a sliding one over its window; the others as `DynamicCache(config=...)` builds them.

    Raises:
        ValueError: an option's word is not one it takes."""
    given = (
        ("keys", keys, KEY_FORMATS),
        ("block_rule", block_rule, BLOCK_RULES),
        ("tensor_scale", tensor_scale, TENSOR_SCALES),
    )
    for name, word, words in given:
        if word not in words:
            raise ValueError(f"{name}={word!r} is not one of {', '.join(words)}")
    windows = sliding_windows(config)
    options = {"key_format": keys, "block_rule": block_rule, "tensor_rule": tensor_scale}
    layers: list = [None] * len(windows)  # the layers kept at full precision: `with_kept_layers`
    for index in quantized_layers(config, sliding, protect):
        window = windows[index]
        layers[index] = Nvfp4Layer(**options) if window is None else SlidingNvfp4Layer(sliding_window=window, **options)
    return with_kept_layers(Cache(layers=reading_blocks(layers, config)), config, sliding, protect)
