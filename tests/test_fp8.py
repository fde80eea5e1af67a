"""The `fp8` backend's de-quantization by bit placement (`kvdemo.cache.formats.fp8.layers`): the same bits as
transformers' own `Fp8QuantizedLayer._dequantize`, for every code at every kind of scale and on decode steps; NaN codes
read the library's way; the bytes the library's."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig, QuantizedCache
from transformers.cache_utils import Fp8QuantizedLayer

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats.fp8.layers import ExactFp8Layer
from kvdemo.cache.layers.float8 import dequantize_e4m3, has_nan_codes
from kvdemo.cache.spec import estimate_kv_bytes
from kvdemo.cache.state.snapshot import restore, take

EVERY_CODE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(1, 1, 32, 8)
NAN_CODES = [0x7F, 0xFF]


@pytest.mark.parametrize(
    "scale",
    [1.0, 0.0123, 3.7e-3, 251.9, torch.finfo(torch.float32).tiny, 1.0e-30, 2.0**7 * 1.999],
    ids=["one", "small", "typical", "large", "tiny", "very-small", "near-overflow"],
)
def test_every_code_de_quantizes_to_the_library_s_bits(scale):
    library = Fp8QuantizedLayer()
    library.update(torch.ones(1, 1, 1, 8), torch.ones(1, 1, 1, 8))
    scale = torch.tensor(scale, dtype=torch.float32)
    expected = library._dequantize((EVERY_CODE, scale))
    got = dequantize_e4m3(EVERY_CODE, scale, torch.float32)
    finite = torch.ones(256, dtype=torch.bool)
    finite[NAN_CODES] = False
    finite = finite.reshape(EVERY_CODE.shape)
    # bit for bit (-0.0 and subnormals included), every code but the two NaN codes
    assert torch.equal(got[finite].view(torch.int32), expected[finite].view(torch.int32))
    assert expected.isnan().sum() == 2 and not got.isnan().any()  # the NaN codes are why the layer checks


def test_the_result_takes_the_model_s_dtype():
    scale = torch.tensor(0.05)
    got = dequantize_e4m3(EVERY_CODE, scale, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    finite = ~EVERY_CODE.float().isnan()
    assert torch.equal(got[finite], (EVERY_CODE.float() * scale).to(torch.bfloat16)[finite])


def test_decode_steps_return_what_transformers_layer_returns():
    torch.manual_seed(0)
    mine, library = ExactFp8Layer(), Fp8QuantizedLayer()
    prefill = torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64) * 0.1
    for layer in (mine, library):
        layer.update(*prefill)
    for step_index in range(5):
        step = torch.randn(1, 3, 1, 64) * (1 + 100 * step_index), torch.randn(1, 3, 1, 64) * 0.1  # saturating
        ours, theirs = mine.update(*step), library.update(*step)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert not mine._nan_codes and "_nan_codes" not in vars(mine)  # saturated, never NaN: the fast path throughout


def test_a_nan_state_is_read_the_library_s_way_until_the_store_is_restored():
    cache = QuantizedCache("fp8", PretrainedConfig(num_hidden_layers=1))
    cache.layers = [ExactFp8Layer()]
    mine, library = cache.layers[0], Fp8QuantizedLayer()
    prefill = torch.randn(1, 2, 6, 8)
    for layer in (mine, library):
        layer.update(prefill, prefill)
    snapshot = take(cache)
    assert not mine._nan_codes
    step = torch.randn(1, 2, 1, 8)
    step[0, 1, 0, 3] = float("nan")
    ours, theirs = mine.update(step, step), library.update(step, step)
    assert mine._nan_codes and has_nan_codes(mine._quantized_keys[0])
    assert torch.equal(ours[0].isnan(), theirs[0].isnan()) and int(ours[0].isnan().sum()) == 1
    finite = ~theirs[0].isnan()
    assert torch.equal(ours[0][finite], theirs[0][finite])
    restore(cache, snapshot)  # the post-prefill store again, which holds no NaN code: bit placement again
    restored = mine._dequantize(mine._quantized_keys)
    assert not mine._nan_codes and restored.shape == prefill.shape and not restored.isnan().any()
    assert torch.equal(restored, Fp8QuantizedLayer._dequantize(mine, mine._quantized_keys))


def test_answers_and_bytes(tiny, normans):
    session = QASession(tiny, CacheSpec("fp8"))
    report = session.prefill(normans.paragraphs[0])
    # only the library's store is held: one byte per value, one float32 scale per layer and tensor
    geometry = 2 * tiny.config.num_hidden_layers * tiny.config.num_key_value_heads * tiny.config.head_dim
    expected = geometry * report.context_tokens + 2 * tiny.config.num_hidden_layers * 4
    estimate = estimate_kv_bytes(CacheSpec("fp8"), tiny.config, report.context_tokens, torch.float32)
    assert report.kv_bytes == estimate == expected
    first = session.ask("Who was the Norse leader?", 8)
    assert session.ask("Who was the Norse leader?", 8).token_ids == first.token_ids
    assert isinstance(session.cache.layers[0], ExactFp8Layer)


def test_a_scale_too_large_for_bit_placement_is_read_the_library_s_way():
    mine, library = ExactFp8Layer(), Fp8QuantizedLayer()
    states = torch.randn(1, 2, 6, 8).clamp(-3, 3) * 1.0e4
    states[0, 0, 0, 0] = 448 * 300.0  # the scale is 300: 2^120 * 300 overflows float32
    for layer in (mine, library):
        layer.update(states, states)
    scale = mine._quantized_keys[1]
    assert float(scale) == 300.0 and not torch.isfinite(scale * 2.0**120)
    assert dequantize_e4m3(mine._quantized_keys[0], scale, torch.float32).isinf().any()  # why the layer checks
    ours = mine._dequantize(mine._quantized_keys)
    assert torch.equal(ours, library._dequantize(library._quantized_keys)) and ours.isfinite().all()
