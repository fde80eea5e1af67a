"""kvdemo's attention function: transformers' `sdpa_attention_forward`, plus the query side of a rotated cache and
the block-wise read of a quantized store.

A cache layer that stores its keys and values in the rotated basis (`kvdemo.cache.layers.rotation.QueryRotationMixin`:
it rotates each new token once, K' = K @ H, V' = V @ H, H the orthonormal Hadamard matrix, H @ H = I) hands
attention K' and V' with a mark (`ROTATED_MARK`, a Python attribute on the key tensor). For marked keys this
function attends with the query rotated and rotates the output back:

    softmax((q H)(K H)^T) (V H) H = softmax(q K^T) V      (H H^T = I, H symmetric)

so attention's scores and output are those of the unrotated keys and values in exact arithmetic, at a cost of
O(new tokens x head_dim^2) per layer and step (the query and the output), not O(cached tokens x head_dim^2) (the
read-side rotation of `kvdemo.cache.layers.rotation.RotationMixin`, which rotates the whole de-quantized store back at
every step). Keys marked by a block-wise layer (`kvdemo.cache.layers.blockwise.BLOCKS_MARK`: quanto and hqq at a decode
step) are the residual, and the mark names the quantized store's blocks: `attend_blockwise` attends to each block as
the layer de-quantizes it and merges the parts by log-sum-exp; a call it does not take (a mask, several new tokens,
another device than the CPU) reads the whole store joined, as transformers' layer returns it. Unmarked keys (every
other cache: `dynamic`, fp8, transformers' own caches in the same model) go to `sdpa_attention_forward` unchanged,
with the same arguments: the same bits.

The function is registered with transformers' `AttentionInterface` under `ATTENTION`, and its masks with
`AttentionMaskInterface` (transformers' `sdpa_mask`, so every mask is what `sdpa` gets); `install(model)` points a
model whose attention is `sdpa` at it (`model.set_attn_implementation`). The model's attention layers look the
function up by `config._attn_implementation` at every forward pass. Pattern: transformers' documentation,
"Attention Interface" (registering a wrapper of `sdpa_attention_forward`), and QuaRot's online rotation of the
query (Ashkboos et al. 2024, arXiv:2404.00456); llama.cpp rotates Q, K and V for a quantized KV cache
(ggml-org/llama.cpp#21038).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import BaseQuantizedLayer, Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvdemo.cache.layers.blockwise import StoreBlocks, attend_blockwise, blocks_of, code_reader, codes_read
from kvdemo.cache.layers.rotation import ROTATED_MARK, QueryRotation
from kvdemo.cache.layers.sliding import SlidingWindowMask
from kvdemo.cache.read import c_build, code_attention

ATTENTION = "kvdemo_sdpa"
"""The name kvdemo's attention function is registered under (`config._attn_implementation` of an installed model)."""


