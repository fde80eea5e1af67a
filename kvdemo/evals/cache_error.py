"""Where a quantized KV cache's error sits, and whether it drifts: the de-quantized keys and values against the
full-precision ones of the same tokens, per layer and KV head (`reference_kv`, `dequantized_kv`, `kv_error`), and the
context's error measured again after each flush (`context_error`, `drift_ratio`). De-quantizing uses each backend's
own code, never a quantizer of ours; see `kvdemo.evals.fidelity` for the method and its sources.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import BaseQuantizedLayer, Cache, DynamicLayer

from kvdemo.cache.layers.rotation import to_model_basis
from kvdemo.qa.models import LoadedModel

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""Keys and values per layer, each of shape [batch, kv_heads, tokens, head_dim]."""


def full_precision_kv(cache: Cache) -> KV:
    """The keys and values a `DynamicCache` holds (no copy), per layer: [batch, kv_heads, tokens, head_dim].

    Raises:
        TypeError: a layer is quantized (use `dequantized_kv`).
    """
    out = []
    for index, layer in enumerate(cast("list[DynamicLayer]", cache.layers)):  # a DynamicCache's or QuantizedCache's
        if isinstance(layer, BaseQuantizedLayer):
            raise TypeError(f"layer {index} is quantized ({type(layer).__name__}); use dequantized_kv")
        out.append(cast("tuple[torch.Tensor, torch.Tensor]", (layer.keys, layer.values)))  # set by a prefill
    return tuple(out)


def reference_kv(loaded_model: LoadedModel, token_ids: Sequence[int]) -> KV:
    """The full-precision keys and values of `token_ids` (a prefill into a fresh `DynamicCache` in the model's
    dtype): the reference `kv_error` compares a quantized cache with.

    Returns:
        Per layer (keys, values), each [1, kv_heads, len(token_ids), head_dim] on the model's device.

    Raises:
        ValueError: no token, or more than the model's window.
    """
    if not token_ids:
        raise ValueError("no token to prefill; give the context's token ids")
    if len(token_ids) > loaded_model.max_context_tokens:
        raise ValueError(f"{len(token_ids)} tokens exceed the model's {loaded_model.max_context_tokens}-token window")
    cache = DynamicCache(config=loaded_model.config)
    ids = torch.tensor([list(token_ids)], device=loaded_model.device)
    with torch.no_grad():
        loaded_model.forward(ids, cache)
    return full_precision_kv(cache)


def dequantized_kv(cache: Cache, tokens: int | None = None) -> KV:
    """The keys and values the model reads from `cache` (nothing in it changes): for a quantized layer the
    backend's own de-quantization of its store (`layer._dequantize`, as `QuantizedLayer.update` calls it) followed
    by the full-precision residual, in the model's basis (a query-side rotated layer's rotated back,
    `kvdemo.cache.layers.rotation.to_model_basis`); for a `DynamicLayer` its tensors.

    Args:
        tokens: keep only the first `tokens` positions (e.g. the context's); None keeps all.

    Returns:
        Per layer (keys, values), each [batch, kv_heads, tokens, head_dim], in the model's dtype.

    Raises:
        ValueError: a layer holds fewer than `tokens` tokens, or nothing (no prefill yet).
    """
    out = []
    for index, layer in enumerate(cast("list[DynamicLayer]", cache.layers)):  # a DynamicCache's or QuantizedCache's
        if not layer.is_initialized:
            raise ValueError(f"layer {index} holds nothing; prefill the cache first")
        keys, values = layer_kv(layer)
        if tokens is not None:
            if keys.shape[-2] < tokens:
                raise ValueError(f"layer {index} holds {keys.shape[-2]} tokens, fewer than the {tokens} asked for")
            keys, values = keys[..., :tokens, :], values[..., :tokens, :]
        out.append((keys, values))
    return tuple(out)


