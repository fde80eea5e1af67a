"""The speed limit's arithmetic against a hand computation from the tiny model's parameters and its cache's
tensors; the bandwidth probe gives a positive finite figure."""

from __future__ import annotations

import math

import pytest
import torch

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats.quanto.layers import QUANTO_LAYERS
from kvdemo.cache.layers.blockwise import dequantized_reads
from kvdemo.cache.state.speedlimit import SpeedLimit, probe_bandwidth, speed_limit, weight_bytes
from kvdemo.ui import views
from tests.helpers import make_tiny


@pytest.fixture(scope="module")
def small(embedded):
    return make_tiny(embedded.tokenizer, kv_heads=2, head_dim=64, layers=2)


def test_weight_bytes_count_each_parameter_once(small):
    config = small.model.config
    hidden, inter, vocab, layers = config.hidden_size, config.intermediate_size, config.vocab_size, 2
    q, kv = 4 * 64, 2 * 64  # 4 attention heads and 2 KV heads of 64
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter + 2 * hidden
    by_hand = 4 * (vocab * hidden + layers * per_layer + hidden)  # the LM head is tied to the embedding: once
    assert weight_bytes(small.model) == by_hand


@pytest.mark.parametrize("spec", [CacheSpec("dynamic"), CacheSpec("quanto", nbits=4, residual_length=8)])
def test_floor_is_bytes_by_hand_over_bandwidth(small, spec):
    qa = QASession(small, spec)
    qa.prefill("The Normans were the people who in the 10th and 11th centuries gave their name to Normandy. " * 3)
    bandwidth = 10e9
    limit = speed_limit(small.model, qa.cache, bandwidth=bandwidth)
    n = qa.cache_length
    if spec.backend == "dynamic":  # keys and values of 2 layers x 2 KV heads x 64 values per token, float32
        kv_by_hand = 2 * 2 * 2 * 64 * 4 * n
    else:  # the prefill is quantized whole (empty residual): per tensor 2 x n x 64 values at 4 bits, and one
        # float32 scale and shift per group of 64 values along head_dim (axis 0): 64 n + 16 n bytes
        assert qa.cache.layers[0].keys.numel() == 0
        kv_by_hand = 2 * 2 * (64 * n + 2 * n * 2 * 4)
    assert limit.kv_bytes == kv_by_hand and limit.kv_tokens == qa.cache_length
    assert limit.floor_seconds == pytest.approx((weight_bytes(small.model) + kv_by_hand) / bandwidth)
    assert limit.crossover_tokens == math.ceil(weight_bytes(small.model) / (kv_by_hand / qa.cache_length))
    assert limit.ratio(2 * limit.floor_seconds) == pytest.approx(2.0)
    line = views.speed_limit_line(limit, 3 * limit.floor_seconds)
    assert "3.0×" in line and f"{limit.crossover_tokens:,}" in line
    # beside it, the floor of a full-precision cache of the same tokens (what a quantized one is compared with)
    assert limit.full_precision_kv_bytes == 2 * 2 * 2 * 64 * 4 * n
    assert limit.full_precision_floor_seconds == pytest.approx((weight_bytes(small.model) + 2048 * n) / bandwidth)
    assert ("a full-precision cache of these tokens would read" in line) == (spec.backend != "dynamic")
    # a quantized step's attention reads the codes in both layers: nothing de-quantized
    assert limit.code_layers == (0 if spec.backend == "dynamic" else 2) and limit.dequantized_bytes == 0
    assert ("reads the stored codes in 2 layers" in line) == (spec.backend != "dynamic")
    # on the de-quantize path it de-quantizes its whole store (every stored token, keys and values, float32) in each
    # layer (after the prefill the residual is empty: all n tokens are in the store)
    with dequantized_reads():
        limit = speed_limit(small.model, qa.cache, bandwidth=bandwidth)
    line = views.speed_limit_line(limit, None)
    expected = 0 if spec.backend == "dynamic" else 2 * 2 * 2 * 64 * 4 * n  # 2 layers x keys and values x 2 x 64
    assert limit.dequantized_bytes == expected and limit.code_layers == 0
    assert ("de-quantizes the stored values it reads" in line) == bool(expected)
    if expected:
        assert f"{limit.dequantized_bytes / 2**20:,.1f} MiB of full-precision keys and values" in line


