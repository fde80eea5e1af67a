"""kvdemo.evals.metrics: an answer that names a gold answer is never an abstention, whatever words that gold holds;
an answer that says the text does not give the answer still is. Scores computed by hand."""

from __future__ import annotations

import pytest

from kvdemo.evals.metrics import (
    ABSTENTION_PHRASES,
    is_abstention,
    normalize_answer,
    says_unanswerable,
    score_against_gold,
)


def _scores(prediction, golds):
    s = score_against_gold(prediction, golds)
    return s.exact_match, s.contains_gold, s.f1


def test_a_gold_answer_holding_an_abstention_word_scores_as_an_answer():
    assert says_unanswerable("Tomb of the Unknown Soldier")  # "unknown" is an abstention phrase...
    assert _scores("Tomb of the Unknown Soldier", ["Tomb of the Unknown Soldier"]) == (1.0, 1.0, 1.0)
    # ...inside the gold answer it names: contained, not exact; F1 = 2PR/(P+R) with P = 4/8, R = 1 (SQuAD drops
    # "the": "it was tomb of unknown soldier in arlington" against "tomb of unknown soldier")
    assert _scores("It was the Tomb of the Unknown Soldier in Arlington.", ["Tomb of the Unknown Soldier"]) == (
        0.0,
        1.0,
        pytest.approx(2 * 0.5 / 1.5),
    )


@pytest.mark.parametrize("phrase", ABSTENTION_PHRASES)
def test_every_abstention_phrase_inside_a_gold_answer(phrase):
    gold = f"The {phrase.title()} Memorial"  # e.g. "The Not Mentioned Memorial"
    words = len(normalize_answer(gold).split())  # the phrase's words + "memorial" ("the" is dropped)
    assert _scores(gold, [gold]) == (1.0, 1.0, 1.0)
    assert _scores(gold.upper() + "!", ["Somewhere else", gold]) == (1.0, 1.0, 1.0)
    # contained in a longer answer: P = words / (words + 2) ("it", "is"), R = 1
    precision = words / (words + 2)
    assert _scores(f"It is the {gold}.", [gold]) == (0.0, 1.0, pytest.approx(2 * precision / (precision + 1)))
    assert not is_abstention(f"It is the {gold}.", [gold])
    # the same phrase as an abstention, outside any gold answer, still scores 0
    assert is_abstention(f"Sorry: {phrase}.", [gold]) and _scores(f"Sorry: {phrase}.", [gold]) == (0.0, 0.0, 0.0)
    assert _scores(f"{phrase}, but the {gold} is nearby", ["Rollo"]) == (0.0, 0.0, 0.0)


def test_an_abstention_that_repeats_a_gold_word_is_still_an_abstention():
    assert is_abstention("The text does not say who Rollo was.", ["Rollo"])
    assert _scores("The text does not say who Rollo was.", ["Rollo"]) == (0.0, 0.0, 0.0)
    # a removed gold answer cannot join the words around it into a phrase: "not" + "Rollo" + "given" is no phrase
    assert not is_abstention("not Rollo given", ["Rollo"]) and says_unanswerable("not given")


def test_unanswerable_questions_keep_their_rule():
    assert _scores("The passage does not mention it.", []) == (1.0, 1.0, 1.0)
    assert _scores("Unknown.", []) == (1.0, 1.0, 1.0)
    assert _scores("", []) == (1.0, 1.0, 1.0)  # SQuAD 2.0's own no-answer prediction
    assert _scores("It was founded in 911.", []) == (0.0, 0.0, 0.0)
