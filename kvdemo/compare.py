"""The same context and questions over several backends: memory, fidelity and speed, side by side.

A first version (memory; answers against `dynamic` and against gold answers; speed). Fidelity against gold
uses SQuAD's answer normalisation (lower case, punctuation and the articles a/an/the removed, whitespace
collapsed; `normalize_answer` in the SQuAD 2.0 evaluation script) and its token F1. Small chat models
answer in sentences, so `contains_gold` (a normalised gold answer appears inside the normalised answer)
is the figure to read first; exact match would almost never hold.
"""

from __future__ import annotations

import collections
import re
import statistics
import string
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import pandas as pd

from kvdemo.backends import CacheSpec
from kvdemo.models import LoadedModel
from kvdemo.session import QASession

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, punctuation removed, articles removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens two answers share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class QuestionResult:
    """One question's answer under one spec, measured against `dynamic` and the gold answers."""

    question: str
    answer: str
    token_ids: tuple[int, ...]
    identical_to_dynamic: bool
    common_prefix_tokens: int
    contains_gold: bool | None
    f1: float | None
    tokens_per_second: float
    cache_length_after: int


@dataclass(frozen=True)
class SpecResult:
    """One spec's figures: memory after the prefill (bytes), speed, and its answers."""

    spec: str
    backend: str
    context_tokens: int
    kv_bytes: int
    bytes_per_token: float
    ratio_to_dynamic: float
    prefill_seconds: float
    tokens_per_second: float
    flushes: int
    questions: tuple[QuestionResult, ...]


@dataclass(frozen=True)
class ComparisonReport:
    """Every spec's `SpecResult`, `dynamic` first."""

    results: tuple[SpecResult, ...]

    def to_frame(self) -> pd.DataFrame:
        """One row per spec: memory, agreement with `dynamic`, gold containment and F1 (means over the
        questions; NaN without gold answers), decode tokens/s."""
        rows = []
        for r in self.results:
            golds = [q for q in r.questions if q.contains_gold is not None]
            rows.append(
                {
                    "spec": r.spec,
                    "bytes/token": round(r.bytes_per_token, 1),
                    "ratio to dynamic": round(r.ratio_to_dynamic, 4),
                    "identical to dynamic": sum(q.identical_to_dynamic for q in r.questions) / len(r.questions),
                    "common prefix (tokens)": statistics.mean(q.common_prefix_tokens for q in r.questions),
                    "contains gold": statistics.mean(q.contains_gold for q in golds) if golds else float("nan"),
                    "F1": statistics.mean(q.f1 for q in golds) if golds else float("nan"),
                    "tokens/s": round(r.tokens_per_second, 2),
                    "flushes": r.flushes,
                }
            )
        return pd.DataFrame(rows)

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {"results": [asdict(r) for r in self.results]}


def compare(
    loaded_model: LoadedModel,
    context: str,
    questions: Sequence[str],
    specs: Sequence[CacheSpec],
    max_new_tokens: int = 32,
    gold_answers: Sequence[Sequence[str]] | None = None,
    on_spec: Callable[[CacheSpec], None] | None = None,
) -> ComparisonReport:
    """Prefill `context` and answer `questions` once per spec, one backend at a time (each cache is freed
    before the next), `dynamic` first and always included.

    Args:
        gold_answers: per question, the accepted answers (the case files' `answers`), or None.
        on_spec: called with each spec before it runs (a progress bar).

    Raises:
        ValueError: no question, gold answers not one list per question, or a spec/context/question the
            session refuses (its message).
    """
    if not questions:
        raise ValueError("compare needs at least one question")
    if gold_answers is not None and len(gold_answers) != len(questions):
        raise ValueError(f"gold_answers has {len(gold_answers)} entries for {len(questions)} questions")
    ordered = [CacheSpec("dynamic")] + [s for s in specs if s.backend != "dynamic"]
    results: list[SpecResult] = []
    reference: list[tuple[int, ...]] = []
    for spec in ordered:
        if on_spec is not None:
            on_spec(spec)
        session = QASession(loaded_model, spec)
        report = session.prefill(context)
        answers = [session.ask(q, max_new_tokens) for q in questions]
        if not reference:
            reference = [a.token_ids for a in answers]
        per_question = tuple(
            QuestionResult(
                question=q,
                answer=a.text,
                token_ids=a.token_ids,
                identical_to_dynamic=a.token_ids == ref,
                common_prefix_tokens=common_prefix(a.token_ids, ref),
                contains_gold=None if gold_answers is None else contains_gold(a.text, gold_answers[i]),
                f1=None if gold_answers is None else max((token_f1(a.text, g) for g in gold_answers[i]), default=0.0),
                tokens_per_second=a.tokens_per_second,
                cache_length_after=a.cache_length_after,
            )
            for i, (q, a, ref) in enumerate(zip(questions, answers, reference))
        )
        dynamic_bytes = results[0].kv_bytes if results else report.kv_bytes
        results.append(
            SpecResult(
                spec=spec.label,
                backend=spec.backend,
                context_tokens=report.context_tokens,
                kv_bytes=report.kv_bytes,
                bytes_per_token=report.bytes_per_token,
                ratio_to_dynamic=report.kv_bytes / dynamic_bytes,
                prefill_seconds=report.seconds,
                tokens_per_second=statistics.median(a.tokens_per_second for a in answers),
                flushes=sum(a.flush_count for a in answers),
                questions=per_question,
            )
        )
        del session, report
    return ComparisonReport(tuple(results))
