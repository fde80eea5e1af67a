"""quanto's and hqq's de-quantization with the same bits, in place: one float tensor per store instead of three.

At every decode step a quantized layer de-quantizes its whole store (or, read block-wise, each block:
`kvdemo.cache.layers.blockwise`). The libraries' own code allocates a new float tensor at each element-wise operation:

- optimum-quanto (`QBitsDequantizer.forward`): `dqt = scale * unpack(data)` (uint8 promoted to float inside the
  product), then `dqt -= shift`, then `ungroup`; behind an autograd `Function` on a tensor subclass.
- hqq (`Quantizer.dequantize`): `W_r = unpack(W_q, dtype=compute_dtype)`, then `((W_r - zero) * scale)`, then
  `reshape(shape)`.

Here the same operations, in the same order and dtypes, run on the one float tensor the unpacking gives:
`unpack(data).to(scale.dtype).mul_(scale).sub_(shift)` for quanto (a product is the same in either order) and
`unpack(W_q).sub_(zero).mul_(scale)` for hqq, each with the library's own unpacking (`PackedTensor.unpack`,
`Quantizer.unpack[packing]`) and shaping (`ungroup`, `reshape`). Every rounding is the one the library's operation
does, so the result is equal bit for bit (`tests/test_dequantize.py` checks `torch.equal` with the library's
`_dequantize` for every nbits, axis and group size kvdemo offers). A store of another form (quanto's integer shift or
float qtype, hqq's unpacked or mixed-dtype store) takes the library's own path.

Measured (`benchmarks/decode.py`, 2026-12-03): one warm key store of 2,048 tokens ([1, 3, 2,048, 64]) quanto
0.65 -> 0.55 ms, hqq 0.46 -> 0.50 ms (no faster alone); in whole decode steps (30 layers, cold stores) the in-place
path takes 0.06-0.22 of a `dynamic` step off. Pattern: the in-place form of the libraries' own formulas, as
kvdemo's fp8 layer (`kvdemo.cache.layers.fp8`) replaces transformers' fp8 de-quantization with the same bits.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import HQQQuantizedLayer, QuantizedLayer, QuantoQuantizedLayer

from kvdemo.cache.layers.code_attention import StoreCodes, hqq_codes, quanto_codes


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


def dequantize_hqq(qtensor: tuple[torch.Tensor, dict]) -> torch.Tensor:
    """hqq's `Quantizer.dequantize(W_q, meta)` with the same bits, in place (module docstring).

    Args:
        qtensor: hqq's `(W_q, meta)` (what `HQQQuantizedLayer._quantize` returns): the packed codes and the
            scale, zero point, shape and packing to de-quantize them.

    Returns:
        `meta["shape"]` ([batch, kv_heads, tokens, head_dim]) in `meta["compute_dtype"]`: a new tensor.
    """
    from hqq.core.quantize import Quantizer  # imported here, as transformers' layer imports hqq

    packed, meta = qtensor
    zero, scale = meta["zero"], meta["scale"]
    dtype = meta.get("compute_dtype", torch.float16)
    if not meta["packing"] or not zero.dtype == scale.dtype == dtype:
        return Quantizer.dequantize(packed, meta)  # unpacked codes, or a product that would change dtype
    if meta["view_as_float"]:
        packed = packed.view(meta["unpack_view_dtype"])
    out = Quantizer.unpack[meta["packing"]](packed, dtype=dtype)  # a new tensor (hqq's unpackers allocate it)
    if meta["nbits"] == 3:  # 3-bit packing pads the rows to 10 per 32-bit word: hqq keeps the first ones
        shape, group_size = meta["shape"], meta["group_size"]
        out = out[: group_size if meta["axis"] == 0 else shape[0] * shape[1] // group_size]
    if torch.broadcast_shapes(out.shape, zero.shape, scale.shape) != out.shape:  # never for a KV store
        return Quantizer.dequantize(qtensor[0], meta)
    return out.sub_(zero).mul_(scale).reshape(meta["shape"])


class ExactQuantoLayer(QuantoQuantizedLayer):
    """transformers' `QuantoQuantizedLayer` de-quantizing by `dequantize_quanto` (the same bits, in place)."""

    def _dequantize(self, qtensor):
        """The store de-quantized, [batch, kv_heads, tokens, head_dim]."""
        return dequantize_quanto(qtensor)

    def _codes_of(self, qtensor) -> StoreCodes | None:
        """The store as the decode kernel reads it (`kvdemo.cache.layers.code_attention.quanto_codes`), or None."""
        return quanto_codes(qtensor)


class ExactHQQLayer(HQQQuantizedLayer):
    """transformers' `HQQQuantizedLayer` de-quantizing by `dequantize_hqq` (the same bits, in place)."""

    def _dequantize(self, qtensor):
        """The store de-quantized, [batch, kv_heads, tokens, head_dim]."""
        return dequantize_hqq(qtensor)

    def _codes_of(self, qtensor) -> StoreCodes | None:
        """The store as the decode kernel reads it (`kvdemo.cache.layers.code_attention.hqq_codes`), or None."""
        return hqq_codes(qtensor)


EXACT_LAYERS: dict[type, type[QuantizedLayer]] = {
    QuantoQuantizedLayer: ExactQuantoLayer,
    HQQQuantizedLayer: ExactHQQLayer,
}
"""transformers' layer class -> the same layer de-quantizing in place, which kvdemo's layers build on."""
