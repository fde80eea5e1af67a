"""Where a quantized KV cache's error sits, and whether it drifts: the de-quantized keys and values against the
full-precision ones of the same tokens, per layer and KV head (`reference_kv`, `dequantized_kv`, `kv_error`), and the
context's error measured again after each flush (`context_error`, `drift_ratio`). De-quantizing uses each backend's
own code, never a quantizer of ours; see `kvdemo.evals.fidelity` for the method and its sources.

Every layer kind (`kvdemo.cache.model.layer_kinds`) is compared with what it holds (`LayerRead`, one per layer):
- a full-attention layer: every context token (`ALL_TOKENS`); on a latent (MLA) model the latent and the rotary key
  part it caches, latent to latent (`KVError.latent`);
- a sliding-window layer (kept or `sliding=quantize`): the tokens it holds after the prefill, the context's last
  `sliding_window - 1` (`WINDOW`); once an answer has moved its window past the context, it is left out of the
  context's error (`MOVED`);
- a linear-attention or conv layer: states, not keys and values, left out (`STATE`); a KV-shared or MLP-only layer
  holds nothing (`NOTHING`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast, overload

import torch
from transformers import DynamicCache
from transformers.cache_utils import BaseQuantizedLayer, Cache, DynamicLayer

from kvdemo.cache.layers.rotation import to_model_basis
from kvdemo.cache.model.layer_kinds import STATE_ATTRIBUTES
from kvdemo.qa.models import LoadedModel

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values, each [batch, kv_heads, tokens, head_dim] (a window: its last tokens)."""

KV = tuple[LayerKV | None, ...]
"""Keys and values per layer; None for a layer that holds none (linear-attention or conv states, a KV-shared or
MLP-only layer)."""

ALL_TOKENS, WINDOW, MOVED, STATE, NOTHING = "all tokens", "window", "window moved", "state", "nothing"
"""What `kv_error` compared of a layer (`KVError.reads`): every context token; a sliding window's tokens; left out:
a window an answer has moved past the context, conv or recurrent states, a layer that holds nothing."""

COMPARED = (ALL_TOKENS, WINDOW)
"""The reads whose error is measured; the others are left out of the matrices (empty rows) and the totals."""


@dataclass(frozen=True)
class ReferenceKV(Sequence):
    """The full-precision keys and values of a context: a sequence of `LayerKV | None`, one per layer, and the
    context's token count (a window layer holds fewer).

    Attributes:
        layers: per layer (keys, values) or None (see `KV`).
        tokens: the context's tokens.
    """

    layers: KV
    tokens: int

    def __len__(self) -> int:
        return len(self.layers)

    @overload
    def __getitem__(self, index: int) -> LayerKV | None: ...
    @overload
    def __getitem__(self, index: slice) -> KV: ...
    def __getitem__(self, index):
        return self.layers[index]

    def __iter__(self) -> Iterator[LayerKV | None]:
        return iter(self.layers)

    def prefix(self, tokens: int) -> ReferenceKV:
        """The reference of the context's first `tokens` tokens (attention is causal, so a full layer's first
        positions are those of a shorter context); a window layer, whose earlier window it does not hold, becomes
        None (left out)."""
        cut = tuple(
            None if kv is None or kv[0].shape[-2] < self.tokens else (kv[0][..., :tokens, :], kv[1][..., :tokens, :])
            for kv in self.layers
        )
        return ReferenceKV(cut, min(tokens, self.tokens))


def as_reference(reference: Sequence[LayerKV | None]) -> ReferenceKV:
    """A `ReferenceKV` as given, or one of plain layers whose context is the longest layer's tokens."""
    if isinstance(reference, ReferenceKV):
        return reference
    tokens = max((kv[0].shape[-2] for kv in reference if kv is not None), default=0)
    return ReferenceKV(tuple(reference), tokens)


