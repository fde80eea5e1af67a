"""`dynamic`: transformers' `DynamicCache`, keys and values in the model's dtype, the full-precision baseline; with
`storage=growing`, kvdemo's `GrowingLayer` (`kvdemo.cache.layers.storage`).

Its folder: the card alone (its layers are transformers' and `kvdemo.cache.layers.storage`'s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import Deployment
from kvdemo.cache.options import Option, SpecOptions
from kvdemo.cache.policies import STORAGE_POLICIES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.model.geometry import KVGeometry

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""

DEFAULT_LINES = {
    "llama.cpp": "llama.cpp: the default f16 cache (no -ctk/-ctv)",
    "vllm": "vLLM: --kv-cache-dtype auto (the default)",
    "sglang": "SGLang: --kv-cache-dtype auto (the default)",
    "tensorrt-llm": 'TensorRT-LLM: KvCacheConfig(dtype="auto") (the default)',
    "transformers": "transformers: the default DynamicCache",
    "mlx-lm": "mlx-lm: the default cache (no --kv-bits)",
}
"""Each engine's full-precision cache, the `dynamic` baseline (in the engine's own dtype)."""


def full_precision_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """Every value in the model's dtype; with `storage=growing` (`kvdemo.cache.layers.storage.GrowingLayer`) the
    buffers' whole capacity, at most `capacity_bound(tokens)` tokens (an upper bound, reached right after a one-pass
    prefill; up to max(256 tokens, 12.5 %) above the tokens held). `nominal` counts the tokens held only."""
    from kvdemo.cache.layers.storage import capacity_bound

    held = capacity_bound(tokens) if opts.get("storage") == "growing" and not nominal else tokens
    # a sliding layer keeps its window, as transformers builds it under either storage
    return element * sum(
        layer.values_per_token * layer.tokens_held(held if layer.window is None else tokens) for layer in geo.per_layer
    )


def _cache(name: str, options: SpecOptions, config: PreTrainedConfig) -> Cache:
    """transformers' `DynamicCache(config=config)`, or its `GrowingLayer` form with `storage=growing`."""
    from kvdemo.cache.layers.storage import dynamic_cache

    return dynamic_cache(config, str(options.get("storage", STORAGE_POLICIES[0])))


def _deploy(backend: Backend, given: SpecOptions, resolved: SpecOptions, config: PreTrainedConfig):
    """Every engine's default cache, for transformers' storage (`concat`); kvdemo only for `growing`."""
    if resolved.get("storage", STORAGE_POLICIES[0]) != STORAGE_POLICIES[0]:
        return ()
    return tuple(Deployment(engine, line) for engine, line in DEFAULT_LINES.items())


BACKEND = Backend(
    NAME,
    "DynamicCache: keys and values in the model's dtype, the full-precision baseline",
    "No quantization and no residual: it never flushes. storage=concat (transformers') copies the whole cache "
    "into a new tensor at every decode step; storage=growing writes only the new token into spare capacity.",
    quantized=False,
    make_cache=_cache,
    kv_bytes=full_precision_bytes,
    options={
        "storage": Option(
            "storage",
            STORAGE_POLICIES[0],
            choices=STORAGE_POLICIES,
            help="concat: the whole cache copied each step (transformers); growing: in place, spare room counted",
        )
    },
    deploy=_deploy,
    examples={"baseline": {NAME: 0}, "needle": {NAME: 0}},
    reference="transformers' DynamicCache itself",
)
