"""A per-layer plan (`plan=`, `kvdemo.cache.layer_plan`): its syntax and canonical text, the registry's checks and
messages, each layer stored exactly as the library stores that layer's bits and rotation, and the byte formula
summed layer by layer equal to the real tensors. The plan's choice is tests/test_planner.py; its restore and fresh
runs are in the invariant matrix (tests/test_invariants.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvdemo import CacheSpec
from kvdemo.cache.layer_plan import LayerPrecision, canonical_plan, mean_bits, parse_plan, plan_text
from kvdemo.cache.layers.rotation import to_model_basis
from kvdemo.cache.spec import build_cache, estimate_kv_bytes
from kvdemo.cache.state.telemetry import kv_memory

LAYERS = 4
CONFIG = LlamaConfig(
    vocab_size=8,
    hidden_size=128,
    intermediate_size=8,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
)


def test_the_syntax_reads_runs_and_writes_one_canonical_text():
    layers = parse_plan("K4V2H*2+k4v2h + k2v4*1")
    assert layers == (
        LayerPrecision(4, 2, "hadamard"),
        LayerPrecision(4, 2, "hadamard"),
        LayerPrecision(4, 2, "hadamard"),
        LayerPrecision(2, 4, "none"),
    )
    assert plan_text(layers) == "k4v2h*3+k2v4"
    assert canonical_plan("k4v2h+k4v2h*2+k2v4") == "k4v2h*3+k2v4"
    assert mean_bits(layers) == (3.5, 2.5)
    # two texts of one plan are one spec
    assert CacheSpec.parse("quanto,plan=k4v2h+k4v2h*2+k2v4") == CacheSpec("quanto", plan="K4V2H*3+k2v4")


def test_a_plan_spec_shows_its_plan_and_no_single_precision():
    spec = CacheSpec.parse("hqq,plan=k8v4*2+k2v2h*2,q_group_size=32")
    assert "nbits" not in spec.resolved() and "rotation" not in spec.resolved()
    assert spec.short_text == "hqq,q_group_size=32,plan=k8v4*2+k2v2h*2"
    assert CacheSpec.parse(spec.short_text) == spec and CacheSpec.parse(spec.full_text).label == spec.label
    assert spec.label == "hqq q_group_size=32 residual_length=128 plan=k8v4*2+k2v2h*2"
    assert "plan" not in CacheSpec.parse("hqq:4").resolved()  # unset, no `plan=` anywhere
    assert "plan" not in CacheSpec.parse("hqq:4").full_text


@pytest.mark.parametrize(
    "text, message",
    [
        ("quanto,plan=", "give the nbits|is not option=value"),
        ("quanto,plan=k4", r"plan entry 'k4' is not k<nbits>v<nbits_value>\[h\]\[\*<layers>\]; write"),
        ("quanto,plan=k4v4*0", r"repeats 0 times; give \*1 or more"),
        ("quanto,plan=k4v4*5000", "more than 1024 layers"),
        ("quanto:4,plan=k4v4*4", "nbits and plan are both given; the plan sets each layer's nbits"),
        ("quanto,rotation=hadamard,plan=k4v4*4", "rotation and plan are both given"),
        ("fp8,plan=k4v4*4", "plan=k4v4\\*4 is not an option of the fp8 backend"),
        ("dynamic,plan=k4v4*4", "not an option of the dynamic backend"),
    ],
)
def test_a_bad_plan_gets_the_registry_message(text, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec.parse(text)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "quanto,plan=k4v4*3",
            "the plan gives 3 layers and this model has 4 layers that are quantized; give one entry per quantized "
            "layer",
        ),
        ("quanto,plan=k4v4*3+k3v4", r"layer 3 \(k3v4\) asks nbits=3; this backend takes 2, 4"),
        ("hqq,plan=k4v16*4", "asks nbits_value=16; this backend takes 1, 2, 3, 4, 8"),
        ("hqq,plan=k8v2*4,q_group_size=2", r"q_group_size=2 \(axis_value=0\): hqq packs 4 2-bit values"),
    ],
)
def test_a_plan_the_model_cannot_run_is_refused_with_what_to_change(text, message):
    spec = CacheSpec.parse(text)
    with pytest.raises(ValueError, match=message):
        spec.validate(CONFIG)


def _model_basis(layer, store):
    return to_model_basis(layer, layer._dequantize(store))


@pytest.mark.parametrize("flush", ["requantize", "append"])
@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_each_layer_is_stored_as_a_uniform_spec_of_its_precision_stores_it(backend, flush):
    torch.manual_seed(0)
    plan = "k4v2h+k2v4+k4v4*2" if backend == "quanto" else "k8v3+k2v4h+k4v4h+k1v8"
    spec = CacheSpec(backend, plan=plan, residual_length=4, flush=flush)
    cache = build_cache(spec, CONFIG)
    states = [(torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64) * 2) for _ in range(LAYERS)]
    for index, (keys, values) in enumerate(states):
        cache.layers[index].update(keys, values)
        for step in range(6):  # decode steps with a flush
            cache.layers[index].update(keys[..., step : step + 1, :], values[..., step : step + 1, :])
    for index, precision in enumerate(parse_plan(plan)):
        alike = CacheSpec(backend, residual_length=4, flush=flush, nbits=precision.nbits)
        alike = alike.replace(nbits_value=precision.nbits_value, rotation=precision.rotation)
        own = build_cache(alike, CONFIG).layers[0]
        keys, values = states[index]
        own.update(keys, values)
        for step in range(6):
            own.update(keys[..., step : step + 1, :], values[..., step : step + 1, :])
        layer = cache.layers[index]
        assert torch.equal(_model_basis(layer, layer._quantized_keys), _model_basis(own, own._quantized_keys))
        assert torch.equal(_model_basis(layer, layer._quantized_values), _model_basis(own, own._quantized_values))
        assert type(layer) is type(own) and layer.nbits == precision.nbits


@pytest.mark.parametrize("text", ["quanto,plan=k4v2h+k2v4+k4v4*2", "hqq,plan=k8v3+k2v4h+k4v4h+k3v8"])
def test_the_bytes_are_the_formula_summed_layer_by_layer(text):
    spec = CacheSpec.parse(text).replace(residual_length=8)
    cache = build_cache(spec, CONFIG)
    for layer in cache.layers:
        layer.update(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64))
        layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))  # a token in the residual
    estimate = estimate_kv_bytes(spec, CONFIG, 41, torch.float32, residual_tokens=1)
    assert kv_memory(cache).cache_bytes == estimate
    # each layer's share: the mean of the uniform caches of every layer's precision
    alike = [
        estimate_kv_bytes(
            spec.replace(plan=None, nbits=p.nbits, nbits_value=p.nbits_value), CONFIG, 41, torch.float32, 1
        )
        for p in parse_plan(spec.plan)
    ]
    assert estimate == pytest.approx(sum(alike) / LAYERS, abs=1)
    # fewer bits than the top layer's uniform spec, more than the bottom's
    assert min(alike) < estimate < max(alike)