def _holding(layer) -> str:
    """What a cache layer holds: `ALL_TOKENS` for keys and values (of any span), else `STATE` (conv or recurrent
    states only) or `NOTHING` (`DummyLayer`).

    Raises:
        ValueError: a layer of keys and values not filled yet (no prefill)."""
    if isinstance(layer, BaseQuantizedLayer) or getattr(layer, "keys", None) is not None:
        return ALL_TOKENS
    if any(hasattr(layer, name) for name in STATE_ATTRIBUTES):
        return STATE
    if type(layer).__name__ == "DummyLayer":
        return NOTHING
    raise ValueError(f"a {type(layer).__name__} holds nothing; prefill the cache first")


def full_precision_kv(cache: Cache) -> ReferenceKV:
    """The keys and values a full-precision cache (a `DynamicCache`, or a quantized backend's kept layers) holds, no
    copy; None for a layer without keys and values.

    Raises:
        TypeError: a layer is quantized (use `dequantized_kv`).
    """
    out: list[LayerKV | None] = []
    for index, layer in enumerate(cast("list[DynamicLayer]", cache.layers)):  # a DynamicCache's or QuantizedCache's
        if isinstance(layer, BaseQuantizedLayer):
            raise TypeError(f"layer {index} is quantized ({type(layer).__name__}); use dequantized_kv")
        held = _holding(layer) == ALL_TOKENS
        out.append(cast("LayerKV", (layer.keys, layer.values)) if held else None)
    return ReferenceKV(tuple(out), int(cache.get_seq_length()))  # a tensor on a hybrid cache (transformers 5.25)


def reference_kv(loaded_model: LoadedModel, token_ids: Sequence[int]) -> ReferenceKV:
    """The full-precision keys and values of `token_ids` (a prefill into a fresh `DynamicCache` in the model's
    dtype, built from the model's layer kinds): the reference `kv_error` compares a quantized cache with.

    Returns:
        Per layer (keys, values), each [1, kv_heads, len(token_ids), head_dim] on the model's device (a sliding
        window: its last `sliding_window - 1`), or None (see `KV`); `tokens` = len(token_ids).

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
    `kvdemo.cache.layers.rotation.to_model_basis`); for a `DynamicLayer` its tensors; None for a layer without keys
    and values.

    Args:
        tokens: keep only the first `tokens` positions (e.g. the context's) of every layer; None keeps all.

    Returns:
        Per layer (keys, values), each [batch, kv_heads, tokens, head_dim], in the model's dtype, or None.

    Raises:
        ValueError: a layer holds fewer than `tokens` tokens, or nothing (no prefill yet).
    """
    out: list[LayerKV | None] = []
    for index, layer in enumerate(cast("list[DynamicLayer]", cache.layers)):  # a DynamicCache's or QuantizedCache's
        try:
            holding = _holding(layer)
        except ValueError:
            raise ValueError(f"layer {index} holds nothing; prefill the cache first") from None
        if holding != ALL_TOKENS:
            out.append(None)
            continue
        keys, values = layer_kv(layer)
        if tokens is not None:
            if keys.shape[-2] < tokens:
                raise ValueError(f"layer {index} holds {keys.shape[-2]} tokens, fewer than the {tokens} asked for")
            keys, values = keys[..., :tokens, :], values[..., :tokens, :]
        out.append((keys, values))
    return tuple(out)


