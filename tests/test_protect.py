"""`protect=first:last` on every quantized backend (`kvdemo.cache.model.layer_kinds.layer_actions`): the protected
layers are transformers' own full-precision layers holding exactly `dynamic`'s keys and values, the others the
backend's; the bytes are the formula's; answers equal a fresh run and the cache restores; protecting every layer is
refused before the prefill. And fp8's per-token-head scales (`kvdemo.cache.formats.fp8.layers.PerTokenHeadFp8Layer`):
the library's arithmetic per token, exact bytes, and no clipping of a later outlier token.

Cost: about 6 s."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import BaseQuantizedLayer, DynamicLayer

from kvdemo import CacheSpec, QASession, kv_memory
from kvdemo.cache.formats.fp8.layers import ExactFp8Layer, PerTokenHeadFp8Layer
from kvdemo.cache.layers.float8 import dequantize_per_token_head
from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import estimate_kv_bytes
from tests.helpers import make_tiny

CONTEXT = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them. " * 3
QUANTIZED = [name for name, backend in BACKENDS.items() if backend.quantized and "protect" in backend.options]
"""The backends that take `protect` (llama.cpp keeps no layer at full precision: `ggml` takes none)."""


@pytest.fixture(scope="module")
def four_layers(embedded):
    return make_tiny(embedded.tokenizer, layers=4, seed=2)


@pytest.mark.parametrize("backend", QUANTIZED)
def test_protected_layers_are_dynamics_and_the_others_quantized(four_layers, backend):
    spec = CacheSpec(backend, protect="1:1")
    session, dynamic = QASession(four_layers, spec), QASession(four_layers, CacheSpec("dynamic"))
    report = session.prefill(CONTEXT)
    dynamic.prefill(CONTEXT)
    layers = session.cache.layers
    assert [isinstance(layer, BaseQuantizedLayer) for layer in layers] == [False, True, True, False]
    for index in (0, 3):
        assert type(layers[index]) is DynamicLayer
        # the first layer bit for bit; the last after two layers that attended in a rotated basis (turboquant's keys,
        # the query rotated too): the same in exact arithmetic, within float rounding (docs/DESIGN.md, invariant 6)
        for mine, theirs in (
            (layers[index].keys, dynamic.cache.layers[index].keys),
            (layers[index].values, dynamic.cache.layers[index].values),
        ):
            assert torch.equal(mine, theirs) if index == 0 else torch.allclose(mine, theirs, atol=1e-5)
    assert report.kv_bytes == estimate_kv_bytes(spec, four_layers.config, report.context_tokens, four_layers.dtype)
    assert kv_memory(session.cache).bytes_by_kind()["full"] == 2 * dynamic.prefill(CONTEXT).kv_bytes // 4
    first = session.ask("Who led them?", 6)
    assert session.ask("Who led them?", 6).token_ids == first.token_ids  # restored to the post-prefill state
    fresh = QASession(four_layers, spec)
    fresh.prefill(CONTEXT)
    assert fresh.ask("Who led them?", 6).token_ids == first.token_ids
    assert kv_memory(session.cache).seq_length == report.context_tokens


@pytest.mark.parametrize("backend", QUANTIZED)
def test_protecting_every_quantized_layer_is_refused_before_the_prefill(four_layers, backend):
    with pytest.raises(
        ValueError, match=r"protect=2:2 keeps .* so it would quantize nothing; set protect=1:1 or lower"
    ):
        QASession(four_layers, CacheSpec(backend, protect="2:2"))
    with pytest.raises(ValueError, match="protect='2' is not allowed"):
        CacheSpec(backend, protect="2").validate()


def test_a_preset_protects_two_layers_each_side(embedded):
    six = make_tiny(embedded.tokenizer, layers=6, seed=3)
    session = QASession(six, CacheSpec.parse("turboquant:4bit_nc"))
    session.prefill(CONTEXT)
    assert [isinstance(layer, BaseQuantizedLayer) for layer in session.cache.layers] == [False] * 2 + [True] * 2 + [
        False
    ] * 2


def test_per_token_head_scales_are_the_librarys_arithmetic_per_token():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 9, 64) * torch.logspace(-2, 2, 9).view(1, 1, 9, 1)  # tokens of very different sizes
    layer = PerTokenHeadFp8Layer()
    layer.update(keys, keys)
    codes, scale = layer._quantized_keys
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (1, 2, 9, 1) and scale.dtype == torch.float32
    library = ExactFp8Layer()
    library.lazy_initialization(keys, keys)
    for token in range(9):  # each token as transformers quantizes a tensor alone: amax / 448
        for head in range(2):
            one = keys[:, head : head + 1, token : token + 1]
            expected_codes, expected_scale = library._quantize(one)
            assert torch.equal(
                codes[:, head : head + 1, token : token + 1].view(torch.uint8), expected_codes.view(torch.uint8)
            )
            assert torch.equal(scale[:, head : head + 1, token : token + 1].squeeze(), expected_scale)
    assert torch.equal(dequantize_per_token_head(codes, scale, torch.float32), (codes.float() * scale))
    assert not layer._nan_codes  # checked where the codes were made: reads take bit placement
    nan = keys[..., :1, :].clone()
    nan[..., 5] = float("nan")
    returned, _ = layer.update(nan, nan)
    assert layer._nan_codes and returned[..., -1, 5].isnan().all()  # the library's arithmetic reads it
    assert torch.equal(returned[..., :9, :], dequantize_per_token_head(codes, scale, torch.float32))


def test_per_token_head_scales_do_not_clip_a_later_outlier():
    torch.manual_seed(1)
    prefill = torch.randn(1, 2, 16, 64)
    outlier = torch.randn(1, 2, 1, 64) * 1000  # 1000 x the prefill: past 448 x a scale frozen at the prefill
    errors = {}
    for layer in (ExactFp8Layer(), PerTokenHeadFp8Layer()):
        layer.update(prefill, prefill)
        keys, _ = layer.update(outlier, outlier)
        errors[type(layer).__name__] = float((keys[..., -1:, :] - outlier).abs().max() / outlier.abs().max())
    assert errors["ExactFp8Layer"] > 0.5 and errors["PerTokenHeadFp8Layer"] < 0.07, errors


def test_per_token_head_bytes_and_restore(tiny):
    spec = CacheSpec.parse("fp8,scale=per_token_head")
    session = QASession(tiny, spec)
    report = session.prefill(CONTEXT)
    heads = tiny.config.num_key_value_heads
    per_tensor = estimate_kv_bytes(CacheSpec("fp8"), tiny.config, report.context_tokens, tiny.dtype)
    scales = 2 * tiny.config.num_hidden_layers * heads * report.context_tokens * 4  # float32 per token, head, tensor
    assert report.kv_bytes == per_tensor - 2 * tiny.config.num_hidden_layers * 4 + scales
    assert report.kv_bytes == kv_memory(session.cache).cache_bytes
    first = session.ask("Who led them?", 6)
    assert session.ask("Who led them?", 6).token_ids == first.token_ids
