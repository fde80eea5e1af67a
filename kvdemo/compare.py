"""The same context and questions over several KV cache backends: memory, fidelity and speed, side by side.

`compare` prefills the context and answers every question once per `CacheSpec`, one backend at a time
(each cache is freed before the next), the `dynamic` baseline first. Per spec it measures:

- **memory**: the cache's bytes after the prefill (`telemetry.kv_memory`), per context token, and the ratio
  to `dynamic` (the full-precision cache in the model's dtype);
- **fidelity against `dynamic`**: whether the answer's tokens are identical, the common prefix in tokens,
  and the mean KL divergence KL(P_dynamic || P_spec) in nats per answer token, both distributions
  teacher-forced on `dynamic`'s answer (`QASession.score`), so that the figure measures the cache and not
  a text that has already diverged;
- **fidelity against gold answers** (the SQuAD case files): exact match, containment and token F1 after
  SQuAD's normalisation, and the unanswerable rule of `score_against_gold` (all in `kvdemo.metrics`);
- **speed**: prefill seconds, decode tokens/s (median over the answers), and the time spent in decode
  steps during which a layer flushed;
- **restore**: every answer's `cache_length_after`, which must equal the context's tokens.

Unanswerable questions (SQuAD 2.0 `is_impossible`, given as an empty gold list): an answer counts as right
only when it says that the text does not give the answer (`metrics.says_unanswerable`: one of
`ABSTENTION_PHRASES` in the normalised answer); for an answerable question such an answer scores 0.
"""

from __future__ import annotations

import gc
import statistics
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import pandas as pd
import torch

from kvdemo import checks
from kvdemo.spec import CacheSpec
from kvdemo.models import LoadedModel
from kvdemo.metrics import common_prefix, kl_divergence, score_against_gold
from kvdemo.session import QASession

ProgressCallback = Callable[[int, int, str], None]
"""`on_progress(done, total, what)`: units of work done so far, the total, and what runs next."""


@dataclass(frozen=True)
class QuestionResult:
    """One question's answer under one spec.

    Attributes:
        identical_to_dynamic: the answer's token ids equal `dynamic`'s.
        common_prefix_tokens: leading tokens shared with `dynamic`'s answer.
        kl_nats: mean KL(P_dynamic || P_spec) per token of `dynamic`'s answer, teacher-forced (nats).
        exact_match, contains_gold, f1: `score_against_gold` (None without gold answers).
        answerable: False for a question the text does not answer (empty gold list); None without gold.
        tokens_per_second: generated tokens per second of the answer.
        flush_steps: decode steps (after the question's own pass) during which at least one layer flushed.
        flush_seconds: wall time of those steps (seconds).
        cache_length_after: the cache's length after the restore (tokens).
    """

    question: str
    answer: str
    token_ids: tuple[int, ...]
    finish_reason: str
    identical_to_dynamic: bool
    common_prefix_tokens: int
    kl_nats: float
    exact_match: float | None
    contains_gold: float | None
    f1: float | None
    answerable: bool | None
    tokens_per_second: float
    flush_steps: int
    flush_seconds: float
    cache_length_after: int


@dataclass(frozen=True)
class SpecResult:
    """One spec's figures and answers.

    Attributes:
        spec: `CacheSpec.label` (every option resolved); `spec_text` is `CacheSpec.text`.
        backend, nbits, options: the spec's fields (nbits None where the backend takes none; options every
            option the backend takes, resolved): read these, never cut `spec` apart.
        kv_bytes, quantized_bytes, residual_bytes: the cache after the prefill (bytes, `kv_memory`).
        bytes_per_token: kv_bytes / context_tokens.
        ratio_to_dynamic: kv_bytes / `dynamic`'s kv_bytes (the cache in the model's dtype).
        prefill_seconds: the prefill's wall time.
        tokens_per_second: median over the answers of `Answer.tokens_per_second` (generated tokens over the
            answer's wall time, the question's own forward pass included).
        flushes: flushes summed over layers and answers, those of the question's own pass included;
            flush_seconds: summed `QuestionResult.flush_seconds` (decode steps after the question's pass).
        restored: every answer's cache_length_after equals context_tokens.
    """

    spec: str
    spec_text: str
    backend: str
    nbits: int | None
    options: dict[str, int]
    context_tokens: int
    kv_bytes: int
    quantized_bytes: int
    residual_bytes: int
    bytes_per_token: float
    ratio_to_dynamic: float
    prefill_seconds: float
    tokens_per_second: float
    flushes: int
    flush_seconds: float
    restored: bool
    questions: tuple[QuestionResult, ...]


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


