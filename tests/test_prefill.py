"""The prefill in chunks: the same cache as one forward pass for every backend, real progress, a stop between
chunks that leaves the session clean; and the question's own pass reported apart from the decode steps."""

from __future__ import annotations

import pytest
import torch

from kvdemo import QASession
from kvdemo.prefill import PrefillStopped
from kvdemo.spec import estimate_kv_bytes
from tests.conftest import ALL_SPECS, spec_id

CONTEXT = " ".join(
    f"In {900 + i} the Normans held council number {i} at Rouen, and Rollo's heirs kept the duchy." for i in range(12)
)


def _layer_tensors(cache) -> list[torch.Tensor]:
    """Every layer's keys and values as the model would read them (de-quantized where quantized)."""
    out = []
    for layer in cache.layers:
        if getattr(layer, "_quantized_keys", None) is not None:
            out += [layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)]
        out += [layer.keys, layer.values]
    return out


@pytest.mark.parametrize(
    "spec", [s.replace(residual_length=8) if s.info.has_residual else s for s in ALL_SPECS], ids=spec_id
)
def test_a_chunked_prefill_builds_the_cache_of_one_forward_pass(tiny, spec):
    one = QASession(tiny, spec)
    one_report = one.prefill(CONTEXT, chunk_tokens=10_000)
    chunked, progress = QASession(tiny, spec), []
    report = chunked.prefill(CONTEXT, chunk_tokens=16, on_progress=lambda done, total: progress.append((done, total)))
    n = report.context_tokens
    assert n == one_report.context_tokens > 16 * 4
    assert progress == [(min(d, n), n) for d in range(16, n + 16, 16)]  # tokens done after each chunk, to the end
    assert chunked.cache_length == one.cache_length == n
    if spec.resolved().get("storage") == "growing":  # the spare room follows the chunks; both within the bound
        bound = estimate_kv_bytes(spec, tiny.config, n, torch.float32)
        assert report.kv_bytes < one_report.kv_bytes == bound
    else:
        assert report.kv_bytes == one_report.kv_bytes
    for a, b in zip(_layer_tensors(chunked.cache), _layer_tensors(one.cache)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)
    question = "Where did the Normans hold council?"
    assert chunked.ask(question, 6).token_ids == one.ask(question, 6).token_ids


def test_a_stopped_prefill_leaves_no_half_cache_and_the_session_prefills_again(tiny):
    session = QASession(tiny)
    session.prefill("Rollo led the Normans.")

    def stop_after_two_chunks(done, total):
        if done == 32:
            session.request_stop()  # the Stop button, from another thread

    with pytest.raises(PrefillStopped, match="the prefill was stopped after 32 of"):
        session.prefill(CONTEXT, chunk_tokens=16, on_progress=stop_after_two_chunks)
    assert session.cache is None and session.cache_length == 0 and session.context is None
    with pytest.raises(ValueError, match="prefill a context before asking"):
        session.ask("Who?", 2)
    report = session.prefill(CONTEXT, chunk_tokens=16)  # the stop does not linger
    assert session.ask("Who held council?", 3).cache_length_after == report.context_tokens


def test_the_question_pass_is_reported_apart_from_the_decode_steps(tiny):
    session = QASession(tiny, ALL_SPECS[0])
    session.prefill(CONTEXT)
    question = "Where did the Normans hold council?"
    events = list(session.stream(question, 5))
    answer = session.history[-1]
    assert answer.question_tokens == len(session.question_ids(question))
    assert answer.question_seconds == pytest.approx(events[0].seconds)
    decode_seconds = answer.seconds - answer.question_seconds
    assert answer.decode_tokens_per_second == pytest.approx((len(answer.token_ids) - 1) / decode_seconds)
    record = answer.to_dict()
    assert record["question_tokens"] == answer.question_tokens and "decode_tokens_per_second" in record
