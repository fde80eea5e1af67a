"""The out-of-memory guard: `estimate_kv_bytes` against the bytes really held (`kv_memory`) for every backend
and nbits, and a prefill over the budget refused with the estimate and the limit, the session unchanged."""

from __future__ import annotations

import pytest
import torch

from kvdemo import CacheSpec, QASession
from kvdemo.cache.layouts import store_blocks
from kvdemo.cache.spec import estimate_kv_bytes
from kvdemo.cache.state.budget import KVBudgetError
from tests.helpers import ALL_SPECS, make_tiny, spec_id

CONTEXT = " ".join(["The Normans were the people who gave their name to Normandy, a region in France."] * 12)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
def test_estimate_matches_the_bytes_held_after_prefill_and_during_an_answer(tiny, spec):
    session = QASession(tiny, spec.replace(residual_length=8) if spec.info.has_residual else spec)
    report = session.prefill(CONTEXT)
    estimate = estimate_kv_bytes(session.spec, tiny.config, report.context_tokens, torch.float32)
    assert estimate == report.kv_bytes
    # mid-answer, with tokens in the residual: the worst case the guard plans for
    stream = session.stream("Who?", 6)
    for event in stream:
        held, steps = event.memory, event.step
    residual = held.layers[0].residual_tokens
    blocks = None
    if spec.info.has_residual:  # the question's pass, then one token a decode step, flushed as the layers flush
        opts = session.spec.resolved()
        question = held.seq_length - report.context_tokens - steps
        blocks, in_residual = store_blocks(
            opts.get("flush", "requantize"), opts["residual_length"], report.context_tokens, [question] + [1] * steps
        )
        assert in_residual == residual
    expected = estimate_kv_bytes(session.spec, tiny.config, held.seq_length, torch.float32, residual, blocks=blocks)
    if spec.resolved().get("storage") == "growing":  # the room grown at the prefill: the estimate is its bound
        assert (
            estimate_kv_bytes(spec, tiny.config, held.seq_length, torch.float32, nominal_bits=True) < held.cache_bytes
        )
        assert held.cache_bytes <= expected
    else:
        assert expected == held.cache_bytes  # the cache itself, to the byte
    # the guard plans for all that is held, the post-prefill store the snapshot keeps after a flush included
    reserve = held.seq_length - report.context_tokens
    assert held.total_bytes <= session.estimate_kv_bytes(report.context_tokens, reserve) * 1.03
    if held.snapshot_bytes:  # the cache's estimate alone would plan for less than is held
        cache_only = estimate_kv_bytes(session.spec, tiny.config, held.seq_length, torch.float32, reserve)
        assert cache_only < held.total_bytes


@pytest.mark.parametrize(
    "text",
    [
        "quanto:4,flush=append,residual_length=1",
        "quanto:2,flush=append,residual_length=1",
        "quanto:4,residual_length=4,axis_key=-1,axis_value=-1,q_group_size=3",
        "hqq:3,flush=append,residual_length=1,q_group_size=32",
    ],
)
def test_estimate_counts_each_blocks_packing_to_the_byte(embedded, text):
    """3 KV heads: quanto packs 2 (4-bit) or 4 (2-bit) rows a byte, so a one-token block of 3 rows pads a row, and
    with axis -1 a group of 3 pads to 4 rows; hqq packs 3-bit codes ten to an int32 (a group of 32 takes 40)."""
    three_heads = make_tiny(embedded.tokenizer, kv_heads=3)
    session = QASession(three_heads, CacheSpec.parse(text))
    context_tokens = session.prefill(CONTEXT).context_tokens
    opts = session.spec.resolved()
    for event in session.stream("Who?", 5):
        held, steps = event.memory, event.step
        updates = [held.seq_length - context_tokens - steps] + [1] * steps
        blocks, residual = store_blocks(opts["flush"], opts["residual_length"], context_tokens, updates)
        assert residual == held.layers[0].residual_tokens
        estimate = estimate_kv_bytes(
            session.spec, three_heads.config, held.seq_length, torch.float32, residual, blocks=blocks
        )
        assert estimate == held.cache_bytes
        # one block of the same tokens pads no more, and the textbook nbits not at all
        whole = estimate_kv_bytes(session.spec, three_heads.config, held.seq_length, torch.float32, residual)
        nominal = estimate_kv_bytes(
            session.spec, three_heads.config, held.seq_length, torch.float32, residual, nominal_bits=True
        )
        assert nominal <= whole <= estimate
    assert nominal < estimate  # each case pads
    assert len(blocks) > 2 if opts["flush"] == "append" else len(blocks) == 1
    # the guard plans for at least what was held
    assert session.estimate_kv_bytes(context_tokens, held.seq_length - context_tokens) >= held.total_bytes


