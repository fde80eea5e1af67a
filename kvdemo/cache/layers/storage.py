"""A `DynamicLayer` whose storage grows geometrically, so that a decode step writes only its own token.

transformers' `DynamicLayer.update` appends with `torch.cat([self.keys, key_states], dim=-2)`: every decode step
allocates a new tensor and copies the whole cache into it, O(context) bytes written per token (for the embedded
model 46 KB per token of context: about 100 MB per step at 2k tokens, keys and values together). `GrowingLayer`
keeps each of keys and values in a buffer with spare capacity along the sequence axis and writes new tokens into
it in place (`buffer[..., length:length + n, :].copy_(key_states)`); `keys` and `values` are views of the filled
length (`buffer[..., :length, :]`), so transformers' attention, `get_seq_length`, `get_mask_sizes` and `crop` read
them as they read a `DynamicLayer`'s tensors. When a write does not fit, the buffer is replaced by a bigger one
(`grown_capacity`): the only copy of the cache, amortised over the tokens that fill the new room.

Growth factor 1.125 with at least `MIN_HEADROOM` tokens of room (why not x2 or x1.5): this is a demo of KV memory,
and the spare capacity is real memory that `kvdemo.cache.state.telemetry.kv_memory` counts (the view's storage is
counted whole), so it must stay small against the cache: at most 1/9 of the storage (11%) with x1.125, where x2 would
let the baseline hold up to twice its keys and values. The price is amortised copying of 1/(1.125 - 1) = 8 tokens
per token appended, against the whole context per token with `torch.cat`; and since the context is prefilled once
and each answer is restored away, the room left after the prefill (at least 256 tokens, 12.5% of the context)
usually holds every answer: the buffer is then never reallocated after the prefill.

Restore (docs/DESIGN.md, invariant 3, the in-place clause): decode steps write only at positions >= the post-prefill
length, so the prefix's bytes are never written after the prefill; `kvdemo.cache.state.snapshot.restore` assigns
`layer.keys = layer.keys[..., :length, :]`, which this layer reads as "set the length back" (a view of its own
buffer from position 0), copy-free. Assigning any other tensor (transformers' `reset`, `batch_select_indices`,
`batch_repeat_interleave`) makes it the new buffer, filled to its length.

The page, the command line and the tests' matrix reach it as the `dynamic` backend's option `storage=growing`
(`dynamic,storage=growing`; `kvdemo.cache.registry`); `storage=concat`, transformers' own layer, stays the default. Its
byte formula plans for the most capacity a cache can have reached (`capacity_bound`).

Source of the pattern: a dynamic array with geometric growth (amortised O(1) append, Cormen et al.,
"Introduction to Algorithms", 17.4), as llama.cpp's and vLLM's caches avoid per-token copies with
pre-allocated storage.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from kvdemo.cache.policies import STORAGE_POLICIES

GROWTH = 1.125
"""The factor by which a full buffer's capacity grows (see the module docstring for why 1.125)."""

MIN_HEADROOM = 256
"""The least room (tokens) a new buffer leaves after the tokens it holds: a typical answer's length."""


