"""kv_memory against bytes computed by hand for a known shape, for each backend; flush detection;
full-precision reference; telemetry never changes the cache; during an answer every figure counts what the
snapshot keeps alive beside the cache."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvdemo import CacheSpec, QASession, build_cache, kv_memory
from kvdemo.cache.model.geometry import full_precision_bytes
from kvdemo.cache.state import snapshot
from kvdemo.cache.state.telemetry import expected_flush_steps, flushed_layers
from tests.test_snapshot import held_bytes

HEADS, DIM, TOKENS, LAYERS = 2, 64, 37, 2
N = HEADS * TOKENS * DIM  # values in one key (or value) tensor of one layer


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        head_dim=DIM,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _prefill(model, spec, tokens=TOKENS):
    cache = build_cache(spec, model.config)
    with torch.no_grad():
        model(torch.arange(tokens).view(1, -1) % 64, cache=cache)
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
            model(torch.tensor([[5]]), cache=cache)
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
            model(torch.tensor([[5]]), cache=cache)
        assert flushed_layers(cache) == ()
    assert kv_memory(cache).total_bytes == 2 * LAYERS * HEADS * (TOKENS + 1) * DIM * 4


def test_reading_memory_changes_nothing(model):
    cache = _prefill(model, CacheSpec("quanto", nbits=4, residual_length=8))
    with torch.no_grad():
        model(torch.tensor([[5]]), cache=cache)
    before = [dict(vars(layer)) for layer in cache.layers]
    kv_memory(cache), flushed_layers(cache)
    for layer, saved in zip(cache.layers, before):
        assert vars(layer).keys() == saved.keys() and all(vars(layer)[k] is v for k, v in saved.items())


def test_full_precision_bytes_formula(model):
    assert full_precision_bytes(model.config, 100, torch.float32) == 2 * LAYERS * HEADS * DIM * 100 * 4
    assert full_precision_bytes(model.config, 100, torch.bfloat16) == 2 * LAYERS * HEADS * DIM * 100 * 2
    full = full_precision_bytes(model.config, TOKENS, torch.float32)
    assert kv_memory(_prefill(model, CacheSpec())).total_bytes == full


def test_expected_flush_steps_follow_transformers_rule():
    # 5 question tokens >= residual_length 4: flush at step 0, then every 4th single-token step
    assert expected_flush_steps(5, 4, 10) == [0, 4, 8]
    # 2 question tokens: the residual holds 2, 3 after step 1, then 4 at step 2 -> flush
    assert expected_flush_steps(2, 4, 8) == [2, 6]
    assert expected_flush_steps(3, 1, 3) == [0, 1, 2]  # residual_length=1: every step
    assert expected_flush_steps(20, 128, 30) == []  # an answer shorter than the residual


# ---- what the snapshot keeps alive: every figure counts it ---------------------------------------------------

SESSION_SPECS = [CacheSpec("dynamic"), CacheSpec("fp8")] + [
    CacheSpec(backend, nbits=nbits, residual_length=3)
    for backend, bits in (("quanto", (2, 4)), ("hqq", (1, 2, 3, 4, 8)))
    for nbits in bits
]


@pytest.mark.parametrize("spec", SESSION_SPECS, ids=lambda s: s.label)
def test_every_memory_figure_counts_what_the_snapshot_keeps_alive(tiny, spec):
    """At the prefill and at every decode step the figure equals the bytes held by the cache and the snapshot
    together (counted independently), and the snapshot's share is what each layer type leaves it holding."""
    session = QASession(tiny, spec)
    report = session.prefill("The Normans gave their name to Normandy, a region in France. Rollo led them.")
    held_after_prefill = held_bytes(session.cache, session._snapshot)
    assert report.memory.total_bytes == report.kv_bytes == held_after_prefill and report.memory.snapshot_bytes == 0
    store = report.memory.quantized_bytes  # the post-prefill quantized store, which the snapshot keeps
    layers, tokens = len(session.cache.layers), report.context_tokens
    question = "Who led the Normans?"
    flush_steps = expected_flush_steps(len(session.question_ids(question)), 3, 8)
    for event in session.stream(question, 8):
        assert event.memory.total_bytes == held_bytes(session.cache, session._snapshot)
        assert event.memory.cache_bytes == kv_memory(session.cache).total_bytes
        if spec.backend == "dynamic":  # the snapshot keeps only lengths
            snapshot_bytes = 0
        elif spec.backend == "fp8":  # torch.cat appends: the post-prefill fp8 keys and values stay with the snapshot
            snapshot_bytes = 2 * layers * 2 * tokens * 64 * 1  # K and V x layers x 2 KV heads x tokens x head_dim x 1 B
            # + a float32 scale for K and V per layer, the cache's too
            assert store == snapshot_bytes + 2 * layers * 4
        else:  # the old quantized store, from the first flush on (the residual is empty after the prefill)
            snapshot_bytes = store if event.step >= flush_steps[0] else 0
        assert event.memory.snapshot_bytes == snapshot_bytes
    if spec.info.quantized:  # restored: the very objects of the prefill, nothing more
        assert held_bytes(session.cache, session._snapshot) == held_after_prefill
        assert kv_memory(session.cache, session._snapshot).total_bytes == held_after_prefill


def test_a_snapshot_of_another_cache_is_refused(model):
    saved = snapshot.take(_prefill(model, CacheSpec()))
    with pytest.raises(ValueError, match="the snapshot has 2 layers but the cache has 0; it was taken from another"):
        kv_memory(DynamicCache(), saved)
