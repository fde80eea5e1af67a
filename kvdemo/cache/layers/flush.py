"""Flush policies of the residual backends (quanto, hqq): what a flush does with the quantized store.

- `requantize` (transformers' `QuantizedLayer.update`, the default): at a flush the whole layer is de-quantized,
  the residual appended, and everything quantized again into one new store. A flush step's cost grows with the
  context (it touches every token); tokens quantized at one flush are quantized again at the next.
- `append` (`AppendFlushMixin`, here; each residual format's `Append*` layers): at a flush only the residual block (the
  residual and the step's new tokens) is quantized, with the layer's own `_quantize` (optimum-quanto's / hqq's own
  quantizer: kvdemo has no quantization code), and appended to the store, which becomes a list of blocks: the
  prefill's block, then one block per flush. Attention reads the blocks de-quantized (each with the library's
  own `_dequantize`) and concatenated, then the residual. A flush step costs one block's quantization, whatever
  the context. Each token is quantized once; groups never span a block's boundary and each block has its own
  scales and zero points (see `kvdemo.cache.layouts.group_bytes`). Pattern: KIVI (Liu et al. 2024,
  github.com/jy-yuan/KIVI), which quantizes each full residual group and appends it.

The snapshot (`kvdemo.snapshot`) keeps `vars(layer).copy()`: `update` here assigns a new list at each flush and
never appends in place to the list the snapshot holds, so restore stays exact and copy-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from transformers import PreTrainedConfig, QuantizedCache
from transformers.cache_utils import QuantizedLayer

from kvdemo.cache.layer_plan import PLAN, LayerPrecision, parse_plan
from kvdemo.cache.layers.attention import uses_query_rotation
from kvdemo.cache.layers.blockwise import blockwise_layer
from kvdemo.cache.layers.by_kind import library_cache, sliding_windows, with_kept_layers
from kvdemo.cache.layers.precision import value_precision_layer
from kvdemo.cache.layers.rotation import LibraryLayer
from kvdemo.cache.layers.sliding import sliding_layer
from kvdemo.cache.model.layer_kinds import is_latent, quantized_layers
from kvdemo.cache.policies import FLUSH_POLICIES, PROTECT_CHOICES, ROTATIONS, SLIDING_CHOICES

_READ_WHOLE: ContextVar[bool] = ContextVar("kvdemo_read_whole", default=False)
_T = TypeVar("_T")


@contextmanager
def read_whole() -> Iterator[None]:
    """Within it, the caches `quantized_cache` builds read their store whole at every decode step and undo a rotation
    on read, as for a model that does not attend through `kvdemo_attention`: the same stored values, the reference
    that kvdemo's block-wise read and query-side rotation are checked against (`kvdemo.qa.probe`)."""
    token = _READ_WHOLE.set(True)
    try:
        yield
    finally:
        _READ_WHOLE.reset(token)


_WRITES: ContextVar[list | Iterator | None] = ContextVar("kvdemo_writes", default=None)


@contextmanager
def recorded_writes() -> Iterator[list]:
    """Within it, what a layer that quantizes each new token as it is written hands `written` (the `ggml` backend's
    rows) is kept in the list it yields, in order: the run `kvdemo.qa.probe` checks."""
    writes: list = []
    token = _WRITES.set(writes)
    try:
        yield writes
    finally:
        _WRITES.reset(token)


@contextmanager
def replayed_writes(writes: list) -> Iterator[None]:
    """Within it, such a layer stores `writes`' entries, in order, instead of its own quantization of the same tokens:
    a second run of the same tokens (the probe's read-whole reference) holds the very bytes of the run it checks. Its
    new tokens' keys come from earlier layers whose attention took another float order, so without this a value within
    a rounding of a level (or of a float16 scale's midpoint) can be written the other way, and the step cascades
    through every later layer (Gemma 3 270M, ggml q5_1: one float16 scale one unit apart moved the logits 0.73)."""
    token = _WRITES.set(iter(writes))
    try:
        yield
    finally:
        _WRITES.reset(token)


def written(stored: _T) -> _T:
    """`stored` (a layer's new quantized rows), kept where `recorded_writes` is open, or the recorded rows in its
    place where `replayed_writes` is (`stored` once they run out)."""
    writes = _WRITES.get()
    if writes is None:
        return stored
    if isinstance(writes, list):
        writes.append(stored)
        return stored
    return next(writes, stored)


