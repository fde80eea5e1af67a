"""vLLM's TurboQuant write path: every token coded as it is written, in vLLM's layout (`vllm`), read by the decode
kernel from its codes.

vLLM's TurboQuant backend stores each new token into its cache before attention runs (`do_kv_cache_update`), and its
decode attention scores every cached token from the codes, the step's own included; its prefill attends to the
prompt in full precision (`vllm/v1/attention/backends/turboquant_attn.py`). So `turboquant` with `layout=vllm`,
`residual_length=1` and `flush=append` (every preset) is an `AppendedLayer` (`kvdemo.cache.layers.appended`): the
first update stores the prefill and returns it as given, later updates code their tokens into vLLM's records, and a
decode step hands kvdemo's attention the store, read from its codes. The bytes are `vllm.quantize_keys` and
`vllm.quantize_values`, unchanged.

The keys' codes stand for (k / |k|) H, H the plain Hadamard matrix. Attention reads them in that basis and rotates
the query by the same H once per step (`VLLM_KEY_ROTATION`, the mark on the keys a decode step returns), where
vLLM's read path rotates the other way; the scores are the same in exact arithmetic. Only the decode steps' reads are
in the rotated basis (`_read_rotated`, which the kernel equals bit for bit, except that for `_nc` keys the kernel sums
|c|^2 in its own order); every other read is in the model's basis (`_dequantize`). k8v4's float8 keys are stored in
the model's basis and read as they are, with no rotation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from kvdemo.cache.layers.appended import AppendedLayer, reading_blocks
from kvdemo.cache.layers.blockwise import StoreBlocks, blocks_of
from kvdemo.cache.layers.by_kind import sliding_windows, with_kept_layers
from kvdemo.cache.layers.rotation import QueryRotation, mark_rotated
from kvdemo.cache.layers.sliding import SlidingStoreWindow
from kvdemo.cache.model.layer_kinds import quantized_layers
from kvdemo.cache.read.code_attention import StoreCodes, scaled_codes

from .codes import lookup_codes, uniform_codes
from .vllm import (
    VllmFp8Keys,
    VllmKeys,
    VllmValues,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
    rotated_keys,
    vllm_centroids,
)

VLLM_KEY_ROTATION = QueryRotation(signed=False, values=False)
"""vLLM's rotation of the keys, x H (no random signs), the values left in the model's basis: the query is rotated the
same way at a decode step."""

FP8_KEY_BITS = 8
"""nbits at which the keys are float8_e4m3, not rotated (vLLM's `k8v4`: no scale; kvdemo's layout: a scale per token
and head)."""


class VllmTurboLayer(AppendedLayer):
    """One decoder layer's keys and values in vLLM's TurboQuant layout, each token coded as it is written (module
    docstring).

    Attributes:
        nbits, nbits_value: the keys' bits (3, 4, or 8 for float8 keys) and the values' (3 or 4).
        norm_correction: vLLM's `_nc`: a key reads back as its centroids over their own norm, times the stored norm.
        _quantized_keys, _quantized_values: a `VllmKeys` (or `VllmFp8Keys`) and a `VllmValues`.
    """

    def __init__(self, nbits: int = 4, nbits_value: int | None = None, norm_correction: bool = False) -> None:
        super().__init__()
        self.nbits, self.nbits_value = nbits, nbits if nbits_value is None else nbits_value
        self.norm_correction = norm_correction

    @property
    def rotates_query(self) -> bool:
        """Whether a decode step's attention rotates the query (Lloyd-Max keys read from their codes by kvdemo's
        attention); float8 keys and a model attending some other way read the keys in the model's basis."""
        return self.reads_blocks and self.nbits != FP8_KEY_BITS

    def _code(self, states: torch.Tensor, keys: bool, store: Any) -> VllmKeys | VllmFp8Keys | VllmValues:
        """`states` [batch, kv_heads, tokens, head_dim] as vLLM stores keys (`keys`) or values."""
        return quantize_keys(states, self.nbits) if keys else quantize_values(states, self.nbits_value)

    def _dequantize(self, q_tensor: VllmKeys | VllmFp8Keys | VllmValues) -> torch.Tensor:
        """A record read back in the model's basis, [batch, kv_heads, tokens, head_dim] of the layer's dtype."""
        assert self.keys is not None  # set by the first update
        if isinstance(q_tensor, VllmValues):
            return dequantize_values(q_tensor, self.nbits_value, self.keys.dtype)
        return dequantize_keys(q_tensor, self.nbits, self.norm_correction, self.keys.dtype)

    def _codes_of(self, q_tensor: VllmKeys | VllmFp8Keys | VllmValues) -> StoreCodes | None:
        """A record as the decode kernel reads it: values as code x scale + zero, float8 keys as they are, Lloyd-Max
        keys as centroid x norm in the rotated basis (over the centroids' norm for `_nc`)."""
        if isinstance(q_tensor, VllmValues):
            return uniform_codes(q_tensor.codes, q_tensor.scale, q_tensor.zero, self.nbits_value)
        if isinstance(q_tensor, VllmFp8Keys):
            return scaled_codes(q_tensor.codes)
        if not self.rotates_query:
            return None
        dimension = q_tensor.codes.shape[-1] * 8 // self.nbits
        table = vllm_centroids(dimension, self.nbits)
        return lookup_codes(q_tensor.codes, q_tensor.norms, self.nbits, table, unit=self.norm_correction)

    def _read_rotated(self, q_tensor: Any) -> torch.Tensor:
        """A record (a `VllmKeys`, `VllmFp8Keys` or `VllmValues`) read back as a decode step's attention reads it:
        Lloyd-Max keys in the rotated basis (centroid x norm, as the kernel computes them), anything else as
        `_dequantize`; [batch, kv_heads, tokens, head_dim]."""
        if not isinstance(q_tensor, VllmKeys):
            return self._dequantize(q_tensor)
        assert self.keys is not None
        return rotated_keys(q_tensor, self.nbits, self.norm_correction).to(self.keys.dtype)

    def stored_blocks(self, tokens: int | None = None) -> StoreBlocks:
        """The store for a decode step's attention, read in the basis of the query it scores (`_read_rotated`)."""
        blocks = super().stored_blocks(tokens)
        return replace(blocks, dequantize=self._read_rotated) if self.rotates_query else blocks

    def rotation_cost(self, query_heads: int, kv_heads: int, stored_tokens: int) -> tuple[int, str]:
        """(head_dim x head_dim products a decode step spends rotating, side): the query and the new key on the query
        side; every stored key rotated back on the read side (`dequantize_keys`); none for float8 keys."""
        if self.nbits == FP8_KEY_BITS:
            return 0, ""
        return (query_heads + kv_heads, "query") if self.rotates_query else (stored_tokens * kv_heads, "read")


