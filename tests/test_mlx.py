"""The `mlx` format (`kvdemo.cache.formats.mlx`): MLX's affine groups byte for byte against `mlx.core.quantize` and
`mx.dequantize` (mlx-cpu, run as an oracle: `tests/oracles.py`) at every bits, group size and dtype mlx-lm stores,
mlx-lm's `quantized_kv_start` rule, the bytes held, the deploy line and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats.mlx.affine import dequantize_affine, quantize_affine
from kvdemo.cache.spec import build_cache
from kvdemo.cache.state.telemetry import kv_memory
from tests.oracles import run_oracle

MLX = """
import mlx.core as mx
for name, x in inputs.items():
    dtype = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[name.split("_")[0]]
    for bits in (2, 3, 4, 5, 6, 8):
        for group in (32, 64, 128):
            q, s, b = mx.quantize(mx.array(x).astype(dtype), group_size=group, bits=bits)
            tag = f"{name}_{bits}_{group}"
            outputs[tag + "_codes"] = np.array(q).view(np.uint8)
            outputs[tag + "_scales"] = np.array(s.astype(mx.float32))
            outputs[tag + "_biases"] = np.array(b.astype(mx.float32))
            outputs[tag + "_read"] = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits).astype(mx.float32))
"""

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def rows():
    """Rows at three magnitudes (one head each), a constant group and an outlier channel, in each dtype: [2, 3, 9,
    128]."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 128) * torch.tensor([0.01, 1.0, 30.0]).reshape(1, 3, 1, 1)
    x[0, 0, 0, :32] = 0.5
    x[..., 7] *= 20
    return {name: x.to(dtype) for name, dtype in DTYPES.items()}


@pytest.fixture(scope="module")
def mlx(rows):
    return run_oracle(MLX, **{f"{name}_rows": x.float().numpy() for name, x in rows.items()})


@pytest.mark.process  # the reference runs in a process of its own (tests/oracles.py)
@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_groups_are_mlx_s_bytes(rows, mlx, name, bits):
    for group in (32, 64, 128):
        tag = f"{name}_rows_{bits}_{group}"
        store = quantize_affine(rows[name], bits, group)
        assert store.scales.dtype == rows[name].dtype  # stored in the model's dtype, as mlx-lm does
        np.testing.assert_array_equal(store.codes.numpy(), mlx[tag + "_codes"].reshape(store.codes.shape))
        np.testing.assert_array_equal(store.scales.float().numpy(), mlx[tag + "_scales"])
        np.testing.assert_array_equal(store.biases.float().numpy(), mlx[tag + "_biases"])
        if name == "f32":  # read back to the same bits as mx.dequantize
            np.testing.assert_array_equal(
                dequantize_affine(store, bits, group, torch.float32).numpy(), mlx[tag + "_read"]
            )


def test_the_layer_converts_when_it_reaches_quantized_kv_start(tiny):
    layer = build_cache(CacheSpec.parse("mlx:4,quantized_kv_start=20"), tiny.config).layers[0]
    torch.manual_seed(1)
    chunks = [(torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)) for n in (12, 12, 1, 1)]
    keys, _ = layer.update(*chunks[0])
    assert layer._quantized_keys is None and torch.equal(keys, chunks[0][0])  # 12 < 20: full precision
    keys, _ = layer.update(*chunks[1])
    whole = torch.cat([chunks[0][0], chunks[1][0]], dim=-2)
    assert torch.equal(keys, whole)  # the update that reaches the start still attends in full precision
    assert torch.equal(layer._quantized_keys.codes, quantize_affine(whole, 4, 64).codes)  # then all 24 at once
    assert layer.keys.shape[-2] == 0  # nothing left in full precision
    for step in chunks[2:]:
        keys, values = layer.update(*step)
    every = torch.cat([whole, chunks[2][0], chunks[3][0]], dim=-2)
    assert torch.equal(layer._quantized_keys.codes, quantize_affine(every, 4, 64).codes)  # per token: appending
    assert torch.equal(keys, dequantize_affine(quantize_affine(every, 4, 64), 4, 64, torch.float32))


@pytest.mark.parametrize("text", ["mlx:4", "mlx:8,kv_group_size=32", "mlx:4,quantized_kv_start=100000"])
def test_the_bytes_held_are_the_formula_s(tiny, text):
    session = QASession(tiny, CacheSpec.parse(text))
    tokens = session.prefill("The Normans gave their name to Normandy, a region in France. " * 8).context_tokens
    config, spec = tiny.config, session.spec.resolved()
    values = 2 * config.num_hidden_layers * config.num_key_value_heads * 64 * tokens  # keys and values
    if spec["quantized_kv_start"] > tokens:
        expected = values * 4  # float32: not quantized yet
    else:
        expected = values * spec["nbits"] / 8 + values / spec["kv_group_size"] * 2 * 4  # a float32 scale and bias
    assert kv_memory(session.cache).cache_bytes == expected == session.prefill_report.kv_bytes


def test_deploy_line_is_mlx_lm_s_flags_and_none_on_sliding_windows(tiny):
    from tests.families import family_config

    lines = [d.line for d in CacheSpec.parse("mlx:4,kv_group_size=32").deployments(tiny.config)]
    assert lines[0].startswith(
        "mlx-lm: mlx_lm.generate --model MODEL --kv-bits 4 --kv-group-size 32 --quantized-kv-start 0  # kvdemo prefills"
    )
    gemma = [d.engine for d in CacheSpec.parse("mlx:4,kv_group_size=32").deployments(family_config("Gemma 3"))]
    assert gemma == ["kvdemo"]  # mlx-lm cannot quantize its rotating cache


def test_a_head_dim_no_group_divides_is_refused_before_the_prefill(embedded):
    from tests.helpers import make_tiny

    wide = make_tiny(embedded.tokenizer, head_dim=96)
    refusal = "groups of 64 values along head_dim, so a head_dim of 96 cannot be stored; use kv_group_size=32"
    with pytest.raises(ValueError, match=refusal):
        CacheSpec.parse("mlx:4").validate(wide.config)
    assert CacheSpec.parse("mlx:4,kv_group_size=32").validate(wide.config).resolved()["kv_group_size"] == 32
    with pytest.raises(ValueError, match="a head_dim of 40 cannot be stored; use backend=dynamic"):
        CacheSpec.parse("mlx:4,kv_group_size=32").validate(make_tiny(embedded.tokenizer, head_dim=40).config)
