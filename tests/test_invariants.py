"""docs/DESIGN.md, invariants 1-3: over every backend and nbits, residual_length in {1, 4, default}, and per-layer
plans, on a tiny random Llama: after every answer the cache is back to its post-prefill state, and every answer equals a
fresh single-question run (token ids).

Cost: 48 s for 123 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import BaseQuantizedLayer

from kvdemo import CacheSpec, QASession
from kvdemo.cache.state.telemetry import expected_flush_steps
from tests.helpers import ALL_SPECS, fail_forward_at, spec_id

QUESTIONS = ["Who was the Norse leader?", "In what country is Normandy located?", "When were the Normans in Normandy?"]


ROTATED_APPEND = [CacheSpec.parse(f"{b},flush=append,rotation=hadamard") for b in ("quanto:2", "hqq:4")]
"""The rotation under the `append` flush policy (issue 22, goal 3), which `all_specs` has one at a time: the query
side's rotated residual quantized as a block of its own (`AppendQueryRotated*Layer`)."""


PLANNED = [CacheSpec.parse("quanto,plan=k4v2h+k2v4"), CacheSpec.parse("hqq,plan=k8v3+k2v4h,flush=append")]
"""Per-layer plans (issue 22, goal 5) for the tiny model's two layers: each layer its own key and value bits and
rotation, under both flush policies (`kvdemo.cache.layer_plan`)."""


def _matrix() -> list[CacheSpec]:
    specs = []
    for spec in ALL_SPECS:
        if spec.info.has_residual:
            specs += [spec.replace(residual_length=r) for r in (1, 4, None)]
        else:
            specs.append(spec)
    return specs + [spec.replace(residual_length=4) for spec in ROTATED_APPEND + PLANNED]


MATRIX = _matrix()
RESIDUAL_SPECS = [s for s in ALL_SPECS if s.info.has_residual] + ROTATED_APPEND + PLANNED


@pytest.fixture(scope="module")
def context(normans) -> str:
    return normans.paragraphs[0]


def _state(cache):
    """A test-side record of the post-prefill state: attribute dicts of quantized layers (same objects
    expected back), clones of plain layers' keys and values (same values expected back)."""
    out = []
    for layer in cache.layers:
        if isinstance(layer, BaseQuantizedLayer):
            out.append(dict(vars(layer)))
        else:
            out.append((layer.keys.clone(), layer.values.clone()))
    return out


def _assert_restored(session: QASession, state, context_tokens: int) -> None:
    assert session.cache.get_seq_length() == context_tokens
    for layer, saved in zip(session.cache.layers, state):
        assert layer.get_seq_length() == context_tokens
        if isinstance(saved, dict):
            assert vars(layer).keys() == saved.keys()
            for name, value in saved.items():
                assert vars(layer)[name] is value, f"{name} is not the post-prefill object"
        else:
            assert torch.equal(layer.keys, saved[0]) and torch.equal(layer.values, saved[1])


def _fresh_tokens(model, spec, context, question, max_new_tokens) -> tuple[int, ...]:
    session = QASession(model, spec)
    session.prefill(context)
    return session.ask(question, max_new_tokens).token_ids


@pytest.mark.parametrize("spec", MATRIX, ids=spec_id)
def test_answers_restore_the_cache_and_equal_fresh_runs(tiny, context, spec):
    session = QASession(tiny, spec)
    report = session.prefill(context)
    state = _state(session.cache)
    answers = []
    for question in QUESTIONS + QUESTIONS[:1]:
        answer = session.ask(question, max_new_tokens=9)
        assert answer.cache_length_after == report.context_tokens
        _assert_restored(session, state, report.context_tokens)
        answers.append(answer)
    assert answers[0].steps == 9 and len(answers[0].token_ids) == 9
    for question, answer in zip(QUESTIONS, answers):
        assert answer.token_ids == _fresh_tokens(tiny, spec, context, question, 9)
    assert answers[3].token_ids == answers[0].token_ids
    if spec.keeps_residual and spec.residual_length in (1, 4):
        assert all(a.flush_count > 0 for a in answers)


@pytest.mark.parametrize("spec", RESIDUAL_SPECS, ids=spec_id)
def test_flush_steps_follow_the_rule_and_flush_on_last_step_or_mid_answer_restores(tiny, context, spec):
    spec = spec.replace(residual_length=4)
    session = QASession(tiny, spec)
    context_tokens = session.prefill(context).context_tokens
    state = _state(session.cache)
    question = QUESTIONS[0]
    q_tokens = len(session.question_ids(question))
    events = list(session.stream(question, max_new_tokens=12))
    predicted = expected_flush_steps(q_tokens, 4, len(events))
    seen = [e.step for e in events if e.flushed_layers]
    assert seen == predicted
    assert all(e.flushed_layers == tuple(range(len(session.cache.layers))) for e in events if e.flushed_layers)
    assert session.history[-1].flushes == (len(predicted),) * len(session.cache.layers)
    _assert_restored(session, state, context_tokens)

    last_flush = predicted[-1]
    # the flush on the last decode step, then a flush in the middle of the answer
    for max_new_tokens in (last_flush + 1, last_flush + 2):
        answer = session.ask(question, max_new_tokens=max_new_tokens)
        _assert_restored(session, state, context_tokens)
        assert answer.token_ids == _fresh_tokens(tiny, spec, context, question, max_new_tokens)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_answer_shorter_than_the_residual(tiny, context, spec, max_new_tokens):
    """With the default residual_length (128) a short answer never flushes: its tokens sit in the residual,
    and the restore must drop them."""
    session = QASession(tiny, spec)
    context_tokens = session.prefill(context).context_tokens
    state = _state(session.cache)
    answer = session.ask(QUESTIONS[1], max_new_tokens=max_new_tokens)
    assert answer.steps == max_new_tokens and answer.flush_count == 0
    _assert_restored(session, state, context_tokens)
    assert session.ask(QUESTIONS[2], 5).token_ids == _fresh_tokens(tiny, spec, context, QUESTIONS[2], 5)


