"""Separate key and value precision: a quantized layer that quantizes its keys at `nbits` and its values at
`nbits_value`, each with the library's own quantizer (optimum-quanto's, hqq's: kvdemo has no quantization code).

Why: keys and values do not suffer alike. A key error moves every attention score (the softmax amplifies it), a
value error only what the scores average, so the field gives keys more bits: KIVI takes `k_bits` and `v_bits`
apart (Liu et al. 2024, arXiv:2402.02750), llama.cpp `--cache-type-k` and `--cache-type-v` (users run K8/V4-like
mixes), mlx-lm#1555 asymmetric key/value bits. transformers' `QuantizedLayer` has one `nbits` for both.

How, without changing what transformers' layer does: its `update` (and kvdemo's `flush=append` update) quantizes
with `self._quantize(keys, axis=self.axis_key)` then `self._quantize(values, axis=self.axis_value)`, and the axis
is the only thing at that call that tells the values from the keys (both axes are often 0). So the layer's
`axis_value` is a `ValueAxis`, an `int` equal to the axis that also says "these are the values";
`ValuePrecisionMixin._quantize` then runs the library's `_quantize` with the layer's precision attributes set to
`nbits_value`'s for that one call. Those attributes (`PRECISION_ATTRIBUTES`) are read off a layer of the same
library class built with `nbits=nbits_value`, so the library's own `__init__` checks the value (quanto: 2 or 4)
and derives what it derives (quanto's `qtype`). De-quantizing needs nothing: quanto's `QTensor` and hqq's
`meta` carry their own bits.

Restore (docs/DESIGN.md, invariant 3): the swap is undone before `_quantize` returns, so the attributes the
snapshot (`vars(layer).copy()`) holds are the layer's own at every step boundary.
"""

from __future__ import annotations

from functools import cache

from transformers.cache_utils import QuantizedLayer

from kvdemo.cache.layers.rotation import LibraryLayer

PRECISION_ATTRIBUTES = ("nbits", "qtype")
"""The attributes through which transformers' quantized layers hand their precision to the library: `nbits`
(`HQQQuantizedLayer._quantize` passes `nbits=self.nbits`) and `qtype` (`QuantoQuantizedLayer.__init__` derives
`qint4`/`qint2` from nbits; its `_quantize` passes `self.qtype`)."""


class ValueAxis(int):
    """The values' grouping axis: equal to the `int` it is built from (the library receives `int(axis)`), and
    marks the `_quantize` call that quantizes the values (see the module docstring)."""

    def __repr__(self) -> str:
        return f"ValueAxis({int(self)})"


def _library_class(layer_class: type) -> type[QuantizedLayer]:
    """transformers' own layer class among `layer_class`'s bases (`QuantoQuantizedLayer`, `HQQQuantizedLayer`)."""
    return next(c for c in layer_class.__mro__ if c.__module__ == QuantizedLayer.__module__)


class ValuePrecisionMixin(LibraryLayer):
    """`nbits_value` for a transformers `QuantizedLayer` subclass (and kvdemo's flush and rotation layers): keys
    quantized at `nbits`, values at `nbits_value`, both by the library's `_quantize`.

    Attributes:
        nbits_value: bits per quantized value of the values.
        axis_value: a `ValueAxis` equal to the axis given.

    Raises (at construction):
        ValueError: `nbits_value` is not one the library's layer takes (its own message).
    """

    def __init__(self, *, nbits_value: int, **options) -> None:
        super().__init__(**options)
        library = _library_class(type(self))
        probe = vars(library(**{**options, "nbits": nbits_value}))  # the library checks nbits_value its way
        self._value_precision = {name: probe[name] for name in PRECISION_ATTRIBUTES if name in probe}
        self.nbits_value = nbits_value
        self.axis_value = ValueAxis(self.axis_value)

    def _quantize(self, tensor, axis):
        """The library's `_quantize` of `tensor` ([batch, kv_heads, tokens, head_dim]) at `nbits` for the keys,
        at `nbits_value` for the values (`axis` a `ValueAxis`)."""
        if not isinstance(axis, ValueAxis):
            return super()._quantize(tensor, axis)
        own = {name: vars(self)[name] for name in self._value_precision}
        vars(self).update(self._value_precision)
        try:
            return super()._quantize(tensor, int(axis))
        finally:
            vars(self).update(own)


@cache
def value_precision_layer(layer_class: type[QuantizedLayer]) -> type[QuantizedLayer]:
    """`layer_class` with `ValuePrecisionMixin` in front: built once per class (e.g.
    `ValuePrecisionAppendHQQLayer` from `AppendHQQLayer`), constructed with the layer's keywords plus
    `nbits_value`."""
    return type(f"ValuePrecision{layer_class.__name__}", (ValuePrecisionMixin, layer_class), {})
