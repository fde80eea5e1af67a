"""The KV cache's geometry, read from a model's config: the bottom layer that the registry, the telemetry
and the session share. Nothing here knows a backend.

The one full-precision formula lives here (`full_precision_bytes`): what a `DynamicCache` in the model's
dtype holds, the reference every quantized figure is set against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one sequence's KV cache.

    Attributes:
        layers: decoder layers (one cache layer each).
        kv_heads: `num_key_value_heads`.
        head_dim: values per head and token.
    """

    layers: int
    kv_heads: int
    head_dim: int

    @property
    def values_per_token(self) -> int:
        """Keys and values of one token over all layers: 2 x layers x kv_heads x head_dim."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def kv_shape(model_config: PreTrainedConfig) -> tuple[int, int]:
    """(num_key_value_heads, head_dim) of the model's decoder, as its attention layers cache them
    (`head_dim` falls back to hidden_size / num_attention_heads, as transformers' Llama does)."""
    cfg = model_config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kv_heads, head_dim


def kv_geometry(model_config: PreTrainedConfig) -> KVGeometry:
    """The `KVGeometry` of the model's decoder."""
    kv_heads, head_dim = kv_shape(model_config)
    return KVGeometry(model_config.get_text_config(decoder=True).num_hidden_layers, kv_heads, head_dim)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (4 for float32, 2 for bfloat16)."""
    return torch.empty((), dtype=dtype).element_size()


def full_precision_bytes(model_config: PreTrainedConfig, tokens: int, dtype: torch.dtype) -> int:
    """Bytes a `DynamicCache` in `dtype` holds for `tokens` tokens of one sequence:
    2 (keys and values) x layers x num_key_value_heads x head_dim x tokens x bytes per element.

    Example:
        >>> full_precision_bytes(config, 1000, torch.float32)  # SmolLM2-135M: 30 layers, 3 KV heads, 64
        46080000
    """
    return kv_geometry(model_config).values_per_token * tokens * element_size(dtype)