def kvdemo_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' `sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)`; for keys marked
    by `kvdemo.cache.layers.rotation.mark_rotated` (keys, and values unless the mark says otherwise, in the
    rotated basis), with the query rotated the same way (`QueryRotation.forward`: `query @ H`, or TurboQuant's
    `(query D) @ H`) and the output rotated back where the values were rotated; for keys marked by a block-wise
    layer, over the store's blocks and the residual
    (`kvdemo.cache.layers.blockwise.attend_blockwise`).

    Args:
        query: [batch, heads, new tokens, head_dim]; key, value: [batch, kv_heads, tokens, head_dim] (for
            block-wise keys, the residual tokens only).

    Returns:
        (attention output [batch, new tokens, heads, head_dim] in the model's basis, None), as sdpa's.
    """
    recorder = _RECORDER.get()
    if recorder is not None:  # `recording_queries` in this thread: keep the query, in the model's basis
        recorder.add(module, query, kwargs.get("scaling"))
    rotation: QueryRotation | None = getattr(key, ROTATED_MARK, None)
    if rotation is not None:
        query = rotation.forward(query)
    blocks = blocks_of(key)
    if blocks is not None and _blockwise_call(query, key, blocks, attention_mask, kwargs) and not _MATERIALIZE.get():
        output, weights = attend_blockwise(query, key, value, blocks, kwargs.get("scaling")), None
    else:
        if blocks is not None:  # a call the block-wise path does not take: the whole store, as transformers'
            key, value = blocks.materialized(key, value)
        output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return (rotation.back_values(output) if rotation is not None and rotation.values else output), weights


def _blockwise_call(
    query: torch.Tensor, tail: torch.Tensor, blocks: StoreBlocks, attention_mask: torch.Tensor | None, kwargs: dict
) -> bool:
    """Whether `attend_blockwise` gives this call's attention: one new token on the CPU (its kernel is torch's CPU
    flash attention), every key visible, no dropout, no attention sinks and no soft cap (options it does not apply).

    Every key is visible where there is no mask and no sliding window, or where the store is a window's (its
    `blocks.tokens` known: `kvdemo.cache.layers.sliding`, ggml's `SlidingGgmlLayer`) no longer than the window, and any
    mask covers exactly its tokens and the tail and hides none (a sliding layer's mask once the window is full)."""
    if query.shape[-2] != 1 or query.device.type != "cpu" or kwargs.get("dropout"):
        return False
    if any(kwargs.get(name) is not None for name in ("s_aux", "softcap")):
        return False
    window = kwargs.get("sliding_window")
    if attention_mask is None and window is None:
        return True
    if blocks.tokens is None:
        return False
    keys = blocks.tokens + tail.shape[-2]
    if window is not None and keys > window:
        return False
    if attention_mask is None:
        return True
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return attention_mask.shape[-1] == keys and bool(visible.all())


@dataclass
class QueryRecord:
    """The queries attention received in the `recording_queries` block, per layer: the last `last` positions.

    Attributes:
        last: how many of the latest query positions each layer keeps.
        queries: layer index -> [batch, heads, <= last, head_dim], in the model's basis (before any rotation), in
            the order the positions came (a chunked prefill's chunks are joined).
        scaling: layer index -> the softmax scale attention used (the module's `scaling`; sdpa's
            1/sqrt(head_dim) where the model gives none).
    """

    last: int
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)

    def add(self, module: torch.nn.Module, query: torch.Tensor, scaling: float | None) -> None:
        """Keep `query`'s positions for `module`'s layer (`module.layer_idx`), the last `last` of them."""
        index = int(getattr(module, "layer_idx", len(self.queries)))
        held = self.queries.get(index)
        joined = query.detach() if held is None else torch.cat([held, query.detach()], dim=-2)
        self.queries[index] = joined[..., -self.last :, :].clone()  # not a view pinning the whole chunk
        self.scaling[index] = float(scaling if scaling is not None else query.shape[-1] ** -0.5)


_RECORDER: ContextVar[QueryRecord | None] = ContextVar("kvdemo_query_recorder", default=None)
_MATERIALIZE: ContextVar[bool] = ContextVar("kvdemo_materialize_blocks", default=False)


@contextmanager
def materialized_blocks() -> Iterator[None]:
    """Within it (in this thread), keys a block-wise layer marked are attended whole: every block de-quantized and
    joined with the residual (`StoreBlocks.materialized`), then transformers' sdpa, instead of torch's flash kernel
    block by block (`attend_blockwise`). The marks still travel from the cache to attention, so a model that keeps
    them gives exactly the read-whole logits here: `kvdemo.qa.probe` uses it to tell kvdemo's own block-wise read
    going wrong from a model that changes the keys between the cache and attention."""
    token = _MATERIALIZE.set(True)
    try:
        yield
    finally:
        _MATERIALIZE.reset(token)


@contextmanager
def recording_queries(last: int) -> Iterator[QueryRecord]:
    """Inside the block, `kvdemo_attention` keeps the last `last` query positions of every layer it runs in this
    thread (a `ContextVar`: another user's forward pass through the same shared model records nothing), so that
    a measure can ask what attention would give with other keys and values (`kvdemo.evals.planner`). Only a model
    that attends through kvdemo's function (`install`) records.

    Args:
        last: positions per layer to keep (>= 1).

    Raises:
        ValueError: last < 1.

    Example:
        >>> with recording_queries(64) as record:
        ...     reference = reference_kv(loaded, ids)
        >>> record.queries[0].shape  # [batch, heads, 64, head_dim]
    """
    if last < 1:
        raise ValueError(f"last={last} must be >= 1 (query positions kept per layer)")
    record = QueryRecord(last)
    token = _RECORDER.set(record)
    try:
        yield record
    finally:
        _RECORDER.reset(token)


