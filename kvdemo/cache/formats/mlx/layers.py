"""The `mlx` format's layer: mlx-lm's `KVCache` that becomes a `QuantizedKVCache` (`to_quantized`) once it holds
`quantized_kv_start` tokens, and the cache of them.

mlx-lm (`mlx_lm/generate.py`, `maybe_quantize_kv_cache`, mlx-lm 0.32.2) checks after each forward pass, the prefill's
chunks included, whether a layer's cache holds at least `quantized_kv_start` tokens; if so it quantizes everything it
holds at once (`mx.quantize` of the keys and of the values) and from then on quantizes each new token as it is written
(`QuantizedKVCache.update_and_fetch`), and attention reads the codes. The layer here does the same at the end of the
update that reaches the start: that update's own attention still reads full precision, as mlx-lm's forward pass did
before it converted.

kvdemo's prefill attends in full precision and hands the whole context over in one update per layer
(`kvdemo.qa.prefill.hand_over`), so the context is quantized at once and the question and answer read the codes: what
mlx-lm does with a prompt within one `--prefill-step-size` chunk (2048 tokens by default; its prompt's last token is
its first read of the codes). Over longer prompts mlx-lm's later chunks attend through the codes of the earlier ones,
so its store depends on the chunk size; kvdemo's does not (the chunked prefill builds the cache of one pass,
docs/DESIGN.md). mlx-lm's rotating cache (sliding-window layers) cannot be quantized ("RotatingKVCache Quantization
NYI"): those layers stay at full precision.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import BaseQuantizedLayer, Cache

from kvdemo.cache.layers.by_kind import sliding_windows, with_kept_layers
from kvdemo.cache.model.layer_kinds import quantized_layers
from kvdemo.cache.policies import PROTECT_CHOICES, SLIDING_CHOICES

from .affine import AffineStore, dequantize_affine, quantize_affine


class MlxLayer(BaseQuantizedLayer):
    """One decoder layer's keys and values as mlx-lm holds them (see the module docstring).

    Attributes:
        bits, group_size: `--kv-bits`, `--kv-group-size`; start: `--quantized-kv-start`.
        keys, values: the full-precision tokens before the conversion (then empty).
        _quantized_keys, _quantized_values: an `AffineStore` each after it, else None.
    """

    def __init__(self, bits: int, group_size: int, start: int) -> None:
        super().__init__()
        self.bits, self.group_size, self.start = bits, group_size, start

    def _quantize(self, tensor: torch.Tensor) -> AffineStore:
        return quantize_affine(tensor, self.bits, self.group_size)

    def _dequantize(self, q_tensor: AffineStore) -> torch.Tensor:
        """The store read back, [batch, kv_heads, tokens, head_dim] of the model's dtype."""
        assert self.keys is not None  # set by the first update
        return dequantize_affine(q_tensor, self.bits, self.group_size, self.keys.dtype)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Before the conversion: append in full precision and return every token (converting at the end once the
        layer holds `start` tokens); after it: code the new tokens, append, and return every token read back. States
        are [batch, kv_heads, tokens, head_dim]."""
        self.cumulative_length += key_states.shape[-2]
        if self._quantized_keys is None:
            keys, values = super().update(key_states, value_states)  # DynamicLayer's: a torch.cat of the tokens
            if self.cumulative_length >= self.start:  # `to_quantized`: everything held, at once
                self._quantized_keys, self._quantized_values = self._quantize(keys), self._quantize(values)
                self.keys, self.values = keys[..., :0, :].clone(), values[..., :0, :].clone()
            return keys, values
        stores = []
        for store, states in ((self._quantized_keys, key_states), (self._quantized_values, value_states)):
            new = self._quantize(states)
            stores.append(AffineStore(*(torch.cat([a, b], dim=-2) for a, b in zip(store, new))))
        self._quantized_keys, self._quantized_values = stores
        return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)


def mlx_cache(config: PreTrainedConfig, bits: int, group_size: int, start: int) -> Cache:
    """A transformers `Cache` whose full-attention layers are `MlxLayer`s, the others (sliding windows: mlx-lm's
    rotating cache; linear attention, conv) as `DynamicCache(config=...)` builds them."""
    keep, none = SLIDING_CHOICES[0], PROTECT_CHOICES[0]
    layers: list = [None] * len(sliding_windows(config))  # the layers kept at full precision: `with_kept_layers`
    for index in quantized_layers(config, keep, none):
        layers[index] = MlxLayer(bits, group_size, start)
    return with_kept_layers(Cache(layers=layers), config, keep, none)
