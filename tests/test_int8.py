"""The `int8` format (`kvdemo.cache.formats.int8`): vLLM's `int8_per_token_head` reference arithmetic written out, the
layer's store equal to its prefill and steps coded whole, the window kept, the bytes held and the deploy lines."""

from __future__ import annotations

import torch

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats.int8.layers import dequantize_int8, quantize_int8
from kvdemo.cache.spec import build_cache
from kvdemo.cache.state.telemetry import kv_memory


def test_codes_are_vllm_s_reference():
    # vLLM's `_quantize_per_token_head_ref` for int8 (tests/quantization/test_per_token_kv_cache.py), written out
    torch.manual_seed(0)
    states = torch.randn(2, 3, 17, 64) * torch.logspace(-4, 2, 17).reshape(1, 1, 17, 1)
    states[0, 0, 0] = 0
    scales = (states.float().abs().amax(dim=-1) / 127.0).clamp(min=1e-6)
    codes = (states.float() * (1.0 / scales.unsqueeze(-1))).round().clamp(-128.0, 127.0).to(torch.int8)
    store = quantize_int8(states)
    assert torch.equal(store.codes, codes) and torch.equal(store.scales.squeeze(-1), scales)
    assert store.codes.abs().max() == 127 and (store.codes[0, 0, 0] == 0).all()
    read = dequantize_int8(store, torch.float32)
    assert ((read - states).abs() <= store.scales / 2 * (1 + 1e-6)).all()  # within half a step of its own token


def test_the_layer_codes_prefill_and_steps_as_a_whole_and_keeps_the_window():
    from tests.families import family_config

    config = family_config("Gemma 3")  # sliding layers first (window 16), then a full-attention one
    cache = build_cache(CacheSpec("int8"), config)
    torch.manual_seed(1)
    heads, width = config.num_key_value_heads, config.head_dim
    prefill = torch.randn(1, heads, 30, width), torch.randn(1, heads, 30, width)
    steps = [(torch.randn(1, heads, 1, width), torch.randn(1, heads, 1, width)) for _ in range(3)]
    sliding, full = cache.layers[0], cache.layers[3]
    for layer in (sliding, full):
        assert layer.update(*prefill)[0] is prefill[0]  # the prefill attends in full precision
        for step in steps:
            keys, _ = layer.update(*step)
    every = torch.cat([prefill[0], *(s[0] for s in steps)], dim=-2)
    assert torch.equal(full._records()[0].codes, quantize_int8(every).codes)  # per token: appending is coding whole
    assert torch.equal(sliding._quantized_keys.codes, quantize_int8(every[..., -15:, :]).codes)  # window - 1 kept
    assert keys.shape[-2] == 33


def test_bytes_held_are_a_row_of_head_dim_plus_4(tiny):
    session = QASession(tiny, CacheSpec("int8"))
    tokens = session.prefill("The Normans gave their name to Normandy, a region in France. " * 8).context_tokens
    rows = 2 * tiny.config.num_hidden_layers * tiny.config.num_key_value_heads * tokens
    assert kv_memory(session.cache).cache_bytes == rows * (64 + 4) == session.prefill_report.kv_bytes


def test_deploy_line_is_vllm_s_dtype_with_its_kept_layers(tiny):
    from tests.families import family_config

    assert CacheSpec("int8").deployments(tiny.config)[0].line == "vLLM: --kv-cache-dtype int8_per_token_head"
    gemma = family_config("Gemma 3")
    kept = CacheSpec.parse("int8,sliding=keep").deployments(gemma)[0].line
    assert kept == "vLLM: --kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers sliding_window"
