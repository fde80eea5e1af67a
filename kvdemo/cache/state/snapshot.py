"""Take and restore the post-prefill state of every cache layer, without copying a KV tensor.

Pattern: the kvpress fix for `QuantizedCache` (a shallow `vars(layer).copy()` before the answer,
written back after it), generalised per layer type. It is exact because every layer type accepted
here *assigns* new tensors in `update` (`torch.cat`, a fresh quantized store) instead of writing into
the old ones, so the objects the snapshot holds are never changed while an answer decodes.

- Quantized layers (`quanto`, `hqq`, `fp8`) and sliding-window `DynamicSlidingWindowLayer`s: the
  snapshot is `vars(layer).copy()`, and restoring puts back the very same tensor objects. While an answer
  decodes it keeps the post-prefill store alive once the cache has replaced it: for quanto and hqq from the
  first flush (the flush re-quantizes every token into a new store, so the old one, as big as the cache's own
  quantized store, is the only exact way back), for fp8 from the first step (each `torch.cat` builds a new
  fp8 tensor). The quantized bytes held during an answer can so reach twice the cache's;
  `telemetry.kv_memory(cache, snapshot)` counts them.
- A `DynamicSlidingWindowLayer` keeps only its last `sliding_window - 1` tokens, but after the prefill they
  are a view (`full[:, :, -sliding_window + 1:, :]`) into the prefill's whole `torch.cat`, whose storage stays
  alive as long as the view does: held by the snapshot, it would pin the whole prefill for the session's life
  (transformers alone frees it at the next decode step). `take` therefore first replaces such a view by a
  compact copy of the window (`clone()`: at most `sliding_window - 1` tokens per layer, once per prefill, the
  same values), so after the prefill and after every restore the layer holds no more than the window.
- Plain `DynamicLayer`s: holding the post-prefill tensors would keep a second full-precision copy alive
  during the answer (each decode step's `torch.cat` builds a new tensor), so only the length is kept and
  restore slices the keys and values back to it: `keys[..., :length, :]`, a view, exact and copy-free.
  Until the next decode step replaces it, that view keeps the longer storage alive;
  `telemetry.kv_memory` counts it as held.
- `kvdemo.cache.layers.storage.GrowingLayer`s (a `DynamicLayer` that writes new tokens in place into storage with spare
  capacity): the same length is kept, and the same slicing assignment sets the layer's length back without a
  copy; its decode steps write only after the post-prefill length, so the prefix's bytes are never changed.

- Layers with conv or recurrent states (transformers' `LinearAttentionLayer` and the hybrids that hold both:
  Mamba, gated DeltaNet, LFM2's convolutions, Falcon-H1): those states have a fixed size (a few KB to MB per
  layer, whatever the context) and transformers writes them in place (`copy_`), so no shallow copy can restore
  them. `take` clones them (what the snapshot holds: `telemetry.kv_memory` counts it) and `restore` copies the
  clones back into the same tensors; a hybrid layer's keys and values are restored by their own rule below.
  These states are not the KV cache: invariant 3's "no copy of the KV cache" is about the keys and values.
- Layers that hold nothing (`DummyLayer`: a layer that reads another layer's KV cache, Gemma 3n/4, or has no
  attention) are skipped.

A layer is recognised by what it does, checked in this order: in-place states, then its keys and values (a
sliding window, a quantized store, a length). A layer that writes its keys and values in place (`StaticLayer` and
its kin) or is of a kind not known here is refused with `TypeError` instead of being silently mis-restored; the
spec's checks refuse such models before the prefill (`kvdemo.cache.model.layer_kinds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import (
    BaseQuantizedLayer,
    Cache,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
)

from kvdemo.cache.layers.storage import GrowingLayer
from kvdemo.cache.model.layer_kinds import STATE_ATTRIBUTES

_LENGTH_LAYERS = (DynamicLayer, GrowingLayer)
"""The layer types restored by moving their length back: transformers' `DynamicLayer` (a view of the longer
tensor) and `kvdemo.cache.layers.storage.GrowingLayer` (it writes in place but never at positions below the post-prefill
length, so setting the length back is exact: docs/DESIGN.md, invariant 3, the in-place clause)."""

_STATE_FLAGS = ("has_previous_state", "is_conv_states_initialized", "is_recurrent_states_initialized")
_STATE_COUNTERS = ("cumulative_length_linear",)
"""Token counts a layer with states keeps in a tensor it changes in place (`add_`, `sub_`: transformers 5.25's
`LinearAttentionLayer`, whose `get_seq_length` a hybrid cache's first layer answers with): cloned and copied back
with the states, or the restored cache would count the answer's tokens and place the next question after them."""


@dataclass(frozen=True)
class LayerSnapshot:
    """The saved state of one layer.

    Attributes:
        attributes: `vars(layer).copy()` for layers restored by writing their attributes back, else None.
        length: for a plain `DynamicLayer` (or a hybrid's full-attention part), its sequence length in tokens;
            else None.
        states: for a layer with in-place states, {attribute: {state index: a clone}} and its flags
            ({flag: {state index: value}}); else None. A layer with none of the three holds nothing.
    """

    attributes: dict[str, Any] | None
    length: int | None
    states: dict[str, dict[int, Any]] | None = None


@dataclass(frozen=True)
class CacheSnapshot:
    """The saved state of a whole cache: one `LayerSnapshot` per layer and the total length in tokens."""

    layers: tuple[LayerSnapshot, ...]
    seq_length: int


def has_states(layer: object) -> bool:
    """Whether `layer` holds conv or recurrent states written in place (`STATE_ATTRIBUTES`)."""
    return any(isinstance(getattr(layer, name, None), dict) for name in STATE_ATTRIBUTES)


def _saved_states(layer: object) -> dict[str, dict[int, Any]]:
    """Clones of the layer's in-place states, and its flags."""
    saved: dict[str, dict[int, Any]] = {}
    for name in STATE_ATTRIBUTES:
        states = getattr(layer, name, None) or {}
        saved[name] = {i: t.clone() for i, t in states.items() if isinstance(t, torch.Tensor)}
    for name in _STATE_FLAGS:
        saved[name] = dict(getattr(layer, name, None) or {})
    for name in _STATE_COUNTERS:
        counter = getattr(layer, name, None)
        if isinstance(counter, torch.Tensor):
            saved[name] = {0: counter.clone()}
    return saved


def _restore_states(layer: object, saved: dict[str, dict[int, Any]]) -> None:
    """Copy the clones back into the layer's own state tensors (the same objects, as transformers keeps them),
    or put a clone in where the layer has none of that shape."""
    for name in STATE_ATTRIBUTES:
        states = getattr(layer, name)
        for index, clone in saved[name].items():
            live = states.get(index)
            if isinstance(live, torch.Tensor) and live.shape == clone.shape:
                live.copy_(clone)
            else:
                states[index] = clone.clone()
    for name in _STATE_FLAGS:
        if name in saved and isinstance(getattr(layer, name, None), dict):
            getattr(layer, name).update(saved[name])
    for name in _STATE_COUNTERS:
        if name in saved:
            getattr(layer, name).copy_(saved[name][0])


def _kv_rule(index: int, layer: object) -> str:
    """How the layer's keys and values are restored: `attributes` (a sliding window, a quantized store),
    `length`, or `none` (a layer with states only, or one that holds nothing).

    Raises:
        TypeError: the layer writes its keys and values in place, or is of a kind not known to assign new tensors."""
    if isinstance(layer, StaticLayer):
        raise TypeError(
            f"layer {index} is a {type(layer).__name__}, which writes new tokens into its tensors in place, so a "
            "shallow snapshot cannot restore it; use a DynamicCache or a QuantizedCache"
        )
    if isinstance(layer, DummyLayer) or (has_states(layer) and not isinstance(layer, DynamicLayer)):
        return "none"
    if getattr(layer, "is_sliding", False) and isinstance(layer, DynamicSlidingWindowLayer):
        return "attributes"
    if isinstance(layer, BaseQuantizedLayer):
        return "attributes"
    if type(layer) in _LENGTH_LAYERS or (has_states(layer) and isinstance(layer, DynamicLayer)):
        return "length"
    raise TypeError(
        f"layer {index} is a {type(layer).__name__}; kvdemo can only snapshot layers that assign new tensors on "
        "update (DynamicLayer, DynamicSlidingWindowLayer and the QuantizedCache layers), in-place recurrent states "
        "and layers that hold nothing; a format's own layer subclasses transformers' BaseQuantizedLayer, restored by "
        "its attributes, as ggml's and TurboQuant's are"
    )


def _compact_window(layer: DynamicSlidingWindowLayer) -> None:
    """Replace a sliding-window layer's keys and values by compact copies when they are views pinning a larger
    storage (the prefill's whole `torch.cat`); the values are unchanged."""
    for name in ("keys", "values"):
        tensor = getattr(layer, name, None)
        if not isinstance(tensor, torch.Tensor):
            continue
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            setattr(layer, name, tensor.clone(memory_format=torch.contiguous_format))


def take(cache: Cache) -> CacheSnapshot:
    """Save the state of every layer of `cache`, copying no KV tensor (a sliding-window layer's view of the
    prefill is first compacted to its window, and in-place recurrent states are cloned: see the module docstring).

    Args:
        cache: a `DynamicCache` or `QuantizedCache` after the prefill.

    Returns:
        The snapshot to give to `restore`.

    Raises:
        TypeError: a layer writes its keys and values in place (e.g. `StaticLayer`) or is of a type not known
            to assign new tensors on update.
    """
    saved = []
    for index, layer in enumerate(cache.layers):
        rule = _kv_rule(index, layer)
        states = _saved_states(layer) if has_states(layer) else None
        if rule == "length":
            saved.append(LayerSnapshot(None, cast(DynamicLayer, layer).get_seq_length(), states))
        elif rule == "attributes":
            if isinstance(layer, DynamicSlidingWindowLayer) and not getattr(layer, "record_past", False):
                _compact_window(layer)
            saved.append(LayerSnapshot(vars(layer).copy(), None, states))
        else:
            saved.append(LayerSnapshot(None, None, states))
    return CacheSnapshot(layers=tuple(saved), seq_length=attention_length(cache))


def attention_length(cache: Cache) -> int:
    """Tokens the cache has taken in, as its attention layers count them (`get_seq_length`: a sliding layer's count
    goes on past its window); 0 while no attention layer holds keys (an empty cache, or recurrent layers only)."""
    held = [
        cast(DynamicLayer, layer).get_seq_length()
        for layer in cache.layers
        if getattr(layer, "keys", None) is not None and hasattr(layer, "get_seq_length")
    ]
    return max(held, default=0)


def restore(cache: Cache, snapshot: CacheSnapshot) -> None:
    """Put `cache` back to the state saved in `snapshot`, copying no KV tensor.

    Quantized and sliding-window layers get their saved attributes back (attributes added since are
    dropped); plain `DynamicLayer`s are sliced back to their saved length (a view); in-place states get their
    saved values copied back; a layer that holds nothing is left as it is.

    Raises:
        ValueError: the snapshot was taken from a cache with another number of layers, or a
            `DynamicLayer` is shorter than its saved length (the snapshot belongs to another cache).
    """
    if len(snapshot.layers) != len(cache.layers):
        raise ValueError(
            f"the snapshot has {len(snapshot.layers)} layers but the cache has {len(cache.layers)}; "
            "it was taken from another cache"
        )
    for index, (layer, saved) in enumerate(zip(cache.layers, snapshot.layers)):
        if saved.attributes is not None:
            state = vars(layer)
            state.clear()
            state.update(saved.attributes)
        elif saved.length is not None:
            _restore_length(index, cast(DynamicLayer, layer), saved.length)
        if saved.states is not None:
            _restore_states(layer, saved.states)


def _restore_length(index: int, layer: DynamicLayer, length: int) -> None:
    """Slice a length-restored layer's keys and values back to `length` tokens (a view)."""
    if layer.get_seq_length() < length:
        raise ValueError(
            f"layer {index} holds {layer.get_seq_length()} tokens, fewer than the {length} saved; "
            "the snapshot was taken from another cache"
        )
    if layer.get_seq_length() != length:
        assert layer.keys is not None and layer.values is not None  # it holds more tokens than saved
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