@dataclass(frozen=True)
class ComparisonReport:
    """Every spec's `SpecResult`, `dynamic` first.

    Attributes:
        model: the model's name; max_new_tokens: the answers' limit (tokens).
    """

    model: str
    max_new_tokens: int
    results: tuple[SpecResult, ...]

    COLUMNS = ("spec", "backend", "nbits", "KV bytes", "bytes/token", "ratio to dynamic", "identical to dynamic", "common prefix (tokens)",
               "KL (nats)", "exact match", "contains gold", "F1", "prefill s", "tokens/s", "flushes", "flush s",
               "restored")

    def to_frame(self) -> pd.DataFrame:
        """One row per spec (`COLUMNS`, also when there is none). Fidelity columns are means over the questions;
        the gold columns are NaN without gold answers. Columns: spec, backend, nbits (NaN without), KV bytes, bytes/token, ratio to dynamic, identical to dynamic (share),
        common prefix (tokens), KL (nats), exact match, contains gold, F1, prefill s, tokens/s, flushes,
        flush s, restored."""
        rows = []
        for r in self.results:
            qs = r.questions
            gold = [q for q in qs if q.f1 is not None]
            rows.append(
                {
                    "spec": r.spec,
                    "backend": r.backend,
                    "nbits": r.nbits,
                    "KV bytes": r.kv_bytes,
                    "bytes/token": round(r.bytes_per_token, 1),
                    "ratio to dynamic": round(r.ratio_to_dynamic, 4),
                    "identical to dynamic": _mean([float(q.identical_to_dynamic) for q in qs]),
                    "common prefix (tokens)": _mean([q.common_prefix_tokens for q in qs]),
                    "KL (nats)": _mean([q.kl_nats for q in qs]),
                    "exact match": _mean([q.exact_match for q in gold]),
                    "contains gold": _mean([q.contains_gold for q in gold]),
                    "F1": _mean([q.f1 for q in gold]),
                    "prefill s": round(r.prefill_seconds, 2),
                    "tokens/s": round(r.tokens_per_second, 2),
                    "flushes": r.flushes,
                    "flush s": round(r.flush_seconds, 2),
                    "restored": r.restored,
                }
            )
        return pd.DataFrame(rows, columns=list(self.COLUMNS)).astype({"nbits": "Int64"})

    def to_dict(self) -> dict:
        """JSON-ready: model, max_new_tokens and every result with its answers."""
        return {"model": self.model, "max_new_tokens": self.max_new_tokens, "results": [asdict(r) for r in self.results]}


class ComparisonCancelled(Exception):
    """Raised by `compare` when its `cancel` event is set; `report` holds the specs finished before."""

    def __init__(self, report: ComparisonReport):
        super().__init__(f"comparison cancelled after {len(report.results)} spec(s)")
        self.report = report


@dataclass(frozen=True)
class Reference:
    """`dynamic`'s answers and their teacher-forced log-probabilities (one [n_i, vocab] tensor per question)."""

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[torch.Tensor, ...]


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise _Cancelled


class _Cancelled(Exception):
    pass


