"""`kvdemo.cache.layers.storage.GrowingLayer`: the same logits as transformers' `DynamicLayer`, in-place appends into
storage that grows geometrically, a restore that only moves the length back (the prefix never written after the
prefill), and memory accounting that counts the spare capacity."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvdemo import CacheSpec, QASession, kv_memory
from kvdemo.cache.layers.storage import (
    GROWTH,
    MIN_HEADROOM,
    GrowingLayer,
    capacity_bound,
    growing_dynamic_cache,
    grown_capacity,
)
from kvdemo.cache.spec import build_cache, estimate_kv_bytes
from kvdemo.cache.state import snapshot
from kvdemo.cache.state.budget import KVBudgetError
from kvdemo.cli.main import build_parser
from kvdemo.ui.inputs import spec_from_inputs
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


GROWING = CacheSpec("dynamic", storage="growing")


QUESTIONS = ("Who led the Normans?", "Where is Normandy?", "Who led the Normans?")


def test_answers_equal_dynamic_cache_and_restore_moves_only_the_length(tiny):
    plain = QASession(tiny, CacheSpec("dynamic"))
    plain.prefill(CONTEXT)
    expected = [plain.ask(q, 12).token_ids for q in QUESTIONS]
    qa = QASession(tiny, GROWING)
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


def test_memory_counts_the_spare_capacity(tiny):
    qa = QASession(tiny, GROWING)
    qa.prefill(CONTEXT)
    capacity = qa.cache.layers[0].capacity
    assert capacity == grown_capacity(qa.cache_length) > qa.cache_length
    per_token = 2 * 2 * 64 * 4  # keys and values of 2 KV heads x 64 values, float32, per layer
    report = kv_memory(qa.cache, qa._snapshot)
    assert report.residual_bytes == 2 * per_token * capacity == held_bytes(qa.cache, qa._snapshot)
    assert report.snapshot_bytes == 0 and report.seq_length == qa.cache_length
    saved = snapshot.take(qa.cache)
    assert saved.layers[0].attributes is None and saved.layers[0].length == qa.cache_length


def test_the_registry_option_builds_it_and_transformers_layer_stays_the_default(tiny):
    assert CacheSpec.parse("dynamic,storage=Growing") == GROWING and GROWING.label == "dynamic storage=growing"
    assert CacheSpec("dynamic").resolved() == {"storage": "concat"}
    assert type(build_cache(CacheSpec("dynamic"), tiny.config).layers[0]) is DynamicLayer
    assert all(isinstance(layer, GrowingLayer) for layer in build_cache(GROWING, tiny.config).layers)
    with pytest.raises(ValueError, match="storage='grown' is not allowed for dynamic; allowed: concat, growing"):
        CacheSpec.parse("dynamic,storage=grown")
    with pytest.raises(ValueError, match="storage=growing is not an option of the hqq backend"):
        CacheSpec.parse("hqq:4,storage=growing")
    assert (
        spec_from_inputs("dynamic", dict(nbits=4, q_group_size=64, flush="append", storage="growing")) == GROWING
    )  # hidden fields ignored
    args = build_parser().parse_args(["ask", "--context-file", "x", "--backend", "dynamic", "--storage", "growing"])
    assert args.storage == "growing"


def test_byte_formula_is_the_capacity_bound_the_budget_guard_plans_for(tiny):
    per_token = 2 * 2 * 2 * 64 * 4  # keys and values x 2 layers x 2 KV heads x 64 values, float32
    for tokens in (1, 100, 3000):
        assert estimate_kv_bytes(GROWING, tiny.config, tokens, torch.float32) == per_token * capacity_bound(tokens)
        assert estimate_kv_bytes(GROWING, tiny.config, tokens, torch.float32, nominal_bits=True) == per_token * tokens
    assert capacity_bound(0) == 0 and capacity_bound(3000) == 3375
    qa = QASession(tiny, GROWING)
    report = qa.prefill(CONTEXT)  # one pass: the bound is reached exactly
    assert report.kv_bytes == estimate_kv_bytes(GROWING, tiny.config, report.context_tokens, torch.float32)
    # an answer longer than the headroom grows the buffer; restored, the capacity stays under the bound of the most
    # tokens ever held, which is what the guard planned for (context + max_new_tokens)
    headroom = qa.cache.layers[0].capacity - qa.cache_length
    answer = qa.ask("Who were the Normans?", headroom + 20)
    most = report.context_tokens + answer.question_tokens + answer.steps
    assert qa.cache.layers[0].capacity > report.context_tokens + headroom
    assert kv_memory(qa.cache, qa._snapshot).total_bytes <= per_token * capacity_bound(most)
    planned = qa.estimate_kv_bytes(report.context_tokens, answer.question_tokens + headroom + 20)
    assert kv_memory(qa.cache, qa._snapshot).total_bytes <= planned
    # the guard refuses a prefill whose capacity would not fit, though its tokens alone would
    needed = estimate_kv_bytes(GROWING, tiny.config, report.context_tokens, torch.float32, nominal_bits=True)
    with pytest.raises(KVBudgetError):
        QASession(tiny, GROWING, kv_budget_bytes=needed + per_token).prefill(CONTEXT)