def test_spare_room_is_held_not_read(small):
    """storage=growing's buffers hold grown_capacity(n) tokens; a step reads the n held, the rest is `unread_bytes`
    (shown on the page, outside the floor). transformers' concat layer right after the prefill reads all it holds;
    after an answer its restored keys and values are views of the last step's larger tensors (the next step's
    torch.cat replaces them): that rest is held, not read."""
    from kvdemo.cache.layers.storage import grown_capacity

    context = "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy. " * 3
    per_token = 2 * 2 * 2 * 64 * 4  # keys and values x 2 layers x 2 KV heads x 64 values x float32
    growing = QASession(small, CacheSpec("dynamic", storage="growing"))
    n = growing.prefill(context).context_tokens
    limit = speed_limit(small.model, growing.cache, bandwidth=10e9)
    assert limit.kv_bytes == per_token * n and limit.kv_tokens == n
    assert limit.unread_bytes == per_token * (grown_capacity(n) - n) > 0
    assert limit.floor_seconds == pytest.approx((weight_bytes(small.model) + per_token * n) / 10e9)
    assert limit.kv_bytes_per_token == per_token
    line = views.speed_limit_line(limit, None)
    assert f"holds {limit.unread_bytes / 2**20:,.1f} MiB beyond its {n:,} tokens: held, not read" in line
    concat = QASession(small, CacheSpec("dynamic"))
    concat.prefill(context)
    prefilled = speed_limit(small.model, concat.cache, bandwidth=10e9)
    assert prefilled.kv_bytes == per_token * n and prefilled.unread_bytes == 0
    assert "beyond its" not in views.speed_limit_line(prefilled, None)
    answer = concat.ask("Who gave their name to Normandy?", max_new_tokens=4)
    after = speed_limit(small.model, concat.cache, bandwidth=10e9)
    last_step = n + answer.question_tokens + len(answer.token_ids) - 1  # the last token generated is never cached
    assert after.kv_bytes == per_token * n and after.unread_bytes == per_token * (last_step - n)


def test_an_empty_cache_has_no_crossover():
    limit = SpeedLimit(weight_bytes=1000, kv_bytes=0, kv_tokens=0, bandwidth=1e9)
    assert limit.crossover_tokens is None and limit.floor_seconds == pytest.approx(1e-6) and limit.kv_share == 0


def test_probe_gives_a_positive_finite_bandwidth():
    bandwidth = probe_bandwidth(mib=16, repeats=2)
    assert math.isfinite(bandwidth) and bandwidth > 1e8
    assert probe_bandwidth(mib=16, repeats=2) == bandwidth  # cached per process
    with pytest.raises(ValueError):
        probe_bandwidth(mib=0)
    assert torch.get_num_threads() >= 1


def test_the_rotation_costs_flops_not_bytes(small):
    """`rotation=hadamard`: the same bytes read; the flops it adds per step by hand. The small model has 2 layers,
    4 query heads, 2 KV heads of 64: one rotation of a head's vector is 2 x 64^2 flops."""
    context = "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy. " * 3
    product = 2 * 64**2
    limits = {}
    for text in ("quanto:4,residual_length=8", "quanto:4,residual_length=8,rotation=hadamard"):
        qa = QASession(small, CacheSpec.parse(text))
        qa.prefill(context)
        limits[text] = speed_limit(small.model, qa.cache, bandwidth=10e9)
    plain, rotated = limits.values()
    assert rotated.kv_bytes == plain.kv_bytes and rotated.floor_seconds == plain.floor_seconds
    assert plain.rotation_flops == 0 and plain.rotation_side == ""
    # the query side (the tiny model attends through kvdemo's function): 2 x 4 query heads + 2 x 2 KV heads per layer
    assert rotated.rotation_side == "query" and rotated.rotation_flops == 2 * (2 * 4 + 2 * 2) * product
    line = views.speed_limit_line(rotated, None)
    assert f"the rotation adds {rotated.rotation_flops / 1e6:,.1f} MFLOP per step, the same bytes" in line
    assert "rotation" not in views.speed_limit_line(plain, None)
    # the read side: every stored token's key and value per KV head (the prefill is all in the store)
    from kvdemo.cache.layers.flush import quantized_cache
    from kvdemo.cache.state.speedlimit import rotation_flops

    read = quantized_cache(QUANTO_LAYERS, small.config, rotation="hadamard", rotate_query=False, residual_length=8)
    n = qa.cache_length
    for index in range(len(qa.cache.layers)):
        keys, values = (torch.randn(1, 2, n, 64) for _ in range(2))
        read.update(keys, values, index)
    assert rotation_flops(small.config, read) == (2 * 2 * 2 * n * product, "read")
    assert "whole store rotated back" in views.speed_limit_line(SpeedLimit(1, 1, n, 1.0, 0, 0, 1, "read"), None)
