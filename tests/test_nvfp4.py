"""The `nvfp4` format (`kvdemo.cache.formats.nvfp4`): its blocks byte for byte against torchao's reference (run as an
oracle, `tests/oracles.py`), 4over6 against the same reference at max 4, the ties written out, the layer's store equal
to its prefill and steps coded whole, the bytes held equal to the formula, the deploy lines and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdemo import CacheSpec
from kvdemo.cache.formats.nvfp4.blocks import (
    E2M1_VALUES,
    amax_scale,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_nvfp4,
)
from kvdemo.cache.spec import build_cache
from kvdemo.cache.state.telemetry import kv_memory
from tests.helpers import read_whole
from tests.oracles import run_oracle

TORCHAO = """
import torch
from torchao.prototype.mx_formats import nvfp4_tensor as nt
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32
x = torch.from_numpy(inputs["x"])
for name, scale in (("one", torch.tensor(1.0)), ("amax", nt.per_tensor_amax_to_scale(x.abs().amax()))):
    outputs[name + "_scale"] = scale.numpy()
    for block_max in (6.0, 4.0):
        nt.F4_E2M1_MAX = block_max  # the module's constant: its block scale is amax / F4_E2M1_MAX
        scales, packed = nt.nvfp4_quantize(x, 16, scale)
        tag = f"{name}_{int(block_max)}"
        outputs[tag + "_codes"] = packed.view(torch.uint8).numpy()
        outputs[tag + "_scales"] = scales.view(torch.uint8).numpy()
        low, high = packed.view(torch.uint8) & 15, packed.view(torch.uint8) >> 4
        codes = torch.stack([low, high], -1).flatten(-2)
        values = f4_unpacked_to_f32(codes).reshape(x.shape[0], -1, 16)
        read = values * (scales.float() * scale).reshape(x.shape[0], -1, 1)
        outputs[tag + "_error"] = (read - x.reshape(read.shape)).square().sum(-1).numpy()
"""


@pytest.fixture(scope="module")
def states():
    """Keys-like rows at several magnitudes: 3 x 2 heads x 40 tokens x 64, a block of zeros, an outlier channel."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 40, 64) * torch.tensor([0.004, 0.3, 20.0]).reshape(3, 1, 1, 1)
    x[..., 5] *= 30
    x[0, 0, 0, :16] = 0
    return x


@pytest.fixture(scope="module")
def torchao(states):
    return run_oracle(TORCHAO, x=states.reshape(-1, 64).numpy())


def _bytes(store):
    return store.codes.reshape(-1, 32).numpy(), store.block_scales.view(torch.uint8).reshape(-1, 4).numpy()


@pytest.mark.process  # the reference runs in a process of its own (tests/oracles.py)
@pytest.mark.parametrize("scale", ["one", "amax"])
def test_blocks_are_torchao_s_bytes(states, torchao, scale):
    tensor_scale = torch.from_numpy(torchao[f"{scale}_scale"])
    if scale == "amax":
        assert torch.equal(tensor_scale, amax_scale(states, fp8=False))  # the computed rule is torchao's
    codes, scales = _bytes(quantize_nvfp4(states, tensor_scale))
    np.testing.assert_array_equal(codes, torchao[f"{scale}_6_codes"])
    np.testing.assert_array_equal(scales, torchao[f"{scale}_6_scales"])


@pytest.mark.process  # the reference runs in a process of its own (tests/oracles.py)
@pytest.mark.parametrize("scale", ["one", "amax"])
def test_4over6_keeps_per_block_torchao_s_block_that_errs_less(states, torchao, scale):
    tensor_scale = torch.from_numpy(torchao[f"{scale}_scale"])
    four = torchao[f"{scale}_4_error"].reshape(-1) < torchao[f"{scale}_6_error"].reshape(-1)
    codes4, codes6 = torchao[f"{scale}_4_codes"].reshape(-1, 8), torchao[f"{scale}_6_codes"].reshape(-1, 8)
    expected_codes = np.where(four[:, None], codes4, codes6)
    expected_scales = np.where(four, torchao[f"{scale}_4_scales"].reshape(-1), torchao[f"{scale}_6_scales"].reshape(-1))
    store = quantize_nvfp4(states, tensor_scale, "4over6")
    np.testing.assert_array_equal(store.codes.reshape(-1, 8).numpy(), expected_codes)
    np.testing.assert_array_equal(store.block_scales.view(torch.uint8).reshape(-1).numpy(), expected_scales)
    assert 0.05 < four.mean() < 0.95  # both scales are chosen somewhere on these rows
    read = dequantize_nvfp4(store, torch.float32)
    plain = dequantize_nvfp4(quantize_nvfp4(states, tensor_scale), torch.float32)
    assert (read - states).square().sum() < (plain - states).square().sum()


