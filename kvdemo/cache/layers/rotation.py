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

Two ways, the same arithmetic in exact terms (`benchmarks/rotation.py` measures both per decode step):

- **query side** (`QueryRotationMixin`, what `rotation=hadamard` builds when the model attends through
  `kvdemo.cache.layers.attention.kvdemo_attention`): the layer rotates each new token's key and value once, on entry,
  and keeps everything (store and residual) in the rotated basis; attention rotates the query and rotates its
  output back. O(new tokens x head_dim^2) per layer and step.
- **read side** (`RotationMixin`, for a model whose attention is not kvdemo's, e.g. `eager`): the library
  quantizes `x @ H` at each flush, and every read of the store is rotated back after de-quantizing, so the
  residual and what `update` returns stay in the model's basis. O(tokens x head_dim^2) per layer and step on top
  of the de-quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import QuantizedLayer

from kvdemo.cache.model.geometry import hadamard_block

if TYPE_CHECKING:

    class LibraryLayer(QuantizedLayer):
        """What a mixin here or in `kvdemo.cache.layers.flush` is mixed into, as the type checker sees it: a
        `QuantizedLayer` whose `_quantize` and `_dequantize` are the library's own (quanto's, hqq's)."""

        def _quantize(self, tensor, axis): ...

        def _dequantize(self, q_tensor): ...

        def _codes_of(self, q_tensor): ...

else:
    LibraryLayer = object


@lru_cache(maxsize=16)
def hadamard(size: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The orthonormal Hadamard matrix of `size`, [size, size]: for a power of two, Sylvester's construction
    H_2n = [[H_n, H_n], [H_n, -H_n]] from H_1 = [1], divided by sqrt(size); for any other size, the block-diagonal
    matrix of size / b such matrices of size b = `hadamard_block(size)` (3 x H_32 for 96). Both are symmetric and
    orthonormal: H @ H = I. The block-diagonal one spreads an outlier channel over the b channels of its block only
    (QuaRot's and llama.cpp's rotations need a power-of-two head_dim; this is the fallback for the others, e.g.
    Phi-3's 96): a group along head_dim whose range one channel sets shrinks less than under a full H, by how much
    depends on how the outliers fall into blocks. Built in float64, then cast to `dtype` on `device` (cached:
    read-only, never modify it).

    Raises:
        ValueError: `size` < 1. (A spec's rotation is refused earlier, by `rotation_problem`, where the block is
            below `MIN_HADAMARD_BLOCK`.)
    """
    if size < 1:
        raise ValueError(f"a Hadamard matrix needs a size >= 1, not {size}")
    block = hadamard_block(size)
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < block:
        matrix = torch.cat([torch.cat([matrix, matrix], dim=1), torch.cat([matrix, -matrix], dim=1)], dim=0)
    matrix = matrix / block**0.5
    if block < size:
        matrix = torch.block_diag(*[matrix] * (size // block))
    return matrix.to(dtype=dtype, device=device)


def rotate(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor @ H` along its last axis (head_dim; `hadamard` of its size), in its own dtype and device: the same shape.
    H is its own inverse, so `rotate` also rotates back."""
    return tensor @ hadamard(tensor.shape[-1], tensor.dtype, str(tensor.device))


ROTATION_SEED = 42
"""The seed of the random signs of a signed rotation (`random_signs`; vLLM's TurboQuant seed): one sign vector per
head_dim, the same in every layer, session and process."""


@lru_cache(maxsize=16)
def random_signs(size: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """[size] random +-1 drawn from `ROTATION_SEED` (a CPU generator, so the same on every machine), in `dtype` on
    `device` (cached: read-only). D in the signed rotation x -> (x D) H (`QueryRotation`)."""
    generator = torch.Generator().manual_seed(ROTATION_SEED)
    signs = torch.randint(0, 2, (size,), generator=generator, dtype=torch.int64) * 2 - 1
    return signs.to(dtype=dtype, device=device)


@dataclass(frozen=True)
class QueryRotation:
    """How a query-side rotated layer's keys (and values) are rotated, as the mark on its keys tells
    `kvdemo.cache.layers.attention.kvdemo_attention`: x -> x H (`rotation=hadamard`, keys and values), or the
    randomized Hadamard transform x -> (x D) H with D the diagonal of `random_signs` (TurboQuant's keys,
    `kvdemo.cache.formats.turboquant.layers`; the signs before H make the rotated coordinates of any vector random, as a
    random rotation does: a Hadamard row itself would come out as one spike). Both are orthonormal, so attention
    rotates the query the same way and sees the same scores.

    Attributes:
        signed: the random signs D come first.
        values: the values are rotated too (the output is then rotated back).
    """

    signed: bool = False
    values: bool = True

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` [..., head_dim] in the rotated basis: (x D) H, or x H unsigned."""
        if self.signed:
            tensor = tensor * random_signs(tensor.shape[-1], tensor.dtype, str(tensor.device))
        return rotate(tensor)

    def back(self, tensor: torch.Tensor) -> torch.Tensor:
        """`forward` undone: (y H) D, or y H unsigned (H H = I, D D = I)."""
        tensor = rotate(tensor)
        if self.signed:
            tensor = tensor * random_signs(tensor.shape[-1], tensor.dtype, str(tensor.device))
        return tensor

    def back_values(self, tensor: torch.Tensor) -> torch.Tensor:
        """Values, or the attention output, back in the model's basis: `back` (one rotation for keys and values)."""
        return self.back(tensor)


HADAMARD = QueryRotation()
"""`rotation=hadamard`'s query-side rotation: keys and values times H."""

ROTATED_MARK = "_kvdemo_rotated"
"""The attribute a query-side rotated layer sets (a `QueryRotation`) on the key tensor its `update` returns; read by
`kvdemo.cache.layers.attention.kvdemo_attention`."""


def mark_rotated(keys: torch.Tensor, rotation: QueryRotation = HADAMARD) -> torch.Tensor:
    """`keys` ([batch, kv_heads, tokens, head_dim], in `rotation`'s basis) marked for `kvdemo_attention`: the same
    tensor object, returned."""
    setattr(keys, ROTATED_MARK, rotation)
    return keys


class RotationMixin(LibraryLayer):
    """`rotation=hadamard` rotated on read, for a transformers `QuantizedLayer` subclass: the library's `_quantize`
    gets the keys and values rotated along head_dim, its `_dequantize` output is rotated back (H is its own
    inverse). The residual stays as it is (full precision, never rotated), so what `update` returns is the same
    layout as without rotation, for any attention function."""

    def _quantize(self, tensor, axis):
        """The library's quantization of `tensor @ H` (tensor [batch, kv_heads, tokens, head_dim])."""
        return super()._quantize(rotate(tensor).contiguous(), axis)

    def _dequantize(self, q_tensor):
        """The library's de-quantization, rotated back: [batch, kv_heads, tokens, head_dim]."""
        return rotate(super()._dequantize(q_tensor))

    def rotation_cost(self, query_heads: int, kv_heads: int, stored_tokens: int) -> tuple[int, str]:
        """(head_dim x head_dim products a decode step spends rotating, side): the store's keys and values rotated back
        at every read, 2 x stored tokens x KV heads (`kvdemo.cache.state.speedlimit.rotation_flops`)."""
        return 2 * stored_tokens * kv_heads, "read"


class QueryRotationMixin(LibraryLayer):
    """`rotation=hadamard` on the query side, for a transformers `QuantizedLayer` subclass (or kvdemo's `append`
    layers): `update` rotates the new keys and values once (`rotate_new`) and hands them to the layer's own update, so
    the store (the library's quantization of rotated tensors, its `_quantize` and `_dequantize` untouched) and the
    residual are in the rotated basis, and so are the keys and values returned, which carry the mark
    (`mark_rotated`) that makes `kvdemo_attention` rotate the query and the output.
    Only for a model that attends through `kvdemo_attention`; `kvdemo.cache.layers.flush.quantized_cache` checks that.

    Attributes:
        query_rotation: the `QueryRotation` (`HADAMARD`: keys and values times H; `to_model_basis` turns them back).
    """

    query_rotation: QueryRotation = HADAMARD

    def rotate_new(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New keys and values ([batch, kv_heads, new tokens, head_dim]) in the layer's rotated basis."""
        rotation = self.query_rotation
        return rotation.forward(key_states), (rotation.forward(value_states) if rotation.values else value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own update of the new keys and values rotated (`rotate_new`, [batch, kv_heads, new tokens,
        head_dim]); returns its (keys, values) in the rotated basis, the keys marked."""
        keys, values = super().update(*self.rotate_new(key_states, value_states), *args, **kwargs)
        return mark_rotated(keys, self.query_rotation), values

    def rotation_cost(self, query_heads: int, kv_heads: int, stored_tokens: int) -> tuple[int, str]:
        """(head_dim x head_dim products a decode step spends rotating, side): the query and the new key, and the output
        and the new value where values rotate too (TurboQuant's do not), whatever the tokens stored."""
        return (2 if self.query_rotation.values else 1) * (query_heads + kv_heads), "query"


def to_model_basis(layer, tensor: torch.Tensor, values: bool = False) -> torch.Tensor:
    """`tensor` (keys, or with `values` the values, read from `layer`'s store or residual, [..., head_dim]) in the
    model's basis: rotated back if the layer keeps it in a rotated basis (`QueryRotationMixin`), else as it is."""
    rotation = getattr(layer, "query_rotation", None)
    if rotation is None or (values and not rotation.values):
        return tensor
    return rotation.back_values(tensor) if values else rotation.back(tensor)
