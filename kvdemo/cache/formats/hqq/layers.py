"""hqq's layers: hqq's de-quantization with the same bits, in place (as quanto's, `kvdemo.cache.formats.quanto.layers`,
whose docstring gives the measure), its store as the decode kernel reads it, and the quantizer `optimize` picks.

hqq (`Quantizer.dequantize`) computes `W_r = unpack(W_q, dtype=compute_dtype)`, then `((W_r - zero) * scale)`, then
`reshape(shape)`, a new float tensor at each operation; here `unpack(W_q).sub_(zero).mul_(scale)` with hqq's own
unpacking (`Quantizer.unpack[packing]`) and shaping, so every rounding is hqq's (`tests/test_dequantize.py` checks
`torch.equal` with the library's `_dequantize` for every nbits, axis and group size kvdemo offers).
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedConfig, QuantizedCache
from transformers.cache_utils import HQQQuantizedLayer

from kvdemo.cache.layers.flush import AppendFlushMixin, ResidualLayers, residual_cache
from kvdemo.cache.layers.rotation import QueryRotationMixin, RotationMixin
from kvdemo.cache.policies import OPTIMIZE_CHOICES
from kvdemo.cache.read.code_attention import StoreCodes, affine_codes


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


HQQ_SHIFTS = {"8bit_u8": (0, 0), "4bit_u8": (4, -4), "2bit_u8": (6, -2), "1bit_u8": (7, -1), "3bit_32": (27, -3)}
"""hqq's packings (`hqq.core.bitpack.BitPack`): (bit of the first row chunk, step to the next)."""


def hqq_codes(qtensor: tuple[torch.Tensor, dict]) -> StoreCodes | None:
    """hqq's `(W_q, meta)` (what `HQQQuantizedLayer._quantize` returns) as the kernel reads it: a packing of
    `HQQ_SHIFTS`, axis 0 (the matrix [group_size, numel / group_size], a group per column) or 1 ([numel / group_size,
    group_size], a group per row), float32 zero, scale and compute dtype; else None."""
    packed, meta = qtensor
    shifts = HQQ_SHIFTS.get(str(meta.get("packing")))
    dtype = torch.float32
    if shifts is None or meta.get("view_as_float") or meta.get("compute_dtype") != dtype or meta["axis"] not in (0, 1):
        return None
    shape, group = tuple(meta["shape"]), meta["group_size"]
    numel = math.prod(shape)
    cols = numel // group if meta["axis"] == 0 else group
    return affine_codes(
        packed, meta["scale"], meta["zero"], shape=shape, bits=meta["nbits"], cols=cols,
        shifts=shifts, by_row=meta["axis"] == 1, zero_first=True,
    )  # fmt: skip


class ExactHQQLayer(HQQQuantizedLayer):
    """transformers' `HQQQuantizedLayer` de-quantizing by `dequantize_hqq` (the same bits, in place)."""

    def _dequantize(self, qtensor):
        """The store de-quantized, [batch, kv_heads, tokens, head_dim]."""
        return dequantize_hqq(qtensor)

    def _codes_of(self, qtensor) -> StoreCodes | None:
        """The store as the decode kernel reads it (`hqq_codes`), or None."""
        return hqq_codes(qtensor)


class RotatedHQQLayer(RotationMixin, ExactHQQLayer):
    """transformers' `HQQQuantizedLayer` storing rotated keys and values, rotated back on read."""


class QueryRotatedHQQLayer(QueryRotationMixin, ExactHQQLayer):
    """transformers' `HQQQuantizedLayer` in the rotated basis, for `kvdemo_attention`."""


class AppendHQQLayer(AppendFlushMixin, ExactHQQLayer):
    """transformers' `HQQQuantizedLayer` with the `append` flush policy (`kvdemo.cache.layers.flush`)."""


class AppendRotatedHQQLayer(AppendFlushMixin, RotatedHQQLayer):
    """`RotatedHQQLayer` with the `append` flush policy."""


class AppendQueryRotatedHQQLayer(QueryRotationMixin, AppendFlushMixin, ExactHQQLayer):
    """`QueryRotatedHQQLayer` with the `append` flush policy."""


HQQ_LAYERS = ResidualLayers(
    "hqq",  # transformers' QuantizedCache backend name
    ExactHQQLayer,
    RotatedHQQLayer,
    QueryRotatedHQQLayer,
    AppendHQQLayer,
    AppendRotatedHQQLayer,
    AppendQueryRotatedHQQLayer,
)
"""hqq's layers under each rotation and flush, for `kvdemo.cache.layers.flush.quantized_cache`."""


def set_quantizer(cache: QuantizedCache, optimize: str) -> QuantizedCache:
    """`cache` with its hqq layers given the quantizer `optimize` asks for (`kvdemo.cache.formats.hqq.optimize`: the
    fused solver, or min-max rounding alone).

    Raises:
        ValueError: `optimize` is not one of `OPTIMIZE_CHOICES`; `optimize=false` on a cache without hqq layers."""
    from .optimize import MinMaxQuantizer, ProximalQuantizer

    if optimize not in OPTIMIZE_CHOICES:
        raise ValueError(f"optimize={optimize!r} is not one of {', '.join(OPTIMIZE_CHOICES)}")
    if optimize == "false" and not isinstance(cache.layers[0], HQQQuantizedLayer):
        name = type(cache.layers[0]).__name__
        raise ValueError(f"optimize=false is hqq's option; {name} has no optimiser to switch off")
    quantizer = MinMaxQuantizer if optimize == "false" else ProximalQuantizer
    for layer in cache.layers:
        if isinstance(layer, HQQQuantizedLayer):
            layer.quantizer = quantizer  # the library's layer calls `self.quantizer`
    return cache


def hqq_cache(options: dict, config: PreTrainedConfig) -> QuantizedCache:
    """`kvdemo.cache.layers.flush.residual_cache` of hqq's layers with a spec's options, its `optimize` option given
    to the layers' quantizer (`set_quantizer`). Raises ValueError as those two do."""
    options = dict(options)
    optimize = str(options.pop("optimize", OPTIMIZE_CHOICES[0]))
    return set_quantizer(residual_cache(HQQ_LAYERS, options, config), optimize)
