"""snapshot.take / restore on their own: what they keep, and what they refuse."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from kvdemo import CacheSpec, build_cache, kv_memory
from kvdemo import snapshot


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _run(model, cache, tokens):
    with torch.no_grad():
        model(torch.arange(tokens).view(1, -1) % 64, past_key_values=cache)


def test_dynamic_snapshot_keeps_only_lengths_and_restore_is_a_view(model):
    cache = build_cache(CacheSpec(), model.config)
    _run(model, cache, 10)
    keys0 = cache.layers[0].keys.clone()
    saved = snapshot.take(cache)
    assert [(s.attributes, s.length) for s in saved.layers] == [(None, 10), (None, 10)]
    _run(model, cache, 4)
    grown = cache.layers[0].keys
    snapshot.restore(cache, saved)
    assert cache.get_seq_length() == 10 and torch.equal(cache.layers[0].keys, keys0)
    assert cache.layers[0].keys.untyped_storage().data_ptr() == grown.untyped_storage().data_ptr()  # no copy
    # until the next decode step, the view keeps the longer storage alive, and kv_memory says so
    assert kv_memory(cache).layers[0].residual_bytes == 2 * 14 * 32 * 4


def test_quantized_snapshot_restores_the_same_objects(model):
    cache = build_cache(CacheSpec("quanto", nbits=2, q_group_size=32, residual_length=2), model.config)
    _run(model, cache, 10)
    layer = cache.layers[1]
    store, residual = layer._quantized_keys, layer.keys
    saved = snapshot.take(cache)
    _run(model, cache, 3)  # flushes
    assert layer._quantized_keys is not store
    layer.extra_attribute = "added during the answer"
    snapshot.restore(cache, saved)
    assert layer._quantized_keys is store and layer.keys is residual and layer.cumulative_length == 10
    assert not hasattr(layer, "extra_attribute")


def test_static_cache_is_refused(model):
    cache = StaticCache(config=model.config, max_cache_len=32)
    _run(model, cache, 5)
    with pytest.raises(TypeError, match="layer 0 is a StaticLayer, which writes new tokens into its tensors in place"):
        snapshot.take(cache)


def test_unknown_layer_types_are_refused():
    class InPlaceLayer:
        pass

    cache = DynamicCache()
    cache.layers = [InPlaceLayer()]
    with pytest.raises(TypeError, match="layer 0 is a InPlaceLayer; kvdemo can only snapshot layers that assign"):
        snapshot.take(cache)


def test_restore_refuses_a_snapshot_of_another_cache(model):
    small = build_cache(CacheSpec(), model.config)
    _run(model, small, 4)
    big = build_cache(CacheSpec(), model.config)
    _run(model, big, 9)
    saved_big = snapshot.take(big)
    with pytest.raises(ValueError, match="layer 0 holds 4 tokens, fewer than the 9 saved"):
        snapshot.restore(small, saved_big)
    one_layer = DynamicCache()
    with pytest.raises(ValueError, match="the snapshot has 2 layers but the cache has 0"):
        snapshot.restore(one_layer, saved_big)
