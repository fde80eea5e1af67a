"""The KV cache's geometry, read from a model's config layer by layer: the bottom layer that the registry, the
telemetry and the session share. Nothing here knows a backend.

Each layer's own head count and head_dim come from transformers' per-layer config (`config.per_layer_config`:
Gemma 4's full-attention layers have another head_dim and head count than its sliding ones), what each layer
holds from its kind (`kvdemo.cache.model.layer_kinds`): a KV-shared or recurrent layer holds no keys and values, a
sliding layer at most its window, and a latent (MLA) layer stores the latent and the rotary key part, one "head"
each, not the attention's heads.

The one full-precision formula lives here (`full_precision_bytes`): what a `DynamicCache` in the model's
dtype holds, the reference every quantized figure is set against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig

from kvdemo.cache.model.layer_kinds import KEEP, LAYER_KINDS, QUANTIZE, is_latent, layer_actions, layer_types


@dataclass(frozen=True)
class LayerGeometry:
    """What one cache layer stores per token.

    Attributes:
        kind: transformers' layer type (`full_attention`, `sliding_attention`, `linear_attention`, `dummy`, ...).
        key_heads, key_dim: the stored keys' heads and width (`num_key_value_heads`, `head_dim`; for a latent
            layer 1 and `kv_lora_rank`); 0 where the layer stores none.
        value_heads, value_dim: the same for the stored values (for a latent layer 1 and `qk_rope_head_dim`).
        window: for a sliding layer, the most tokens it keeps (`sliding_window - 1`, as
            `DynamicSlidingWindowLayer` keeps them between steps); None for a layer that keeps every token.
    """

    kind: str
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    window: int | None = None

    @property
    def values_per_token(self) -> int:
        """Keys and values stored per token: key_heads x key_dim + value_heads x value_dim."""
        return self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def tokens_held(self, tokens: int) -> int:
        """Tokens this layer holds when the cache holds `tokens` (its window at most)."""
        return tokens if self.window is None else min(tokens, self.window)


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one sequence's KV cache, layer by layer.

    Attributes:
        per_layer: one `LayerGeometry` per decoder layer (one cache layer each).
    """

    per_layer: tuple[LayerGeometry, ...]

    @property
    def layers(self) -> int:
        """Decoder layers (one cache layer each, a layer that holds nothing included)."""
        return len(self.per_layer)

    @property
    def kv_layers(self) -> tuple[LayerGeometry, ...]:
        """The layers that store keys and values."""
        return tuple(layer for layer in self.per_layer if layer.values_per_token)

    @property
    def values_per_token(self) -> int:
        """Keys and values of one token over all layers that keep every token (for a model with full-attention
        layers alone: 2 x layers x kv_heads x head_dim)."""
        return sum(layer.values_per_token for layer in self.per_layer)

    def values_held(self, tokens: int) -> int:
        """Keys and values held over all layers when the cache holds `tokens` tokens (sliding layers their window)."""
        return sum(layer.values_per_token * layer.tokens_held(tokens) for layer in self.per_layer)

    def shapes(self, tensor: str) -> list[tuple[int, int]]:
        """The distinct stored (heads, width) of `tensor` (`keys` or `values`) over the layers that store it,
        ascending."""
        pairs = (
            (lay.key_heads, lay.key_dim) if tensor == "keys" else (lay.value_heads, lay.value_dim)
            for lay in self.kv_layers
        )
        return sorted(set(pairs))

    @property
    def kv_heads(self) -> int:
        """The keys' head count when every layer stores the same (else the largest)."""
        return max(heads for heads, _ in self.shapes("keys"))

    @property
    def head_dim(self) -> int:
        """The keys' width when every layer stores the same (else the largest)."""
        return max(dim for _, dim in self.shapes("keys"))


def _layer(kind: str, layer_config: PreTrainedConfig, window: int | None, latent: bool) -> LayerGeometry:
    """One layer's `LayerGeometry` from its own config."""
    if not LAYER_KINDS.get(kind, LAYER_KINDS["full_attention"]).holds_kv:
        return LayerGeometry(kind, 0, 0, 0, 0)
    if latent:
        return LayerGeometry(kind, 1, layer_config.kv_lora_rank, 1, layer_config.qk_rope_head_dim)
    heads = layer_config.num_attention_heads
    kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
    head_dim = getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads
    return LayerGeometry(kind, kv_heads, head_dim, kv_heads, head_dim, None if window is None else window - 1)


