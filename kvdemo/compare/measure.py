"""One spec of a comparison measured (`measure_spec`): a fresh `QASession`, one prefill, every question answered
then teacher-forced on the reference's answers, and a perplexity feed; `dynamic`'s run is the `Reference` of the
others. `kvdemo.compare.run` runs it over every spec; see there for what each figure means."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvdemo.cache.model.layer_kinds import is_latent
from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state.telemetry import flushed_layers
from kvdemo.compare.records import Departure, QuestionResult, SpecResult
from kvdemo.evals import cache_error, fidelity
from kvdemo.evals.fidelity import PerplexityInputs
from kvdemo.evals.metrics import common_prefix, score_against_gold
from kvdemo.qa.job import JobRun
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PreparedContext
from kvdemo.qa.records import Answer, PrefillReport
from kvdemo.qa.session import QASession


@dataclass(frozen=True)
class Reference:
    """What `dynamic`'s run gives the other specs: its answers, their teacher-forced log-probabilities ([n_i, vocab]
    per question), its keys and values after the prefill (`cache_error.ReferenceKV`), its perplexity (or None)."""

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[torch.Tensor, ...]
    kv: cache_error.ReferenceKV
    perplexity: float | None = None


PERPLEXITY_STEPS_PER_UNIT = 32
"""Decode steps of a perplexity feed counted as one unit of `compare`'s progress."""

TOKEN_BLOCK = 8
"""Decode steps of an answer or a teacher-forced score between two notes (`on_note`): a long answer's progress."""


def perplexity_units(tokens: int) -> int:
    """Progress units of one perplexity feed of `tokens` decode steps (0 without one)."""
    return math.ceil(tokens / PERPLEXITY_STEPS_PER_UNIT) if tokens > 0 else 0


@dataclass(frozen=True)
class ComparisonRun:
    """What every spec of one comparison shares, made once by `kvdemo.compare.run.compare` and handed to each
    spec's `measure_spec`.

    Attributes:
        loaded_model: the model. context: the text, or its `PreparedContext` (tokenized once for every spec).
        questions: asked in turn; max_new_tokens: per answer (tokens).
        gold_answers: per question, the accepted answers (an empty list: unanswerable); None: no gold figures.
        job: the comparison's units and cancel event (`kvdemo.qa.job.JobRun`, shared with the needle grid): a unit
            after the prefill, each answer and each score, and every `PERPLEXITY_STEPS_PER_UNIT` decode steps of the
            perplexity feed; a note after each chunk of a prefill ("hqq:4: prefilling 512 of 1,341 tokens"), each
            layer its quantizer has taken, and every `TOKEN_BLOCK` decode steps of an answer or a score ("hqq:4:
            answering 1/2, 24 tokens"); the cancel event checked at every decode step (the session is then closed,
            its cache restored, and `JobCancelled` propagates to `compare`).
        kv_budget_bytes: each session's out-of-memory guard (`QASession`), also applied to the perplexity's cache.
        perplexity_inputs: from `fidelity.perplexity_inputs`; None: no perplexity.
    """

    loaded_model: LoadedModel
    context: str | PreparedContext
    questions: tuple[str, ...]
    max_new_tokens: int = 32
    gold_answers: Sequence[Sequence[str]] | None = None
    job: JobRun = field(default_factory=JobRun)
    kv_budget_bytes: int | None = None
    perplexity_inputs: PerplexityInputs | None = None

    def check_cancel(self) -> None:
        """Raises `JobCancelled` once the job's cancel event is set."""
        self.job.check_cancel()

    def step(self, what: str) -> None:
        """One unit of work done."""
        self.job.step(what)

    def note(self, what: str) -> None:
        """What runs now, no unit done."""
        self.job.note(what)

    def prefill(self, session: QASession) -> PrefillReport:
        """`session.prefill` of the run's context through the job (`JobRun.prefill`: chunks and layers told, the
        cancel event checked after each). Raises JobCancelled: cancelled."""
        return self.job.prefill(session, self.context, session.spec.text, max_new_tokens=self.max_new_tokens)