def test_ties_round_to_the_even_code_and_the_sign_is_kept():
    # each midpoint between two E2M1 magnitudes, then the same negated, then -0.1 (magnitude 0, sign kept); the block's
    # amax 6 makes its scale exactly 1
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1])
    store = quantize_nvfp4(row.reshape(1, 1, 1, 16), torch.tensor(1.0))
    low, high = store.codes & 15, store.codes >> 4
    codes = torch.stack([low, high], -1).flatten().tolist()
    assert codes == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 8]
    assert store.block_scales.float().item() == 1.0
    assert E2M1_VALUES[codes].tolist()[:8] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_the_c_writer_writes_the_bytes_of_the_torch_arithmetic():
    """On the CPU a float32 tensor is coded in one C pass (`write_nvfp4`, kvdemo/cache/layers/row_codes.c); the torch
    arithmetic (torchao's, checked above) codes the same values given in float64 (`quantize_nvfp4` computes in
    float32 either way). The same bytes over 18 decades, at the ties, for zeros of either sign, NaN and the
    infinities, under tensor scales of 1, an amax's and a tiny one."""
    torch.manual_seed(2)
    spread = torch.randn(2, 3, 100, 64) * torch.logspace(-12, 6, 100).reshape(1, 1, 100, 1)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    ties = torch.cat([ties, -ties])
    edges = torch.tensor([0.0, -0.0, float("nan"), 1.0, float("inf"), -1.0, float("-inf"), 2.0] * 2)
    for values in (spread, torch.stack([ties, ties * 3, ties / 7, edges]).reshape(1, 1, 4, 16)):
        finite = values.nan_to_num(0.0, 0.0, 0.0)
        for scale in (torch.tensor(1.0), amax_scale(finite, fp8=False), torch.tensor(1e-30)):
            ours, theirs = quantize_nvfp4(values, scale), quantize_nvfp4(values.double(), scale)
            assert torch.equal(ours.codes, theirs.codes)
            assert torch.equal(ours.block_scales.view(torch.uint8), theirs.block_scales.view(torch.uint8))


def test_fp8_keys_saturate_as_vllm_writes_them():
    store = quantize_fp8(torch.tensor([1000.0, -1000.0, 0.3]), torch.tensor(1.0))
    assert store.codes.float().tolist() == [448.0, -448.0, 0.3125]  # no NaN: saturated


@pytest.mark.parametrize("text", ["nvfp4", "nvfp4:nvfp4_4over6", "nvfp4:fp8_k_nvfp4_v", "nvfp4,tensor_scale=prefill"])
def test_the_layer_codes_prefill_and_steps_as_the_blocks_do(tiny, text):
    spec = CacheSpec.parse(text)
    layer = build_cache(spec, tiny.config).layers[0]
    torch.manual_seed(1)
    prefill = torch.randn(1, 2, 30, 64) * 3, torch.randn(1, 2, 30, 64) * 0.05
    steps = [(torch.randn(1, 2, 1, 64) * 9, torch.randn(1, 2, 1, 64)) for _ in range(3)]
    assert layer.update(*prefill)[0] is prefill[0]  # the prefill attends in full precision
    for step in steps:
        keys, values = read_whole(layer.update(*step))
    scale = layer._quantized_values.tensor_scale
    expected = torch.cat([prefill[1], *(s[1] for s in steps)], dim=-2)
    whole = quantize_nvfp4(expected, scale, spec.resolved()["block_rule"])
    assert torch.equal(layer._records()[1].codes, whole.codes)  # per-token blocks: appending is coding whole
    assert torch.equal(values, dequantize_nvfp4(whole, torch.float32))
    if spec.keys == "e4m3":
        assert layer._quantized_keys.codes.dtype == torch.float8_e4m3fn and keys.shape == (1, 2, 33, 64)
    if spec.tensor_scale == "prefill":
        assert torch.equal(scale, amax_scale(prefill[1], fp8=False))  # frozen at the prefill, not moved by steps
    else:
        assert scale.item() == 1.0


