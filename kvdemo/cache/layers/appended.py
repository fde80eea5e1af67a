"""Layers that code every token as it is written and append its record (`AppendedLayer`): no residual, no flush. The
first update (the prefill handed over in one update, `kvdemo.qa.prefill.hand_over`) is coded whole and returned as
given, as transformers' fp8 layer returns its first states; each later update codes its tokens, appends them to the
store (new tensors, so the snapshot's `vars(layer).copy()` restores it) and returns every stored token read back. A
format's layer says how it codes (`_code`) and reads (`_dequantize`): nvfp4's blocks, int8's rows. Their window is
`kvdemo.cache.layers.sliding.SlidingStoreWindow`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import BaseQuantizedLayer


def append_records(store: Any, new: Any) -> Any:
    """`store` (a record, a named tuple of per-token tensors [..., tokens, x] and per-tensor scalars) with `new`'s
    tokens after its own; a scalar (0-d: a tensor scale) stays the store's."""
    return type(store)(*(torch.cat([a, b], dim=-2) if a.dim() else a for a, b in zip(store, new)))


class AppendedLayer(BaseQuantizedLayer):
    """One decoder layer whose keys and values are records appended token by token (see the module docstring).

    Attributes:
        _quantized_keys, _quantized_values: the format's records (named tuples).
    """

    def _code(self, states: torch.Tensor, keys: bool, store: Any) -> Any:
        """`states` ([batch, kv_heads, tokens, head_dim]) as the format's record of keys (`keys`) or values; `store`:
        the record they are appended to (None at the first update)."""
        raise NotImplementedError

    def _quantize(self, tensor: torch.Tensor) -> Any:
        return self._code(tensor, False, None)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Code the new tokens ([batch, kv_heads, new tokens, head_dim]) and append them (see the module docstring)."""
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)  # DynamicLayer's: dtype, device, empty keys
            self._quantized_keys = self._code(key_states, True, None)
            self._quantized_values = self._code(value_states, False, None)
            return key_states, value_states
        self._quantized_keys = append_records(self._quantized_keys, self._code(key_states, True, self._quantized_keys))
        self._quantized_values = append_records(
            self._quantized_values, self._code(value_states, False, self._quantized_values)
        )
        return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)
