"""A quantized backend's cache built layer by layer from the model's layer kinds (`kvdemo.cache.model.layer_kinds`):
the layers the backend quantizes get its layer (`kvdemo.cache.layers.flush.quantized_cache` chooses which), every other
layer is the one transformers' `DynamicCache(config=...)` builds for its type (a `DynamicSlidingWindowLayer`, a
`LinearAttentionLayer` with its conv and recurrent states, a combined attention-and-Mamba layer, a `DummyLayer`).

transformers' `QuantizedCache` raises on any model that is not all full attention (PR #47160); the PR that would
have kept the sliding layers and quantized the others (#47828) was closed. kvdemo builds the library's own layers
with the library's own checks of the options (`QuantizedCache(backend, ...)` over a stand-in config of as many
full-attention layers) and sets the kept layers in their places. Pattern: vLLM and mlx-lm quantize the
full-attention layers of hybrid models only (vLLM's `kv_cache_dtype_skip_layers=sliding_window`, mlx-lm PR #495).
"""

from __future__ import annotations

from typing import TypeVar

from transformers import PreTrainedConfig, QuantizedCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from kvdemo.cache.model.layer_kinds import QUANTIZE, layer_actions

CacheT = TypeVar("CacheT", bound=Cache)


def library_cache(backend: str, config: PreTrainedConfig, **options) -> QuantizedCache:
    """`QuantizedCache(backend, ..., **options)` with one of the library's layers per decoder layer of `config`,
    whatever its kind (the caller replaces the ones it does not quantize: `with_kept_layers`).

    Raises:
        ValueError: the library's own refusal of an option (fp8 with a group-wise option, an unknown backend)."""
    layers = len(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])
    stand_in = PreTrainedConfig()
    stand_in.num_hidden_layers = layers
    stand_in.layer_types = ["full_attention"] * layers
    return QuantizedCache(backend, stand_in, **options)


def sliding_windows(config: PreTrainedConfig) -> list[int | None]:
    """Each decoder layer's `sliding_window` (a chunked layer's `attention_chunk_size`), None for the others, as
    transformers builds its layers."""
    _, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [extra.get("sliding_window") for extra in kwargs]


def with_kept_layers(cache: CacheT, config: PreTrainedConfig, sliding: str, protect: str = "0:0") -> CacheT:
    """`cache` with every layer the backend does not quantize (`LayerKind.action` is not `QUANTIZE`; a layer its
    `protect` keeps) replaced by transformers' own dynamic layer for its type, built with the same arguments as
    `DynamicCache(config=...)` builds it."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    actions = layer_actions(config, True, sliding, protect)
    cache.layers = [
        layer if action == QUANTIZE else DYNAMIC_LAYER_TYPE_MAPPING[kind](**extra)
        for layer, action, kind, extra in zip(cache.layers, actions, types, kwargs)
    ]
    return cache
