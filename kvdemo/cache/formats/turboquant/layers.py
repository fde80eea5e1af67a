"""The `turboquant` backend's layers: TurboQuant keys (a random rotation, then an optimal scalar code per coordinate
and the vector's norm) and uniform values, with the full-precision residual and the flush rule of the other
residual backends.

TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, arXiv:2504.19874, ICLR 2026; its MSE stage, Algorithm 1) as vLLM
serves it (`vllm/model_executor/layers/quantization/turboquant`, the `turboquant_*` `kv_cache_dtype` presets):

- **Keys** at nbits 2 to 4: each key vector k (one token, one KV head, head_dim d) is rotated by the randomized
  Hadamard transform y = (k D) H (`kvdemo.cache.layers.rotation.QueryRotation`, signed: D random signs drawn from a
  fixed seed, H the orthonormal Hadamard matrix), so that the coordinates of y / |k| follow the marginal of a
  uniform random unit vector whatever k was: an outlier channel is spread over all d coordinates. Each coordinate
  of y / |k| is stored as the index of its nearest centroid in the Lloyd-Max code of that marginal at d
  (`kvdemo.cache.formats.turboquant.lloyd_max.exact_marginal`), nbits bits packed densely, and |k| as one float16 per
  token and head. With `norm_correction=true` (vLLM's `_nc` presets) the stored norm is |k| / |c|, c the vector of
  centroids, so that the de-quantized key has exactly the key's norm (vLLM renormalises c at de-quantization; dividing
  the stored norm once is the same product, at no cost per read). QJL, the paper's second stage, is left out, as vLLM
  leaves it out ("community consensus (5+ independent groups) found it hurts attention quality").
- **Keys** at nbits 8 (vLLM's `k8v4`): float8_e4m3 codes with a scale per token and head, no rotation
  (`kvdemo.cache.formats.fp8.layers.quantize_per_token_head`).
- **Values**: uniform codes of nbits_value bits with a float16 scale and zero point per token and head (min-max
  rounding, no rotation): vLLM's value layout, `ceil(d x bits / 8) + 4` bytes per vector. Written here rather than
  with hqq's quantizer, which packs along the grouped axis and fails on token counts that are not a multiple of its
  pack (measured with hqq 0.2.8 at axis 1, group = head_dim: 2-bit at 1, 2, 5, 37 and 130 tokens; 3-bit at all).

The rotation runs once per token: on the query side (`QueryTurboQuantLayer`, when the model attends through
`kvdemo.cache.layers.attention.kvdemo_attention`) the layer rotates each new key on entry and keeps store and
residual keys rotated, and attention rotates the query by the same (x D) H (the values stay in the model's basis, so
the output needs no rotation); on the read side (`TurboQuantLayer`: a latent (MLA) model, another attention, a
quantized sliding window) the store's keys are rotated back at every read. Norms are stored in float16 (vLLM's
layout); a tensor whose norms, scales or zero points do not fit float16 keeps them in float32, and the measured bytes
show it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, QuantizedLayer

from kvdemo.cache.layers.blockwise import blockwise_layer
from kvdemo.cache.layers.by_kind import sliding_windows, with_kept_layers
from kvdemo.cache.layers.float8 import dequantize_per_token_head, placeable, quantize_per_token_head
from kvdemo.cache.layers.flush import AppendFlushMixin, attends_through_kvdemo
from kvdemo.cache.layers.precision import ValueAxis
from kvdemo.cache.layers.rotation import QueryRotation, QueryRotationMixin
from kvdemo.cache.layers.sliding import sliding_layer
from kvdemo.cache.model.layer_kinds import quantized_layers
from kvdemo.cache.policies import (
    FLUSH_POLICIES,
    NORM_CORRECTION_CHOICES,
    PROTECT_CHOICES,
    SLIDING_CHOICES,
    TURBOQUANT_LAYOUTS,
    vllm_write_path,
)
from kvdemo.cache.read.code_attention import StoreCodes, scaled_codes

from .codes import lookup_codes, uniform_codes
from .lloyd_max import decode_integers, decode_packed, exact_marginal, pack_codes
from .vllm import VllmFp8Keys, VllmKeys, VllmValues
from .vllm import dequantize_keys as vllm_dequantize_keys
from .vllm import dequantize_values as vllm_dequantize_values
from .vllm import quantize_keys as vllm_quantize_keys
from .vllm import quantize_values as vllm_quantize_values
from .vllm_layers import FP8_KEY_BITS, vllm_turboquant_cache

KEY_ROTATION = QueryRotation(signed=True, values=False)
"""TurboQuant's rotation of the keys: (k D) H, the values left in the model's basis."""


_TINY = torch.finfo(torch.float32).tiny


class TurboKeys(NamedTuple):
    """A key store: `codes` [batch, kv_heads, tokens, head_dim x nbits / 8] uint8 (`lloyd_max.pack_codes`), `norms`
    [batch, kv_heads, tokens, 1] float16 (float32 where a norm does not fit float16)."""

    codes: torch.Tensor
    norms: torch.Tensor


class UniformValues(NamedTuple):
    """A value store: `codes` [batch, kv_heads, tokens, head_dim x nbits_value / 8] uint8, `scale` and `zero`
    [batch, kv_heads, tokens, 1] float16 (float32 where one does not fit): value = code x scale + zero."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (float32) as float16 where every entry fits, else as it is."""
    half = tensor.to(torch.float16)
    return half if bool(torch.isfinite(half).all()) else tensor


