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
from tests.helpers import read_whole

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
    assert mine._nan_codes and has_nan_codes(mine._records()[0][0])  # the step sits in the answer's record
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


# ---- the engines' scale rules ----------------------------------------------------------------------------------
def _layer(text, tiny):
    from kvdemo.cache.spec import build_cache

    return build_cache(CacheSpec.parse(text), tiny.config).layers[0]


def test_scale_one_saturates_as_vllm_and_sglang_write_fp8(tiny):
    layer = _layer("fp8,scale=one", tiny)
    keys = torch.tensor([1000.0, -1000.0, 0.3, -0.01]).reshape(1, 1, 1, 4).expand(1, 2, 3, 4).contiguous()
    layer.update(keys, keys * 0.5)
    codes, scale = layer._quantized_keys
    assert scale.item() == 1.0 and codes[0, 0, 0].float().tolist() == [448.0, -448.0, 0.3125, -0.009765625]
    e5m2 = _layer("fp8,scale=one,float8=e5m2", tiny)
    e5m2.update(keys * 100, keys)
    codes, _ = e5m2._quantized_keys
    assert codes.dtype == torch.float8_e5m2 and codes[0, 0, 0, :2].float().tolist() == [57344.0, -57344.0]  # no inf
    assert torch.equal(e5m2.update(keys, keys)[1][..., -1:, :], (keys.to(torch.float8_e5m2).float())[..., -1:, :])


def test_calculated_scales_are_vllm_s_amax_over_200_and_100_frozen_at_the_prefill(tiny):
    layer = _layer("fp8,scale=calculated", tiny)
    torch.manual_seed(3)
    keys, values = torch.randn(1, 2, 20, 64) * 4, torch.randn(1, 2, 20, 64)
    layer.update(keys, values)
    assert layer._quantized_keys[1].item() == (keys.abs().amax() / 200).item()
    assert layer._quantized_values[1].item() == (values.abs().amax() / 100).item()
    # a later token 50x larger: saturates at 448 x scale
    k, v = read_whole(layer.update(keys[..., :1, :] * 50, values[..., :1, :]))
    assert layer._quantized_keys[1].item() == (keys.abs().amax() / 200).item()
    assert k[..., -1, :].abs().max().item() == pytest.approx(448 * keys.abs().amax().item() / 200, rel=1e-6)


def test_per_token_head_is_vllm_s_reference_arithmetic(tiny):
    # vLLM's `_quantize_per_token_head_ref` (tests/quantization/test_per_token_kv_cache.py), written out
    torch.manual_seed(4)
    states = torch.randn(1, 2, 30, 64) * torch.logspace(-3, 2, 30).reshape(1, 1, 30, 1)
    states[0, 0, 0] = 0
    scales = (states.float().abs().amax(dim=-1) / 448.0).clamp(min=1e-6)
    codes = (states.float() * (1.0 / scales.unsqueeze(-1))).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    layer = _layer("fp8,scale=per_token_head", tiny)
    layer.update(states, states)
    got_codes, got_scales = layer._quantized_keys
    assert torch.equal(got_codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got_scales.squeeze(-1), scales)


def test_fp8_deploy_lines_follow_the_scale_rule(tiny, embedded):
    def lines(text):
        return [d.line for d in CacheSpec.parse(text).deployments(tiny.config)][:-1]  # kvdemo's own line is last

    assert [line.split(":")[0] for line in lines("fp8")] == ["transformers", "TensorRT-LLM"]
    assert lines("fp8,scale=one") == ["vLLM: --kv-cache-dtype fp8_e4m3", "SGLang: --kv-cache-dtype fp8_e4m3"]
    assert lines("fp8,scale=one,float8=e5m2") == [
        "vLLM: --kv-cache-dtype fp8_e5m2",
        "SGLang: --kv-cache-dtype fp8_e5m2",
    ]
    assert lines("fp8,scale=calculated")[0].startswith("vLLM: --kv-cache-dtype fp8_e4m3 --calculate-kv-scales")
    assert lines("fp8,scale=per_token_head") == ["vLLM: --kv-cache-dtype fp8_per_token_head"]
    protected = CacheSpec.parse("fp8,scale=one,protect=1:1").deployments(embedded.config)  # 30 layers
    assert [d.line for d in protected][:-1] == ["vLLM: --kv-cache-dtype fp8_e4m3 --kv-cache-dtype-skip-layers 0 29"]
    with pytest.raises(ValueError, match="float8=e5m2 is stored unscaled .* so it takes scale=one"):
        CacheSpec.parse("fp8,float8=e5m2")


def test_the_c_writer_writes_torch_s_bytes():
    """A decode step's codes are written in one C pass (`kvdemo/cache/layers/row_codes.c`): the bytes of torch's own
    operations (transformers' `(x / scale).to(float8_e4m3fn)`, vLLM's per-token-head float8 and int8 references), on
    values over 18 decades, random float32 bit patterns (subnormals included), e4m3's ties and its saturation, NaN and
    the infinities (float8 only: torch's int8 cast of NaN is not defined)."""
    from kvdemo.cache.layers.float8 import PER_TOKEN_HEAD_FLOOR, ROW_E4M3, ROW_INT8, TENSOR_E4M3, write_codes

    torch.manual_seed(0)
    spread = torch.randn(2, 3, 200, 64) * torch.logspace(-12, 6, 200).reshape(1, 1, 200, 1)
    patterns = torch.randint(-(2**31), 2**31 - 1, (1, 1, 2000, 64), dtype=torch.int64).to(torch.int32)
    patterns = patterns.view(torch.float32).nan_to_num(0.0)
    edges = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 448.0, 464.0, 480.0, 479.9, 2**-9, 2**-10]
    special = torch.tensor(edges * 6)[:64].reshape(1, 1, 1, 64)
    for values in (spread, patterns, special):
        for scale in (torch.tensor(1.0), torch.tensor(0.37), torch.tensor(1e-30)):
            written = write_codes(TENSOR_E4M3, values, scale)
            assert written is not None and written.scales is None
            expected = (values / scale).to(torch.float8_e4m3fn)
            assert torch.equal(written.codes.view(torch.uint8), expected.view(torch.uint8))
            assert written.nan_codes == bool(values.isnan().any())
        written = write_codes(ROW_E4M3, values)
        scales = (values.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=PER_TOKEN_HEAD_FLOOR)
        expected = (values * (1.0 / scales)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert written is not None and torch.equal(written.codes.view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(written.scales.nan_to_num(7.0), scales.nan_to_num(7.0))
        finite = values.nan_to_num(0.0, posinf=0.0, neginf=0.0)
        written = write_codes(ROW_INT8, finite)
        scales = (finite.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-6)
        assert written is not None and torch.equal(written.scales, scales)
        assert torch.equal(written.codes, torch.round(finite * (1.0 / scales)).clamp(-128, 127).to(torch.int8))
    assert write_codes(ROW_E4M3, spread.to(torch.bfloat16)) is None  # a bfloat16 model's states: torch codes them
