"""Block-wise reads of a quantized store: a decode step attends to each stored block as the library de-quantizes
it, and to the full-precision tail, and merges the parts by their log-sum-exp, instead of de-quantizing the whole
store and joining it to the residual first.

transformers' `QuantizedLayer.update` returns `cat([dequantize(store), residual, new])` at every decode step: the
whole store de-quantized (one float tensor of every stored token) and copied once more by `torch.cat`, then read
by attention. Here a decode step's `update` (one new token, no flush) only appends the token to the residual and
returns the residual (the "tail", [batch, kv_heads, residual tokens, head_dim]) with a mark (`BLOCKS_MARK`, a
Python attribute on the returned key tensor) that names the store's blocks and the layer's own `_dequantize`.
`kvdemo.cache.layers.attention.kvdemo_attention` sees the mark and calls `attend_blockwise`: for each block, the
library's de-quantization of that block alone (quanto's, hqq's, through any kvdemo rotation or value precision
layered on it), then torch's CPU flash-attention kernel (`aten._scaled_dot_product_flash_attention_for_cpu`,
what `scaled_dot_product_attention` runs on CPU), which also returns each query's log-sum-exp of its scores;
the parts are merged exactly as softmax over the union of the blocks:

    out = sum_b exp(lse_b - lse) out_b,   lse = log sum_b exp(lse_b)

No concatenated copy of the store is made, and the de-quantized block is read while it is still in the CPU's
cache. The merge equals one softmax over all keys in exact arithmetic; in float32 it differs in the last bits
(`tests/test_blockwise.py` bounds it; `benchmarks/decode.py` checks the greedy tokens against the whole-store
path). The store is what the flush policy makes it: one block (`flush=requantize`, transformers' store) or the
prefill's block and one per flush (`flush=append`).

Every other step takes the layer's own `update` unchanged (the prefill, a question's tokens, a flush step, a
pending beam reorder), and so does any model whose attention is not kvdemo's
(`kvdemo.cache.layers.flush.quantized_cache` adds the mixin only where the config attends through
`kvdemo_attention`). The snapshot (`kvdemo.cache.state.snapshot`) is unchanged: `update` assigns new tensors, as
transformers' does.

Pattern: Flash-Decoding's split-KV decode (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
inference"): attention over blocks of the KV cache, each with its log-sum-exp, reduced at the end; FlashAttention's
softmax rescaling (Dao et al. 2022, arXiv:2205.14135).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch
from transformers.cache_utils import QuantizedLayer

from kvdemo.cache.layers.rotation import LibraryLayer, QueryRotationMixin, mark_rotated
from kvdemo.cache.read.code_attention import NotFinite, StoreCodes, attend_codes, float_rows

BLOCKS_MARK = "_kvdemo_blocks"
"""The attribute `BlockwiseReadMixin.update` sets on the key tensor it returns (a `StoreBlocks`); read by
`kvdemo.cache.layers.attention.kvdemo_attention`."""

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

_CODES: ContextVar[bool] = ContextVar("kvdemo_read_codes", default=True)


def codes_read() -> bool:
    """Whether block-wise layers read their codes in this thread now (False inside `dequantized_reads`)."""
    return _CODES.get()


@contextmanager
def dequantized_reads() -> Iterator[None]:
    """Within it (in this thread), every block is de-quantized and read by torch's flash kernel, as before the
    decode kernel (`kvdemo.cache.read.code_attention`): the reference its tests and `benchmarks/decode.py`
    compare it with."""
    token = _CODES.set(False)
    try:
        yield
    finally:
        _CODES.reset(token)


@dataclass(frozen=True)
class StoreBlocks:
    """A layer's quantized store as a decode step reads it, besides the full-precision tail.

    Attributes:
        keys, values: the store's blocks, oldest first, each what the library's `_quantize` returned (a quanto
            `QTensor`, an hqq `(W_q, meta)` pair).
        dequantize: the layer's `_dequantize` of one block -> [batch, kv_heads, block tokens, head_dim].
        codes: the layer's `_codes_of`, one block as the decode kernel reads it
            (`kvdemo.cache.read.code_attention`), where `code_reader` finds its `_dequantize` plain; None: every
            block is de-quantized.
        tokens: how many tokens of the blocks this step reads, where the layer knows every one is visible to it (a
            window's store: `kvdemo_attention` then takes a sliding window or a mask that hides none of them); None:
            not known, and such a call reads the whole store joined.
        first: tokens at the start of each head's store that left the window and are not read (a residual format's
            window, `kvdemo.cache.layers.sliding.SlidingQuantizedMixin`, whose store is one block).
    """

    keys: Sequence[object]
    values: Sequence[object]
    dequantize: Callable[[object], torch.Tensor]
    codes: Callable[[object], StoreCodes | None] | None = None
    tokens: int | None = None
    first: int = 0

    def read(self, block: object) -> torch.Tensor:
        """One block de-quantized, less its first `first` tokens: [batch, kv_heads, tokens, head_dim]."""
        values = self.dequantize(block)
        return values[..., self.first :, :] if self.first else values

    def coded(self, block: object) -> StoreCodes | None:
        """One block as the decode kernel reads it, less its first `first` tokens, or None."""
        codes = self.codes(block) if self.codes is not None else None
        if codes is None or not self.first:
            return codes
        return codes.window(self.first, codes.shape[2] - self.first)

    def materialized(self, tail_keys: torch.Tensor, tail_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [batch, kv_heads, stored + tail tokens, head_dim]: every block de-quantized and joined
        with the tail, as transformers' `QuantizedLayer.update` returns them (the fallback for an attention call
        `attend_blockwise` does not take)."""
        keys = torch.cat([*(self.read(b) for b in self.keys), tail_keys], dim=-2)
        values = torch.cat([*(self.read(b) for b in self.values), tail_values], dim=-2)
        return keys, values


