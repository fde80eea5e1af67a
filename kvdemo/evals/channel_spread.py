"""Why the rotation helps, measured on a real cache: how unevenly a layer's keys (or values) spread over their
head_dim channels, before and after the Hadamard rotation (`channel_max`), and the span of every quantization
group's grid as the library itself stored it (`group_spans`).

A group-wise quantizer gives each group one grid of 2**nbits levels from its smallest to its largest value. When
a few channels carry large values for every token (the keys' outlier channels: the rotary pairs of low
frequency), every group that holds one of them gets a wide grid, and the other channels of the group fall on a
few levels. The rotation (`kvdemo.cache.layers.rotation.rotate`, x @ H) spreads each channel over all head_dim channels,
so the channels' maxima even out and a group's span shrinks towards the typical magnitude. Pattern: QuaRot
(Ashkboos et al. 2024, arXiv:2404.00456, its figure 1: per-channel activation magnitudes before and after a
Hadamard rotation); KIVI (Liu et al. 2024, arXiv:2402.02750, section 3: the keys' outlier channels).
Nothing here quantizes: the spans are read from optimum-quanto's and hqq's own stores.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.cache_utils import BaseQuantizedLayer, Cache

from kvdemo.cache.layers.rotation import rotate
from kvdemo.evals.cache_error import KV

TENSORS = ("keys", "values")
"""What `channel_max` and `group_spans` read: the keys or the values of a layer."""


def _which(tensor: str) -> int:
    if tensor not in TENSORS:
        raise ValueError(f"tensor={tensor!r}: choose keys or values")
    return TENSORS.index(tensor)


def channel_max(kv: KV, layer: int, tensor: str = "keys", rotated: bool = False) -> torch.Tensor:
    """The largest |x| over the batch and the tokens, per KV head and channel, of one layer's keys or values.

    Args:
        kv: per layer (keys, values), each [batch, kv_heads, tokens, head_dim], e.g. from
            `kvdemo.evals.cache_error.reference_kv` (the full-precision ones).
        layer: the layer's index.
        tensor: `keys` or `values`.
        rotated: measure `x @ H` (what `rotation=hadamard` hands the library's quantizer) instead of x.

    Returns:
        [kv_heads, head_dim] float64 on the CPU, in the tensor's units.

    Raises:
        IndexError: no such layer. ValueError: the layer holds no keys and values; `tensor` is neither keys nor
        values; rotated with a head_dim that is not a power of two (`kvdemo.cache.layers.rotation.hadamard`).
    """
    held = kv[layer]
    if held is None:
        raise ValueError(
            f"layer {layer} holds no keys and values (conv or recurrent states, or nothing); choose another"
        )
    x = held[_which(tensor)].double()
    if rotated:
        x = rotate(x)
    return x.abs().amax(dim=(0, 2)).cpu()


def spread(maxima: torch.Tensor) -> torch.Tensor:
    """Per KV head, the largest channel maximum over the median one (`channel_max`'s [kv_heads, head_dim] ->
    [kv_heads], float64): 1 for channels that spread evenly, large where a few channels dominate."""
    return maxima.amax(dim=-1) / maxima.median(dim=-1).values


def group_spans(cache: Cache, layer: int, tensor: str = "keys") -> torch.Tensor:
    """The span of each quantization group's grid in one layer's store, as the library stored it: scale x
    (2**nbits - 1), from optimum-quanto's `WeightQBitsTensor._scale` (its codes run from 0 to 2**nbits - 1) or
    hqq's `meta["scale"]` (de-quantized = (codes - zero) x scale). In the basis the store holds: a rotated
    layer's spans are those of `x @ H`.

    Args:
        cache: a prefilled `QuantizedCache` of quanto or hqq (its store holds the context's tokens; with
            `flush=append`, the blocks' groups one after the other).
        layer: the layer's index.
        tensor: `keys` or `values`.

    Returns:
        [groups] float64 on the CPU, in the tensor's units, in the library's order of its groups.

    Raises:
        IndexError: no such layer. ValueError: `tensor` is neither keys nor values; the layer is not quantized, has
        no store yet, or is not group-wise (fp8's one scale per tensor is not a group grid).
    """
    which = _which(tensor)
    entry = cache.layers[layer]
    if not isinstance(entry, BaseQuantizedLayer):
        raise ValueError(f"layer {layer} is {type(entry).__name__}, not quantized: it has no quantization groups")
    store = (entry._quantized_keys, entry._quantized_values)[which]
    if store is None:
        raise ValueError(f"layer {layer} has no quantized store yet; prefill the cache first")
    # `flush=append` keeps a list of blocks, each what the library's `_quantize` returned (`kvdemo.cache.layers.flush`)
    return torch.cat([_block_spans(block, layer, entry) for block in (store if isinstance(store, list) else [store])])


def _block_spans(block, layer: int, entry) -> torch.Tensor:
    """`group_spans` of one block the library's `_quantize` returned: [groups] float64 on the CPU."""
    if isinstance(block, tuple) and isinstance(block[1], dict) and "scale" in block[1]:  # hqq: (codes, meta)
        meta = cast(dict, block[1])
        scale, nbits = meta["scale"], int(meta["nbits"])
    elif hasattr(block, "_scale") and hasattr(block, "qtype"):  # optimum-quanto's WeightQBitsTensor
        scale, nbits = block._scale, int(block.qtype.bits)
    else:
        raise ValueError(f"layer {layer} ({type(entry).__name__}) is not group-wise: it has no per-group scales")
    return (scale.double().abs().flatten() * (2**nbits - 1)).cpu()
