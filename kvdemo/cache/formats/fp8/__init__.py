"""`fp8`: transformers' `QuantizedCache(backend="fp8")`, float8_e4m3 codes with one scale per tensor frozen at the first
update, or one per token and KV head (`scale=per_token_head`, vLLM's); no residual
(`kvdemo.cache.formats.fp8.layers`).

Its folder: the card (here) and its layers and cache (`layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import transformers_rule
from kvdemo.cache.options import PROTECT_OPTION, SLIDING_OPTION, Option
from kvdemo.cache.policies import FP8_SCALES, PROTECT_CHOICES, SLIDING_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.model.geometry import KVGeometry

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""


def fp8_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """One byte per value held (float8_e4m3; a sliding layer its window, `kvdemo.cache.layers.sliding`) plus one float32
    scale per layer and tensor (transformers' `Fp8QuantizedLayer`; kvdemo's de-quantization,
    `kvdemo.cache.formats.fp8.layers`, holds nothing more), or with `scale=per_token_head` one float32 scale per token
    held, head and tensor (`kvdemo.cache.formats.fp8.layers.PerTokenHeadFp8Layer`). `geo`: the quantized layers."""
    if opts.get("scale", "per_tensor") == "per_tensor":
        return geo.values_held(tokens) + 2 * len(geo.kv_layers) * 4
    scales = sum(4 * (layer.key_heads + layer.value_heads) * layer.tokens_held(tokens) for layer in geo.per_layer)
    return geo.values_held(tokens) + scales


def _cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """`kvdemo.cache.formats.fp8.layers.fp8_cache` of the spec's options: transformers' fp8 layers de-quantizing by
    bit placement (the same bits, the same store)."""
    from .layers import fp8_cache

    return fp8_cache(
        config,
        sliding=str(options.get("sliding", SLIDING_CHOICES[0])),
        protect=str(options.get("protect", PROTECT_CHOICES[0])),
        scale=str(options.get("scale", FP8_SCALES[0])),
    )


BACKEND = Backend(
    NAME,
    "QuantizedCache(backend='fp8'): float8_e4m3, one scale per tensor frozen at the first update (or one per "
    "token and head), no residual",
    "It appends every new token, with the scale frozen at the prefill (scale=per_tensor) or its own scales "
    "(scale=per_token_head): no residual, never flushes.",
    quantized=True,
    make_cache=_cache,
    kv_bytes=fp8_bytes,
    options={
        "sliding": SLIDING_OPTION,
        "protect": PROTECT_OPTION,
        "scale": Option(
            "scale",
            FP8_SCALES[0],
            choices=FP8_SCALES,
            help="per_tensor: one scale per layer and tensor, frozen at the first update (transformers'); "
            "per_token_head: one float32 scale per token and KV head (vLLM's dynamic per-token-head scales)",
            quiet=True,
        ),
    },
    deploy=transformers_rule,
    examples={"needle": {NAME: 4}},
)