def test_prefill_over_the_budget_is_refused_and_the_session_kept(tiny):
    spec = CacheSpec("hqq", nbits=4, residual_length=8)
    probe = QASession(tiny, spec)
    tokens = probe.prefill(CONTEXT).context_tokens
    needed = probe.estimate_kv_bytes(tokens, 128)
    session = QASession(tiny, spec, kv_budget_bytes=needed - 1)
    small = session.prefill("Rollo led the Normans.")
    answer = session.ask("Who led them?", 4)
    with pytest.raises(KVBudgetError) as error:
        session.prefill(CONTEXT)
    message = str(error.value)
    assert f"for this context ({tokens:,} tokens + 128 for a question and its answer)" in message
    assert f"would hold about {needed / 2**20:,.1f} MiB; the KV budget is {(needed - 1) / 2**20:,.1f} MiB" in message
    assert "Shorten the context to about" in message and "fewer bits" in message
    assert error.value.estimate_bytes == needed and isinstance(error.value, ValueError)
    assert session.context == "Rollo led the Normans." and session.cache_length == small.context_tokens
    assert session.ask("Who led them?", 4).token_ids == answer.token_ids
    assert QASession(tiny, spec, kv_budget_bytes=needed).prefill(CONTEXT).context_tokens == tokens  # at the limit
    with pytest.raises(ValueError, match="kv_budget_bytes=0 must be >= 1"):
        QASession(tiny, spec, kv_budget_bytes=0)


def test_estimates_on_the_embedded_shape_match_the_measured_table():
    """Bytes per token measured on the embedded model (docs/compare.md's table): 30 layers, 3 KV heads, head_dim 64."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576
    )
    measured = {
        "dynamic": 46_080,
        "fp8": 11_520,
        "quanto:2": 4_320,
        "quanto:4": 7_200,
        "hqq:1": 2_880,
        "hqq:2": 4_320,
        "hqq:3": 6_480,
        "hqq:4": 7_200,
        "hqq:8": 12_960,
    }
    scales = {"fp8": 2 * 30 * 4}  # fp8's float32 scale per layer and tensor
    for text, per_token in measured.items():
        estimate = estimate_kv_bytes(CacheSpec.parse(text), config, 1000, torch.float32)
        assert estimate == pytest.approx(per_token * 1000 + scales.get(text, 0), rel=0.001), text


def test_an_answer_that_would_grow_the_cache_over_the_budget_is_refused(tiny):
    spec = CacheSpec("fp8")
    probe = QASession(tiny, spec)
    tokens = probe.prefill("Rollo led the Normans.").context_tokens
    question = len(probe.question_ids("Who led them?"))
    budget = probe.estimate_kv_bytes(tokens, question + 40)
    session = QASession(tiny, spec, kv_budget_bytes=budget)
    session.prefill("Rollo led the Normans.", reserve_tokens=question + 40)
    assert session.ask("Who led them?", 40).cache_length_after == tokens  # exactly at the budget
    with pytest.raises(KVBudgetError, match="Lower max_new_tokens, or prefill a shorter context"):
        session.ask("Who led them?", 41)
    assert session.cache_length == tokens and len(session.history) == 1