def measure_spec(
    run: ComparisonRun, spec: CacheSpec, reference: Reference | None = None, dynamic_kv_bytes: int | None = None
) -> tuple[SpecResult, Reference | None]:
    """One spec of `compare`: a fresh `QASession`, one prefill, every question answered then scored; then, with
    `run.perplexity_inputs`, a perplexity feed on a fresh cache (the session's cache is freed first).

    Args:
        run: what the comparison's specs share (`ComparisonRun`).
        reference: `dynamic`'s run to compare with; None makes this run the reference (its KL is 0, its answers
            identical and its cache error 0 by definition; for a quantized spec the full-precision keys and values
            then come from a `cache_error.reference_kv` prefill).
        dynamic_kv_bytes: `dynamic`'s kv_bytes for `ratio_to_dynamic` (default: this run's own).

    Returns:
        The `SpecResult`, and this run's own `Reference` when it is the reference run (else None).

    Raises:
        ValueError, ImportError: the session refuses the spec, context or a question (its message).
    """
    session = QASession(run.loaded_model, spec, kv_budget_bytes=run.kv_budget_bytes)
    prefill = run.prefill(session)
    context_ids = session.context_ids(run.context)  # a PreparedContext is not tokenized again
    reference_kv = _reference_kv(run.loaded_model, session, context_ids, reference)
    assert session.cache is not None  # prefilled
    kv_error = cache_error.kv_error(reference_kv, session.cache, latent=is_latent(run.loaded_model.config))
    run.step(f"{spec.text}: prefilled {prefill.context_tokens} tokens")
    answers, flush_steps, flush_seconds = _answer_all(run, session, spec)
    ref_ids = reference.token_ids if reference is not None else tuple(a.token_ids for a in answers)
    own, parts, drift_runs, departures = _score_all(run, session, spec, answers, ref_ids, reference, reference_kv)
    del session  # this cache freed before the perplexity's (reference counting: no cycle holds a session)
    ppl = None
    if run.perplexity_inputs is not None:
        ppl = _perplexity(run, spec, run.perplexity_inputs, context_ids, reference_kv, reference)
        drift_runs.append(ppl.context_errors)
    questions_out = _question_results(run, answers, ref_ids, parts, flush_steps, flush_seconds, drift_runs, departures)
    result = _spec_result(
        spec, prefill, answers, flush_seconds, questions_out, parts, kv_error, drift_runs, ppl, dynamic_kv_bytes
    )
    result = replace(result, deploy=tuple(d.line for d in spec.deployments(run.loaded_model.config)))
    own_reference = None
    if reference is None:
        own_reference = Reference(
            tuple(a.token_ids for a in answers), tuple(own), reference_kv, None if ppl is None else ppl.perplexity
        )
    return result, own_reference


def _spec_result(
    spec: CacheSpec,
    prefill: PrefillReport,
    answers: Sequence,
    flush_seconds: Sequence[float],
    questions_out: Sequence[QuestionResult],
    parts: Sequence,
    kv_error: cache_error.KVError,
    drift_runs: Sequence[tuple[float, ...]],
    ppl: fidelity.PerplexityResult | None,
    dynamic_kv_bytes: int | None,
) -> SpecResult:
    """The `SpecResult` of one spec's run, from its prefill, answers, scores and perplexity."""
    memory = prefill.memory
    drift, drift_flushes = cache_error.drift_ratio(kv_error.context_total, drift_runs)
    return SpecResult(
        spec=spec.label,
        spec_text=spec.text,
        backend=spec.backend,
        nbits=spec.resolved().get("nbits"),
        options=spec.resolved(),
        context_tokens=prefill.context_tokens,
        kv_bytes=prefill.kv_bytes,
        quantized_bytes=memory.quantized_bytes,
        residual_bytes=memory.residual_bytes,
        kept_bytes=memory.kept_bytes,
        bytes_per_token=prefill.bytes_per_token,
        ratio_to_dynamic=prefill.kv_bytes / (dynamic_kv_bytes or prefill.kv_bytes),
        prefill_seconds=prefill.seconds,
        tokens_per_second=statistics.median(a.tokens_per_second for a in answers),
        flushes=sum(a.flush_count for a in answers),
        flush_seconds=sum(flush_seconds),
        restored=all(a.cache_length_after == prefill.context_tokens for a in answers),
        questions=tuple(questions_out),
        kl=fidelity.KLStats.pool(parts),
        kv_error=kv_error,
        drift=drift,
        drift_flushes=drift_flushes,
        perplexity=ppl,
    )