@pytest.mark.parametrize("text", ["nvfp4", "nvfp4:fp8_k_nvfp4_v"])
def test_the_bytes_held_are_36_per_64_values(tiny, text):
    from kvdemo import QASession

    session = QASession(tiny, CacheSpec.parse(text))
    tokens = session.prefill("The Normans gave their name to Normandy, a region in France. " * 8).context_tokens
    config = tiny.config
    values = config.num_hidden_layers * config.num_key_value_heads * 64 * tokens  # keys, and as many values
    per_64 = 36 + 36 if text == "nvfp4" else 64 + 36  # NVFP4 keys and values; float8 keys and NVFP4 values
    expected = values / 64 * per_64 + 2 * 4 * config.num_hidden_layers  # a float32 tensor scale each
    assert kv_memory(session.cache).cache_bytes == expected  # test_budget: the formula on every spec of the matrix


def test_deploy_lines_name_each_engine_that_stores_it(embedded):
    texts = ("nvfp4", "nvfp4:nvfp4_4over6", "nvfp4:fp8_k_nvfp4_v", "nvfp4,tensor_scale=prefill", "nvfp4,protect=1:1")
    lines = {t: [d.line for d in CacheSpec.parse(t).deployments(embedded.config)] for t in texts}
    assert lines["nvfp4"][:2] == [
        "vLLM: --kv-cache-dtype nvfp4",
        "SGLang: --kv-cache-dtype nvfp4",
    ]
    assert lines["nvfp4:nvfp4_4over6"][0] == "vLLM: --kv-cache-dtype nvfp4_4over6"
    assert lines["nvfp4:fp8_k_nvfp4_v"][0] == "vLLM: --kv-cache-dtype fp8_k_nvfp4_v"
    assert lines["nvfp4,tensor_scale=prefill"][0].startswith("TensorRT-LLM: ModelOpt hf_ptq.py --kv_cache_qformat")
    protected = lines["nvfp4,protect=1:1"]  # vLLM keeps layers in the model's dtype by index; no other engine does
    layers = embedded.config.num_hidden_layers
    assert protected[0] == f"vLLM: --kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers 0 {layers - 1}"
    assert [line.split(":")[0] for line in protected] == ["vLLM", "kvdemo"]


def test_a_head_dim_off_the_block_is_refused_before_the_prefill(embedded):
    from tests.helpers import make_tiny

    odd = make_tiny(embedded.tokenizer, head_dim=40)
    with pytest.raises(ValueError, match="blocks of 16 values, so a head_dim of 40 cannot be NVFP4"):
        CacheSpec.parse("nvfp4").validate(odd.config)
    with pytest.raises(ValueError, match="values in blocks of 16 values"):  # float8 keys take any width; values do not
        CacheSpec.parse("nvfp4,keys=e4m3").validate(odd.config)


def test_sliding_windows_kept_deploy_as_vllm_s_skip_layers():
    from tests.families import family_config

    config = family_config("Gemma 3")  # three sliding-window layers, then a full-attention one

    def lines(text):
        return [d.line for d in CacheSpec.parse(text).deployments(config)]

    assert lines("nvfp4")[:2] == [
        "vLLM: --kv-cache-dtype nvfp4",
        "SGLang: --kv-cache-dtype nvfp4",
    ]
    kept = lines("nvfp4,sliding=keep")
    assert kept[0] == "vLLM: --kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers sliding_window"
    assert [line.split(":")[0] for line in kept] == ["vLLM", "kvdemo"]  # SGLang stores every layer in its dtype
