"""`kvdemo.capacity.GrowingLayer`: the same logits as transformers' `DynamicLayer`, in-place appends into storage
that grows geometrically, a restore that only moves the length back (the prefix never written after the prefill),
and memory accounting that counts the spare capacity."""

from __future__ import annotations

import dataclasses

import torch
from transformers import DynamicCache

from kvdemo import BACKENDS, CacheSpec, QASession, kv_memory, snapshot
from kvdemo.capacity import GROWTH, MIN_HEADROOM, GrowingLayer, growing_dynamic_cache, grown_capacity
from tests.test_snapshot import held_bytes

CONTEXT = "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy. " * 4


def test_grown_capacity_is_geometric_with_a_minimum_headroom():
    assert grown_capacity(10) == 10 + MIN_HEADROOM
    assert grown_capacity(8000) == 9000 and GROWTH == 1.125


def test_same_logits_as_dynamic_layer_through_prefill_chunks_decode_steps_and_crop(tiny):
    model = tiny.model
    ids = torch.randint(5, 1000, (1, 420), generator=torch.Generator().manual_seed(0))
    plain, growing = DynamicCache(config=model.config), growing_dynamic_cache(model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in growing.layers)
    with torch.no_grad():
        for start, end in [(0, 100), (100, 380)] + [(i, i + 1) for i in range(380, 420)]:  # grows twice
            expected = model(ids[:, start:end], cache=plain).logits
            assert torch.equal(model(ids[:, start:end], cache=growing).logits, expected)
        assert growing.layers[0].capacity == grown_capacity(380) and growing.get_seq_length() == 420
        plain.crop(-7)
        growing.crop(-7)
        for a, b in zip(plain.layers, growing.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(model(ids[:, 5:6], cache=growing).logits, model(ids[:, 5:6], cache=plain).logits)


def _use_growing_layers(monkeypatch) -> None:
    """`dynamic` built with `GrowingLayer`s until the test ends (the registry's build replaced)."""
    growing = dataclasses.replace(BACKENDS["dynamic"], build=lambda spec, config: growing_dynamic_cache(config))
    monkeypatch.setitem(BACKENDS, "dynamic", growing)


QUESTIONS = ("Who led the Normans?", "Where is Normandy?", "Who led the Normans?")


def test_answers_equal_dynamic_cache_and_restore_moves_only_the_length(tiny, monkeypatch):
    plain = QASession(tiny, CacheSpec("dynamic"))
    plain.prefill(CONTEXT)
    expected = [plain.ask(q, 12).token_ids for q in QUESTIONS]
    _use_growing_layers(monkeypatch)
    qa = QASession(tiny, CacheSpec("dynamic"))
    qa.prefill(CONTEXT)
    layers = qa.cache.layers
    assert all(isinstance(layer, GrowingLayer) for layer in layers)
    length = qa.cache_length
    prefix = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    buffers = [(layer._key_buffer.data_ptr(), layer._value_buffer.data_ptr()) for layer in layers]
    assert [qa.ask(q, 12).token_ids for q in QUESTIONS] == expected
    for layer, (keys, values), pointers in zip(layers, prefix, buffers):
        assert layer.get_seq_length() == length
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)  # the prefix's bytes unchanged
        assert (layer._key_buffer.data_ptr(), layer._value_buffer.data_ptr()) == pointers  # written in place


def test_memory_counts_the_spare_capacity(tiny, monkeypatch):
    _use_growing_layers(monkeypatch)
    qa = QASession(tiny, CacheSpec("dynamic"))
    qa.prefill(CONTEXT)
    capacity = qa.cache.layers[0].capacity
    assert capacity == grown_capacity(qa.cache_length) > qa.cache_length
    per_token = 2 * 2 * 64 * 4  # keys and values of 2 KV heads x 64 values, float32, per layer
    report = kv_memory(qa.cache, qa._snapshot)
    assert report.residual_bytes == 2 * per_token * capacity == held_bytes(qa.cache, qa._snapshot)
    assert report.snapshot_bytes == 0 and report.seq_length == qa.cache_length
    saved = snapshot.take(qa.cache)
    assert saved.layers[0].attributes is None and saved.layers[0].length == qa.cache_length
