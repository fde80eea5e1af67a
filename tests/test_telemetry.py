"""kv_memory against bytes computed by hand for a known shape, for each backend; flush detection;
full-precision reference; telemetry never changes the cache."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvdemo import CacheSpec, build_cache, kv_memory
from kvdemo.telemetry import expected_flush_steps, flushed_layers, full_precision_bytes

HEADS, DIM, TOKENS, LAYERS = 2, 64, 37, 2
N = HEADS * TOKENS * DIM  # values in one key (or value) tensor of one layer


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=HEADS, head_dim=DIM, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _prefill(model, spec, tokens=TOKENS):
    cache = build_cache(spec, model.config)
    with torch.no_grad():
        model(torch.arange(tokens).view(1, -1) % 64, past_key_values=cache)
    return cache


def _quanto_bytes(nbits, group):
    rows = N // group  # quanto groups the flattened tensor into rows of `group` values (axis 0)
    packed = math.ceil(rows / (8 // nbits)) * group  # uint8, 8/nbits rows per byte row
    return packed + rows * 4 + rows * 4  # + float32 scale and shift per group


def _hqq_bytes(nbits, group):
    groups = N // group
    if nbits == 3:
        packed = math.ceil(group / 10) * groups * 4  # ten 3-bit values per int32
    else:
        packed = group * nbits // 8 * groups  # uint8
    return packed + groups * 4 * 2  # + float32 scale and zero per group


@pytest.mark.parametrize(
    "spec, per_tensor",
    [
        (CacheSpec("dynamic"), N * 4),
        (CacheSpec("fp8"), N * 1 + 4),  # float8 values + one float32 scale
        (CacheSpec("quanto", nbits=2), _quanto_bytes(2, 64)),
        (CacheSpec("quanto", nbits=4, q_group_size=32), _quanto_bytes(4, 32)),
        (CacheSpec("hqq", nbits=1, q_group_size=16), _hqq_bytes(1, 16)),
        (CacheSpec("hqq", nbits=2), _hqq_bytes(2, 64)),
        (CacheSpec("hqq", nbits=3), _hqq_bytes(3, 64)),
        (CacheSpec("hqq", nbits=4), _hqq_bytes(4, 64)),
        (CacheSpec("hqq", nbits=8, q_group_size=32), _hqq_bytes(8, 32)),
    ],
    ids=lambda v: v.label if isinstance(v, CacheSpec) else str(v),
)
def test_memory_after_prefill_matches_bytes_by_hand(model, spec, per_tensor):
    report = kv_memory(_prefill(model, spec))
    assert report.total_bytes == 2 * LAYERS * per_tensor
    assert report.seq_length == TOKENS
    if spec.info.quantized:
        assert report.residual_bytes == 0 and all(layer.residual_tokens == 0 for layer in report.layers)
    else:
        assert report.quantized_bytes == 0 and report.layers[0].residual_tokens == TOKENS


def test_quanto_packed_storage_is_counted_not_the_unpacked_size(model):
    cache = _prefill(model, CacheSpec("quanto", nbits=2))
    qkeys = cache.layers[0]._quantized_keys
    assert qkeys.element_size() * qkeys.nelement() == N * 4  # what the tensor claims: the unpacked float size
    assert kv_memory(cache).layers[0].quantized_bytes == 2 * _quanto_bytes(2, 64)  # ~9x less


def test_residual_bytes_and_flushes_during_decode(model):
    cache = _prefill(model, CacheSpec("hqq", nbits=4, residual_length=3))
    residuals, flushes = [], []
    with torch.no_grad():
        for _ in range(7):
            model(torch.tensor([[5]]), past_key_values=cache)
            report = kv_memory(cache)
            residuals.append(report.layers[0].residual_tokens)
            flushes.append(flushed_layers(cache))
            assert report.layers[0].residual_bytes == 2 * HEADS * DIM * 4 * report.layers[0].residual_tokens
    assert residuals == [1, 2, 0, 1, 2, 0, 1]  # sawtooth: flush when residual + 1 >= 3
    assert flushes == [(), (), (0, 1), (), (), (0, 1), ()]


def test_fp8_and_dynamic_never_flush(model):
    for spec in (CacheSpec("fp8"), CacheSpec("dynamic")):
        cache = _prefill(model, spec)
        with torch.no_grad():
            model(torch.tensor([[5]]), past_key_values=cache)
        assert flushed_layers(cache) == ()
    assert kv_memory(cache).total_bytes == 2 * LAYERS * HEADS * (TOKENS + 1) * DIM * 4


def test_reading_memory_changes_nothing(model):
    cache = _prefill(model, CacheSpec("quanto", nbits=4, residual_length=8))
    with torch.no_grad():
        model(torch.tensor([[5]]), past_key_values=cache)
    before = [dict(vars(layer)) for layer in cache.layers]
    kv_memory(cache), flushed_layers(cache)
    for layer, saved in zip(cache.layers, before):
        assert vars(layer).keys() == saved.keys() and all(vars(layer)[k] is v for k, v in saved.items())


def test_full_precision_bytes_formula(model):
    assert full_precision_bytes(model.config, 100, torch.float32) == 2 * LAYERS * HEADS * DIM * 100 * 4
    assert full_precision_bytes(model.config, 100, torch.bfloat16) == 2 * LAYERS * HEADS * DIM * 100 * 2
    assert kv_memory(_prefill(model, CacheSpec())).total_bytes == full_precision_bytes(model.config, TOKENS, torch.float32)


def test_expected_flush_steps_follow_transformers_rule():
    # 5 question tokens >= residual_length 4: flush at step 0, then every 4th single-token step
    assert expected_flush_steps(5, 4, 10) == [0, 4, 8]
    # 2 question tokens: the residual holds 2, 3 after step 1, then 4 at step 2 -> flush
    assert expected_flush_steps(2, 4, 8) == [2, 6]
    assert expected_flush_steps(3, 1, 3) == [0, 1, 2]  # residual_length=1: every step
    assert expected_flush_steps(20, 128, 30) == []  # an answer shorter than the residual