class _MarksQuery:
    """Marks the keys a decode step hands kvdemo's attention with `VLLM_KEY_ROTATION`, so that it rotates the query
    (first in a layer's bases: a window's update makes the tail it returns)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # type: ignore[misc]
        if self.rotates_query and blocks_of(keys) is not None:  # type: ignore[attr-defined]
            mark_rotated(keys, VLLM_KEY_ROTATION)
        return keys, values


class VllmTurboQuantLayer(_MarksQuery, VllmTurboLayer):
    """`VllmTurboLayer` as a cache holds it."""


class SlidingVllmTurboQuantLayer(_MarksQuery, SlidingStoreWindow, VllmTurboLayer):
    """`VllmTurboLayer` over a sliding window (`kvdemo.cache.layers.sliding.SlidingStoreWindow`)."""


def vllm_turboquant_cache(
    config: PreTrainedConfig, nbits: int, nbits_value: int | None, norm_correction: bool, sliding: str, protect: str
) -> Cache:
    """A transformers `Cache` whose quantized layers (`kvdemo.cache.model.layer_kinds`: `sliding`, `protect`) write
    vLLM's layout token by token (`VllmTurboLayer`), a sliding one over its window; the others as
    `DynamicCache(config=...)` builds them."""
    windows = sliding_windows(config)
    layers: list = [None] * len(windows)  # the layers kept at full precision: `with_kept_layers`
    for index in quantized_layers(config, sliding, protect):
        window = windows[index]
        layers[index] = (
            VllmTurboQuantLayer(nbits, nbits_value, norm_correction)
            if window is None
            else SlidingVllmTurboQuantLayer(
                window, nbits=nbits, nbits_value=nbits_value, norm_correction=norm_correction
            )
        )
    return with_kept_layers(Cache(layers=reading_blocks(layers, config)), config, sliding, protect)
