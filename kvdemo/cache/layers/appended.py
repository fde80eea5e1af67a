"""Layers that code every token as it is written and append its record (`AppendedLayer`): no residual, no flush. The
first update (the prefill handed over in one update, `kvdemo.qa.prefill.hand_over`) is coded whole and returned as
given, as transformers' fp8 layer returns its first states; each later update codes its tokens, appends them to the
store (new tensors, so the snapshot's `vars(layer).copy()` restores it) and returns every stored token read back,
except a decode step where kvdemo's attention reads the store: that returns an empty tail marked with the store
(`kvdemo.cache.layers.blockwise.marked_tail`), which the decode kernel reads from its codes. A decode step's token
goes to the answer's record (`_answer_keys`, `_answer_values`), a second block, so that a step copies the tokens
decoded so far and never the context's (at 2,048 tokens the copy of an fp8 store cost 30 µs per tensor and layer);
an update of several tokens (a question) joins it to the store first. A format's layer says how
it codes (`_code`), reads (`_dequantize`) and hands the kernel its codes (`_codes_of`): fp8's rows, nvfp4's blocks,
int8's rows. Their window is `kvdemo.cache.layers.sliding.SlidingStoreWindow`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import BaseQuantizedLayer

from kvdemo.cache.layers.blockwise import StoreBlocks, code_reader, marked_tail
from kvdemo.cache.layers.flush import attends_through_kvdemo
from kvdemo.cache.read.code_attention import StoreCodes


def append_records(store: Any, new: Any) -> Any:
    """`store` (a record, a named tuple or a plain tuple of per-token tensors [..., tokens, x] and per-tensor scalars)
    with `new`'s tokens after its own; a scalar (0-d: a tensor scale) stays the store's."""
    joined = [torch.cat([a, b], dim=-2) if a.dim() else a for a, b in zip(store, new)]
    return type(store)(*joined) if hasattr(store, "_fields") else tuple(joined)


class AppendedLayer(BaseQuantizedLayer):
    """One decoder layer whose keys and values are records appended token by token (see the module docstring).

    Attributes:
        _quantized_keys, _quantized_values: the format's records (named tuples, or fp8's `(codes, scale)`).
        reads_blocks: decode steps hand kvdemo's attention the store (`marked_tail`); set by the cache builder
            where the model attends through `kvdemo_attention` (`kvdemo.cache.layers.flush.attends_through_kvdemo`).
    """

    reads_blocks = False
    answer_block = True
    """Decode steps write into the answer's record (module docstring); a window's layer, which cuts its store at every
    update, keeps one record."""
    _answer_keys: Any = None
    _answer_values: Any = None

    def _code(self, states: torch.Tensor, keys: bool, store: Any) -> Any:
        """`states` ([batch, kv_heads, tokens, head_dim]) as the format's record of keys (`keys`) or values; `store`:
        the record they are appended to (None at the first update)."""
        raise NotImplementedError

    def _codes_of(self, q_tensor: Any) -> StoreCodes | None:
        """A record as the decode kernel reads it (`kvdemo.cache.read.code_attention`), or None: it is read back
        with `_dequantize` (a format's layer that defines `_dequantize` defines this beside it: `code_reader`)."""
        return None

    def _quantize(self, tensor: torch.Tensor) -> Any:
        return self._code(tensor, False, None)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Code the new tokens ([batch, kv_heads, new tokens, head_dim]) and append them (see the module docstring)."""
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            BaseQuantizedLayer.lazy_initialization(self, key_states, value_states)  # dtype, device, empty keys
            # contiguous codes for the kernel: an element-wise op keeps a transposed layout, so code contiguous states
            self._quantized_keys = self._code(key_states.contiguous(), True, None)
            self._quantized_values = self._code(value_states.contiguous(), False, None)
            return key_states, value_states
        new_keys = self._code(key_states, True, self._quantized_keys)
        new_values = self._code(value_states, False, self._quantized_values)
        if self.answer_block and key_states.shape[-2] == 1:  # a decode step: the answer's record
            self._answer_keys = new_keys if self._answer_keys is None else append_records(self._answer_keys, new_keys)
            self._answer_values = (
                new_values if self._answer_values is None else append_records(self._answer_values, new_values)
            )
        else:
            if self._answer_keys is not None:  # the answer's tokens first, in order
                new_keys = append_records(self._answer_keys, new_keys)
                new_values = append_records(self._answer_values, new_values)
                self._answer_keys = self._answer_values = None
            self._quantized_keys = append_records(self._quantized_keys, new_keys)
            self._quantized_values = append_records(self._quantized_values, new_values)
        if self.reads_blocks and key_states.shape[-2] == 1 and key_states.device.type == "cpu":
            return marked_tail(key_states, self.stored_blocks())
        keys, values = self._records()
        return self._dequantize(keys), self._dequantize(values)

    def _records(self) -> tuple[Any, Any]:
        """The keys' and the values' records, the answer's joined to the store's (a new record where there is one)."""
        if self._answer_keys is None:
            return self._quantized_keys, self._quantized_values
        return (
            append_records(self._quantized_keys, self._answer_keys),
            append_records(self._quantized_values, self._answer_values),
        )

    def stored_blocks(self, tokens: int | None = None) -> StoreBlocks:
        """The store for `attend_blockwise`: its record, then the answer's where there is one (read from their codes
        where `code_reader` allows); `tokens`: how many it holds where each is visible to the step (a window's
        store)."""
        codes = self._codes_of if code_reader(type(self)) else None
        keys, values = [self._quantized_keys], [self._quantized_values]
        if self._answer_keys is not None:
            keys.append(self._answer_keys)
            values.append(self._answer_values)
        return StoreBlocks(keys, values, self._dequantize, codes, tokens)


def reading_blocks(layers: list, config: PreTrainedConfig) -> list:
    """`layers` (a cache's, built for `config`), each `AppendedLayer` among them handing its decode steps' store to
    kvdemo's attention (`reads_blocks`) where the model attends through it (`attends_through_kvdemo`)."""
    if attends_through_kvdemo(config):
        for layer in layers:
            if isinstance(layer, AppendedLayer):
                layer.reads_blocks = True
    return layers
