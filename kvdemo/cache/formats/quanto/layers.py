"""quanto's layers: optimum-quanto's de-quantization with the same bits, in place (one float tensor per store
instead of three), its store as the decode kernel reads it, and the layers under each rotation and flush.

At every decode step a quantized layer de-quantizes its whole store (or, read block-wise, each block:
`kvdemo.cache.layers.blockwise`). The libraries' own code allocates a new float tensor at each element-wise operation:

- optimum-quanto (`QBitsDequantizer.forward`): `dqt = scale * unpack(data)` (uint8 promoted to float inside the
  product), then `dqt -= shift`, then `ungroup`; behind an autograd `Function` on a tensor subclass.
- hqq (`Quantizer.dequantize`): `W_r = unpack(W_q, dtype=compute_dtype)`, then `((W_r - zero) * scale)`, then
  `reshape(shape)`.

Here the same operations, in the same order and dtypes, run on the one float tensor the unpacking gives:
`unpack(data).to(scale.dtype).mul_(scale).sub_(shift)` for quanto (a product is the same in either order) and
`unpack(W_q).sub_(zero).mul_(scale)` for hqq (`kvdemo.cache.formats.hqq.layers`), each with the library's own
unpacking (`PackedTensor.unpack`, `Quantizer.unpack[packing]`) and shaping (`ungroup`, `reshape`). Every rounding is the
one the library's operation does, so the result is equal bit for bit (`tests/test_dequantize.py` checks `torch.equal`
with the library's `_dequantize` for every nbits, axis and group size kvdemo offers). A store of another form (quanto's
integer shift or float qtype, hqq's unpacked or mixed-dtype store) takes the library's own path.

Measured (`benchmarks/decode.py`, 2026-12-03): one warm key store of 2,048 tokens ([1, 3, 2,048, 64]) quanto
0.65 -> 0.55 ms, hqq 0.46 -> 0.50 ms (no faster alone); in whole decode steps (30 layers, cold stores) the in-place
path takes 0.06-0.22 of a `dynamic` step off. Pattern: the in-place form of the libraries' own formulas, as
kvdemo's fp8 layer (`kvdemo.cache.formats.fp8.layers`) replaces transformers' fp8 de-quantization with the same bits.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import QuantoQuantizedLayer

from kvdemo.cache.layers.flush import AppendFlushMixin, ResidualLayers
from kvdemo.cache.layers.rotation import QueryRotationMixin, RotationMixin
from kvdemo.cache.read.code_attention import StoreCodes, affine_codes


def dequantize_quanto(qtensor) -> torch.Tensor:
    """optimum-quanto's `qtensor.dequantize()` with the same bits, in place (module docstring).

    Args:
        qtensor: a quanto `QBitsTensor` (what `QuantoQuantizedLayer._quantize` returns) of shape
            [batch, kv_heads, tokens, head_dim].

    Returns:
        [batch, kv_heads, tokens, head_dim] in the scale's dtype: a new tensor.
    """
    from optimum.quanto.tensor.grouped import ungroup  # type: ignore[import-untyped]  # as transformers' layer
    from optimum.quanto.tensor.packed import PackedTensor  # type: ignore[import-untyped]

    data, scale, shift = qtensor._data, qtensor._scale, qtensor._shift
    if not shift.dtype.is_floating_point or qtensor.qtype.is_floating_point or shift.dtype != scale.dtype:
        return qtensor.dequantize()  # the library's other forms (an integer shift, float codes)
    codes = data.unpack() if isinstance(data, PackedTensor) else data
    out = codes.to(scale.dtype, copy=True)  # the integer codes as floats, as the library's promotion gives them
    out.mul_(scale).sub_(shift)
    return out if qtensor.axis is None else ungroup(out, axis=qtensor.axis, orig_shape=qtensor.shape)


def quanto_codes(qtensor) -> StoreCodes | None:
    """optimum-quanto's `QBitsTensor` (what `QuantoQuantizedLayer._quantize` returns) as the kernel reads it: 2 or 4
    bits, `axis=0`, packed (`PackedTensor`, row chunk i at bit bits x i), float32 scale and shift; else None."""
    from optimum.quanto.tensor.packed import PackedTensor  # type: ignore[import-untyped]

    data, scale, shift = (
        getattr(qtensor, "_data", None),
        getattr(qtensor, "_scale", None),
        getattr(qtensor, "_shift", None),
    )
    if not isinstance(data, PackedTensor) or scale is None or shift is None or qtensor.axis != 0:
        return None
    if qtensor.qtype.is_floating_point or not shift.dtype.is_floating_point:
        return None
    bits, group = qtensor.qtype.bits, getattr(qtensor, "_group_size", None)
    if not group:
        return None
    return affine_codes(
        data._data, scale, shift, shape=tuple(qtensor.shape), bits=bits, cols=group,
        shifts=(0, bits), by_row=True, zero_first=False,
    )  # fmt: skip


class ExactQuantoLayer(QuantoQuantizedLayer):
    """transformers' `QuantoQuantizedLayer` de-quantizing by `dequantize_quanto` (the same bits, in place)."""

    def _dequantize(self, qtensor):
        """The store de-quantized, [batch, kv_heads, tokens, head_dim]."""
        return dequantize_quanto(qtensor)

    def _codes_of(self, qtensor) -> StoreCodes | None:
        """The store as the decode kernel reads it (`quanto_codes`), or None."""
        return quanto_codes(qtensor)


class RotatedQuantoLayer(RotationMixin, ExactQuantoLayer):
    """transformers' `QuantoQuantizedLayer` storing rotated keys and values, rotated back on read."""


class QueryRotatedQuantoLayer(QueryRotationMixin, ExactQuantoLayer):
    """transformers' `QuantoQuantizedLayer` in the rotated basis, for `kvdemo_attention`."""


class AppendQuantoLayer(AppendFlushMixin, ExactQuantoLayer):
    """transformers' `QuantoQuantizedLayer` with the `append` flush policy (`kvdemo.cache.layers.flush`)."""


class AppendRotatedQuantoLayer(AppendFlushMixin, RotatedQuantoLayer):
    """`RotatedQuantoLayer` with the `append` flush policy: each block is stored rotated and read back un-rotated (the
    mixin's `super()._dequantize` is the rotated layer's)."""


class AppendQueryRotatedQuantoLayer(QueryRotationMixin, AppendFlushMixin, ExactQuantoLayer):
    """`QueryRotatedQuantoLayer` with the `append` flush policy: the rotation's `update` comes first and hands the
    rotated states to the append policy's."""


QUANTO_LAYERS = ResidualLayers(
    "quanto",  # transformers' QuantizedCache backend name
    ExactQuantoLayer,
    RotatedQuantoLayer,
    QueryRotatedQuantoLayer,
    AppendQuantoLayer,
    AppendRotatedQuantoLayer,
    AppendQueryRotatedQuantoLayer,
)
"""quanto's layers under each rotation and flush, for `kvdemo.cache.layers.flush.quantized_cache`."""
