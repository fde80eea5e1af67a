"""hqq's `optimize` option (`kvdemo.cache.layers.hqq_optimize`): `optimize=false` stores exactly what hqq's own
`Quantizer.quantize(..., optimize=False)` makes, with every flush policy, rotation and value precision; `true` stays
transformers' layer; the bytes do not change; bad values and other backends are refused with what to change."""

from __future__ import annotations

import pytest
import torch
from hqq.core.quantize import Quantizer
from transformers import LlamaConfig

from kvdemo import CacheSpec
from kvdemo.cache.layers.dequantize import ExactHQQLayer
from kvdemo.cache.layers.flush import quantized_cache
from kvdemo.cache.layers.hqq_optimize import MinMaxQuantizer
from kvdemo.cache.spec import build_cache, estimate_kv_bytes
from kvdemo.cache.telemetry import kv_memory
from tests.helpers import filled_layer

CONFIG = LlamaConfig(
    vocab_size=8,
    hidden_size=128,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
)


def test_the_min_max_quantizer_is_hqqs_own_without_its_optimiser():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 32, 64) * 2
    options = {"nbits": 4, "group_size": 64, "axis": 0, "device": "cpu", "compute_dtype": torch.float32}
    ours, meta = MinMaxQuantizer.quantize(x, **options)
    plain, plain_meta = Quantizer.quantize(x, optimize=False, **options)
    optimised, optimised_meta = Quantizer.quantize(x, **options)
    assert torch.equal(ours, plain) and torch.equal(meta["zero"], plain_meta["zero"])
    assert not torch.equal(meta["zero"], optimised_meta["zero"])  # the optimiser moves the zero points
    # de-quantized by hqq's own code; the min-max rounding errs by at most half a step per value
    step = meta["scale"].reshape(-1)
    error = (Quantizer.dequantize(ours, meta) - x).abs().reshape(64, -1)
    assert bool((error <= step / 2 + 1e-5).all())


@pytest.mark.parametrize(
    "base",
    [
        "hqq:4",
        "hqq:4,flush=append",
        "hqq:4,rotation=hadamard",
        "hqq:4,nbits_value=2",
        "hqq:2,axis_key=1,q_group_size=32",
    ],
)
def test_a_layer_with_optimize_false_stores_what_the_min_max_quantizer_makes(base):
    torch.manual_seed(1)
    keys, values = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64) * 3
    spec = CacheSpec.parse(base).replace(residual_length=4)
    off = filled_layer(spec.replace(optimize="false"), CONFIG, keys, values, steps=9)
    on = filled_layer(spec, CONFIG, keys, values, steps=9)
    assert off.quantizer is MinMaxQuantizer and on.quantizer is not MinMaxQuantizer
    # the same layer class, the quantizer swapped: quantizing the same rows by hand gives the stored codes
    assert type(off) is type(on)
    for store_off, store_on in (
        (off._quantized_keys, on._quantized_keys),
        (off._quantized_values, on._quantized_values),
    ):
        assert not torch.equal(off._dequantize(store_off), on._dequantize(store_on))
    manual = filled_layer(spec, CONFIG, keys, values, steps=0)
    manual.quantizer = MinMaxQuantizer
    fresh = filled_layer(spec.replace(optimize="false"), CONFIG, keys, values, steps=0)
    manual_again = manual._quantize(keys.contiguous(), axis=manual.axis_key)
    assert torch.equal(fresh._dequantize(fresh._quantized_keys), manual._dequantize(manual_again))


def test_optimize_true_is_transformers_layer_and_changes_no_byte():
    assert type(build_cache(CacheSpec.parse("hqq:4,optimize=true"), CONFIG).layers[0]) is ExactHQQLayer
    torch.manual_seed(2)
    keys, values = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    for spec in (CacheSpec.parse("hqq:4,residual_length=8"), CacheSpec.parse("hqq:4,residual_length=8,optimize=false")):
        cache = build_cache(spec, CONFIG)
        for layer in cache.layers:
            layer.update(keys, values)
        assert kv_memory(cache).cache_bytes == estimate_kv_bytes(spec, CONFIG, 40, torch.float32, 0)


def test_bad_optimize_values_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="allowed: true, false"):
        CacheSpec.parse("hqq:4,optimize=off")
    with pytest.raises(ValueError, match="not an option of the quanto backend.*leave it unset"):
        CacheSpec.parse("quanto:4,optimize=false")
    with pytest.raises(ValueError, match="hqq's option"):
        quantized_cache("quanto", CONFIG, optimize="false", nbits=4)
    with pytest.raises(ValueError, match="optimize='maybe' is not one of true, false"):
        quantized_cache("hqq", CONFIG, optimize="maybe", nbits=4)