def layer_kv(layer) -> LayerKV:
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
            head (the same for values); 0 for a full-precision cache; an empty row for a layer left out (`reads`).
        keys_total, values_total: the same over the quantized layers and their heads at once (norms of the whole
            tensors): the error of what the spec stores quantized, which kept layers (exact) would dilute; over every
            compared layer where none is quantized (`dynamic`: 0).
        total: keys and values together: sqrt(sum ||K - K^||^2 + ||V - V^||^2) / sqrt(sum ||K||^2 + ||V||^2), over
            the same layers.
        tokens: the context's tokens.
        reads: per layer what was compared (`ALL_TOKENS`, `WINDOW`) or why it was left out (`MOVED`, `STATE`,
            `NOTHING`).
        quantized: per layer, whether the cache stores it quantized (else kept at full precision, or holding none).
        context_total: `total` over the quantized layers that hold every context token (`ALL_TOKENS`; all such
            layers where none is quantized): the figure the drift is measured on, since a window moves as an answer
            is decoded; None where no layer holds them all.
        latent: the layers hold a latent (MLA: the compressed latent and the rotary key part), compared as stored.
    """

    keys: tuple[tuple[float, ...], ...]
    values: tuple[tuple[float, ...], ...]
    keys_total: float
    values_total: float
    total: float
    tokens: int
    reads: tuple[str, ...] = ()
    quantized: tuple[bool, ...] = ()
    context_total: float | None = None
    latent: bool = False

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as float64 tensors of shape [layers, kv_heads], NaN for a layer left out."""
        heads = max((len(row) for row in self.keys), default=0)

        def matrix(rows: tuple[tuple[float, ...], ...]) -> torch.Tensor:
            return torch.tensor([list(row) if row else [math.nan] * heads for row in rows], dtype=torch.float64)

        return matrix(self.keys), matrix(self.values)


