"""Quantized sliding-window layers (`sliding=quantize`): a quantized backend's own layer that keeps only the last
`sliding_window - 1` tokens, exactly as transformers' `DynamicSlidingWindowLayer` does, so attention sees the same
tokens under the same mask (`get_mask_sizes` is the sliding layer's own).

- Residual backends (quanto, hqq; `SlidingQuantizedMixin`): the store holds at most the window's last
  `sliding_window - 1` tokens, quantized at the prefill and at each flush by the library's own `_quantize`; new tokens
  wait in the full-precision residual, as in transformers' `QuantizedLayer`. An update returns the last
  `sliding_window - 1` cached tokens (de-quantized store, then residual) and the new ones: what the sliding layer
  returns. At a flush the window is re-quantized (a window is small: 511 tokens on Gemma 3), so `flush=append` does
  not apply to these layers. Between flushes the store may still hold up to `residual_length - 1` tokens that have
  left the window (never returned to attention): held bytes are at most (window + residual_length - 1) tokens.
- A format that codes every token as it comes into a record of per-token tensors and per-tensor scales (nvfp4, int8,
  fp8's `(codes, scale)` under transformers' frozen scale or a scale per token and head; `SlidingStoreWindow`): each
  update appends, then every per-token tensor of the store keeps its last `sliding_window - 1` tokens. A decode step
  that hands kvdemo's attention the store (`kvdemo.cache.layers.appended`) hands it the window before the cut: the
  last `sliding_window - 1` tokens and the new one, every one visible to the step, so the decode kernel reads them as
  a full layer's store.

All assign new tensors at every update, so the snapshot's `vars(layer).copy()` restores them exactly
(`kvdemo.cache.state.snapshot`). Pattern: llama.cpp quantizes its sliding-window (SWA) KV cache with the same
`-ctk`/`-ctv` types as the full one (`llama-kv-cache-iswa`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvdemo.cache.layers.blockwise import BLOCKS_MARK, StoreBlocks, blocks_of, code_reader, marked_tail
from kvdemo.cache.layers.rotation import LibraryLayer


class SlidingWindowMask:
    """The sliding-window mask sizes and length of transformers' `DynamicSlidingWindowLayer`, for a quantized
    layer that counts `cumulative_length` tokens and keeps `sliding_window - 1` of them."""

    is_sliding = True
    sliding_window: int
    cumulative_length: int

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask, as `DynamicSlidingWindowLayer.get_mask_sizes`."""
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        if self.cumulative_length >= self.sliding_window:
            return self.sliding_window - 1 + query_length, kv_offset
        return self.cumulative_length + query_length, kv_offset

    def get_max_length(self) -> int:
        """The most tokens attention reads from this layer (its window)."""
        return self.sliding_window