class AppendFlushMixin(LibraryLayer):
    """The `append` flush policy for a transformers `QuantizedLayer` subclass: the store
    (`_quantized_keys`, `_quantized_values`) is a list of blocks, each what the layer's own `_quantize` returns
    (a quanto `QTensor`, an hqq `(W_q, meta)` pair)."""

    dequantize_delegates = True
    """A single block's `_dequantize` is the next class's (`kvdemo.cache.layers.blockwise.code_reader`)."""

    def _dequantize(self, store):
        """The store de-quantized, [batch, kv_heads, tokens, head_dim]: each block by the library's own
        `_dequantize`, concatenated along the tokens. A single block (not a list) is de-quantized as it is."""
        if not isinstance(store, list):
            return super()._dequantize(store)
        parts = [super(AppendFlushMixin, self)._dequantize(block) for block in store]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' `QuantizedLayer.update` with the flush replaced: the residual block is quantized alone and
        appended (a new list), instead of re-quantizing the whole layer.

        Returns:
            (keys, values) to attend to: the blocks de-quantized, the residual, the new states; exactly what
            transformers returns at the same step when the store holds one block.
        """
        if not self.is_initialized or self._pending_beam_idx is not None:
            # the first update quantizes the prefill as one block; a pending beam reorder (never in kvdemo)
            # is baked in only by a re-quantization, so that rare case takes transformers' path
            keys, values = QuantizedLayer.update(self, key_states, value_states, *args, **kwargs)
            if not isinstance(self._quantized_keys, list):
                self._quantized_keys, self._quantized_values = [self._quantized_keys], [self._quantized_values]
            return keys, values
        assert self.keys is not None and self.values is not None  # set by the first update
        self.cumulative_length += key_states.shape[-2]
        keys_blocks = [super(AppendFlushMixin, self)._dequantize(b) for b in self._quantized_keys]
        values_blocks = [super(AppendFlushMixin, self)._dequantize(b) for b in self._quantized_values]
        residual = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        # one cat per tensor: the blocks, the residual and the new states (the same copies as transformers' path)
        keys_to_return = torch.cat([*keys_blocks, self.keys, key_states], dim=-2)
        values_to_return = torch.cat([*values_blocks, self.values, value_states], dim=-2)
        if residual + key_states.shape[-2] >= self.residual_length:
            block = keys_to_return.shape[-2] - residual - key_states.shape[-2]
            new_keys = self._quantize(keys_to_return[..., block:, :].contiguous(), axis=self.axis_key)
            new_values = self._quantize(values_to_return[..., block:, :].contiguous(), axis=self.axis_value)
            # new lists: the snapshot holds the old ones (never append in place)
            self._quantized_keys = [*self._quantized_keys, new_keys]
            self._quantized_values = [*self._quantized_values, new_values]
            self.keys = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
            self.values = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return keys_to_return, values_to_return


@dataclass(frozen=True)
class ResidualLayers:
    """One transformers `QuantizedLayer` family as a residual format (quanto, hqq) hands it to `quantized_cache`: the
    library's layer de-quantizing in place and the same layer under each rotation and flush policy, each a class of
    the format's own folder (so that a session file names them as before).

    Attributes:
        library: transformers' backend name, for `QuantizedCache(library, ...)` (`kvdemo.cache.layers.by_kind`).
        plain: the library's layer de-quantizing in place (its `_dequantize` the library's bits, its `_codes_of` the
            store as the decode kernel reads it).
        rotated, query_rotated: `plain` with `RotationMixin` (rotated back on read) or `QueryRotationMixin`
            (`kvdemo.cache.layers.rotation`).
        append, append_rotated, append_query_rotated: the three with the `append` flush (`AppendFlushMixin`).
    """

    library: str
    plain: type[QuantizedLayer]
    rotated: type[QuantizedLayer]
    query_rotated: type[QuantizedLayer]
    append: type[QuantizedLayer]
    append_rotated: type[QuantizedLayer]
    append_query_rotated: type[QuantizedLayer]

    def pick(self, flush: str, rotation: str, rotate_query: bool) -> type[QuantizedLayer]:
        """The class for `flush` (`requantize`, `append`) and `rotation` (`none`, `hadamard`) on the query side or
        the read side."""
        rotated = rotation != ROTATIONS[0]
        if flush == "append":
            if not rotated:
                return self.append
            return self.append_query_rotated if rotate_query else self.append_rotated
        if not rotated:
            return self.plain
        return self.query_rotated if rotate_query else self.rotated


def _layer_class(layers: ResidualLayers, flush: str, rotation: str, rotate_query: bool, blockwise: bool) -> type:
    """The layer class for one layer of the family `layers`: rotated by `rotation` (query or read side), with the
    `flush` policy, read block-wise at decode steps if `blockwise` (`kvdemo.cache.layers.blockwise`)."""
    layer_class = layers.pick(flush, rotation, rotate_query)
    return blockwise_layer(layer_class) if blockwise else layer_class


def _per_layer(
    plan: Sequence[LayerPrecision] | None,
    first: QuantizedLayer,
    layers: int,
    nbits_value: int | None,
    rotation: str,
    nbits_given: bool,
) -> Sequence[LayerPrecision]:
    """Each layer's precision: the plan's, or the same for every layer (the library layer `first`'s nbits, the
    values' `nbits_value`, `rotation`). Raises ValueError: a plan with nbits, nbits_value or a rotation, or a plan
    whose length is not `layers`."""
    if plan is None:
        nbits = int(first.nbits)
        return [LayerPrecision(nbits, nbits_value or nbits, rotation)] * layers
    if nbits_value is not None or rotation != "none" or nbits_given:
        raise ValueError("a plan sets each layer's nbits, nbits_value and rotation; leave those out")
    if len(plan) != layers:
        raise ValueError(f"the plan gives {len(plan)} layers and this model has {layers} layers that are quantized")
    return plan


def attends_through_kvdemo(config: PreTrainedConfig) -> bool:
    """Whether a cache built now for `config` may hand attention what `kvdemo_attention` reads (keys in a rotated
    basis, a store to read block by block): the model attends through it, caches its attention's keys and values (a
    latent, MLA, is up-projected between `update` and attention, so its layers must return the whole store in the
    model's basis: `kvdemo.cache.model.layer_kinds`), and no `read_whole` block is open."""
    return uses_query_rotation(config) and not is_latent(config) and not _READ_WHOLE.get()


def _checked(
    config: PreTrainedConfig,
    flush: str,
    rotation: str,
    rotate_query: bool | None,
    blockwise: bool | None,
) -> tuple[bool, bool]:
    """`quantized_cache`'s words checked; (rotate_query, blockwise) resolved for `config` (None: whether it attends
    through `kvdemo_attention`). Raises ValueError as `quantized_cache` documents."""
    if flush not in FLUSH_POLICIES:
        raise ValueError(f"flush={flush!r} is not a flush policy; choose one of {', '.join(FLUSH_POLICIES)}")
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r} is not a rotation; choose one of {', '.join(ROTATIONS)}")
    latent, own_attention = is_latent(config), attends_through_kvdemo(config)
    for name, wanted in (("rotate_query", rotate_query), ("blockwise", blockwise)):
        if wanted and latent:
            raise ValueError(f"{name} needs attention to read what the cache returns; this model up-projects a latent")
        if wanted and not own_attention:
            raise ValueError(f"{name} needs a model that attends through kvdemo_attention (attention.install)")
    return (own_attention if rotate_query is None else rotate_query), (
        own_attention if blockwise is None else blockwise
    )