def _reference_kv(
    loaded_model: LoadedModel, session: QASession, context_ids: list[int], reference: Reference | None
) -> cache_error.ReferenceKV:
    """The full-precision keys and values the cache's error is measured against (see `measure_spec`)."""
    if reference is not None:
        return reference.kv
    if session.spec.info.quantized:
        return cache_error.reference_kv(loaded_model, context_ids)
    assert session.cache is not None  # prefilled
    return cache_error.full_precision_kv(session.cache)  # the post-prefill tensors, before any answer


def _answer_all(run: ComparisonRun, session: QASession, spec: CacheSpec) -> tuple[list, list[int], list[float]]:
    """Every question answered in turn: the answers, and per answer its flush steps and their seconds."""
    answers: list[Answer] = []
    flush_steps: list[int] = []
    flush_seconds: list[float] = []
    for question in run.questions:
        stream = session.stream(question, run.max_new_tokens)
        steps, seconds = 0, 0.0
        try:
            for event in stream:
                if event.is_flush_step:
                    steps, seconds = steps + 1, seconds + event.seconds
                run.check_cancel()
                if (event.step + 1) % TOKEN_BLOCK == 0:
                    run.note(f"{spec.text}: answering {len(answers) + 1}/{len(run.questions)}, {event.step + 1} tokens")
        finally:
            stream.close()
        answers.append(session.history[-1])
        flush_steps.append(steps)
        flush_seconds.append(seconds)
        run.step(f"{spec.text}: answered {len(answers)}/{len(run.questions)}")
    return answers, flush_steps, flush_seconds


def _score_all(
    run: ComparisonRun,
    session: QASession,
    spec: CacheSpec,
    answers: Sequence,
    ref_ids: Sequence[Sequence[int]],
    reference: Reference | None,
    reference_kv: cache_error.ReferenceKV,
) -> tuple[list[torch.Tensor], list, list[tuple[float, ...]], list[Departure | None]]:
    """The reference's answers (`ref_ids`) teacher-forced through this cache: the own log-probabilities (kept only
    for the reference run), each question's `PositionFidelity`, the context's error after each flush (the drift),
    and where each of this spec's `answers` first leaves the reference's (`first_departure`)."""
    own, parts, drift_runs = [], [], []
    departures: list[Departure | None] = []
    for i, question in enumerate(run.questions):
        run.check_cancel()
        errors: list[float] = []

        def after_step(row: int, cache, errors=errors, i=i) -> None:
            if flushed_layers(cache) and (error := cache_error.context_error(reference_kv, cache)) is not None:
                errors.append(error)
            run.check_cancel()
            if (row + 1) % TOKEN_BLOCK == 0:
                run.note(f"{spec.text}: scoring {i + 1}/{len(run.questions)}, {row + 1} tokens")

        logprobs = session.score(question, ref_ids[i], on_step=after_step)
        if reference is None:
            own.append(logprobs)  # kept only when this run is the reference ([n, vocab] float32 per question)
            departures.append(None)
        else:
            departures.append(
                first_departure(run.loaded_model, answers[i].token_ids, ref_ids[i], logprobs, reference.logprobs[i])
            )
        parts.append(
            fidelity.position_fidelity(logprobs if reference is None else reference.logprobs[i], logprobs, ref_ids[i])
        )
        drift_runs.append(tuple(errors))
        del logprobs
        run.step(f"{spec.text}: scored {i + 1}/{len(run.questions)}")
    return own, parts, drift_runs, departures