class SlidingQuantizedMixin(SlidingWindowMask, LibraryLayer):
    """`sliding=quantize` for a transformers `QuantizedLayer` subclass (and kvdemo's rotation and value-precision
    layers): see the module docstring. Built with `sliding_window` beside the library's own options.

    Attributes:
        reads_blocks: decode steps hand kvdemo's attention the window's part of the store and the residual
            (`_window_blocks`); set by the cache builder where the model attends through `kvdemo_attention`.
        _held: the tokens the store holds (its last re-coding's), an attribute the snapshot restores with the store;
            where it is missing, decode steps take the layer's own update.
    """

    reads_blocks = False
    _held = 0

    def __init__(self, *, sliding_window: int, **options) -> None:
        super().__init__(**options)
        self.sliding_window = sliding_window

    def _window_blocks(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A decode step (one new token, no flush) on the codes: the token appended to the residual, and (residual
        keys marked with the store's visible part, residual values) returned, or None where this step cannot be
        read so (the window would hide a residual token; the step is the layer's own `update` then). The store's
        first tokens past the window are skipped in place (`StoreBlocks.first`), no copy."""
        if "_held" not in vars(self):  # a store not counted here (a layer opened from an older session file)
            return None
        residual = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0
        hidden = max(0, self._held + residual + 1 - self.sliding_window)  # stored tokens that left the window
        if hidden > self._held or residual + 1 >= self.residual_length or self._pending_beam_idx is not None:
            return None
        assert self.keys is not None and self.values is not None  # set by the first update
        self.cumulative_length += 1
        self.keys = torch.cat([self.keys, key_states], dim=-2)  # new tensors: a snapshot holds the old ones
        self.values = torch.cat([self.values, value_states], dim=-2)
        codes = self._codes_of if code_reader(type(self)) else None  # type: ignore[attr-defined]
        stored = ([self._quantized_keys], [self._quantized_values]) if hidden < self._held else ([], [])
        blocks = StoreBlocks(*stored, self._dequantize, codes, self._held - hidden, hidden)  # type: ignore[attr-defined]
        keys = self.keys.view(self.keys.shape)  # a new tensor object: the mark never sticks to the stored residual
        setattr(keys, BLOCKS_MARK, blocks)
        return keys, self.values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' `QuantizedLayer.update` over the window.

        Args:
            key_states, value_states: the new tokens, [batch, kv_heads, new tokens, head_dim].

        Returns:
            (keys, values) to attend to: the last `sliding_window - 1` cached tokens and the new ones, as
            `DynamicSlidingWindowLayer.update` returns them (the prefill's first chunk: the new states as given).
        """
        keep = self.sliding_window - 1
        if self.reads_blocks and self.is_initialized and key_states.shape[-2] == 1 and key_states.is_cpu:
            read = self._window_blocks(key_states, value_states)
            if read is not None:
                return read
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._quantized_keys = self._quantize(key_states[..., -keep:, :].contiguous(), axis=self.axis_key)
            self._quantized_values = self._quantize(value_states[..., -keep:, :].contiguous(), axis=self.axis_value)
            self._held = min(keep, key_states.shape[-2])
            return key_states, value_states
        assert self.keys is not None and self.values is not None  # set by the first update
        residual = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        visible = keep + key_states.shape[-2]
        keys = torch.cat([self._dequantize(self._quantized_keys), self.keys, key_states], dim=-2)[..., -visible:, :]
        values = torch.cat([self._dequantize(self._quantized_values), self.values, value_states], dim=-2)
        values = values[..., -visible:, :]
        if residual + key_states.shape[-2] >= self.residual_length:  # a flush: the window quantized anew
            self._quantized_keys = self._quantize(keys[..., -keep:, :].contiguous(), axis=self.axis_key)
            self._quantized_values = self._quantize(values[..., -keep:, :].contiguous(), axis=self.axis_value)
            self._held = min(keep, keys.shape[-2])
            self.keys = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
            self.values = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return keys, values


_SLIDING_LAYERS: dict[type, type] = {}


def sliding_layer(layer_class: type) -> type:
    """`layer_class` (a `QuantizedLayer` subclass) with `SlidingQuantizedMixin` in front, built once per class
    (e.g. `SlidingRotatedQuantoLayer`): a subclass of `layer_class`."""
    if layer_class not in _SLIDING_LAYERS:
        name = "Sliding" + layer_class.__name__
        _SLIDING_LAYERS[layer_class] = type(name, (SlidingQuantizedMixin, layer_class), {"__module__": __name__})
    return _SLIDING_LAYERS[layer_class]


class SlidingStoreWindow(SlidingWindowMask):
    """`sliding=quantize` for a layer (after this mixin in the bases) whose `update` appends each new token's codes to
    `_quantized_keys` and `_quantized_values`, records (named tuples, or fp8's plain `(codes, scale)`) of per-token
    tensors ([..., tokens, x]) and per-tensor scalars (0-d): after the update, each per-token tensor keeps its last
    `sliding_window - 1` tokens (a compact copy, so the longer store is not pinned), as `DynamicSlidingWindowLayer`
    keeps its states. Built with `sliding_window` beside the layer's own options."""

    answer_block = False
    """One record, cut to the window at every update (`kvdemo.cache.layers.appended.AppendedLayer`)."""

    def __init__(self, sliding_window: int, **options) -> None:
        super().__init__(**options)
        self.sliding_window = sliding_window

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's update, then the window kept; returns what `DynamicSlidingWindowLayer.update` returns (the
        first update: the new states as given; later: the last `sliding_window - 1` cached tokens and the new ones),
        de-quantized. States are [batch, kv_heads, tokens, head_dim]."""
        keep, first = self.sliding_window - 1, not self.is_initialized  # type: ignore[attr-defined]
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # type: ignore[misc]
        self._quantized_keys, self._quantized_values = (
            _window(store, keep)
            for store in (self._quantized_keys, self._quantized_values)  # type: ignore[has-type]
        )
        if first:
            return keys, values
        blocks = blocks_of(keys)
        if blocks is not None:  # a decode step handing attention its store: the window before the cut, all visible
            record: tuple = blocks.keys[0]  # type: ignore[assignment]  # this mixin's layers hold records
            held = next(t.shape[-2] for t in record if t.dim())
            return marked_tail(key_states, replace(blocks, tokens=held))
        visible = keep + key_states.shape[-2]
        return keys[..., -visible:, :], values[..., -visible:, :]


def _window(store, keep: int):
    """`store` (a record or a plain tuple of per-token tensors [..., tokens, x] and per-tensor scalars) with each
    per-token tensor cut to its last `keep` tokens (a compact copy, so the longer one is not pinned)."""
    kept = [t[..., -keep:, :].clone() if t.dim() and t.shape[-2] > keep else t for t in store]
    return type(store)(*kept) if hasattr(store, "_fields") else tuple(kept)
