"""The `ggml` backend's cache: llama.cpp's KV cache types (`-ctk`/`-ctv`), every token quantized as it is written.

What llama.cpp does with a quantized cache (llama.cpp commit 0c1e570 as vendored by llama-cpp-python 0.3.36:
`src/llama-kv-cache.cpp`, `src/llama-graph.cpp`), and what this module does the same way:

- **No residual, no flush.** Each new token's keys and values are written into the cache as blocks
  (`ggml_set_rows`, the type's `from_float`) before attention reads them, and attention reads the whole cache from the
  blocks, the tokens of the same forward pass included. `GgmlLayer.update` quantizes the new tokens
  (`kvdemo.cache.formats.ggml.blocks.quantize_rows`), appends their rows and returns the whole store de-quantized. The
  cost per decode step: one token quantized per layer (a few microseconds) and the whole store de-quantized (the
  store's bytes read, its values written in the model's dtype).
- **The prefill attends through the blocks too**, as llama.cpp's does (`llm_graph_context::build_attn` stores the
  batch with `cpy_k`/`cpy_v` and attends to `get_k`/`get_v`, views of the cache). So the first update returns the
  store de-quantized like any other, the prefill's chunks run over this cache itself (`Backend.prefill_reads_cache`,
  `kvdemo.qa.prefill.run_prefill`: each token's blocks are its own, so chunks equal one pass), and no full-precision
  prefill is ever handed over. Until 2026-12-07 the first update returned the states as given, as transformers'
  quantized layers do: on the Normans text the recommendation then read the embedded model's q4_0 at KL 0.019 where
  llama.cpp itself gives 0.21 (`recommend --verify`). Since, the two agree there (q5_0: 0.0094 and 0.0064); on Gemma 3
  270M q5_1 still reads 0.013 in kvdemo against 0.040 in llama.cpp, a gap not yet explained (docs/recommend.md).
- **The rotation** (ggml-org/llama.cpp#21038, on by default since 2026-04): `attn_rot_k` is set where the key type is
  quantized and head_dim is a multiple of 64, `attn_rot_v` likewise for the values; `LLAMA_ATTN_ROT_DISABLE=1` turns
  both off (kvdemo's `rotation=none`). Keys are rotated by the block-diagonal Sylvester Hadamard matrix of the largest
  power of two dividing head_dim (`build_input_k_rot`: H_64 for 64, H_128 for 128, H_256 for 256), values always by
  H_64 blocks (`build_input_v_rot`: "using smaller rotation matrices for V seems beneficial"); both orthonormal and
  symmetric, no random signs. llama.cpp rotates Q and K before the store and V before the store, and rotates the
  attention output back by the values' matrix. kvdemo does the same under its attention function (`GgmlRotation`,
  read by `kvdemo.cache.layers.attention.kvdemo_attention`), or undoes both rotations on read for any other attention
  (and for a latent, MLA, model).
- **Sliding-window layers** take the same types (`llama_kv_cache_iswa` builds both caches with `type_k`/`type_v`):
  the layer keeps the last `sliding_window - 1` tokens' rows, as transformers' `DynamicSlidingWindowLayer` keeps its
  tokens.
- **f16**: the values rounded to float16 (llama.cpp's default cache type), never rotated.

What differs, and why (docs/ggml.md): llama.cpp's attention takes dot products on the blocks (the query converted to
the key type's `vec_dot_type`, q8_0 for the 4- and 5-bit types) and accumulates in float16 or float32; kvdemo
de-quantizes the blocks exactly and attends in the model's dtype. The blocks are the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, cast

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import BaseQuantizedLayer, Cache

from kvdemo.cache.layers.blockwise import StoreBlocks, marked_tail
from kvdemo.cache.layers.by_kind import sliding_windows, with_kept_layers
from kvdemo.cache.layers.flush import attends_through_kvdemo, written
from kvdemo.cache.layers.rotation import hadamard, mark_rotated
from kvdemo.cache.layers.sliding import SlidingWindowMask
from kvdemo.cache.model.layer_kinds import quantized_layers
from kvdemo.cache.read.code_attention import GGML, HALF, StoreCodes, store_codes

from .blocks import BLOCK_BYTES, KERNEL_TYPES, dequantize_rows, quantize_rows

F16 = "f16"
"""llama.cpp's default cache type: float16 values, not quantized, not rotated."""