def _squares(reference: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, sum of squared errors and sum of squared reference values (float64, shape [kv_heads])."""
    ref = reference.double()
    err = (ref - approx.to(ref.device).double()).pow(2).sum(dim=(0, 2, 3))
    return err.cpu(), ref.pow(2).sum(dim=(0, 2, 3)).cpu()


def _read(layer, reference: LayerKV | None, tokens: int) -> tuple[str, LayerKV | None, LayerKV | None]:
    """What of one cache layer `kv_error` compares with its reference: (read, reference part, cache part)."""
    holding = _holding(layer)
    if holding != ALL_TOKENS:
        return holding, None, None
    if reference is None and getattr(layer, "is_sliding", False):
        return MOVED, None, None  # a shorter context's reference (`ReferenceKV.prefix`) holds no earlier window
    if reference is None:
        raise ValueError(f"the reference holds no keys and values where the cache holds {type(layer).__name__}'s")
    keys, values = layer_kv(layer)
    ref_k, ref_v = reference
    if getattr(layer, "is_sliding", False) and ref_k.shape[-2] < tokens:  # a window: its last tokens
        if int(layer.get_seq_length()) != tokens:
            return MOVED, None, None
        held = min(ref_k.shape[-2], keys.shape[-2])
        return WINDOW, (ref_k[..., -held:, :], ref_v[..., -held:, :]), (keys[..., -held:, :], values[..., -held:, :])
    if keys.shape[-2] < tokens:
        raise ValueError(f"a cache layer holds {keys.shape[-2]} tokens, fewer than the context's {tokens}")
    return (
        ALL_TOKENS,
        (ref_k[..., :tokens, :], ref_v[..., :tokens, :]),
        (keys[..., :tokens, :], values[..., :tokens, :]),
    )


def kv_error(reference: Sequence[LayerKV | None], cache: Cache, latent: bool = False) -> KVError:
    """Where the error sits: per layer and KV head, ||K - K^|| / ||K|| and ||V - V^|| / ||V|| (Frobenius norms over
    the tokens and head_dim) of `cache`'s de-quantized keys and values (`layer_kv`) against the full-precision
    `reference` of the same tokens: a full layer on the context's tokens (the first positions of the cache), a
    window on the tokens it holds, states and empty layers left out (the module docstring).

    Args:
        reference: from `reference_kv` (or `full_precision_kv` of a `DynamicCache` prefilled with the same tokens);
            a plain sequence of per-layer (keys, values) is taken as a context of its longest layer's tokens.
        cache: the cache under test, holding at least those tokens first (after the prefill, or later: then the
            context's positions are compared and a moved window is left out; see `context_error`).
        latent: the model caches a latent (MLA, `kvdemo.cache.model.layer_kinds.is_latent`): labels the result.

    Returns:
        A `KVError` ([layers][kv_heads] matrices, what each layer compared, and the totals).

    Raises:
        ValueError: the layer counts or shapes differ, or no layer could be compared.

    Example:
        >>> session = QASession(loaded, CacheSpec("hqq", nbits=2)); session.prefill(context)
        >>> error = kv_error(reference_kv(loaded, session.context_ids(context)), session.cache)
        >>> keys, values = error.matrices()  # [layers, kv_heads] each
    """
    ref = as_reference(reference)
    if len(ref) != len(cache.layers):
        raise ValueError(f"the reference has {len(ref)} layers and the cache {len(cache.layers)}")
    rows_k: list[tuple[float, ...]] = []
    rows_v: list[tuple[float, ...]] = []
    reads: list[str] = []
    quantized: list[bool] = []
    # key error, key norm, value error, value norm: over [every compared layer, the quantized ones] and the same
    # over the layers holding every context token
    sums = torch.zeros(2, 4, dtype=torch.float64)
    context = torch.zeros(2, 4, dtype=torch.float64)
    for layer, reference_layer in zip(cache.layers, ref):
        read, expected, held = _read(layer, reference_layer, ref.tokens)
        reads.append(read)
        quantized.append(isinstance(layer, BaseQuantizedLayer))
        if expected is None or held is None:
            rows_k.append(())
            rows_v.append(())
            continue
        if expected[0].shape != held[0].shape or expected[1].shape != held[1].shape:
            raise ValueError(f"reference {tuple(expected[0].shape)} and cache {tuple(held[0].shape)} shapes differ")
        ek, nk = _squares(expected[0], held[0])
        ev, nv = _squares(expected[1], held[1])
        rows_k.append(tuple(float(x) for x in (ek / nk).sqrt()))
        rows_v.append(tuple(float(x) for x in (ev / nv).sqrt()))
        part = torch.stack([ek.sum(), nk.sum(), ev.sum(), nv.sum()])
        rows = [0, 1] if quantized[-1] else [0]
        sums[rows] += part
        if read == ALL_TOKENS:
            context[rows] += part
    if not any(read in COMPARED for read in reads):
        raise ValueError(f"no layer of the cache holds the context's keys and values to compare (layers: {reads})")
    chosen = 1 if any(quantized[i] and reads[i] in COMPARED for i in range(len(reads))) else 0
    err_k, norm_k, err_v, norm_v = (float(x) for x in sums[chosen])
    chosen = 1 if context[1, 1] > 0 else 0
    c_err_k, c_norm_k, c_err_v, c_norm_v = (float(x) for x in context[chosen])
    return KVError(
        keys=tuple(rows_k),
        values=tuple(rows_v),
        keys_total=math.sqrt(err_k / norm_k),
        values_total=math.sqrt(err_v / norm_v),
        total=math.sqrt((err_k + err_v) / (norm_k + norm_v)),
        tokens=ref.tokens,
        reads=tuple(reads),
        quantized=tuple(quantized),
        context_total=math.sqrt((c_err_k + c_err_v) / (c_norm_k + c_norm_v)) if c_norm_k + c_norm_v else None,
        latent=latent,
    )


def context_error(reference: Sequence[LayerKV | None], cache: Cache) -> float | None:
    """`kv_error(reference, cache).context_total`: the relative error of the context's keys and values together in
    the layers that hold them all, read after a flush to see whether re-quantizing moved them (drift); None on a
    model whose every layer is a window."""
    return kv_error(reference, cache).context_total


def drift_ratio(prefill_error: float | None, runs: Sequence[Sequence[float | None]]) -> tuple[float | None, int]:
    """Whether flushes make the context's error grow: of the runs of flushes (each the `context_error` after every
    flush of one answer or continuation, which all start from the post-prefill cache), the one with the most
    flushes (the first on a tie); its last error divided by the error after the prefill (`KVError.context_total`).

    Returns:
        (ratio, flushes in that run); (None, 0) when no run flushed, the prefill error is 0 (full precision) or
        None (no layer holds the whole context). 1.0 means re-quantizing left the context as it was.
    """
    longest = max(runs, key=len, default=())
    if not longest or not prefill_error or longest[-1] is None:
        return None, 0
    return longest[-1] / prefill_error, len(longest)
