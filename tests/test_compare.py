"""kvdemo.compare (first version): SQuAD metrics on hand-made cases, and a comparison on a tiny model."""

from __future__ import annotations

import math

import pytest

from kvdemo import CacheSpec, QASession
from kvdemo.compare import common_prefix, compare, contains_gold, normalize_answer, token_f1


def test_squad_normalisation():
    assert normalize_answer("The Normans, in  FRANCE!") == "normans in france"
    assert normalize_answer("An apple a day") == "apple day"


def test_token_f1_and_containment():
    assert token_f1("Rollo", "Rollo") == 1.0
    assert token_f1("the leader was Rollo", "Rollo") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert token_f1("Charles", "Rollo") == 0.0
    assert contains_gold("Their leader was Rollo.", ["rollo"]) is True
    assert contains_gold("Rolloesque", ["Rollo"]) is False  # whole words only
    assert contains_gold("anything", []) is False


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0 and common_prefix([5], [5]) == 1


def test_compare_puts_dynamic_first_and_agrees_with_sessions(tiny):
    context = "The Normans were the people who gave their name to Normandy. Rollo led them."
    questions = ["Who led them?", "Where?"]
    report = compare(tiny, context, questions, [CacheSpec("hqq", nbits=2), CacheSpec("fp8")], max_new_tokens=5,
                     gold_answers=[["Rollo"], ["Normandy"]])
    assert [r.backend for r in report.results] == ["dynamic", "hqq", "fp8"]
    dynamic = report.results[0]
    assert all(q.identical_to_dynamic and q.common_prefix_tokens == len(q.token_ids) for q in dynamic.questions)
    assert dynamic.ratio_to_dynamic == 1.0
    for result, spec in zip(report.results[1:], [CacheSpec("hqq", nbits=2), CacheSpec("fp8")]):
        session = QASession(tiny, spec)
        prefill = session.prefill(context)
        assert result.kv_bytes == prefill.kv_bytes
        assert result.ratio_to_dynamic == pytest.approx(prefill.kv_bytes / dynamic.kv_bytes)
        assert [q.token_ids for q in result.questions] == [session.ask(q, 5).token_ids for q in questions]
        assert all(q.cache_length_after == prefill.context_tokens for q in result.questions)
    frame = report.to_frame()
    assert list(frame["spec"])[0] == "dynamic" and frame["identical to dynamic"].iloc[0] == 1.0
    assert not math.isnan(frame["F1"].iloc[0])
    with pytest.raises(ValueError, match="gold_answers has 1 entries for 2 questions"):
        compare(tiny, context, questions, [], gold_answers=[["x"]])
    with pytest.raises(ValueError, match="at least one question"):
        compare(tiny, context, [], [])