VALUE_ROTATION_BLOCK = 64
"""The size of the Hadamard blocks that rotate the values (`build_input_v_rot`), and the multiple of 64 head_dim
must be for either rotation (`attn_rot_k`, `attn_rot_v`)."""


def key_rotation_block(head_dim: int) -> int:
    """llama.cpp's key rotation size for `head_dim` (`build_input_k_rot`): the largest power of two dividing it,
    from 64 up; 0 where head_dim is not a multiple of 64 (no rotation)."""
    if head_dim % VALUE_ROTATION_BLOCK:
        return 0
    block = VALUE_ROTATION_BLOCK
    while head_dim % (block * 2) == 0:
        block *= 2
    return block


@lru_cache(maxsize=32)
def _block_hadamard(width: int, block: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The block-diagonal matrix of `width / block` orthonormal Sylvester Hadamard matrices of `block` (ggml's
    `ggml_gen_hadamard`, applied by `llama_mul_mat_hadamard` to each `block` values of a row): [width, width]."""
    return torch.block_diag(*[hadamard(block, dtype, device)] * (width // block))


def _rotate(tensor: torch.Tensor, block: int) -> torch.Tensor:
    """`tensor` [..., width] times the block-diagonal Hadamard of `block` (itself its inverse); as it is for 0."""
    if not block:
        return tensor
    return tensor @ _block_hadamard(tensor.shape[-1], block, tensor.dtype, str(tensor.device))


@dataclass(frozen=True)
class GgmlRotation:
    """llama.cpp's rotations of one layer, as the mark on its keys tells `kvdemo_attention`: the query and the keys
    by the keys' block (`forward`, `back`), the output back by the values' block (`back_values`); 0: not rotated."""

    key_block: int
    value_block: int

    @property
    def values(self) -> bool:
        """The values are rotated, so attention rotates its output back."""
        return self.value_block > 0

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        """A query (or keys) [..., head_dim] into the keys' basis."""
        return _rotate(tensor, self.key_block)

    def back(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keys [..., head_dim] back to the model's basis."""
        return _rotate(tensor, self.key_block)

    def back_values(self, tensor: torch.Tensor) -> torch.Tensor:
        """Values, or the attention output, [..., head_dim] back to the model's basis."""
        return _rotate(tensor, self.value_block)


class GgmlRows(NamedTuple):
    """One stored tensor of a `GgmlLayer`: `rows` uint8 [batch, kv_heads, tokens, row bytes] of `block_type` blocks
    (float16 [batch, kv_heads, tokens, width] for `f16`), each row `width` values."""

    rows: torch.Tensor
    block_type: str
    width: int

    def tail(self, tokens: int) -> GgmlRows:
        """The last `tokens` tokens' rows (a view)."""
        return self._replace(rows=self.rows[..., -tokens:, :])


def _joined(first: GgmlRows | None, *others: GgmlRows) -> GgmlRows:
    """`first`'s rows followed by each of `others`' (a new tensor; `first` alone where there are no others)."""
    if first is None:
        first, others = others[0], others[1:]
    if not others:
        return first
    return first._replace(rows=torch.cat([first.rows, *(o.rows for o in others)], dim=-2))


def ggml_codes(rows: torch.Tensor, type_number: int, width: int, block_bytes: int) -> StoreCodes | None:
    """llama.cpp's blocks: `rows` uint8 [batch, kv_heads, tokens, row bytes], each row `width` values as blocks of 32
    values in `block_bytes` bytes of the type `type_number` (`kvdemo.cache.formats.ggml.blocks.KERNEL_TYPES`' index), x
    as ggml's `dequantize_row_*` computes it. None for a width not a multiple of 32, rows of another size or dtype."""
    if rows.dtype != torch.uint8 or rows.dim() != 4 or width % 32 or rows.shape[-1] != width // 32 * block_bytes:
        return None
    fields = dict(kind=GGML, bits=type_number, row_bytes=rows.shape[-1])
    return store_codes((*rows.shape[:-1], width), {"codes": rows}, **fields)


def half_rows(tensor: torch.Tensor) -> StoreCodes | None:
    """float16 rows (llama.cpp's `f16` cache type), [batch, kv_heads, tokens, head_dim]; x = float32(value)."""
    if tensor.dtype != torch.float16 or tensor.dim() != 4:
        return None
    return store_codes(tuple(tensor.shape), {"codes": tensor}, kind=HALF, bits=16, row_bytes=2 * tensor.shape[-1])


class GgmlLayer(BaseQuantizedLayer):
    """One layer of llama.cpp's quantized KV cache (module docstring).

    The store: `_quantized_keys`, `_quantized_values`, each a `GgmlRows`, in the rotated basis where the layer
    rotates; every update assigns new tensors (`torch.cat`), so the snapshot's `vars(layer).copy()` restores it
    exactly.
    `keys`, `values` stay empty (no residual).

    Attributes:
        type_k, type_v: the keys' and the values' types (`kvdemo.cache.formats.ggml.BLOCK_BYTES` or `f16`).
        query_rotation: the layer's `GgmlRotation` (its store is in that basis; `to_model_basis` reads it);
            query_side: attention rotates the query (the keys returned carry the mark), else every read is rotated
            back.
    """

    _answer_keys: GgmlRows | None = None
    """The rows of the tokens decoded since the last update of several tokens (a second block, `_append`); None: none.
    Restoring a snapshot taken before them drops the attribute, back to this default."""
    _answer_values: GgmlRows | None = None

    def __init__(self, type_k: str, type_v: str, rotation: GgmlRotation, query_side: bool) -> None:
        super().__init__()
        self.type_k, self.type_v = type_k, type_v
        self.query_rotation, self.query_side = rotation, query_side

    def _quantize(self, tensor: torch.Tensor, block_type: str) -> GgmlRows:  # type: ignore[override]
        """Rows [batch, kv_heads, tokens, head_dim] as blocks of `block_type` (float16 for `f16`)."""
        width = tensor.shape[-1]
        if block_type == F16:
            return GgmlRows(tensor.to(torch.float16), block_type, width)
        return GgmlRows(quantize_rows(tensor, block_type), block_type, width)

    def _dequantize(self, q_tensor: GgmlRows) -> torch.Tensor:  # type: ignore[override]
        """A store in the model's dtype, in the store's basis: [batch, kv_heads, tokens, head_dim]."""
        dtype = self.keys.dtype if self.keys is not None else torch.float32
        if q_tensor.block_type == F16:
            return q_tensor.rows.to(dtype)
        return dequantize_rows(q_tensor.rows, q_tensor.block_type, q_tensor.width).to(dtype)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, answer: bool = False) -> None:
        """Rotate and quantize the new tokens and append their rows: to the store, or with `answer` (a decode step of
        `GgmlLayer`) to the answer's block, so that a decode step copies the rows decoded so far, never the
        context's (`torch.cat` of the whole store at every step cost 3 ms at 2,048 tokens). An update of several
        tokens joins the answer's block to the store first: the rows stay in order."""
        keys = written(self._quantize(_rotate(key_states, self.query_rotation.key_block), self.type_k))
        values = written(self._quantize(_rotate(value_states, self.query_rotation.value_block), self.type_v))
        if self._quantized_keys is None:
            self._quantized_keys, self._quantized_values = keys, values
            return
        if not answer and self._answer_keys is not None:
            keys, values = _joined(self._answer_keys, keys), _joined(self._answer_values, values)
            self._answer_keys = self._answer_values = None
        store = ("_answer_keys", "_answer_values") if answer else ("_quantized_keys", "_quantized_values")
        for name, new in zip(store, (keys, values)):
            setattr(self, name, _joined(getattr(self, name), new))

    def _stores(self) -> tuple[list[GgmlRows], list[GgmlRows]]:
        """The store's blocks, keys and values: the context's rows, then the answer's where there are any."""
        keys, values = [self._quantized_keys], [self._quantized_values]
        if self._answer_keys is not None:
            keys.append(self._answer_keys)
            values.append(self._answer_values)
        return keys, values

    def _read(self, keys: GgmlRows, values: GgmlRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores de-quantized for attention: marked in the rotated basis (query side), or rotated back."""
        key_states, value_states = self._dequantize(keys), self._dequantize(values)
        if not self.query_side:
            return self.query_rotation.back(key_states), self.query_rotation.back_values(value_states)
        if self.query_rotation.key_block or self.query_rotation.values:
            mark_rotated(key_states, self.query_rotation)  # type: ignore[arg-type]
        return key_states, value_states

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens ([batch, kv_heads, new tokens, head_dim]) as blocks, then return every stored token
        de-quantized ([batch, kv_heads, tokens, head_dim]), as llama.cpp's attention reads its cache, the prefill's
        tokens included (module docstring)."""
        self.cumulative_length += key_states.shape[-2]
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        self._append(key_states, value_states, answer=not first and key_states.shape[-2] == 1)
        if self.reads_blocks and not first and key_states.shape[-2] == 1 and key_states.device.type == "cpu":
            return self._blocks(key_states)
        keys, values = self._stores()
        return self._read(_joined(*keys), _joined(*values))

    @property
    def reads_blocks(self) -> bool:
        """Decode steps hand kvdemo's attention the store as one block (`_blocks`): on the query side."""
        return self.query_side

    def _blocks(self, like: torch.Tensor, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's (keys, values) for kvdemo's attention: no tail ([batch, kv_heads, 0, head_dim]), the keys
        marked with the store as one block (`kvdemo.cache.layers.blockwise.StoreBlocks`: read from its codes, or
        de-quantized where attention cannot; `tokens`: a window's store, every token visible) and with the
        rotation."""
        read = cast("Callable[[object], torch.Tensor]", self._dequantize)  # handed this layer's blocks only
        codes = cast("Callable[[object], StoreCodes | None]", self._codes_of)
        blocks = StoreBlocks(*self._stores(), read, codes, tokens)
        keys, values = marked_tail(like, blocks)
        if self.query_rotation.key_block or self.query_rotation.values:
            mark_rotated(keys, self.query_rotation)  # type: ignore[arg-type]
        return keys, values

    def _codes_of(self, q_tensor: GgmlRows) -> StoreCodes | None:
        """A store as the decode kernel reads it (`kvdemo.cache.read.code_attention`), or None."""
        if q_tensor.block_type == F16:
            return half_rows(q_tensor.rows)
        block_type = q_tensor.block_type
        return ggml_codes(q_tensor.rows, KERNEL_TYPES.index(block_type), q_tensor.width, BLOCK_BYTES[block_type])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search reorders the rows (no rounding: the blocks are per token)."""
        for name in ("_quantized_keys", "_quantized_values", "_answer_keys", "_answer_values"):
            store = getattr(self, name)
            if store is not None:
                setattr(self, name, store._replace(rows=store.rows.index_select(0, beam_idx.to(store.rows.device))))

    def rotation_cost(self, query_heads: int, kv_heads: int, stored_tokens: int) -> tuple[int, str]:
        """(head_dim x head_dim products a decode step spends rotating, side): where attention rotates the query, the
        keys' rotation and the values' each where set; none counted where every read rotates back (not query_side)."""
        if not self.query_side:
            return 0, ""
        rotations = bool(self.query_rotation.key_block) + bool(self.query_rotation.value_block)
        return rotations * (query_heads + kv_heads), "query" if rotations else ""


class SlidingGgmlLayer(SlidingWindowMask, GgmlLayer):
    """`GgmlLayer` over a sliding window: it keeps the last `sliding_window - 1` tokens' rows (a compact copy, so the
    longer store is not pinned) and returns what `DynamicSlidingWindowLayer.update` returns, de-quantized, or at a
    decode step the window's rows for the decode kernel."""

    def __init__(self, type_k: str, type_v: str, rotation: GgmlRotation, query_side: bool, sliding_window: int) -> None:
        super().__init__(type_k, type_v, rotation, query_side)
        self.sliding_window = sliding_window

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's last `sliding_window - 1` tokens and the new ones, de-quantized, or at a decode step on the
        query side the window's store marked for kvdemo's attention (`_blocks`: every token it holds is visible); the
        store keeps the last `sliding_window - 1`."""
        keep, first = self.sliding_window - 1, not self.is_initialized
        self.cumulative_length += key_states.shape[-2]
        if first:
            self.lazy_initialization(key_states, value_states)
        self._append(key_states, value_states)
        visible = keep + key_states.shape[-2]
        keys, values = self._quantized_keys, self._quantized_values
        if self.reads_blocks and not first and key_states.shape[-2] == 1 and key_states.device.type == "cpu":
            returned = self._blocks(key_states, tokens=keys.rows.shape[-2])  # at most the window: kept last update
        else:
            returned = self._read(keys.tail(visible), values.tail(visible))
        if keys.rows.shape[-2] > keep:  # compact: the longer rows are not pinned
            self._quantized_keys = keys._replace(rows=keys.rows[..., -keep:, :].clone())
            self._quantized_values = values._replace(rows=values.rows[..., -keep:, :].clone())
        return returned


def ggml_cache(config: PreTrainedConfig, type_k: str, type_v: str, rotation: str, sliding: str, protect: str) -> Cache:
    """The empty `ggml` cache of a model: one `GgmlLayer` (a `SlidingGgmlLayer` on a sliding window) per layer the
    backend quantizes (`kvdemo.cache.model.layer_kinds.quantized_layers` with `sliding` and `protect`), every other
    layer transformers' own (`kvdemo.cache.layers.by_kind.with_kept_layers`).

    Args:
        type_k, type_v: llama.cpp's `--cache-type-k` and `--cache-type-v` (validated by `CacheSpec.validate`).
        rotation: `auto` (llama.cpp's rule, module docstring) or `none` (`LLAMA_ATTN_ROT_DISABLE=1`).
        sliding, protect: as `kvdemo.cache.layers.flush.quantized_cache` takes them.
    """
    from kvdemo.cache.model.geometry import kv_geometry

    query_side, windows = attends_through_kvdemo(config), sliding_windows(config)
    geometry = kv_geometry(config).per_layer
    layers: list = [None] * len(windows)
    for index in quantized_layers(config, sliding, protect):
        layer = geometry[index]
        rotate = rotation != "none"
        key_block = key_rotation_block(layer.key_dim) if rotate and type_k != F16 else 0
        value_block = (
            VALUE_ROTATION_BLOCK if rotate and type_v != F16 and not layer.value_dim % VALUE_ROTATION_BLOCK else 0
        )
        turn = GgmlRotation(key_block, value_block)
        window = windows[index]
        if window is None:
            layers[index] = GgmlLayer(type_k, type_v, turn, query_side)
        else:
            layers[index] = SlidingGgmlLayer(type_k, type_v, turn, query_side, window)
    return with_kept_layers(Cache(layers=layers), config, sliding, protect)