def layer_kv(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """One initialized cache layer's keys and values as the model reads them (see `dequantized_kv`): for a quantized
    layer its store de-quantized by the backend's own code, then its residual, in the model's basis; for a
    `DynamicLayer` its tensors. Each [batch, kv_heads, tokens, head_dim]."""
    if not isinstance(layer, BaseQuantizedLayer):
        assert layer.keys is not None and layer.values is not None  # an initialized layer holds tensors
        return layer.keys, layer.values
    keys = layer._dequantize(layer._quantized_keys)
    values = layer._dequantize(layer._quantized_values)
    if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.shape[-2]:
        assert layer.values is not None  # set with the keys
        keys = torch.cat([keys, layer.keys.to(keys.dtype)], dim=-2)
        values = torch.cat([values, layer.values.to(values.dtype)], dim=-2)
    return to_model_basis(layer, keys), to_model_basis(layer, values, values=True)  # a query-side rotation


@dataclass(frozen=True)
class KVError:
    """Relative error of a cache's keys and values against the full-precision ones of the same tokens.

    Attributes:
        keys, values: [layers][kv_heads]: ||K - K^||_F / ||K||_F over the tokens and head_dim of one layer and KV
            head (the same for values); 0 for a full-precision cache.
        keys_total, values_total: the same over every layer and head at once (norms of the whole tensors).
        total: keys and values together: sqrt(sum ||K - K^||^2 + ||V - V^||^2) / sqrt(sum ||K||^2 + ||V||^2).
        tokens: the positions compared.
    """

    keys: tuple[tuple[float, ...], ...]
    values: tuple[tuple[float, ...], ...]
    keys_total: float
    values_total: float
    total: float
    tokens: int

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as float64 tensors of shape [layers, kv_heads]."""
        return torch.tensor(self.keys, dtype=torch.float64), torch.tensor(self.values, dtype=torch.float64)


def _squares(reference: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, sum of squared errors and sum of squared reference values (float64, shape [kv_heads])."""
    ref = reference.double()
    err = (ref - approx.to(ref.device).double()).pow(2).sum(dim=(0, 2, 3))
    return err.cpu(), ref.pow(2).sum(dim=(0, 2, 3)).cpu()


def kv_error(reference: KV, cache: Cache) -> KVError:
    """Where the error sits: per layer and KV head, ||K - K^|| / ||K|| and ||V - V^|| / ||V|| (Frobenius norms over
    the tokens and head_dim) of `cache`'s de-quantized keys and values (`dequantized_kv`) against the
    full-precision `reference` of the same tokens, on the first `tokens` positions of the cache.

    Args:
        reference: from `reference_kv` (or `full_precision_kv` of a `DynamicCache` prefilled with the same tokens):
            per layer, [batch, kv_heads, tokens, head_dim].
        cache: the cache under test, holding at least those tokens first (after the prefill, or later: then the
            first `tokens` positions, the context's, are compared; see `context_error`).

    Returns:
        A `KVError` ([layers][kv_heads] matrices and totals).

    Raises:
        ValueError: the layer counts or shapes differ.

    Example:
        >>> session = QASession(loaded, CacheSpec("hqq", nbits=2)); session.prefill(context)
        >>> error = kv_error(reference_kv(loaded, session.context_ids(context)), session.cache)
        >>> keys, values = error.matrices()  # [layers, kv_heads] each
    """
    if len(reference) != len(cache.layers):
        raise ValueError(f"the reference has {len(reference)} layers and the cache {len(cache.layers)}")
    tokens = reference[0][0].shape[-2]
    approx = dequantized_kv(cache, tokens)
    rows_k, rows_v = [], []
    sums = torch.zeros(4, dtype=torch.float64)  # key error, key norm, value error, value norm
    for (ref_k, ref_v), (k, v) in zip(reference, approx):
        if ref_k.shape != k.shape or ref_v.shape != v.shape:
            raise ValueError(f"reference {tuple(ref_k.shape)} and cache {tuple(k.shape)} shapes differ")
        ek, nk = _squares(ref_k, k)
        ev, nv = _squares(ref_v, v)
        rows_k.append(tuple(float(x) for x in (ek / nk).sqrt()))
        rows_v.append(tuple(float(x) for x in (ev / nv).sqrt()))
        sums += torch.stack([ek.sum(), nk.sum(), ev.sum(), nv.sum()])
    err_k, norm_k, err_v, norm_v = (float(x) for x in sums)
    return KVError(
        keys=tuple(rows_k),
        values=tuple(rows_v),
        keys_total=math.sqrt(err_k / norm_k),
        values_total=math.sqrt(err_v / norm_v),
        total=math.sqrt((err_k + err_v) / (norm_k + norm_v)),
        tokens=tokens,
    )


def context_error(reference: KV, cache: Cache) -> float:
    """`kv_error(reference, cache).total`: the relative error of the context's keys and values together, read
    after a flush to see whether re-quantizing moved them (drift)."""
    return kv_error(reference, cache).total


def drift_ratio(prefill_error: float, runs: Sequence[Sequence[float]]) -> tuple[float | None, int]:
    """Whether flushes make the context's error grow: of the runs of flushes (each the `context_error` after every
    flush of one answer or continuation, which all start from the post-prefill cache), the one with the most
    flushes (the first on a tie); its last error divided by the error after the prefill.

    Returns:
        (ratio, flushes in that run); (None, 0) when no run flushed or the prefill error is 0 (full precision).
        1.0 means re-quantizing left the context as it was.
    """
    longest = max(runs, key=len, default=())
    if not longest or prefill_error <= 0:
        return None, 0
    return longest[-1] / prefill_error, len(longest)