def _own_layer(
    layers: ResidualLayers,
    first: QuantizedLayer,
    precision: LayerPrecision,
    flush: str,
    window: int | None,
    rotate_query: bool,
    blockwise: bool,
) -> QuantizedLayer:
    """kvdemo's layer of the family `layers` for one quantized layer of precision `precision` (a sliding one of
    `window` tokens), built with the options of transformers' own layer `first`.

    A sliding layer (`kvdemo.cache.layers.sliding`) re-quantizes its window at a flush, rotated back on read: no
    `append`, no query-side rotation; its decode steps hand kvdemo's attention the window's part of the store."""
    layer_class = _layer_class(
        layers,
        flush if window is None else FLUSH_POLICIES[0],
        precision.rotation,
        rotate_query and window is None,
        blockwise and window is None,
    )
    extra: dict = {}
    if precision.nbits_value != precision.nbits:
        layer_class, extra = value_precision_layer(layer_class), {"nbits_value": precision.nbits_value}
    if window is not None:
        layer_class, extra = sliding_layer(layer_class), {**extra, "sliding_window": window}
    # the same options as transformers' own layers (built from the same keywords, so validated the same way)
    kwargs = {name: getattr(first, name) for name in ("axis_key", "axis_value")}
    kwargs.update(nbits=precision.nbits, q_group_size=first.q_group_size, residual_length=first.residual_length)
    layer = layer_class(**kwargs, **extra)
    if window is not None:
        layer.reads_blocks = blockwise  # its decode steps hand attention the window's part of the store
    return layer