def measure_spec(
    loaded_model: LoadedModel,
    context: str,
    questions: Sequence[str],
    spec: CacheSpec,
    max_new_tokens: int = 32,
    reference: Reference | None = None,
    gold_answers: Sequence[Sequence[str]] | None = None,
    dynamic_kv_bytes: int | None = None,
    cancel: threading.Event | None = None,
    on_step: Callable[[str], None] | None = None,
    kv_budget_bytes: int | None = None,
) -> tuple[SpecResult, Reference | None]:
    """One spec of `compare`: a fresh `QASession`, one prefill, every question answered then scored.

    Args:
        reference: `dynamic`'s answers to compare with; None makes this run the reference (its KL is 0 and
            its answers identical by definition).
        dynamic_kv_bytes: `dynamic`'s kv_bytes for `ratio_to_dynamic` (default: this run's own).
        cancel: checked at every decode step; when set the session is closed (its cache restored) and the
            internal cancellation propagates to `compare`.
        on_step: called with a description after the prefill and after each answer and each score.

        kv_budget_bytes: the session's out-of-memory guard (`QASession`).

    Returns:
        The `SpecResult`, and this run's own `Reference` when it is the reference run (else None).

    Raises:
        ValueError, ImportError: the session refuses the spec, context or a question (its message).
    """
    session = QASession(loaded_model, spec, kv_budget_bytes=kv_budget_bytes)
    prefill = session.prefill(context, max_new_tokens=max_new_tokens)
    if on_step is not None:
        on_step(f"{spec.text}: prefilled {prefill.context_tokens} tokens")
    answers, flush_steps, flush_seconds = [], [], []
    for question in questions:
        stream = session.stream(question, max_new_tokens)
        steps, seconds = 0, 0.0
        try:
            for event in stream:
                if event.is_flush_step:
                    steps, seconds = steps + 1, seconds + event.seconds
                _check_cancel(cancel)
        finally:
            stream.close()
        answers.append(session.history[-1])
        flush_steps.append(steps)
        flush_seconds.append(seconds)
        if on_step is not None:
            on_step(f"{spec.text}: answered {len(answers)}/{len(questions)}")
    ref_ids = reference.token_ids if reference is not None else tuple(a.token_ids for a in answers)
    own, kls = [], []
    for i, question in enumerate(questions):
        _check_cancel(cancel)
        logprobs = session.score(question, ref_ids[i])
        if reference is None:
            own.append(logprobs)  # kept only when this run is the reference ([n, vocab] float32 per question)
        kls.append(0.0 if reference is None else float(kl_divergence(reference.logprobs[i], logprobs).mean()))
        del logprobs
        if on_step is not None:
            on_step(f"{spec.text}: scored {i + 1}/{len(questions)}")
    questions_out = []
    for i, (question, answer) in enumerate(zip(questions, answers)):
        gold = None if gold_answers is None else score_against_gold(answer.text, gold_answers[i])
        questions_out.append(
            QuestionResult(
                question=question,
                answer=answer.text,
                token_ids=answer.token_ids,
                finish_reason=answer.finish_reason,
                identical_to_dynamic=answer.token_ids == ref_ids[i],
                common_prefix_tokens=common_prefix(answer.token_ids, ref_ids[i]),
                kl_nats=kls[i],
                exact_match=None if gold is None else gold.exact_match,
                contains_gold=None if gold is None else gold.contains_gold,
                f1=None if gold is None else gold.f1,
                answerable=None if gold_answers is None else bool(gold_answers[i]),
                tokens_per_second=answer.tokens_per_second,
                flush_steps=flush_steps[i],
                flush_seconds=flush_seconds[i],
                cache_length_after=answer.cache_length_after,
            )
        )
    memory = prefill.memory
    result = SpecResult(
        spec=spec.label,
        spec_text=spec.text,
        backend=spec.backend,
        nbits=spec.resolved().get("nbits"),
        options=spec.resolved(),
        context_tokens=prefill.context_tokens,
        kv_bytes=prefill.kv_bytes,
        quantized_bytes=memory.quantized_bytes,
        residual_bytes=memory.residual_bytes,
        bytes_per_token=prefill.bytes_per_token,
        ratio_to_dynamic=prefill.kv_bytes / (dynamic_kv_bytes or prefill.kv_bytes),
        prefill_seconds=prefill.seconds,
        tokens_per_second=statistics.median(a.tokens_per_second for a in answers),
        flushes=sum(a.flush_count for a in answers),
        flush_seconds=sum(flush_seconds),
        restored=all(a.cache_length_after == prefill.context_tokens for a in answers),
        questions=tuple(questions_out),
    )
    own_reference = Reference(tuple(a.token_ids for a in answers), tuple(own)) if reference is None else None
    return result, own_reference


