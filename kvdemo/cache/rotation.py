"""Rotated keys and values: a quantized layer that stores the library's quantization of `x @ H` and reads
`dequantize(.) @ H`, H the orthonormal Hadamard matrix of size head_dim (symmetric, so H @ H = I: in exact
arithmetic attention sees the same keys and values). kvdemo has no quantization code: `_quantize` and
`_dequantize` stay optimum-quanto's and hqq's own, called on the rotated tensors.

Why it helps: a key channel that carries an outlier (large |k| in a few of head_dim's channels, for every
token: the rotary pairs with low frequencies) sets the scale of every group it is in, so the other channels of
those groups are rounded coarsely. H spreads each channel over all head_dim channels (every entry of H is
+-1/sqrt(head_dim)), so the channels' ranges even out and a group's range shrinks towards the typical one.
Groups that run along head_dim (quanto's and hqq's `axis=0` store them along the last axis after the library's
reshape) gain most. Pattern: QuaRot (Ashkboos et al. 2024, arXiv:2404.00456), llama.cpp's Hadamard rotation of
a quantized KV cache (ggml-org/llama.cpp#21038), ik_llama.cpp's `-khad`/`-vhad`.

Cost, as done here (un-rotate after de-quantizing): one [tokens, head_dim] x [head_dim, head_dim] product per
layer and tensor at every quantization (the flush) and at every read of the store (every decode step), so
O(tokens x head_dim^2) per step per layer on top of the de-quantization (`benchmarks/rotation.py` measures
it). The alternative, rotating the query and un-rotating the attention output instead (O(head_dim^2) per new
token), is not built here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import HQQQuantizedLayer, QuantizedLayer, QuantoQuantizedLayer

if TYPE_CHECKING:

    class LibraryLayer(QuantizedLayer):
        """What a mixin here or in `kvdemo.cache.flush` is mixed into, as the type checker sees it: a
        `QuantizedLayer` whose `_quantize` and `_dequantize` are the library's own (quanto's, hqq's)."""

        def _quantize(self, tensor, axis): ...

        def _dequantize(self, q_tensor): ...

else:
    LibraryLayer = object


def rotation_problem(head_dim: int) -> str | None:
    """Why `rotation=hadamard` cannot run for this head_dim (a Sylvester Hadamard matrix needs a power of two),
    or None."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        return f"rotation=hadamard needs head_dim to be a power of two (this model's is {head_dim}); use rotation=none"
    return None


@lru_cache(maxsize=16)
def hadamard(size: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The orthonormal Hadamard matrix of `size` (a power of two), [size, size]: Sylvester's construction
    H_2n = [[H_n, H_n], [H_n, -H_n]] from H_1 = [1], divided by sqrt(size). Symmetric and orthonormal: H @ H = I.
    Built in float64, then cast to `dtype` on `device` (cached: read-only, never modify it).

    Raises:
        ValueError: `size` is not a power of two (`rotation_problem`).
    """
    problem = rotation_problem(size)
    if problem:
        raise ValueError(problem)
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], dim=1), torch.cat([matrix, -matrix], dim=1)], dim=0)
    return (matrix / size**0.5).to(dtype=dtype, device=device)


def _rotate(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor @ H` along its last axis (head_dim), in its own dtype and device."""
    return tensor @ hadamard(tensor.shape[-1], tensor.dtype, str(tensor.device))


class RotationMixin(LibraryLayer):
    """`rotation=hadamard` for a transformers `QuantizedLayer` subclass: the library's `_quantize` gets the keys
    and values rotated along head_dim, its `_dequantize` output is rotated back (H is its own inverse). The
    residual stays as it is (full precision, never rotated), so what `update` returns is the same layout as
    without rotation."""

    def _quantize(self, tensor, axis):
        """The library's quantization of `tensor @ H` (tensor [batch, kv_heads, tokens, head_dim])."""
        return super()._quantize(_rotate(tensor).contiguous(), axis)

    def _dequantize(self, q_tensor):
        """The library's de-quantization, rotated back: [batch, kv_heads, tokens, head_dim]."""
        return _rotate(super()._dequantize(q_tensor))


class RotatedQuantoLayer(RotationMixin, QuantoQuantizedLayer):
    """transformers' `QuantoQuantizedLayer` storing rotated keys and values."""


class RotatedHQQLayer(RotationMixin, HQQQuantizedLayer):
    """transformers' `HQQQuantizedLayer` storing rotated keys and values."""


ROTATED_LAYERS: dict[type, type[QuantizedLayer]] = {
    QuantoQuantizedLayer: RotatedQuantoLayer,
    HQQQuantizedLayer: RotatedHQQLayer,
}
"""transformers' layer class -> the same layer storing rotated keys and values."""