def marked_tail(like: torch.Tensor, blocks: StoreBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's (keys, values) for a layer that writes every token into its store (no residual): empty,
    [batch, kv_heads, 0, head_dim] like `like`, the keys marked with `blocks` (the whole store, read by
    `attend_blockwise` from its codes, or joined where attention cannot)."""
    keys = like.new_empty(*like.shape[:2], 0, like.shape[-1])
    setattr(keys, BLOCKS_MARK, blocks)
    return keys, like.new_empty(keys.shape)


def blocks_of(keys: torch.Tensor) -> StoreBlocks | None:
    """The `StoreBlocks` marked on `keys` by `BlockwiseReadMixin.update`, or None."""
    return getattr(keys, BLOCKS_MARK, None)


class BlockwiseReadMixin(LibraryLayer):
    """Block-wise decode reads for a transformers `QuantizedLayer` subclass (or kvdemo's flush, rotation and value
    precision layers): see the module docstring. Only for a model that attends through
    `kvdemo.cache.layers.attention.kvdemo_attention`; `kvdemo.cache.layers.flush.quantized_cache` checks that."""

    reads_blocks = True
    """Decode steps hand attention the store's blocks (`BLOCKS_MARK`); `kvdemo.cache.formats.ggml.layers.GgmlLayer`
    too."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step (one new token, no flush): the token appended to the residual (rotated first in a
        query-side rotated layer, as `QueryRotationMixin.update` would), and (residual keys marked with the
        store's `StoreBlocks`, residual values) returned, each [batch, kv_heads, residual tokens, head_dim]. Any
        other step: the layer's own `update` (all stored tokens returned)."""
        if self.keys is None or self.values is None or not self.is_initialized:  # the prefill: the layer's own
            return super().update(key_states, value_states, *args, **kwargs)
        residual = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        if self._pending_beam_idx is not None or key_states.shape[-2] != 1 or residual + 1 >= self.residual_length:
            return super().update(key_states, value_states, *args, **kwargs)
        rotation = None
        if isinstance(self, QueryRotationMixin):  # its update is behind this one: rotate the token here
            rotation = self.query_rotation
            key_states, value_states = self.rotate_new(key_states, value_states)
        self.cumulative_length += 1
        # new tensors, as transformers' update assigns them (a snapshot holds the old ones)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        store_keys, store_values = self._quantized_keys, self._quantized_values
        blocks = StoreBlocks(
            keys=store_keys if isinstance(store_keys, list) else [store_keys],
            values=store_values if isinstance(store_values, list) else [store_values],
            dequantize=self._dequantize,
            codes=self._codes_of if code_reader(type(self)) else None,
        )
        keys = self.keys.view(self.keys.shape)  # a new tensor object: the mark never sticks to the stored residual
        setattr(keys, BLOCKS_MARK, blocks)
        return (mark_rotated(keys, rotation) if rotation is not None else keys), self.values


@cache
def code_reader(layer_class: type) -> bool:
    """Whether the decode kernel may read `layer_class`'s blocks from their codes: the class whose `_dequantize` a
    block goes through (past mixins marked `dequantize_delegates`, which hand a single block to the next class, as
    `AppendFlushMixin` does) also defines `_codes_of`, so that the codes it describes de-quantize to what
    `_dequantize` gives. A mixin that changes the read (a rotation back, `RotationMixin`) defines `_dequantize`
    without `_codes_of`, and its blocks are de-quantized."""
    for klass in layer_class.__mro__:
        if "_dequantize" in vars(klass) and not vars(klass).get("dequantize_delegates", False):
            return "_codes_of" in vars(klass)
    return False


@cache
def blockwise_layer(layer_class: type[QuantizedLayer]) -> type[QuantizedLayer]:
    """`layer_class` (kvdemo's layers of transformers' `QuantoQuantizedLayer` or `HQQQuantizedLayer`: in place,
    flush, rotation) with `BlockwiseReadMixin` in front, built once per class (e.g. `BlockwiseAppendHQQLayer`):
    a subclass of `layer_class`."""
    return type(f"Blockwise{layer_class.__name__}", (BlockwiseReadMixin, layer_class), {})


def attend_blockwise(
    query: torch.Tensor,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    blocks: StoreBlocks,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of `query` over the store's blocks and the tail, merged by log-sum-exp (module docstring).

    Args:
        query: [batch, heads, new tokens, head_dim]; every query attends to every key (no mask: a decode step).
        tail_keys, tail_values: [batch, kv_heads, tail tokens, head_dim], heads a multiple of kv_heads.
        blocks: the store, de-quantized one block at a time by `blocks.dequantize`.
        scaling: the softmax scale (None: 1/sqrt(head_dim)).

    Returns:
        [batch, new tokens, heads, head_dim], as transformers' `sdpa_attention_forward` returns it.

    A key or value that is NaN or infinite (a broken model's) is read as the whole store joined, by torch's sdpa
    (`_read_whole`): the decode kernel reports one (`NotFinite`), and a de-quantized block or the tail is checked,
    since torch's flash kernel over a block of one NaN key returns 0 where sdpa over the whole store returns NaN.
    """
    try:
        return _attend_parts(query, tail_keys, tail_values, blocks, scaling)
    except NotFinite:
        return _read_whole(query, tail_keys, tail_values, blocks, scaling)


def _read_whole(
    query: torch.Tensor, tail_keys: torch.Tensor, tail_values: torch.Tensor, blocks: StoreBlocks, scaling: float | None
) -> torch.Tensor:
    """Attention over every block de-quantized and joined with the tail, by torch's sdpa (what transformers'
    `sdpa_attention_forward` computes): [batch, new tokens, heads, head_dim]."""
    keys, values = blocks.materialized(tail_keys, tail_values)
    output = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous()


def _finite(*tensors: torch.Tensor) -> None:
    """Raise `NotFinite` where one of `tensors` holds NaN or an infinity: its sum is then not finite (one parallel
    pass, 0.16 ms for a block of 1.5 million values where `isfinite(t).all()` takes 3.7 ms). A sum that overflows
    raises too, and the store is read whole: slower, never wrong."""
    if not all(bool(torch.isfinite(t.sum())) for t in tensors):
        raise NotFinite("a key or value of the store is NaN or infinite")


def _attend_parts(
    query: torch.Tensor, tail_keys: torch.Tensor, tail_values: torch.Tensor, blocks: StoreBlocks, scaling: float | None
) -> torch.Tensor:
    """`attend_blockwise` over the parts: the coded blocks by the kernel, the others and the tail by torch's flash
    kernel, merged by log-sum-exp.

    Raises:
        NotFinite: a key or value is NaN or infinite."""
    batch, heads, tokens, head_dim = query.shape
    kv_heads = tail_keys.shape[1]
    # the query heads that share a KV head attend as extra query rows of it (no repeat of the keys)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * tokens, head_dim)
    outputs, lses = [], []
    pairs = list(zip(blocks.keys, blocks.values))
    if blocks.codes is not None and _CODES.get():  # the blocks read from their codes
        stores = [(blocks.coded(k), blocks.coded(v)) for k, v in pairs]
        coded = [(k, v) for k, v in stores if k is not None and v is not None]
        tail: list[tuple[StoreCodes, StoreCodes]] = []  # none for ggml, which writes every token as blocks
        if tail_keys.shape[-2]:
            tail_codes = float_rows(tail_keys), float_rows(tail_values)
            tail = [(tail_codes[0], tail_codes[1])] if tail_codes[0] is not None and tail_codes[1] is not None else []
        if len(coded) == len(pairs) and (tail or not tail_keys.shape[-2]):  # every block and the tail: one call
            read = attend_codes(grouped, coded + tail, scaling)
            if read is not None:
                return read[0].to(query.dtype).reshape(batch, heads, tokens, head_dim).transpose(1, 2).contiguous()
        read = attend_codes(grouped, coded, scaling) if coded else None
        if read is not None:  # those it reads in one call, the others de-quantized below, merged
            outputs.append(read[0])
            lses.append(read[1])
            pairs = [pair for pair, (k, v) in zip(pairs, stores) if k is None or v is None]
    for key_block, value_block in pairs:
        # the private kernel skips sdpa's layout checks and misreads a last axis that is not contiguous (a block
        # de-quantized along axis -1 has stride > 1 there; pytorch PR#187506): hand it contiguous blocks only
        keys, values = blocks.read(key_block).contiguous(), blocks.read(value_block).contiguous()
        _finite(keys, values)
        output, lse = _FLASH(grouped, keys, values, scale=scaling)
        outputs.append(output)
        lses.append(lse)
    if tail_keys.shape[-2]:  # ggml's decode steps hand no tail
        _finite(tail_keys, tail_values)
        output, lse = _FLASH(grouped, tail_keys.contiguous(), tail_values.contiguous(), scale=scaling)
        outputs.append(output)
        lses.append(lse)
    # the merge in float32, the kernel's log-sum-exp's dtype, cast back to the model's (bfloat16, float16) at the end
    total = torch.logsumexp(torch.stack(lses), dim=0)
    merged = outputs[0].float() * (lses[0] - total).exp().unsqueeze(-1)
    for output, lse in zip(outputs[1:], lses[1:]):
        merged += output.float() * (lse - total).exp().unsqueeze(-1)
    return merged.to(query.dtype).reshape(batch, heads, tokens, head_dim).transpose(1, 2).contiguous()