def compare(
    loaded_model: LoadedModel,
    context: str,
    questions: Sequence[str],
    specs: Sequence[CacheSpec],
    max_new_tokens: int = 32,
    gold_answers: Sequence[Sequence[str]] | None = None,
    cancel: threading.Event | None = None,
    on_progress: ProgressCallback | None = None,
    kv_budget_bytes: int | None = None,
) -> ComparisonReport:
    """Prefill `context` and answer `questions` once per spec, one backend at a time (each session and cache
    is freed before the next), `dynamic` first and always included; duplicates are run once.

    Work: per spec one prefill, one generation and one teacher-forced scoring per question; about twice
    the decode steps of answering alone.

    Args:
        loaded_model: from `kvdemo.load_model`.
        context: the text; questions: asked in turn on it.
        specs: the specs to compare (validated against the model before anything runs).
        max_new_tokens: per answer (tokens).
        gold_answers: per question, the accepted answers; an empty list marks a question the text does not
            answer (see `score_against_gold`). None: no gold figures.
        cancel: set it (from another thread) to stop at the next decode step.
        on_progress: `ProgressCallback`, called as work units finish (a prefill, an answer, a score).
        kv_budget_bytes: each session's out-of-memory guard (`QASession`); None: no limit.

    Returns:
        The `ComparisonReport`.

    Raises:
        ValueError: no question, an empty one, gold answers not one list per question, max_new_tokens < 1 or a
            spec the model cannot run (nothing has run then); or a context or question the session refuses
            (its message; a question too long for the window is found when its turn comes).
        ImportError: a spec's backend package is missing.
        ComparisonCancelled: `cancel` was set; its `report` holds the specs finished before.
    """
    questions = list(questions)
    if not questions:
        raise ValueError("compare needs at least one question")
    if gold_answers is not None and len(gold_answers) != len(questions):
        raise ValueError(f"gold_answers has {len(gold_answers)} entries for {len(questions)} questions")
    ordered: list[CacheSpec] = []
    for spec in [CacheSpec("dynamic"), *specs]:
        spec = spec.validate(loaded_model.config)
        if spec.label not in [s.label for s in ordered]:
            ordered.append(spec)
    for i, question in enumerate(questions):  # refuse bad input before minutes of work
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question {i + 1} is empty; give the text of every question")
    max_new_tokens = checks.max_new_tokens(max_new_tokens)
    total = len(ordered) * (1 + 2 * len(questions))
    done = 0

    def step(what: str) -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done, total, what)

    results: list[SpecResult] = []
    reference: Reference | None = None
    for spec in ordered:
        if on_progress is not None:
            on_progress(done, total, f"{spec.text}: prefilling")
        try:
            result, own = measure_spec(
                loaded_model,
                context,
                questions,
                spec,
                max_new_tokens,
                reference=reference,
                gold_answers=gold_answers,
                dynamic_kv_bytes=results[0].kv_bytes if results else None,
                cancel=cancel,
                on_step=step,
                kv_budget_bytes=kv_budget_bytes,
            )
        except _Cancelled:
            raise ComparisonCancelled(ComparisonReport(loaded_model.name, max_new_tokens, tuple(results))) from None
        finally:
            gc.collect()
        if reference is None:
            reference = own
        results.append(result)
    return ComparisonReport(loaded_model.name, max_new_tokens, tuple(results))
