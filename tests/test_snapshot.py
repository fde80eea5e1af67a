"""snapshot.take / restore on their own: what they keep, and what they refuse; and a sliding-window model
(a tiny random Mistral saved and loaded by `load_model(folder)`), whose session must hold no more than the window
after the prefill and after every restore."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, StaticCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvdemo import CacheSpec, QASession, build_cache, kv_memory, load_model
from kvdemo.cache.state import snapshot


def held_bytes(cache, saved: snapshot.CacheSnapshot | None = None) -> int:
    """Bytes of every distinct tensor storage held by the cache's layers (every attribute) and by the snapshot
    (every saved attribute), tensor subclasses opened with `__tensor_flatten__`: what stays alive, counted here
    independently of `kv_memory`. A sliding-window layer's `_sliding_window_tensor` (the window size as a 0-dim
    int64, not KV) is left out."""
    seen, total = set(), 0

    def walk(obj: Any):
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
                for name in obj.__tensor_flatten__()[0]:
                    yield from walk(getattr(obj, name))
            else:
                yield obj
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                yield from walk(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                yield from walk(item)

    states = [vars(layer) for layer in cache.layers]
    states += [layer.attributes for layer in (saved.layers if saved else ()) if layer.attributes]
    for state in states:
        for tensor in walk([v for k, v in state.items() if k != "_sliding_window_tensor"]):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _run(model, cache, tokens):
    with torch.no_grad():
        model(torch.arange(tokens).view(1, -1) % 64, cache=cache)


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


# ---- a sliding-window model ---------------------------------------------------------------------------------

WINDOW, KV_HEADS, HEAD_DIM, LAYERS = 16, 1, 32, 2
SLIDING_CONTEXT = " ".join(f"Rollo led the Normans in year {900 + i}." for i in range(80))  # ~1,100 tokens


@pytest.fixture(scope="module")
def sliding(embedded, tmp_path_factory):
    """A tiny random Mistral with `sliding_window=16` on every layer, saved with the embedded tokenizer and
    loaded back through `kvdemo.load_model(folder)`."""
    tokenizer = embedded.tokenizer
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("sliding-mistral")
    MistralForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_model(str(folder))


def _greedy(model, ids, steps):
    """Greedy decoding by a plain transformers forward with a fresh DynamicCache."""
    cache, inputs, out = DynamicCache(config=model.config), torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(input_ids=inputs, cache=cache, use_cache=True).logits[0, -1].argmax()))
            inputs = torch.tensor([[out[-1]]])
    return out, cache


def test_sliding_window_session_holds_only_the_window(sliding):
    session = QASession(sliding, CacheSpec())
    report = session.prefill(SLIDING_CONTEXT)
    assert 1000 < report.context_tokens < 1200
    assert all(type(layer) is DynamicSlidingWindowLayer for layer in session.cache.layers)
    # what the layer itself keeps: transformers alone, after the same prefill and one decode step
    prefix = session.prompt_ids("Who?")[: report.context_tokens]
    _, alone = _greedy(sliding.model, prefix, 2)
    assert held_bytes(alone) == LAYERS * 2 * KV_HEADS * WINDOW * HEAD_DIM * 4 == 8192
    window = LAYERS * 2 * KV_HEADS * (WINDOW - 1) * HEAD_DIM * 4  # the last window - 1 tokens, compact
    assert held_bytes(session.cache, session._snapshot) == window < held_bytes(alone)
    assert report.kv_bytes == report.memory.total_bytes == window  # the report counts all that is held
    question = "Who led the Normans?"
    expected, _ = _greedy(sliding.model, session.prompt_ids(question), 6)
    for _ in range(2):
        events = list(session.stream(question, 6))
        answer = session.history[-1]
        assert list(answer.token_ids) == expected  # the compact window is the same values
        assert answer.cache_length_after == report.context_tokens
        assert held_bytes(session.cache, session._snapshot) == window  # after every restore
        # during the answer the snapshot's window is held beside the cache's, and the figures say so
        assert all(e.memory.snapshot_bytes == window for e in events)
        assert all(e.memory.total_bytes == e.memory.cache_bytes + window for e in events)


@pytest.mark.parametrize("kind", ["hybrid_sliding", "hybrid", "linear_attention"])
def test_in_place_states_are_cloned_and_copied_back(kind):
    """A layer with conv and recurrent states written in place (transformers' `LinearAttentionLayer` and the hybrids)
    is recognised by those states before its base class: `hybrid_sliding` subclasses `DynamicSlidingWindowLayer`, and
    a shallow copy of it left the states 3.87 and 4.33 off after one step. Restored, they equal the saved ones, in the
    same tensor objects, and its keys and values follow their own rule."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

    layer = DYNAMIC_LAYER_TYPE_MAPPING[kind](**({"sliding_window": 8} if kind == "hybrid_sliding" else {}))
    cache = DynamicCache()
    cache.layers = [layer]
    torch.manual_seed(0)
    layer.update_conv_state(torch.randn(1, 6, 3))
    layer.update_recurrent_state(torch.randn(1, 2, 4, 4))
    if kind != "linear_attention":
        layer.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    conv, recurrent = layer.conv_states[0].clone(), layer.recurrent_states[0].clone()
    live = layer.conv_states[0], layer.recurrent_states[0]
    saved = snapshot.take(cache)
    layer.update_conv_state(torch.randn(1, 6, 1))  # a decode step writes both states in place
    layer.update_recurrent_state(torch.randn(1, 2, 4, 4))
    if kind != "linear_attention":
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    assert not torch.equal(layer.conv_states[0], conv) and not torch.equal(layer.recurrent_states[0], recurrent)
    snapshot.restore(cache, saved)
    assert torch.equal(layer.conv_states[0], conv) and torch.equal(layer.recurrent_states[0], recurrent)
    assert layer.conv_states[0] is live[0] and layer.recurrent_states[0] is live[1]
    if kind != "linear_attention":
        assert layer.get_seq_length() == 5 and layer.keys.shape[-2] == 5
    memory = kv_memory(cache, saved)
    assert memory.state_bytes == conv.nbytes + recurrent.nbytes and memory.snapshot_bytes >= memory.state_bytes