def quantize_keys(rotated: torch.Tensor, bits: int, norm_correction: bool = False) -> TurboKeys:
    """TurboQuant's MSE code of keys already rotated (module docstring).

    Args:
        rotated: [batch, kv_heads, tokens, head_dim] keys times the rotation, any float dtype.
        bits: bits per coordinate (1 to 4).
        norm_correction: store |k| / |c| instead of |k| (vLLM's `_nc`).

    Returns:
        `TurboKeys`: head_dim x bits / 8 bytes and one norm per token and head.
    """
    x = rotated.float()
    norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    code = exact_marginal(x.shape[-1], bits)
    indices = code.encode(x / norms.clamp_min(_TINY))
    if norm_correction:
        norms = norms / torch.linalg.vector_norm(code.decode(indices), dim=-1, keepdim=True).clamp_min(_TINY)
    return TurboKeys(pack_codes(indices, bits), _compact(norms))


def dequantize_keys(store: TurboKeys, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """`quantize_keys` undone, in the rotated basis: centroid x norm, [batch, kv_heads, tokens, head_dim] of `dtype`."""
    dimension = store.codes.shape[-1] * 8 // bits
    keys = decode_packed(store.codes, bits, exact_marginal(dimension, bits).centroids, dtype)
    return keys.mul_(store.norms.to(dtype))


def quantize_uniform(tensor: torch.Tensor, bits: int) -> UniformValues:
    """Min-max uniform codes of `bits` bits (1 to 4, or 8) per token and head of `tensor` ([batch, kv_heads, tokens,
    head_dim]): scale = (max - min) / (2^bits - 1), zero = min, both rounded to float16 first so that the codes are
    those of the scale and zero stored."""
    x = tensor.float()
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    levels = 2**bits - 1
    scale = _compact(((high - low) / levels).clamp_min(float(torch.finfo(torch.float16).tiny)))
    zero = _compact(low)
    codes = ((x - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return UniformValues(pack_codes(codes, bits), scale, zero)


def dequantize_uniform(store: UniformValues, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """`quantize_uniform` undone: [batch, kv_heads, tokens, head_dim] of `dtype`."""
    values = decode_integers(store.codes, bits, dtype)
    return values.mul_(store.scale.to(dtype)).add_(store.zero.to(dtype))


class TurboQuantLayer(QuantizedLayer):
    """A TurboQuant layer read on the read side (module docstring): transformers' `QuantizedLayer` (its residual and
    flush, `update` unchanged) with TurboQuant's `_quantize` and `_dequantize`; the store is `TurboKeys` (or fp8
    codes and scales at nbits 8) and `UniformValues`, the keys rotated back at every read.

    Attributes:
        nbits: the keys' bits (2 to 4, or 8 for fp8 keys); nbits_value: the values' bits; norm_correction: see the
            module docstring; residual_length: full-precision tokens held before a flush. `axis_value` is a
            `ValueAxis` (`kvdemo.cache.layers.precision`), which tells `_quantize` the values from the keys.
    """

    rotated_store = False
    """The keys reach `_quantize` rotated already (the query side) and `_dequantize` leaves them rotated."""

    _nan_codes = False
    """fp8 keys only: whether the store may hold codes or scales bit placement cannot read (`fp8.placeable`; an
    attribute, so the snapshot's restore puts it back with the store it describes)."""

    def __init__(
        self,
        nbits: int = 4,
        nbits_value: int | None = None,
        residual_length: int = 128,
        norm_correction: bool = False,
        vllm: bool = False,
    ) -> None:
        super().__init__(
            nbits=nbits, axis_key=0, axis_value=ValueAxis(0), q_group_size=0, residual_length=residual_length
        )
        self.nbits_value = nbits if nbits_value is None else nbits_value
        self.norm_correction, self.vllm = norm_correction, vllm

    def _quantize(self, tensor, axis):
        """The keys' or (`axis` a `ValueAxis`) the values' store of `tensor` [batch, kv_heads, tokens, head_dim]; with
        `vllm`, vLLM's store (`kvdemo.cache.formats.turboquant.vllm`, keys given in the model's basis)."""
        if self.vllm:
            if isinstance(axis, ValueAxis):
                return vllm_quantize_values(tensor, self.nbits_value)
            return vllm_quantize_keys(tensor, self.nbits)
        if isinstance(axis, ValueAxis):
            return quantize_uniform(tensor, self.nbits_value)
        if self.nbits == FP8_KEY_BITS:
            codes, scale = quantize_per_token_head(tensor)
            if not self._nan_codes and not placeable(codes, scale):
                self._nan_codes = True
            return codes, scale
        rotated = tensor if self.rotated_store else KEY_ROTATION.forward(tensor.float())
        return quantize_keys(rotated, self.nbits, self.norm_correction)

    def _dequantize(self, q_tensor):
        """A store de-quantized, [batch, kv_heads, tokens, head_dim] of the residual's dtype."""
        dtype = self.keys.dtype if self.keys is not None else torch.float32
        if isinstance(q_tensor, VllmValues):
            return vllm_dequantize_values(q_tensor, self.nbits_value, dtype)
        if isinstance(q_tensor, (VllmKeys, VllmFp8Keys)):
            return vllm_dequantize_keys(q_tensor, self.nbits, self.norm_correction, dtype)
        if isinstance(q_tensor, UniformValues):
            return dequantize_uniform(q_tensor, self.nbits_value, dtype)
        if not isinstance(q_tensor, TurboKeys):  # fp8 keys: (codes, scales)
            return dequantize_per_token_head(q_tensor[0], q_tensor[1], dtype, by_bits=not self._nan_codes)
        keys = dequantize_keys(q_tensor, self.nbits, dtype)
        return keys if self.rotated_store else KEY_ROTATION.back(keys)

    def _codes_of(self, q_tensor) -> StoreCodes | None:
        """A store as the decode kernel reads it (`kvdemo.cache.read.code_attention`): kvdemo's layout, keys in
        the rotated basis (the query side) at 2-4 bits or float8 with a scale per token and head (nbits 8), values at
        2-8 bits; None for any other store (vLLM's layout)."""
        if isinstance(q_tensor, UniformValues):
            return uniform_codes(q_tensor.codes, q_tensor.scale, q_tensor.zero, self.nbits_value)
        if type(q_tensor) is tuple and self.nbits == FP8_KEY_BITS:  # float8 keys: (codes, scales)
            return scaled_codes(q_tensor[0], row_scale=q_tensor[1])
        if isinstance(q_tensor, TurboKeys) and self.rotated_store:
            dimension = q_tensor.codes.shape[-1] * 8 // self.nbits
            return lookup_codes(
                q_tensor.codes, q_tensor.norms, self.nbits, exact_marginal(dimension, self.nbits).centroids
            )
        return None


class QueryTurboQuantLayer(QueryRotationMixin, TurboQuantLayer):
    """`TurboQuantLayer` on the query side: new keys rotated once on entry (`QueryRotationMixin.update`), store and
    residual keys in the rotated basis, attention rotating the query (`KEY_ROTATION`); values as they are."""

    query_rotation = KEY_ROTATION
    rotated_store = True


class AppendTurboQuantLayer(AppendFlushMixin, TurboQuantLayer):
    """`TurboQuantLayer` with the `append` flush policy (`kvdemo.cache.layers.flush`): each flush codes the residual
    block alone and appends it; a token is coded once."""


class AppendQueryTurboQuantLayer(QueryRotationMixin, AppendFlushMixin, TurboQuantLayer):
    """`QueryTurboQuantLayer` with the `append` flush policy."""

    query_rotation = KEY_ROTATION
    rotated_store = True


def _layer_class(nbits: int, flush: str, window: int | None, own_attention: bool) -> type[TurboQuantLayer]:
    """The class of one quantized layer: a sliding window re-codes its window at a flush and reads it whole (read
    side, `kvdemo.cache.layers.sliding`); else the flush policy's layer, on the query side and read block by block
    when the model attends through kvdemo's attention (fp8 keys are not rotated: read side)."""
    if window is not None:
        return sliding_layer(TurboQuantLayer)
    query = own_attention and nbits != FP8_KEY_BITS
    if flush == FLUSH_POLICIES[1]:
        layer_class: type[TurboQuantLayer] = AppendQueryTurboQuantLayer if query else AppendTurboQuantLayer
    else:
        layer_class = QueryTurboQuantLayer if query else TurboQuantLayer
    return cast("type[TurboQuantLayer]", blockwise_layer(layer_class)) if own_attention else layer_class


def turboquant_cache(
    config: PreTrainedConfig,
    nbits: int = 4,
    nbits_value: int | None = None,
    residual_length: int = 128,
    flush: str = FLUSH_POLICIES[1],
    norm_correction: str = NORM_CORRECTION_CHOICES[0],
    sliding: str = SLIDING_CHOICES[0],
    protect: str = PROTECT_CHOICES[0],
    layout: str = TURBOQUANT_LAYOUTS[0],
) -> Cache:
    """The empty `turboquant` cache of a model: one TurboQuant layer per layer the backend quantizes
    (`kvdemo.cache.model.layer_kinds.quantized_layers` with `sliding` and `protect`), every other layer transformers'
    own (`kvdemo.cache.layers.by_kind.with_kept_layers`).

    Args:
        config: the model's config.
        nbits, nbits_value: the keys' and the values' bits (the registry's choices; `CacheSpec.validate` checks them);
            nbits_value None: nbits.
        residual_length: full-precision tokens held before a flush.
        flush: `append` (each residual block coded once, vLLM's and KIVI's pattern) or `requantize`.
        norm_correction: `true` or `false` (module docstring).
        sliding, protect: as `kvdemo.cache.layers.flush.quantized_cache` takes them.
        layout: `kvdemo` or `vllm` (vLLM's store byte for byte, `kvdemo.cache.formats.turboquant.vllm`). With
            `residual_length=1` and `flush=append` (every preset) vLLM's write path, each token coded as it comes and
            decode reading the codes (`kvdemo.cache.formats.turboquant.vllm_layers`); otherwise the residual layers,
            the store's keys rotated back at every read.

    Raises:
        ValueError: a flush policy, norm_correction or layout word that is not one.
    """
    if (
        flush not in FLUSH_POLICIES
        or norm_correction not in NORM_CORRECTION_CHOICES
        or layout not in TURBOQUANT_LAYOUTS
    ):
        raise ValueError(
            f"flush={flush!r}, norm_correction={norm_correction!r}, layout={layout!r}: a word is not allowed"
        )
    vllm = layout == TURBOQUANT_LAYOUTS[1]
    if vllm_write_path(layout, residual_length, flush):  # every token coded as it comes, as vLLM's
        return vllm_turboquant_cache(config, nbits, nbits_value, norm_correction == "true", sliding, protect)
    own_attention, windows = attends_through_kvdemo(config) and not vllm, sliding_windows(config)
    layers: list = [None] * len(windows)
    options: dict[str, Any] = dict(nbits=nbits, nbits_value=nbits_value, residual_length=residual_length)
    for index in quantized_layers(config, sliding, protect):
        window = windows[index]
        layer_class = _layer_class(nbits, flush, window, own_attention)
        extra = {} if window is None else {"sliding_window": window}
        layers[index] = layer_class(**options, norm_correction=norm_correction == "true", vllm=vllm, **extra)
        if window is not None:
            layers[index].reads_blocks = own_attention  # decode steps hand attention the window's part of the store
    return with_kept_layers(Cache(layers=layers), config, sliding, protect)