AttentionInterface.register(ATTENTION, kvdemo_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def install(model: PreTrainedModel) -> bool:
    """Point `model`'s attention at `kvdemo_attention` if it is `sdpa` (transformers' default where the model
    supports it); any other implementation (eager, flash) is left as it is, and rotated caches then rotate on
    read (`uses_query_rotation`).

    Returns:
        Whether the model's attention is now kvdemo's.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ATTENTION)
    return uses_query_rotation(config)


def uses_query_rotation(config) -> bool:
    """Whether a model with this config attends through `kvdemo_attention` (so a rotated cache may hand it keys
    and values in the rotated basis): the config and its decoder's text config (the one a cache is built for)
    both name it. A model class that cannot switch its attention (transformers warns and keeps it) names sdpa."""
    if getattr(config, "_attn_implementation", None) != ATTENTION:
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) == ATTENTION


DECODE_READS = {
    "codes": "reads the stored codes",
    "blocks": "de-quantizes each block",
    "whole": "de-quantizes the whole store",
    "full": "reads full precision",
}
"""How a layer's decode steps read its keys and values (`layer_reads`) -> the words `decode_read` uses."""


def layer_reads(cache: Cache, model: torch.nn.Module) -> list[str | None]:
    """The `DECODE_READS` key of how each of `cache`'s layers is attended at a decode step of `model`:

    - `codes` where `kvdemo_attention` reads the store's codes (`kvdemo.cache.read.code_attention`): a layer that
      hands attention its blocks (`reads_blocks`: the block-wise layers, `GgmlLayer` on the query side) and whose
      blocks the kernel reads, the model in float32 on the CPU, the kernel built, outside `dequantized_reads`, and an
      attention module that passes none of the options `attend_blockwise` does not take (`_blockwise_call`:
      attention sinks, a soft cap; a sliding window, unless the layer's store is the window's: a block-wise
      `kvdemo.cache.layers.sliding.SlidingWindowMask`, whose decode steps hand the window alone);
    - `blocks` where it de-quantizes block by block (`kvdemo.cache.layers.blockwise`);
    - `whole` for another quantized layer, or one whose attention takes the whole store joined (a GPU, one of those
      options);
    - `full` for a full-precision layer; None for a layer that holds no keys (a KV-shared or recurrent layer).
    """
    parameter = next(model.parameters())
    joined = _joined_layers(model) if parameter.device.type == "cpu" else None  # None: every block-wise layer
    kernel = code_attention.kernel() is not None and codes_read() and parameter.dtype == torch.float32
    reads: list[str | None] = []
    layer: Any
    for index, layer in enumerate(cache.layers):
        if getattr(layer, "reads_blocks", False):
            options = None if joined is None else joined.get(index, set())
            if options is None or options - ({"sliding_window"} if isinstance(layer, SlidingWindowMask) else set()):
                reads.append("whole")
                continue
            codes = getattr(layer, "_codes_of", None) if kernel and code_reader(layer.__class__) else None
            stores = [
                s[0] if isinstance(s, list) and s else s for s in (layer._quantized_keys, layer._quantized_values)
            ]
            coded = codes and all(store is not None and codes(store) is not None for store in stores)
            reads.append("codes" if coded else "blocks")
        elif isinstance(layer, BaseQuantizedLayer):
            reads.append("whole")
        else:
            reads.append("full" if getattr(layer, "keys", None) is not None else None)
    return reads


def _joined_layers(model: torch.nn.Module) -> dict[int, set[str]]:
    """Layer index -> the attention module's attributes that transformers passes as options `attend_blockwise` does
    not take in general (`sliding_window`, attention sinks as `s_aux`, `softcap`): `sliding_window`,
    `sinks`, `attn_logit_softcapping`; layers with none are left out."""
    joined: dict[int, set[str]] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and type(module).__name__.endswith("Attention"):
            names = {
                name
                for name in ("sliding_window", "sinks", "attn_logit_softcapping")
                if getattr(module, name, None) is not None
            }
            if names:
                joined[index] = names
    return joined


def decode_read(cache: Cache, model: torch.nn.Module) -> str:
    """How a decode step of `model` attends to `cache` (after its prefill), for the page and the reports: "Decode
    attention reads the stored codes in 30 layers", or each path with its layer count ("...; de-quantizes the whole
    store in 4 layers"), and why the kernel is missing where no C compiler built it (`layer_reads`)."""
    counts: dict[str, int] = {}
    for read in layer_reads(cache, model):
        if read is not None:
            counts[read] = counts.get(read, 0) + 1
    parts = [f"{DECODE_READS[read]} in {n} layer{'s' if n != 1 else ''}" for read, n in counts.items()]
    problem = code_attention.kernel() is None and c_build.build_problem(code_attention.SOURCE)
    return "Decode attention " + "; ".join(parts) + (f" (the code kernel is not built: {problem})" if problem else "")
