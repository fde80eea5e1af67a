"""`int8`: vLLM's `int8_per_token_head` KV cache: int8 codes with one float32 scale per token and KV head, every token
coded as it is written (no residual, never flushes), sliding-window layers too (`kvdemo.cache.formats.int8.layers`).

Its folder: the card (here) and the codes, layer and cache (`layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import Deployment, vllm_skip_layers
from kvdemo.cache.options import ENGINE_SLIDING_OPTION, PROTECT_OPTION
from kvdemo.cache.policies import PROTECT_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.model.geometry import KVGeometry

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""


def int8_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """Per quantized layer, token held (a sliding layer its window) and head: head_dim bytes and a float32 scale, for
    keys and values (vLLM's row of head_size + 4 bytes). No residual, no padding."""
    return sum(
        layer.tokens_held(tokens) * (layer.key_heads * (layer.key_dim + 4) + layer.value_heads * (layer.value_dim + 4))
        for layer in geo.per_layer
    )


def _deploy(backend: Backend, given, resolved, config: PreTrainedConfig) -> tuple[Deployment, ...]:
    """vLLM's line, its kept layers as `--kv-cache-dtype-skip-layers` (`kvdemo.cache.deploy.vllm_skip_layers`)."""
    return (Deployment("vllm", f"vLLM: --kv-cache-dtype int8_per_token_head{vllm_skip_layers(resolved, config)}"),)


def _cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """`kvdemo.cache.formats.int8.layers.int8_cache` of the spec's options."""
    from .layers import int8_cache

    sliding = str(options.get("sliding", BACKEND.options["sliding"].default))
    return int8_cache(config, sliding, str(options.get("protect", PROTECT_CHOICES[0])))


def _stored() -> dict[str, type]:
    """The int8 store (`kvdemo.cache.formats.int8.layers.Int8Store`)."""
    from .layers import Int8Store

    return {"Int8Store": Int8Store}


BACKEND = Backend(
    NAME,
    "vLLM's int8_per_token_head: int8 codes with one float32 scale per token and KV head (head_dim + 4 bytes a row)",
    "Every token is coded as it is written, with its own scale per head: no residual, never flushes. Sliding-window "
    "layers take the same codes, as vLLM stores them.",
    quantized=True,
    make_cache=_cache,
    kv_bytes=int8_bytes,
    options={
        "sliding": ENGINE_SLIDING_OPTION,
        "protect": PROTECT_OPTION,
    },
    compare_nbits=(),
    deploy=_deploy,
    stored=_stored,
    reference="vLLM's own reference, _quantize_per_token_head_ref, written out (tests/test_int8.py)",
)