def grown_capacity(needed: int) -> int:
    """The capacity (tokens) of a new buffer that must hold `needed` tokens:
    max(needed + MIN_HEADROOM, ceil(needed x GROWTH))."""
    return max(needed + MIN_HEADROOM, math.ceil(needed * GROWTH))


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` with geometric storage growth and in-place appends (see the module docstring).

    `keys` and `values` are properties: reading gives `buffer[..., :length, :]` (None before the first update);
    assigning a view of the layer's own buffer starting at position 0 sets the length (no copy), assigning
    anything else (a tensor or None) replaces the buffer.

    Attributes:
        capacity: tokens the buffers can hold before they are replaced (0 before the first update).
    """

    def __init__(self) -> None:
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0
        super().__init__()

    # -- keys and values: views of the filled length ---------------------------------------------------------
    def _view(self, buffer: torch.Tensor | None) -> torch.Tensor | None:
        return buffer if buffer is None or buffer.dim() != 4 else buffer[..., : self._length, :]

    def _assign(self, name: str, tensor: torch.Tensor | None) -> None:
        buffer = getattr(self, name)
        if (
            tensor is not None
            and buffer is not None
            and tensor.dim() == 4
            and tensor.data_ptr() == buffer.data_ptr()
            and tensor.stride() == buffer.stride()
            and tensor.shape[:2] == buffer.shape[:2]
            and tensor.shape[-1] == buffer.shape[-1]
        ):  # a slice of our own buffer from position 0 (snapshot.restore, crop): only the length moves
            self._length = tensor.shape[-2]
            return
        setattr(self, name, tensor)
        self._length = tensor.shape[-2] if tensor is not None and tensor.dim() == 4 else 0

    @property
    def keys(self) -> torch.Tensor | None:
        return self._view(self._key_buffer)

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._assign("_key_buffer", tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return self._view(self._value_buffer)

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._assign("_value_buffer", tensor)

    @property
    def capacity(self) -> int:
        """Tokens the buffers can hold (0 before the first update)."""
        buffer = self._key_buffer
        return buffer.shape[-2] if buffer is not None and buffer.dim() == 4 else 0

    # -- the update: write in place, grow when full ----------------------------------------------------------
    def _grow(self, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the buffers by ones of `grown_capacity(needed)` tokens holding the current `length` tokens."""
        capacity = grown_capacity(needed)
        old_keys, old_values = self.keys, self.values
        new = []
        for like, old in ((keys, old_keys), (values, old_values)):
            buffer = like.new_empty((*like.shape[:2], capacity, like.shape[-1]))
            if old is not None and old.dim() == 4 and self._length:
                buffer[..., : self._length, :].copy_(old)
            new.append(buffer)
        self._key_buffer, self._value_buffer = new

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers' convention: a negative count) by moving the
        length back; no copy. (`DynamicLayer.crop` slices keys, then values: here the second slice would see the
        first's new length.)"""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized:
            self._length = max(self._length - abs(tokens_to_remove), 0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states` and `value_states` ([batch, kv_heads, new tokens, head_dim]) after the filled length,
        growing the buffers first when they are full; return the keys and values of every token (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self._length, key_states.shape[-2]
        buffer = self._key_buffer  # None only while the capacity is 0
        if (
            self.capacity == 0
            or buffer is None
            or buffer.shape[:2] != key_states.shape[:2]
            or start + new > self.capacity
        ):
            self._grow(start + new, key_states, value_states)
        keys, values = self._key_buffer, self._value_buffer
        assert keys is not None and values is not None  # 4-D buffers: there were, or _grow just made them
        keys[..., start : start + new, :].copy_(key_states)
        values[..., start : start + new, :].copy_(value_states)
        self._length = start + new
        return keys[..., : self._length, :], values[..., : self._length, :]  # the views `keys` and `values` give


def capacity_bound(tokens: int) -> int:
    """The most tokens a `GrowingLayer`'s buffers can hold after at most `tokens` tokens were ever written into it
    (in any chunks, with any restores between): `grown_capacity(tokens)`, reached when the last write that grew
    the buffer ended at `tokens` (one prefill pass); a buffer last grown at fewer tokens is smaller, since
    `grown_capacity` increases with its argument. The byte formula of `dynamic,storage=growing` and so the KV budget
    guard plan for it (`kvdemo.cache.registry`)."""
    return grown_capacity(tokens) if tokens > 0 else 0


def growing_dynamic_cache(config) -> Cache:
    """A `DynamicCache(config=config)` whose full-attention layers (`DynamicLayer`) are `GrowingLayer`s; other
    layer types (sliding window) are kept as transformers builds them.

    Example:
        >>> cache = growing_dynamic_cache(loaded.model.config)
        >>> loaded.model(input_ids, cache=cache)  # the same logits as with DynamicCache
    """
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def dynamic_cache(config, storage: str = STORAGE_POLICIES[0]) -> Cache:
    """The `dynamic` backend's empty cache: transformers' `DynamicCache(config=config)` for `storage="concat"`,
    `growing_dynamic_cache(config)` for `storage="growing"`.

    Raises:
        ValueError: `storage` is not one of `STORAGE_POLICIES`.
    """
    if storage not in STORAGE_POLICIES:
        raise ValueError(f"storage={storage!r} is not a storage policy; choose one of {', '.join(STORAGE_POLICIES)}")
    return growing_dynamic_cache(config) if storage == "growing" else DynamicCache(config=config)
