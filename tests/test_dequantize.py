"""The in-place de-quantization (`kvdemo.cache.formats.quanto.layers`): the same bits as the libraries' own
`_dequantize`, a new tensor each time (the store untouched), and the libraries' path for a store of another form. No
model."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

from kvdemo.cache.formats.hqq.layers import ExactHQQLayer, dequantize_hqq
from kvdemo.cache.formats.quanto import layers as dequantize
from kvdemo.cache.formats.quanto.layers import ExactQuantoLayer, dequantize_quanto


def _states(tokens: int = 128, seed: int = 0) -> torch.Tensor:
    """Keys-like states with outlier channels, [1, 3, tokens, 64]."""
    torch.manual_seed(seed)
    states = torch.randn(1, 3, tokens, 64)
    states[..., 5] *= 20  # an outlier channel, as real keys have
    return states


@pytest.mark.parametrize(("nbits", "group", "axis"), list(itertools.product((2, 4), (32, 64, 128), (0, -1))))
def test_quanto_in_place_equals_the_library_bit_for_bit(nbits, group, axis):
    library = QuantoQuantizedLayer(nbits=nbits, q_group_size=group)
    store = library._quantize(_states(), axis)
    packed = store._data._data.clone()
    expected = library._dequantize(store)
    got = ExactQuantoLayer(nbits=nbits, q_group_size=group)._dequantize(store)
    assert got.shape == expected.shape == (1, 3, 128, 64) and torch.equal(got, expected)
    assert torch.equal(store._data._data, packed)  # the store is read, never written
    assert got.data_ptr() != dequantize_quanto(store).data_ptr()  # a new tensor each time


HQQ_CASES = [c for c in itertools.product((1, 2, 3, 4, 8), (32, 64, 128), (0, 1)) if c[0] != 3 or c[2] == 0]
"""(nbits, group, axis): every one hqq de-quantizes (its own code raises a shape error for 3 bits along axis 1)."""


@pytest.mark.parametrize(("nbits", "group", "axis"), HQQ_CASES)
def test_hqq_in_place_equals_the_library_bit_for_bit(nbits, group, axis):
    library = HQQQuantizedLayer(nbits=nbits, q_group_size=group)
    library.keys = _states()  # `_quantize` reads the dtype and device from the layer's residual
    store = library._quantize(_states(), axis)
    packed = store[0].clone()
    expected = library._dequantize(store)
    got = ExactHQQLayer(nbits=nbits, q_group_size=group)._dequantize(store)
    assert got.shape == expected.shape == (1, 3, 128, 64) and torch.equal(got, expected)
    assert torch.equal(store[0], packed)


def test_other_forms_take_the_library_path(monkeypatch):
    """A store the in-place path does not know is de-quantized by the library's own code, unchanged."""
    library = HQQQuantizedLayer(nbits=4, q_group_size=64)
    library.keys = _states()
    packed, meta = library._quantize(_states(), 0)
    mixed = {**meta, "zero": meta["zero"].double()}  # a product that would change dtype
    calls = []
    from hqq.core.quantize import Quantizer

    original = Quantizer.dequantize.__func__

    def spy(cls, w_q, meta_):
        calls.append(meta_["zero"].dtype)
        return original(cls, w_q, meta_)

    monkeypatch.setattr(Quantizer, "dequantize", classmethod(spy))
    assert torch.equal(dequantize_hqq((packed, mixed)), Quantizer.dequantize(packed, mixed))
    assert calls == [torch.float64, torch.float64]
    quanto = QuantoQuantizedLayer(nbits=4)._quantize(_states(), 0)
    monkeypatch.setattr(quanto, "_shift", quanto._shift.to(torch.int8))  # quanto's integer-shift form
    assert dequantize.dequantize_quanto(quanto).dtype == quanto._scale.dtype
