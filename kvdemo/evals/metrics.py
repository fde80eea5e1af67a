"""Answer metrics: SQuAD's normalisation, exact match, containment and token F1 against gold answers (with
the rule for unanswerable questions), and the fidelity of an answer to a reference one (common prefix,
KL divergence). Sources: the SQuAD 2.0 evaluation script (`normalize_answer`, `compute_exact`,
`compute_f1`); KL(P || Q) = sum P (log P - log Q) (Kullback and Leibler, 1951).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)

ABSTENTION_PHRASES = (
    "does not say",
    "doesnt say",
    "does not mention",
    "doesnt mention",
    "does not specify",
    "does not state",
    "does not provide",
    "does not give",
    "not mentioned",
    "not stated",
    "not specified",
    "not provided",
    "not given",
    "no information",
    "no mention",
    "not enough information",
    "cannot be determined",
    "cannot answer",
    "cant answer",
    "cannot be answered",
    "unanswerable",
    "not in text",
    "not in context",
    "i dont know",
    "unknown",
)
"""Normalised phrases (after `normalize_answer`: lower case, no punctuation, no articles) by which an answer
says that the text does not give the answer."""


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, punctuation removed, articles removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD's token F1 between a prediction and one gold answer, after `normalize_answer` (0.0 to 1.0)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def contains_gold(prediction: str, golds: Iterable[str]) -> bool:
    """Whether some normalised gold answer appears, on word boundaries, in the normalised prediction."""
    text = f" {normalize_answer(prediction)} "
    return any(f" {normalize_answer(g)} " in text for g in golds if normalize_answer(g))


def _has_abstention_phrase(normalized: str) -> bool:
    text = f" {normalized} "
    return any(f" {phrase} " in text for phrase in ABSTENTION_PHRASES)


def says_unanswerable(prediction: str) -> bool:
    """Whether the answer says the text does not give the answer (an `ABSTENTION_PHRASES` phrase on word
    boundaries in the normalised answer), e.g. "The text does not say." or "It is not mentioned."."""
    return _has_abstention_phrase(normalize_answer(prediction))


def is_abstention(prediction: str, golds: Iterable[str]) -> bool:
    """Whether the answer abstains on a question with gold answers `golds`: an `ABSTENTION_PHRASES` phrase
    outside every gold answer it contains (after `normalize_answer`, on word boundaries). A gold answer may hold
    such a phrase ("Tomb of the Unknown Soldier" holds "unknown", "Not Given" holds "not given"): an answer
    naming it is an answer, not an abstention; "The text does not say who Rollo was." still abstains (gold
    "Rollo": the phrase is outside it). Without golds this is `says_unanswerable`.

    Example:
        >>> is_abstention("Tomb of the Unknown Soldier", ["Tomb of the Unknown Soldier"])
        False
    """
    text = normalize_answer(prediction)
    for gold in sorted({normalize_answer(g) for g in golds} - {""}, key=len, reverse=True):
        # a barrier ("|" never survives normalisation) keeps phrases from joining across a removed gold answer
        text = re.sub(rf"(?<!\S){re.escape(gold)}(?!\S)", " | ", text)
    return _has_abstention_phrase(text)


@dataclass(frozen=True)
class GoldScore:
    """An answer against the gold answers of one question (each figure 0.0 to 1.0)."""

    exact_match: float
    contains_gold: float
    f1: float


def score_against_gold(prediction: str, golds: Sequence[str]) -> GoldScore:
    """Exact match, containment and token F1 of `prediction` against the accepted answers `golds`.

    Answerable question (`golds` non-empty): each figure is the best over the golds, after
    `normalize_answer`; an abstention (`is_abstention`: an abstention phrase outside the gold answers the answer
    contains) scores 0 on all three. An answer matching a gold answer is never an abstention, even where that gold
    holds an abstention phrase ("Tomb of the Unknown Soldier" holds "unknown"). Unanswerable question
    (`golds` empty, SQuAD 2.0's `is_impossible`): all three are 1.0 when the answer `says_unanswerable`
    (or is empty, SQuAD 2.0's own no-answer prediction), else 0.0.
    """
    if not golds:
        right = float(says_unanswerable(prediction) or not normalize_answer(prediction))
        return GoldScore(right, right, right)
    if is_abstention(prediction, golds):
        return GoldScore(0.0, 0.0, 0.0)
    norm = normalize_answer(prediction)
    return GoldScore(
        exact_match=float(any(norm == normalize_answer(g) for g in golds)),
        contains_gold=float(contains_gold(prediction, golds)),
        f1=max(token_f1(prediction, g) for g in golds),
    )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens two answers share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) in nats at each position, from log-probabilities.

    Args:
        reference: log P, shape [n, vocab] (e.g. `dynamic`'s teacher-forced distributions).
        other: log Q, the same shape.

    Returns:
        Shape [n]: sum over the vocabulary of P * (log P - log Q), with 0 * log 0 = 0: a token that P gives zero
        probability (log P = -inf, e.g. a masked logit) adds 0 whatever Q gives it, so equal rows give 0 also
        with -inf entries; a token with P > 0 and Q = 0 makes the row +inf (Q cannot encode what P says), kept as
        +inf for the caller to report. (torch's `kl_div(log_target=True)` computes exp(t) * (t - x) and gives
        NaN for t = x = -inf: the case of p-e-w/heretic PR#348.)

    Raises:
        ValueError: the shapes differ.
    """
    if reference.shape != other.shape:
        raise ValueError(f"log-probabilities of shapes {tuple(reference.shape)} and {tuple(other.shape)} differ")
    p = reference.exp()
    terms = torch.where(p > 0, p * (reference - other), torch.zeros((), dtype=p.dtype, device=p.device))
    return terms.sum(dim=-1)
