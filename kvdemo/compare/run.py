"""The same context and questions over several KV cache backends: memory, fidelity and speed, side by side.

`compare` prefills the context and answers every question once per `CacheSpec`, one backend at a time
(each cache is freed before the next), the `dynamic` baseline first. Per spec it measures:

- **memory**: the cache's bytes after the prefill (`telemetry.kv_memory`), per context token, and the ratio
  to `dynamic` (the full-precision cache in the model's dtype);
- **fidelity against `dynamic`**: whether the answer's tokens are identical, the common prefix in tokens,
  and, over every position of `dynamic`'s answers with both distributions teacher-forced on them
  (`QASession.score`, so that the figures measure the cache and not a text that has already diverged), the
  KL divergence KL(P_dynamic || P_spec) in nats per token (mean, median, 99th percentile, maximum), the share
  of positions whose most likely token is `dynamic`'s and |Δ log p| of `dynamic`'s token (`fidelity.KLStats`,
  named as llama.cpp's `--kl-divergence` report names them);
- **perplexity through the cache** (with `perplexity_tokens`): the context prefilled into a fresh cache and the
  text after it fed one decode step per token (`fidelity.perplexity`), and its ratio to `dynamic`'s;
- **where the error sits**: after the prefill, per layer and KV head, the relative error of the de-quantized
  keys and values against `dynamic`'s full-precision ones (`cache_error.kv_error`); and the **drift**: the
  context's error after each flush (while `dynamic`'s answers are scored, and during the perplexity feed)
  against its error after the prefill (`cache_error.drift_ratio`);
- **fidelity against gold answers** (the SQuAD case files): exact match, containment and token F1 after
  SQuAD's normalisation, and the unanswerable rule of `score_against_gold` (all in `kvdemo.evals.metrics`);
- **speed**: prefill seconds, decode tokens/s (median over the answers), and the time spent in decode
  steps during which a layer flushed;
- **restore**: every answer's `cache_length_after`, which must equal the context's tokens.

Unanswerable questions (SQuAD 2.0 `is_impossible`, given as an empty gold list): an answer counts as right
only when it says that the text does not give the answer (`metrics.says_unanswerable`: one of
`ABSTENTION_PHRASES` in the normalised answer); for an answerable question such an answer scores 0.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvdemo import checks
from kvdemo.cache.registry import BASELINE
from kvdemo.cache.spec import CacheSpec
from kvdemo.compare.measure import ComparisonRun, Reference, measure_spec, perplexity_units
from kvdemo.compare.records import ComparisonCancelled, ComparisonReport, SpecResult
from kvdemo.evals import fidelity, plan_budget, planner
from kvdemo.qa.job import JobCancelled, JobRun, ProgressCallback
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PreparedContext


def compare(
    loaded_model: LoadedModel,
    context: str | PreparedContext,
    questions: Sequence[str],
    specs: Sequence[CacheSpec],
    max_new_tokens: int = 32,
    gold_answers: Sequence[Sequence[str]] | None = None,
    cancel: threading.Event | None = None,
    on_progress: ProgressCallback | None = None,
    kv_budget_bytes: int | None = None,
    perplexity_tokens: int = 0,
    continuation: str | None = None,
    plans: Sequence[tuple[CacheSpec, float]] = (),
) -> ComparisonReport:
    """Prefill `context` and answer `questions` once per spec, one backend at a time (each session and cache
    is freed before the next), `dynamic` first and always included; duplicates are run once.

    Work: per spec one prefill, one generation and one teacher-forced scoring per question (about twice the
    decode steps of answering alone); with `perplexity_tokens` N, one more prefill and N decode steps. `dynamic`'s
    full-precision keys and values after the prefill are kept for the whole comparison (the reference of the
    cache error and the drift: as many bytes as `dynamic`'s cache).

    Args:
        loaded_model: from `kvdemo.load_model`.
        context: the text, or a `PreparedContext` of it (`QASession.prepare`: a server that counted its tokens
            for a reservation hands it down); tokenized once for every spec. questions: asked in turn on it.
        specs: the specs to compare (validated against the model before anything runs).
        max_new_tokens: per answer (tokens).
        gold_answers: per question, the accepted answers; an empty list marks a question the text does not
            answer (see `score_against_gold`). None: no gold figures.
        cancel: set it (from another thread) to stop at the next decode step.
        on_progress: `ProgressCallback`, called as work units finish (a prefill, an answer, a score,
            `PERPLEXITY_STEPS_PER_UNIT` perplexity steps).
        kv_budget_bytes: each session's out-of-memory guard (`QASession`); None: no limit.
        perplexity_tokens: N > 0 measures the perplexity of N tokens of text read through each cache
            (`fidelity.perplexity`); 0: none.
        continuation: the text after the context (e.g. `Case.continuation`); None: the last N + 1 tokens of the
            context are held out of the perplexity's prefill and fed instead (`fidelity.perplexity_inputs`).
        plans: each (base spec, bytes per context token at the context's length, the layers the spec keeps at full
            precision included): a per-layer plan chosen for this context within the budget
            (`planner.plan_layers`) is compared, beside the best uniform spec within it; the report's `plans`.

    Returns:
        The `ComparisonReport`.

    Raises:
        ValueError: no question, an empty one, gold answers not one list per question, max_new_tokens < 1,
            perplexity_tokens < 0, a continuation too short for perplexity_tokens, a spec the model cannot run, or a
            plan's base that takes no plan or budget below its backend's smallest cache (nothing has run then); or
            a context or question the session refuses (its message; a question too long for the window is found
            when its turn comes).
        ImportError: a spec's backend package is missing.
        ComparisonCancelled: `cancel` was set; its `report` holds the specs finished before.

    Example:
        >>> case = load_case(example_path("normans")).select("0-11")
        >>> report = compare(loaded, case.context, [q.question for q in case.answerable(10)],
        ...                  [CacheSpec("hqq", nbits=4)], perplexity_tokens=256, continuation=case.continuation)
        >>> report.to_frame()
    """
    questions, ordered, max_new_tokens = _checked(loaded_model, questions, specs, max_new_tokens, gold_answers)
    _check_perplexity_tokens(perplexity_tokens)
    if not isinstance(context, PreparedContext):  # the one tokenization of the context for every spec
        context = loaded_model.prepare(context)
    inputs = None
    if perplexity_tokens:
        inputs = fidelity.perplexity_inputs(loaded_model, context, perplexity_tokens, continuation)
    tokens = len(context.ids)  # the plans' budgets are per context token at the context's own length
    plans = [(plan_budget.check_budget(loaded_model, base, budget, tokens), budget) for base, budget in plans]
    per_spec = 1 + 2 * len(questions) + perplexity_units(perplexity_tokens)
    progress = JobRun((len(ordered) + 2 * len(plans)) * per_spec + len(plans), cancel, on_progress)
    summaries = _plan_all(loaded_model, context, plans, ordered, progress, cancel, max_new_tokens)
    progress.total = len(ordered) * per_spec + len(plans)
    shared = (loaded_model, context, tuple(questions), max_new_tokens, gold_answers, progress)
    run = ComparisonRun(*shared, kv_budget_bytes=kv_budget_bytes, perplexity_inputs=inputs)
    return _measure_all(run, ordered, progress, summaries)


def _check_perplexity_tokens(perplexity_tokens: int) -> None:
    """Raises ValueError unless `perplexity_tokens` is a whole number >= 0."""
    if isinstance(perplexity_tokens, bool) or not isinstance(perplexity_tokens, int) or perplexity_tokens < 0:
        raise ValueError(f"perplexity_tokens={perplexity_tokens!r} must be a whole number >= 0 (0: no perplexity)")


def _plan_all(
    loaded_model: LoadedModel,
    context: PreparedContext,
    plans: Sequence[tuple[CacheSpec, float]],
    ordered: list[CacheSpec],
    progress: JobRun,
    cancel: threading.Event | None,
    max_new_tokens: int,
) -> tuple[str, ...]:
    """Choose each plan on the context (`planner.plan_layers`) and add it to `ordered`, with the best uniform spec
    within its budget (each spec once). Returns the plans' summary lines.

    Raises:
        ComparisonCancelled: `cancel` was set before a plan (an empty report: nothing was measured yet)."""
    summaries = []
    for base, budget in plans:
        progress.note(f"planning {base.backend} per layer at {budget:,.0f} bytes per token")
        if cancel is not None and cancel.is_set():
            raise ComparisonCancelled(ComparisonReport(loaded_model.name, max_new_tokens, ()))
        plan = planner.plan_layers(loaded_model, loaded_model.context_ids(context), base, budget)
        progress.step("planned")
        summaries.append(plan.summary())
        added = [spec.validate(loaded_model.config) for spec in (plan.spec, plan.uniform) if spec is not None]
        ordered += [spec for spec in added if spec.label not in [s.label for s in ordered]]
    return tuple(summaries)


def _measure_all(
    run: ComparisonRun, ordered: list[CacheSpec], progress: JobRun, plans: tuple[str, ...] = ()
) -> ComparisonReport:
    """`measure_spec` for every spec in turn, `dynamic`'s run (the first) the reference of the others; `plans`: the
    plans' lines for the report."""
    results: list[SpecResult] = []
    reference: Reference | None = None
    source = None if run.perplexity_inputs is None else run.perplexity_inputs.source
    name = run.loaded_model.name
    for spec in ordered:
        progress.note(f"{spec.text}: prefilling")
        try:  # each spec's session and cache are freed by reference counting when it returns (tests/test_compare.py)
            result, own = measure_spec(run, spec, reference, results[0].kv_bytes if results else None)
        except JobCancelled:
            raise ComparisonCancelled(
                ComparisonReport(name, run.max_new_tokens, tuple(results), source, plans)
            ) from None
        if reference is None:
            reference = own
        results.append(result)
    return ComparisonReport(name, run.max_new_tokens, tuple(results), source, plans)


def _checked(
    loaded_model: LoadedModel,
    questions: Sequence[str],
    specs: Sequence[CacheSpec],
    max_new_tokens: int,
    gold_answers: Sequence[Sequence[str]] | None,
) -> tuple[list[str], list[CacheSpec], int]:
    """`compare`'s questions, specs (`dynamic` first, each once, validated) and max_new_tokens, checked before
    minutes of work (see `compare` for the errors)."""
    questions = list(questions)
    if not questions:
        raise ValueError("compare needs at least one question")
    if gold_answers is not None and len(gold_answers) != len(questions):
        raise ValueError(f"gold_answers has {len(gold_answers)} entries for {len(questions)} questions")
    ordered: list[CacheSpec] = []
    for spec in [CacheSpec(BASELINE), *specs]:
        spec = spec.validate(loaded_model.config)
        if spec.label not in [s.label for s in ordered]:
            ordered.append(spec)
    for i, question in enumerate(questions):  # refuse bad input before minutes of work
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question {i + 1} is empty; give the text of every question")
    return questions, ordered, checks.max_new_tokens(max_new_tokens)