def first_departure(
    loaded_model: LoadedModel,
    spec_ids: Sequence[int],
    dynamic_ids: Sequence[int],
    spec_logprobs: torch.Tensor,
    dynamic_logprobs: torch.Tensor,
) -> Departure | None:
    """Where a spec's greedy answer `spec_ids` first leaves `dynamic_ids`, with the two tokens' log-probabilities.

    Args:
        loaded_model: the model (its tokenizer decodes each token alone).
        spec_ids, dynamic_ids: the two answers' token ids.
        spec_logprobs, dynamic_logprobs: `dynamic_ids` teacher-forced through the spec's cache and through
            `dynamic`'s (`QASession.score`), float32 [len(dynamic_ids), vocab]: row i is the distribution before
            token i, after the question and the first i tokens of `dynamic_ids`.

    Returns:
        The `Departure`, or None when the answers are identical.
    """
    spec_ids, dynamic_ids = list(spec_ids), list(dynamic_ids)
    if spec_ids == dynamic_ids:
        return None
    at = common_prefix(spec_ids, dynamic_ids)
    theirs = dynamic_ids[at] if at < len(dynamic_ids) else None
    ours = spec_ids[at] if at < len(spec_ids) else None

    def logprob(rows: torch.Tensor, token: int | None) -> float | None:
        return None if token is None or at >= rows.shape[0] else float(rows[at, token])

    def text(token: int | None) -> str | None:
        return None if token is None else loaded_model.tokenizer.decode([token])

    return Departure(
        position=at,
        dynamic_token=text(theirs),
        spec_token=text(ours),
        dynamic_logprobs=(logprob(dynamic_logprobs, theirs), logprob(dynamic_logprobs, ours)),
        spec_logprobs=(logprob(spec_logprobs, theirs), logprob(spec_logprobs, ours)),
    )


def _perplexity(
    run: ComparisonRun,
    spec: CacheSpec,
    perplexity_inputs: PerplexityInputs,
    context_ids: list[int],
    reference_kv: cache_error.ReferenceKV,
    reference: Reference | None,
) -> fidelity.PerplexityResult:
    """The perplexity feed on a fresh cache, with its ratio to the reference's perplexity."""
    fed_context = list(perplexity_inputs.context_ids)
    tokens = len(fed_context)
    same_tokens = context_ids[:tokens] == fed_context
    ppl_reference = None
    if same_tokens:  # the context's first tokens: the reference's first positions (attention is causal)
        ppl_reference = reference_kv.prefix(tokens)
    fed = perplexity_inputs.tokens

    def after_feed(step: int) -> None:
        run.check_cancel()
        if (step + 1) % PERPLEXITY_STEPS_PER_UNIT == 0 or step + 1 == fed:
            run.step(f"{spec.text}: perplexity {step + 1}/{fed} tokens")

    ppl = fidelity.perplexity(
        run.loaded_model,
        spec,
        perplexity_inputs,
        reference=ppl_reference,
        on_step=after_feed,
        kv_budget_bytes=run.kv_budget_bytes,
    )
    base = ppl.perplexity if reference is None else reference.perplexity
    return replace(ppl, ratio_to_dynamic=ppl.perplexity / base if base else None)


def _question_results(
    run: ComparisonRun,
    answers: Sequence,
    ref_ids: Sequence[Sequence[int]],
    parts: Sequence,
    flush_steps: Sequence[int],
    flush_seconds: Sequence[float],
    drift_runs: Sequence[tuple[float, ...]],
    departures: Sequence[Departure | None],
) -> list[QuestionResult]:
    """One `QuestionResult` per question, from its answer, its fidelity, its flushes and its departure."""
    questions_out, gold_answers = [], run.gold_answers
    for i, (question, answer) in enumerate(zip(run.questions, answers)):
        gold = None if gold_answers is None else score_against_gold(answer.text, gold_answers[i])
        questions_out.append(
            QuestionResult(
                question=question,
                answer=answer.text,
                token_ids=answer.token_ids,
                finish_reason=answer.finish_reason,
                identical_to_dynamic=answer.token_ids == ref_ids[i],
                common_prefix_tokens=common_prefix(answer.token_ids, ref_ids[i]),
                kl_nats=float(parts[i].kl.mean()),
                exact_match=None if gold is None else gold.exact_match,
                contains_gold=None if gold is None else gold.contains_gold,
                f1=None if gold is None else gold.f1,
                answerable=None if gold_answers is None else bool(gold_answers[i]),
                tokens_per_second=answer.tokens_per_second,
                flush_steps=flush_steps[i],
                flush_seconds=flush_seconds[i],
                cache_length_after=answer.cache_length_after,
                context_errors=drift_runs[i],
                departure=departures[i],
            )
        )
    return questions_out