def quantized_cache(
    layers: ResidualLayers,
    config: PreTrainedConfig,
    flush: str = "requantize",
    rotation: str = "none",
    nbits_value: int | None = None,
    rotate_query: bool | None = None,
    plan: Sequence[LayerPrecision] | None = None,
    blockwise: bool | None = None,
    sliding: str = SLIDING_CHOICES[0],
    protect: str = PROTECT_CHOICES[0],
    **options,
) -> QuantizedCache:
    """transformers' `QuantizedCache(layers.library, config, **options)` built layer by layer from the model's layer
    kinds (`kvdemo.cache.layers.by_kind`: the full-attention layers quantized, the others as `sliding` says and
    transformers builds them), each quantized layer a class of the family `layers` (a residual format's:
    `ResidualLayers`) with the flush policy `flush`, the rotation `rotation` (`kvdemo.cache.layers.rotation`) and the
    values' own precision `nbits_value` (`kvdemo.cache.layers.precision`); or, with a `plan`, each layer its own nbits,
    nbits_value and rotation (`kvdemo.cache.layer_plan`).

    Args:
        layers: the format's `ResidualLayers` (quanto's, hqq's: `kvdemo.cache.formats.<name>.layers`).
        flush: one of `FLUSH_POLICIES`.
        rotation: one of `ROTATIONS`.
        nbits_value: bits per quantized value of the values; None (or nbits): nbits, as transformers.
        rotate_query: with a rotation, keep the layers in the rotated basis and let attention rotate the query
            (`kvdemo.cache.layers.rotation.QueryRotationMixin`, needs `kvdemo.cache.layers.attention.kvdemo_attention`),
            or rotate every read back (`RotationMixin`, any attention); None: the query side exactly when `config`
            attends through `kvdemo_attention` (`kvdemo.cache.layers.attention.install`) and caches its keys and values
            as attention reads them (not a latent: `kvdemo.cache.model.layer_kinds.is_latent`).
        plan: one `LayerPrecision` per quantized layer (`kvdemo.cache.model.layer_kinds.quantized_layers`), replacing
            `nbits`, `nbits_value`, `rotation` (left unset); None: alike.
        blockwise: decode steps attend to the store block by block (`kvdemo.cache.layers.blockwise`, needs
            `kvdemo_attention`), or read it whole as transformers does (False); None: block-wise exactly when
            `config` attends through `kvdemo_attention` and is not latent.
        sliding: `keep` the sliding-window layers at full precision (transformers' `DynamicSlidingWindowLayer`) or
            `quantize` them (`kvdemo.cache.layers.sliding`: the window re-quantized at each flush, read whole, a
            rotation on the read side). Linear-attention, conv, hybrid and KV-shared layers are always transformers' own
            (`kvdemo.cache.layers.by_kind`).
        protect: `first:last` quantized layers kept at full precision (`kvdemo.cache.model.layer_kinds.layer_actions`).
        options: the group-wise options (nbits, q_group_size, residual_length, axis_key, axis_value).

    Raises:
        ValueError: an unknown policy or rotation word, an `nbits_value` the library's layer does not take (the
            library's message); `rotate_query=True` or `blockwise=True` for a config whose attention is not
            `kvdemo_attention`, or on a latent (MLA) model; a plan whose length is not the model's count of quantized
            layers, or given with nbits, nbits_value or a rotation.

    Example:
        >>> cache = quantized_cache(HQQ_LAYERS, model.config, flush="append", rotation="hadamard", nbits=4,
        nbits_value=2)
        >>> cache = quantized_cache(QUANTO_LAYERS, model.config, plan=parse_plan("k4v2h*20+k2v2h*10"))
    """
    rotate_query, blockwise = _checked(config, flush, rotation, rotate_query, blockwise)
    cache = library_cache(layers.library, config, **options)
    first = cast(QuantizedLayer, cache.layers[0])
    quantized, windows = quantized_layers(config, sliding, protect), sliding_windows(config)
    plan = _per_layer(plan, first, len(quantized), nbits_value, rotation, "nbits" in options)
    built: list = list(cache.layers)
    for index, precision in zip(quantized, plan):
        built[index] = _own_layer(layers, first, precision, flush, windows[index], rotate_query, blockwise)
    cache.layers = built
    return with_kept_layers(cache, config, sliding, protect)


def residual_cache(layers: ResidualLayers, options: dict[str, Any], config: PreTrainedConfig) -> QuantizedCache:
    """`quantized_cache` of the family `layers` with a spec's options (those a spec sets, `CacheSpec.given()`): the
    layers flush by the `flush` option's policy and rotate by the `rotation` option, or take each its own precision
    from the `plan`; read block-wise under kvdemo's attention (`kvdemo.cache.layers.blockwise`)."""
    options = dict(options)
    flush, rotation = str(options.pop("flush", FLUSH_POLICIES[0])), str(options.pop("rotation", ROTATIONS[0]))
    nbits_value = options.pop("nbits_value", None)
    sliding = str(options.pop("sliding", SLIDING_CHOICES[0]))
    protect = str(options.pop("protect", PROTECT_CHOICES[0]))
    plan = parse_plan(str(options.pop(PLAN))) if options.get(PLAN) else None
    return quantized_cache(
        layers, config, flush, rotation, nbits_value=nbits_value, plan=plan, sliding=sliding, protect=protect, **options
    )