def kv_geometry(model_config: PreTrainedConfig) -> KVGeometry:
    """The `KVGeometry` of the model's decoder, layer by layer: each layer's kind (`layer_kinds.layer_types`), its
    own `num_key_value_heads` and `head_dim` (`head_dim` falling back to hidden_size / num_attention_heads, as
    transformers' Llama does), its window, and for a latent (MLA) model the stored latent's widths."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = model_config.get_text_config(decoder=True)
    _, kwargs = get_layer_types_and_kwargs(cfg)
    latent = is_latent(model_config)
    return KVGeometry(
        tuple(
            _layer(kind, layer_config, extra.get("sliding_window"), latent)
            for kind, layer_config, extra in zip(layer_types(model_config), cfg.per_layer_config, kwargs)
        )
    )


def split_geometry(model_config: PreTrainedConfig, sliding: str, protect: str = "0:0") -> tuple[KVGeometry, KVGeometry]:
    """(quantized, kept): the layers a quantized backend stores quantized and the layers it keeps at full precision
    (`kvdemo.cache.model.layer_kinds.layer_actions` with the spec's `sliding` and `protect`); layers that hold nothing
    in neither."""
    geo, actions = kv_geometry(model_config), layer_actions(model_config, True, sliding, protect)
    return (
        KVGeometry(tuple(layer for layer, action in zip(geo.per_layer, actions) if action == QUANTIZE)),
        KVGeometry(tuple(layer for layer, action in zip(geo.per_layer, actions) if action == KEEP)),
    )


SHARE_TOKENS = (2048, 8192, 32768)
"""The context lengths at which `kinds_summary` gives the share a quantized backend shrinks (tokens)."""


def kinds_summary(model_config: PreTrainedConfig) -> dict[str, object]:
    """What a quantized backend does with the model's cache, by layer kind (`describe()`, the status line, the
    command line): `quantized` and `kept` (layer kinds and counts, `sliding=keep`), the window of the kept sliding
    layers (tokens, None without), and `quantized_share`: {tokens: the share of a full-precision cache's values
    held at that context by the layers the backend quantizes} at `SHARE_TOKENS` (a sliding layer stops growing at
    its window, so the share grows with the context; 1.0 for a model of full-attention layers alone)."""
    from kvdemo.cache.model.layer_kinds import kinds_text

    quantized, kept = split_geometry(model_config, "keep")
    geo = kv_geometry(model_config)
    windows = sorted({layer.window for layer in kept.per_layer if layer.window is not None})
    return {
        "quantized": kinds_text([layer.kind for layer in quantized.per_layer]) if quantized.layers else "none",
        "kept": kinds_text([layer.kind for layer in kept.per_layer]) if kept.layers else "none",
        "window_tokens": windows[-1] if windows else None,
        "quantized_share": {
            tokens: round(quantized.values_held(tokens) / max(geo.values_held(tokens), 1), 4) for tokens in SHARE_TOKENS
        },
    }


def kv_shape(model_config: PreTrainedConfig) -> tuple[int, int]:
    """(num_key_value_heads, head_dim) of the keys the model's layers store (the largest where layers differ)."""
    geo = kv_geometry(model_config)
    return geo.kv_heads, geo.head_dim


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (4 for float32, 2 for bfloat16)."""
    return torch.empty((), dtype=dtype).element_size()


def full_precision_bytes(model_config: PreTrainedConfig, tokens: int, dtype: torch.dtype) -> int:
    """Bytes a `DynamicCache` in `dtype` holds for `tokens` tokens of one sequence: the keys and values every layer
    holds (`KVGeometry.values_held`: each layer's own heads and widths, a sliding layer its window at most) x bytes
    per element. Recurrent states are not counted (they do not grow with the context).

    Example:
        >>> full_precision_bytes(config, 1000, torch.float32)  # SmolLM2-135M: 30 layers, 3 KV heads, 64
        46080000
    """
    return kv_geometry(model_config).values_held(tokens) * element_size(dtype)


MIN_HADAMARD_BLOCK = 8
"""The smallest Hadamard block a rotation takes: a head_dim whose largest power-of-two divisor is below it (an odd
one, 4 x an odd one) is refused, since a rotation within blocks of 2 or 4 channels barely spreads an outlier."""


def hadamard_block(head_dim: int) -> int:
    """The size of the Hadamard blocks that rotate a `head_dim`: head_dim itself when it is a power of two, else the
    largest power of two that divides it (32 for 96 = 3 x 32, 16 for 80 = 5 x 16, 64 for 192 = 3 x 64)."""
    return head_dim & -head_dim if head_dim > 0 else 0


def rotation_problem(head_dim: int) -> str | None:
    """Why `rotation=hadamard` cannot run for this head_dim (its power-of-two block, `hadamard_block`, is below
    `MIN_HADAMARD_BLOCK`), or None."""
    if hadamard_block(head_dim) < MIN_HADAMARD_BLOCK:
        return (
            f"rotation=hadamard needs head_dim to be a multiple of {MIN_HADAMARD_BLOCK} (this model's is {head_dim}: "
            "its largest power-of-two block is too small to spread an outlier); use rotation=none"
        )
    return None
