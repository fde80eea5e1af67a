"""Separate key and value precision (`nbits_value`, `kvdemo.cache.layers.precision`): the keys stored exactly as
transformers' layer at `nbits` stores them, the values exactly as its layer at `nbits_value` does, with every flush
policy and rotation; the bytes counted apart; each tensor's group rule checked with its own bits; bad values
refused with the registry's message."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvdemo import CacheSpec, QASession
from kvdemo.cache.spec import build_cache, estimate_kv_bytes
from kvdemo.cache.state.telemetry import kv_memory
from tests.helpers import filled_layer

CONFIG = LlamaConfig(
    vocab_size=8,
    hidden_size=128,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
)


def _stores(spec: CacheSpec, keys: torch.Tensor, values: torch.Tensor, steps: int = 0):
    """The de-quantized keys and values a cache of `spec` holds after a prefill of `keys`, `values`
    ([1, 2, tokens, 64]) and `steps` decode steps of the same rows, and its layer."""
    layer = filled_layer(spec, CONFIG, keys, values, steps)
    return layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values), layer


@pytest.mark.parametrize(
    "base",
    [
        "quanto:4",
        "hqq:4",
        "hqq:8,q_group_size=32",
        "quanto:4,flush=append",
        "hqq:4,rotation=hadamard",
        "hqq:4,flush=append,rotation=hadamard",
    ],
)
def test_keys_and_values_each_stored_as_the_library_stores_their_bits(base):
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64) * 3
    spec = CacheSpec.parse(base).replace(residual_length=4)
    value_bits = 2
    mixed_keys, mixed_values, layer = _stores(spec.replace(nbits_value=value_bits), keys, values, steps=9)
    same_keys, _, _ = _stores(spec, keys, values, steps=9)
    _, low_values, _ = _stores(spec.replace(nbits=value_bits), keys, values, steps=9)
    assert torch.equal(mixed_keys, same_keys) and torch.equal(mixed_values, low_values)
    assert not torch.equal(mixed_values, _stores(spec, keys, values, steps=9)[1])  # 2 bits is not nbits's
    # the library's precision attributes are the keys' again between updates (what a snapshot keeps)
    assert layer.nbits == spec.resolved()["nbits"] and layer.nbits_value == value_bits
    if hasattr(layer, "qtype"):
        assert layer.qtype.bits == 4


@pytest.mark.parametrize("text", ["quanto:4,nbits_value=2", "quanto:2,nbits_value=4", "hqq:4,nbits_value=3"])
def test_the_bytes_count_keys_and_values_apart(text):
    spec = CacheSpec.parse(text).replace(residual_length=8)
    layer = build_cache(spec, CONFIG).layers[0]
    # 40 tokens: quanto's 2-bit packing pads batch x heads x tokens / (head_dim / q_group_size) rows to a multiple
    # of 4 (37 tokens hold 32 bytes more per 2-bit tensor), which the formula leaves out (within 1 %)
    layer.update(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64))
    layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))  # a token in the residual
    held = kv_memory(build := build_cache(spec, CONFIG))  # an empty cache of the same spec holds nothing
    assert held.cache_bytes == 0
    build.layers[0] = layer
    estimate = estimate_kv_bytes(spec, CONFIG, 41, torch.float32, residual_tokens=1)
    assert kv_memory(build).cache_bytes == estimate
    # keys at nbits, values at nbits_value: the mean of the two same-bits caches' quantized bytes
    alike = [
        estimate_kv_bytes(spec.replace(nbits=n, nbits_value=None), CONFIG, 41, torch.float32, 1)
        for n in (spec.nbits, spec.nbits_value)
    ]
    assert estimate == sum(alike) / 2


def test_a_session_answers_with_mixed_bits_as_fresh_and_restores(tiny, normans):
    spec = CacheSpec.parse("quanto:4,nbits_value=2,residual_length=4")
    session = QASession(tiny, spec)
    session.prefill(normans.paragraphs[0])
    first = session.ask("Who was the Norse leader?", 12)
    again = session.ask("Who was the Norse leader?", 12)
    fresh = QASession(tiny, spec)
    fresh.prefill(normans.paragraphs[0])
    assert first.token_ids == again.token_ids == fresh.ask("Who was the Norse leader?", 12).token_ids
    assert session.cache.layers[0].nbits == 4 and session.cache.layers[0].axis_value == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ("quanto:4,nbits_value=3", "nbits_value=3 is not allowed for quanto; allowed: 2, 4"),
        ("fp8,nbits_value=4", "nbits_value=4 is not an option of the fp8 backend"),
        ("dynamic,nbits_value=4", "nbits_value=4 is not an option of the dynamic backend"),
        ("hqq:4,nbits_value=x", "nbits_value='x' must be an integer"),
    ],
)
def test_a_bad_value_precision_gets_the_registry_message(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        CacheSpec.parse(text)


def test_each_tensor_group_rule_takes_its_own_bits():
    # hqq packs two 4-bit values but four 2-bit ones: q_group_size=2 fits the keys, not the values
    CacheSpec.parse("hqq:4,q_group_size=2").validate(CONFIG)
    with pytest.raises(ValueError, match=r"q_group_size=2 \(axis_value=0\): hqq packs 4 2-bit values"):
        CacheSpec.parse("hqq:4,nbits_value=2,q_group_size=2").validate(CONFIG)
    from kvdemo.cache.model.groups import allowed_group_sizes

    sizes = allowed_group_sizes(CacheSpec.parse("hqq:4,nbits_value=2"), CONFIG)
    assert 2 in sizes["axis_key"] and 2 not in sizes["axis_value"] and 4 in sizes["axis_value"]
