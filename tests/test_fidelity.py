"""kvdemo.evals.fidelity: the distribution statistics by hand, perplexity through the cache against a plain forward
pass, the per-layer and per-head KV error against hand computations and the keys a quantized layer really received, and
the drift across flushes."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

from kvdemo import CacheSpec, QASession
from kvdemo.cache.spec import build_cache
from kvdemo.cache.state.budget import KVBudgetError
from kvdemo.cache.state.telemetry import expected_flush_steps
from kvdemo.evals.cache_error import context_error, dequantized_kv, drift_ratio, kv_error, reference_kv
from kvdemo.evals.fidelity import (
    KLStats,
    PerplexityInputs,
    kl_statistics,
    percentile,
    perplexity,
    perplexity_inputs,
    position_fidelity,
)

CONTEXT = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them. " * 2
CONTINUATION = " Their descendants swore fealty to the king of West Francia and spread across Europe. " * 3


# ---- distribution statistics ------------------------------------------------------------------------------------
def test_position_fidelity_by_hand():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.4, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.5, 0.3, 0.2], [0.3, 0.6, 0.1], [0.1, 0.1, 0.8]])
    tokens = [0, 1, 2]
    got = position_fidelity(p.log(), q.log(), tokens)
    kl0 = 0.7 * math.log(0.7 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.1 * math.log(0.1 / 0.2)
    kl1 = 0.4 * math.log(0.4 / 0.3) + 0.4 * math.log(0.4 / 0.6) + 0.2 * math.log(0.2 / 0.1)
    assert got.kl.tolist() == pytest.approx([kl0, kl1, 0.0], abs=1e-6)
    # row 1: P's argmax is token 0 (first of a tie), Q's is token 1
    assert got.same_top.tolist() == [True, False, True]
    assert got.abs_dlogp.tolist() == pytest.approx([math.log(0.7 / 0.5), math.log(0.6 / 0.4), 0.0], abs=1e-6)
    assert got.dp.tolist() == pytest.approx([0.5 - 0.7, 0.6 - 0.4, 0.0], abs=1e-6)  # llama.cpp's Δp: p_spec - p_ref


def test_percentile_is_llama_cpp_linear_interpolation():
    values = torch.tensor([4.0, 1.0, 3.0, 2.0])  # sorted: 1 2 3 4
    assert percentile(values, 0.5) == 2.5  # an even count: the mean of the two middle values
    assert percentile(values, 0.99) == pytest.approx(3 + 0.97)  # position 0.99 * 3 = 2.97
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 4.0
    noise = torch.rand(101, generator=torch.Generator().manual_seed(0))
    assert percentile(noise, 0.99) == pytest.approx(float(torch.quantile(noise.double(), 0.99)))
    with pytest.raises(ValueError, match="no values"):
        percentile(torch.tensor([]), 0.5)
    with pytest.raises(ValueError, match="between 0 and 1"):
        percentile(values, 99)


def test_kl_statistics_pool_every_position_by_hand():
    # two answers: 1 position and 3 positions, with KL 0, 0.1, 0.2, 0.3 built from two-token distributions
    def row(p):
        return torch.tensor([p, 1 - p]).log()

    ref = [torch.stack([row(0.5)]), torch.stack([row(0.5), row(0.5), row(0.5)])]
    other_ps = [[0.5], [0.3, 0.2, 0.9]]
    other = [torch.stack([row(p) for p in ps]) for ps in other_ps]
    tokens = [[0], [0, 0, 0]]
    stats = kl_statistics(ref, other, tokens)
    kls = sorted(0.5 * math.log(0.5 / p) + 0.5 * math.log(0.5 / (1 - p)) for p in (0.5, 0.3, 0.2, 0.9))
    dlogp = sorted(abs(math.log(0.5 / p)) for p in (0.5, 0.3, 0.2, 0.9))
    assert stats.positions == 4
    assert stats.mean_kld == pytest.approx(sum(kls) / 4)
    assert stats.median_kld == pytest.approx((kls[1] + kls[2]) / 2)
    assert stats.p99_kld == pytest.approx(kls[2] + 0.97 * (kls[3] - kls[2]))
    assert stats.max_kld == pytest.approx(kls[3])
    # argmax of [0.5, 0.5] is token 0; of 0.3 and 0.2 token 1 (differs), of 0.9 token 0 (same)
    assert stats.same_top_p == pytest.approx(50.0)
    assert stats.mean_abs_dlogp == pytest.approx(sum(dlogp) / 4)
    assert stats.p99_abs_dlogp == pytest.approx(dlogp[2] + 0.97 * (dlogp[3] - dlogp[2]))
    assert stats.p999_kld == pytest.approx(kls[2] + 0.997 * (kls[3] - kls[2]))  # llama.cpp's 99.9% KLD
    dps = [p - 0.5 for p in (0.5, 0.3, 0.2, 0.9)]  # Δp of token 0, whose p_dynamic is 0.5
    assert stats.rms_dp == pytest.approx(100 * math.sqrt(sum(d * d for d in dps) / 4))  # llama.cpp's RMS Δp, %
    same = kl_statistics(ref, ref, tokens)
    assert (same.mean_kld, same.max_kld, same.same_top_p, same.p99_abs_dlogp) == (0.0, 0.0, 100.0, 0.0)
    assert (same.p999_kld, same.rms_dp) == (0.0, 0.0)


def test_kl_statistics_refuse_bad_input():
    lp = torch.tensor([[0.5, 0.5]]).log()
    with pytest.raises(ValueError, match="give one each per answer"):
        kl_statistics([lp], [lp, lp], [[0]])
    with pytest.raises(ValueError, match="give one token per row"):
        kl_statistics([lp], [lp], [[0, 1]])
    with pytest.raises(ValueError, match="differ"):
        kl_statistics([lp], [torch.tensor([[0.2, 0.3, 0.5]]).log()], [[0]])
    with pytest.raises(ValueError, match="no teacher-forced position"):
        KLStats.pool([])


# ---- where the error sits ---------------------------------------------------------------------------------------
def _one_layer_config(kv_heads: int = 2, head_dim: int = 64) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )


def test_kv_error_of_fp8_by_hand():
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64) * 3
    cache = build_cache(CacheSpec("fp8"), _one_layer_config())
    cache.layers[0].update(keys, values)
    error = kv_error(((keys, values),), cache)

    def by_hand(x):  # per tensor scale = max |x| / 448, stored as float8 e4m3
        scale = x.abs().max() / torch.finfo(torch.float8_e4m3fn).max
        approx = (x / scale).to(torch.float8_e4m3fn).float() * scale
        per_head = [float((x[:, h] - approx[:, h]).norm() / x[:, h].norm()) for h in range(x.shape[1])]
        return per_head, float((x - approx).norm() / x.norm()), float((x - approx).pow(2).sum()), float(x.pow(2).sum())

    k_heads, k_total, k_err, k_norm = by_hand(keys)
    v_heads, v_total, v_err, v_norm = by_hand(values)
    assert list(error.keys[0]) == pytest.approx(k_heads, rel=1e-6)
    assert list(error.values[0]) == pytest.approx(v_heads, rel=1e-6)
    assert error.keys_total == pytest.approx(k_total, rel=1e-6)
    assert error.values_total == pytest.approx(v_total, rel=1e-6)
    assert error.total == pytest.approx(math.sqrt((k_err + v_err) / (k_norm + v_norm)), rel=1e-6)
    assert 0 < error.total < 0.1 and error.tokens == 10
    keys_matrix, values_matrix = error.matrices()
    assert keys_matrix.shape == values_matrix.shape == (1, 2)


@pytest.mark.parametrize(
    "spec",
    [CacheSpec("hqq", nbits=2, residual_length=4), CacheSpec("quanto", nbits=2, residual_length=4)],
    ids=["hqq2", "quanto2"],
)
def test_dequantized_kv_uses_the_backend_and_appends_the_residual(spec):
    torch.manual_seed(1)
    cache = build_cache(spec, _one_layer_config())
    layer = cache.layers[0]
    keys, values = torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64)
    layer.update(keys, values)
    new_k, new_v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    returned_k, returned_v = layer.update(new_k, new_v)  # no flush: the new token waits in the residual
    ((deq_k, deq_v),) = dequantized_kv(cache)
    # what the model read at that step is exactly what dequantized_kv gives, and nothing in the layer moved
    assert torch.equal(deq_k, returned_k) and torch.equal(deq_v, returned_v)
    assert torch.equal(deq_k[..., -1:, :], new_k)
    state = dict(vars(layer))
    error = kv_error(((keys, values),), cache)  # the first 16 tokens, the quantized ones
    assert all(vars(layer)[name] is value for name, value in state.items())
    by_hand = [float((keys[:, h] - deq_k[:, h, :16]).norm() / keys[:, h].norm()) for h in range(2)]
    assert list(error.keys[0]) == pytest.approx(by_hand, rel=1e-6) and min(by_hand) > 0.05  # 2 bits: coarse
    with pytest.raises(ValueError, match="fewer than the 18 asked for"):
        dequantized_kv(cache, tokens=18)


def test_reference_is_what_the_quantized_prefill_received(tiny, monkeypatch):
    """The quantized layers quantize exactly the full-precision keys and values a DynamicCache holds."""
    session = QASession(tiny, CacheSpec("hqq", nbits=4))
    received = []

    def recording_cache(spec, config):
        cache = build_cache(spec, config)
        for layer in cache.layers:
            quantize = layer._quantize

            def record(tensor, axis, quantize=quantize):
                received.append(tensor.clone())
                return quantize(tensor, axis)

            layer._quantize = record
        return cache

    monkeypatch.setattr("kvdemo.qa.session.build_cache", recording_cache)
    session.prefill(CONTEXT)
    monkeypatch.undo()
    reference = reference_kv(tiny, session.context_ids(CONTEXT))
    assert len(received) == 2 * len(reference)
    for (keys, values), got_k, got_v in zip(reference, received[0::2], received[1::2]):
        assert torch.equal(keys, got_k) and torch.equal(values, got_v)
    error = kv_error(reference, session.cache)
    assert len(error.keys) == 2 and len(error.keys[0]) == 2  # tiny: 2 layers x 2 KV heads
    assert 0 < error.keys_total < 0.5
    dynamic = QASession(tiny, CacheSpec("dynamic"))
    dynamic.prefill(CONTEXT)
    zero = kv_error(reference, dynamic.cache)
    assert zero.total == 0.0 and all(v == 0.0 for row in zero.keys + zero.values for v in row)
    with pytest.raises(ValueError, match="the reference has 1 layers"):
        kv_error(reference[:1], session.cache)


def test_drift_ratio_by_hand():
    assert drift_ratio(0.2, [(0.2, 0.3), (0.25,), ()]) == (pytest.approx(1.5), 2)
    assert drift_ratio(0.2, [(0.3,), (0.4,)]) == (pytest.approx(1.5), 1)  # a tie: the first run
    assert drift_ratio(0.2, [(), ()]) == (None, 0)
    assert drift_ratio(0.0, [(0.0,)]) == (None, 0)


# ---- perplexity through the cache -------------------------------------------------------------------------------
def _plain_forward_perplexity(loaded, inputs: PerplexityInputs) -> float:
    """One forward pass without a cache over the context and the continuation."""
    ids = list(inputs.context_ids) + list(inputs.continuation_ids)
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([ids], device=loaded.device)).logits[0].float()
    start = len(inputs.context_ids)  # logits at position j predict token j + 1; c_0 is at position start
    logprobs = torch.log_softmax(logits[start : start + inputs.tokens], dim=-1)
    targets = torch.tensor(inputs.continuation_ids[1:], device=logprobs.device)
    return math.exp(-float(logprobs.gather(-1, targets.unsqueeze(-1)).mean()))


def test_dynamic_perplexity_equals_a_plain_forward_pass(tiny):
    inputs = perplexity_inputs(tiny, CONTEXT, 24, CONTINUATION)
    result = perplexity(tiny, CacheSpec("dynamic"), inputs)
    assert result.tokens == 24 == len(result.nll) and result.context_tokens == len(inputs.context_ids)
    assert result.perplexity == pytest.approx(_plain_forward_perplexity(tiny, inputs), rel=1e-4)
    assert result.perplexity == pytest.approx(math.exp(sum(result.nll) / 24))
    assert result.flush_steps == () and result.prefill_context_error is None


def test_dynamic_perplexity_on_the_embedded_model(embedded, normans):
    case = normans.select("0")
    inputs = perplexity_inputs(embedded, case.context, 32, case.continuation)
    result = perplexity(embedded, CacheSpec("dynamic"), inputs)
    plain = _plain_forward_perplexity(embedded, inputs)
    assert result.perplexity == pytest.approx(plain, rel=1e-4)
    assert 1.5 < plain < 100  # real text: far below the vocabulary's 49,152


def test_quantized_perplexity_flushes_as_in_generation_and_measures_drift(tiny):
    inputs = perplexity_inputs(tiny, CONTEXT, 20, CONTINUATION)
    reference = reference_kv(tiny, inputs.context_ids)
    result = perplexity(tiny, CacheSpec("hqq", nbits=2, residual_length=6), inputs, reference=reference)
    # one token per decode step, the residual empty after the prefill: transformers' rule
    assert list(result.flush_steps) == expected_flush_steps(1, 6, 20) == [5, 11, 17]
    assert len(result.context_errors) == 3 and all(e > 0 for e in result.context_errors)
    session = QASession(tiny, CacheSpec("hqq", nbits=2, residual_length=6))
    session.prefill(CONTEXT)
    assert result.prefill_context_error == pytest.approx(context_error(reference, session.cache), rel=1e-9)
    dynamic = perplexity(tiny, CacheSpec("dynamic"), inputs)
    assert result.perplexity != dynamic.perplexity
    steps = []
    perplexity(tiny, CacheSpec("fp8"), inputs, on_step=steps.append)
    assert steps == list(range(20))


def test_perplexity_inputs_continue_the_context_inside_the_user_turn(tiny, normans):
    case = normans.select("0-1")
    assert case.continuation == "\n\n" + "\n\n".join(normans.paragraphs[2:])
    assert normans.select("0-1").select("0").continuation == "\n\n" + "\n\n".join(normans.paragraphs[1:])
    assert normans.select(f"0-{len(normans.paragraphs) - 1}").continuation is None
    session = QASession(tiny)
    inputs = perplexity_inputs(tiny, case.context, 10, case.continuation)
    assert list(inputs.context_ids) == session.context_ids(case.context) and inputs.source == "continuation"
    assert list(inputs.continuation_ids) == session.text_ids(case.continuation)[:11]
    text = tiny.tokenizer.decode(list(inputs.context_ids) + list(inputs.continuation_ids))
    assert text.endswith(tiny.tokenizer.decode(session.text_ids(case.continuation)[:11]))
    assert "<|im_start|>assistant" not in text and text.count("<|im_end|>") == 1  # the system turn's only
    # the tail of the user's own text: the last N + 1 tokens of the prefill are held out of it
    tail = perplexity_inputs(tiny, case.context, 10)
    assert tail.source == "tail" and list(tail.context_ids + tail.continuation_ids) == session.context_ids(case.context)
    assert len(tail.continuation_ids) == 11


@pytest.mark.parametrize(
    "tokens, continuation, message",
    [
        (0, None, "perplexity tokens=0 must be a whole number >= 1"),
        (2.5, None, "perplexity tokens=2.5 must be a whole number >= 1"),
        (5, " Rollo.", "the continuation holds 3 tokens; scoring 5 needs 6 .* at most 2"),
        (500, None, "the context holds {n} tokens; holding out its last 501 .* at most {n_2} or give a continuation"),
        (480, CONTINUATION * 20, "exceed the model's 512-token window; lower the perplexity tokens to at most"),
    ],
)
def test_perplexity_inputs_refuse_bad_input(tiny, tokens, continuation, message):
    n = len(QASession(tiny).text_ids(CONTEXT))
    with pytest.raises(ValueError, match=message.format(n=n, n_2=n - 2)):
        perplexity_inputs(tiny, CONTEXT, tokens, continuation)


def test_perplexity_refuses_a_cache_over_the_budget(tiny):
    inputs = perplexity_inputs(tiny, CONTEXT, 8, CONTINUATION)
    with pytest.raises(KVBudgetError, match="the KV budget is"):
        perplexity(tiny, CacheSpec("dynamic"), inputs, kv_budget_bytes=1000)
    with pytest.raises(ValueError, match="the reference holds 3 tokens"):
        perplexity(tiny, CacheSpec("dynamic"), inputs, reference=reference_kv(tiny, [1, 2, 3]))