@pytest.mark.parametrize(
    "spec", [s.replace(residual_length=4) if s.info.has_residual else s for s in ALL_SPECS], ids=spec_id
)
def test_early_closed_stream_and_failed_step_restore(tiny, context, spec, monkeypatch):
    session = QASession(tiny, spec)
    context_tokens = session.prefill(context).context_tokens
    state = _state(session.cache)

    stream = session.stream(QUESTIONS[0], max_new_tokens=20)
    events = [next(stream) for _ in range(6)]  # past a flush at residual_length=4
    assert events[-1].cache_length > context_tokens
    stream.close()  # the user pressed Stop
    assert session.history[-1].finish_reason == "stopped"
    assert session.history[-1].token_ids == tuple(e.token_id for e in events)
    _assert_restored(session, state, context_tokens)

    fail_forward_at(monkeypatch, tiny, 4, "injected failure in a decode step")
    with pytest.raises(RuntimeError, match="injected failure"):
        session.ask(QUESTIONS[1], max_new_tokens=10)
    monkeypatch.undo()
    assert session.history[-1].finish_reason == "error" and session.history[-1].steps == 3
    _assert_restored(session, state, context_tokens)
    assert session.ask(QUESTIONS[2], 6).token_ids == _fresh_tokens(tiny, spec, context, QUESTIONS[2], 6)


def test_a_new_answer_closes_an_open_stream_first(tiny, context):
    session = QASession(tiny, CacheSpec("hqq", nbits=4, residual_length=4))
    context_tokens = session.prefill(context).context_tokens
    stream = session.stream(QUESTIONS[0], max_new_tokens=20)
    next(stream), next(stream)
    answer = session.ask(QUESTIONS[1], max_new_tokens=5)  # the open stream is closed and restored first
    assert [a.finish_reason for a in session.history] == ["stopped", "max_new_tokens"]
    assert answer.token_ids == _fresh_tokens(tiny, session.spec, context, QUESTIONS[1], 5)
    assert session.cache_length == context_tokens


def _kvpress_trim(cache, lengths):
    """kvpress 0.5.5's pipeline trims an answer off the cache by slicing each layer's `keys`/`values` back to
    the length it had before the answer (`generate_answer`)."""
    for layer, length in zip(cache.layers, lengths):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


@pytest.mark.parametrize(
    "spec",
    [CacheSpec("hqq", nbits=4, residual_length=4), CacheSpec("quanto", nbits=4, residual_length=4), CacheSpec("fp8")],
    ids=spec_id,
)
def test_kvpress_slicing_cannot_restore_a_quantized_cache(tiny, context, spec):
    """Why the snapshot exists: on a QuantizedCache, `keys`/`values` are only the residual (or nothing, for
    fp8), the answer's tokens are flushed into (or appended to) the quantized store and counted in
    `cumulative_length`, so slicing leaves the answer in the cache."""
    session = QASession(tiny, spec)
    context_tokens = session.prefill(context).context_tokens
    cache = session.cache
    lengths = [layer.get_seq_length() for layer in cache.layers]
    ids = torch.tensor([session.question_ids(QUESTIONS[0])])
    with torch.no_grad():
        for _ in range(6):
            token = tiny.model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax()
            ids = token.view(1, 1)
    if not spec.keeps_residual:  # fp8 (every format that codes each token) holds no 4-D residual: slicing fails
        with pytest.raises(IndexError):
            _kvpress_trim(cache, lengths)
        return
    _kvpress_trim(cache, lengths)
    answer_tokens = len(session.question_ids(QUESTIONS[0])) + 5
    assert cache.get_seq_length() == context_tokens + answer_tokens  # the answer is still counted
    for layer in cache.layers:
        assert _quantized_tokens(layer._quantized_keys) > context_tokens  # and still stored


def _quantized_tokens(store) -> int:
    """Tokens in a quantized store: quanto's tensor, hqq's (W_q, meta) or fp8's (tensor, scale)."""
    if isinstance(store, tuple):
        return store[1]["shape"][-2] if isinstance(store[1], dict) else store[0].shape[-2]
    return store.shape[-2]


def test_kvpress_slicing_is_enough_for_a_dynamic_cache_only(tiny, context):
    session = QASession(tiny, CacheSpec("dynamic"))
    context_tokens = session.prefill(context).context_tokens
    cache = session.cache
    lengths = [layer.get_seq_length() for layer in cache.layers]
    ids = torch.tensor([session.question_ids(QUESTIONS[0])])
    with torch.no_grad():
        tiny.model(input_ids=ids, cache=cache, use_cache=True)
    _kvpress_trim(cache, lengths)
    assert cache.get_seq_length() == context_tokens
