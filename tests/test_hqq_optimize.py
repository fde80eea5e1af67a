"""hqq's `optimize` option (`kvdemo.cache.formats.hqq.optimize`): `optimize=false` stores exactly what hqq's own
`Quantizer.quantize(..., optimize=False)` makes, with every flush policy, rotation and value precision; `true` is
hqq's solver fused into one C loop (`proximal.c`), equal to hqq's own within float rounding, and hqq's own
where the kernel cannot be built; the bytes do not change; bad values and other backends are refused with what to
change."""

from __future__ import annotations

import pytest
import torch
from hqq.core.optimize import optimize_weights_proximal_legacy
from hqq.core.quantize import Quantizer
from transformers import LlamaConfig

from kvdemo import CacheSpec
from kvdemo.cache.formats.hqq import optimize as hqq_optimize
from kvdemo.cache.formats.hqq.layers import ExactHQQLayer, hqq_cache, set_quantizer
from kvdemo.cache.formats.hqq.optimize import MinMaxQuantizer, ProximalQuantizer, fused_solver, solve_zero
from kvdemo.cache.formats.quanto.layers import QUANTO_LAYERS
from kvdemo.cache.layers.flush import quantized_cache
from kvdemo.cache.read import c_build
from kvdemo.cache.spec import build_cache, estimate_kv_bytes
from kvdemo.cache.state.telemetry import kv_memory
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


def _keys_like(seed: int) -> torch.Tensor:
    """[1, 3, 128, 64]: a flushed block of the embedded model's shape, channels of very different ranges (as keys
    have) and a few outliers."""
    torch.manual_seed(seed)
    x = torch.randn(1, 3, 128, 64) * torch.linspace(0.1, 4.0, 64)
    x[0, 1, 5, 7] = 40.0
    return x


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("nbits", [2, 3, 4, 8])
def test_the_fused_solver_is_hqqs_own_within_float_rounding(nbits, axis):
    x = _keys_like(nbits + 10 * axis)
    options = {"nbits": nbits, "group_size": 64, "axis": axis, "device": "cpu", "compute_dtype": torch.float32}
    ours, meta = ProximalQuantizer.quantize(x, **options)
    hqqs, hqq_meta = Quantizer.quantize(x, **options)
    assert fused_solver() is not None, c_build.build_problem(hqq_optimize.SOURCE)  # the kernel ran, not the fallback
    assert torch.equal(meta["scale"], hqq_meta["scale"])  # the min-max scales: the solver moves the zero points only
    assert not torch.equal(meta["zero"], MinMaxQuantizer.quantize(x, **options)[1]["zero"])  # it did move them
    assert (meta["zero"] - hqq_meta["zero"]).abs().max() <= 1e-3 * hqq_meta["zero"].abs().max()
    assert (ours != hqqs).float().mean() <= 1e-3  # a code differs only on a rounding boundary (none here)
    if (nbits, axis) != (3, 1):  # hqq's own 3-bit unpacking fails along axis 1 (its limit, not kvdemo's)
        error = (Quantizer.dequantize(ours, meta) - x).abs().mean()
        hqq_error = (Quantizer.dequantize(hqqs, hqq_meta) - x).abs().mean()
        assert abs(error - hqq_error) <= 1e-5 * hqq_error


def test_the_fused_solver_runs_hqqs_iterations_and_stopping_rule():
    # iterations counted by the kernel against hqq's loop on the same groups (20, or the first that does not improve)
    for seed, max_v in ((0, 15), (1, 3), (2, 7)):
        groups = _keys_like(seed).reshape(-1, 64)
        low, high = groups.min(1)[0], groups.max(1)[0]
        scale = max_v / (high - low)
        zero = -low * scale
        hqqs = optimize_weights_proximal_legacy(groups, scale[:, None], zero[:, None], [0, max_v], axis=1)[2]
        ours = solve_zero(fused_solver(), groups, scale, zero, max_v)
        assert torch.allclose(ours, hqqs.reshape(-1), rtol=0, atol=1e-3 * float(hqqs.abs().max()))


def test_without_a_compiler_optimize_true_is_hqqs_own_quantizer(monkeypatch, tmp_path):
    monkeypatch.setattr(c_build, "_LOADED", {})
    monkeypatch.setattr(c_build, "_PROBLEMS", {})
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.delenv("CC", raising=False)
    assert fused_solver() is None
    assert c_build.build_problem(hqq_optimize.SOURCE) == "no C compiler (set $CC or install gcc)"
    x = _keys_like(3)
    options = {"nbits": 4, "group_size": 64, "axis": 1, "device": "cpu", "compute_dtype": torch.float32}
    ours, meta = ProximalQuantizer.quantize(x, **options)
    hqqs, hqq_meta = Quantizer.quantize(x, **options)
    assert torch.equal(ours, hqqs) and torch.equal(meta["zero"], hqq_meta["zero"])


def test_a_kernel_is_built_once_and_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(c_build, "_LOADED", {})
    monkeypatch.setattr(c_build, "_PROBLEMS", {})
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    good, bad = tmp_path / "twice.c", tmp_path / "broken.c"
    good.write_text("int twice(int x) { return 2 * x; }\n")
    bad.write_text("int broken(int x) { return x }\n")
    assert c_build.load(good).twice(21) == 42
    built = list((tmp_path / "c").glob("twice-*.so"))
    assert len(built) == 1 and not list((tmp_path / "c").glob(".*"))  # no partial file left
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(c_build, "_LOADED", {})
    assert c_build.load(good).twice(2) == 4 and built[0].stat().st_mtime_ns == stamp  # loaded, not compiled again
    assert c_build.load(bad) is None
    assert "failed on broken.c" in c_build.build_problem(bad) and "expected" in c_build.build_problem(bad)


def test_loading_a_kernel_leaves_subnormal_floats_alone():
    # a library linked with -ffast-math would set flush-to-zero for the process as it loads (`c_build.LINK_FLAGS`)
    assert fused_solver() is not None
    tiny = torch.tensor([1e-39, -3e-42], dtype=torch.float32)  # subnormals
    assert torch.equal((tiny * 2) / 2, tiny) and bool((tiny * 2 != 0).all())


def test_optimize_true_is_transformers_layer_and_changes_no_byte():
    cache = build_cache(CacheSpec.parse("hqq:4,optimize=true"), CONFIG)
    assert type(cache.layers[0]) is ExactHQQLayer and cache.layers[0].quantizer is ProximalQuantizer
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
        set_quantizer(quantized_cache(QUANTO_LAYERS, CONFIG, nbits=4), "false")
    with pytest.raises(ValueError, match="optimize='maybe' is not one of true, false"):
        hqq_cache({"optimize": "maybe", "nbits": 4}, CONFIG)
