"""Answer metrics: SQuAD's normalisation, exact match, containment and token F1 against gold answers (with
the rule for unanswerable questions), and the fidelity of an answer to a reference one (common prefix,
KL divergence). Sources: the SQuAD 2.0 evaluation script (`normalize_answer`, `compute_exact`,
`compute_f1`); KL(P || Q) = sum P (log P - log Q) (Kullback and Leibler, 1951).
"""

from __future__ import annotations

import collections
import re
import string
from dataclasses import dataclass
from typing import Iterable, Sequence

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


def says_unanswerable(prediction: str) -> bool:
    """Whether the answer says the text does not give the answer (an `ABSTENTION_PHRASES` phrase on word
    boundaries in the normalised answer), e.g. "The text does not say." or "It is not mentioned."."""
    text = f" {normalize_answer(prediction)} "
    return any(f" {phrase} " in text for phrase in ABSTENTION_PHRASES)


@dataclass(frozen=True)
class GoldScore:
    """An answer against the gold answers of one question (each figure 0.0 to 1.0)."""

    exact_match: float
    contains_gold: float
    f1: float


def score_against_gold(prediction: str, golds: Sequence[str]) -> GoldScore:
    """Exact match, containment and token F1 of `prediction` against the accepted answers `golds`.

    Answerable question (`golds` non-empty): each figure is the best over the golds, after
    `normalize_answer`; an answer that `says_unanswerable` scores 0 on all three. Unanswerable question
    (`golds` empty, SQuAD 2.0's `is_impossible`): all three are 1.0 when the answer `says_unanswerable`
    (or is empty, SQuAD 2.0's own no-answer prediction), else 0.0.
    """
    if not golds:
        right = float(says_unanswerable(prediction) or not normalize_answer(prediction))
        return GoldScore(right, right, right)
    if says_unanswerable(prediction):
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
        Shape [n]: sum over the vocabulary of P * (log P - log Q); 0 where the rows are equal.

    Raises:
        ValueError: the shapes differ.
    """
    if reference.shape != other.shape:
        raise ValueError(f"log-probabilities of shapes {tuple(reference.shape)} and {tuple(other.shape)} differ")
    return torch.nn.functional.kl_div(other, reference, log_target=True, reduction="none").sum(dim=-1)
