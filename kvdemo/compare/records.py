"""What a comparison returns: one `QuestionResult` per answer, one `SpecResult` per spec, and the
`ComparisonReport` with its table (`to_frame`), JSON and CSV; `ComparisonCancelled` carries the specs finished
before a Cancel. See `kvdemo.compare.run` for how each figure is measured."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, cast

import pandas as pd

from kvdemo.cache.options import SpecOptions
from kvdemo.cache.registry import BACKENDS, BASELINE, SPEC_OPTIONS
from kvdemo.evals.cache_error import KVError
from kvdemo.evals.fidelity import KLStats, PerplexityResult
from kvdemo.qa.records import Cancelled


@dataclass(frozen=True)
class Departure:
    """Where a spec's greedy answer first leaves `dynamic`'s: the position, both tokens, and each token's
    log-probability under both caches. The two answers share every token before `position`, so the distribution
    `dynamic`'s answer is teacher-forced through at `position` is the one the spec's greedy step chose from.

    Attributes:
        position: the index of the first differing answer token (= `QuestionResult.common_prefix_tokens`).
        dynamic_token, spec_token: each answer's token there (the text of that token alone); None where that
            answer had already ended (an end-of-turn token, or max_new_tokens).
        dynamic_logprobs: (log P(dynamic_token), log P(spec_token)) under `dynamic`'s cache (nats; None for a
            token that is None).
        spec_logprobs: the same two under the spec's cache (nats).
    """

    position: int
    dynamic_token: str | None
    spec_token: str | None
    dynamic_logprobs: tuple[float | None, float | None]
    spec_logprobs: tuple[float | None, float | None]

    def describe(self, spec_text: str) -> str:
        """One line for a reader, "here" being the spec's cache (`spec_text` is not repeated), e.g. `token 4:
        ' Parliament' (log p -0.91 here, -2.30 under dynamic) where dynamic has ' Melbourne' (-0.42 under dynamic,
        -1.20 here)`."""

        def shown(token: str | None) -> str:
            return "the end" if token is None else repr(token)

        def nats(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        return (
            f"token {self.position + 1}: {shown(self.spec_token)} (log p {nats(self.spec_logprobs[1])} here, "
            f"{nats(self.dynamic_logprobs[1])} under dynamic) where dynamic has {shown(self.dynamic_token)} "
            f"({nats(self.dynamic_logprobs[0])} under dynamic, {nats(self.spec_logprobs[0])} here)"
        )


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
        context_errors: `cache_error.context_error` of the context's tokens after each flush while `dynamic`'s
            answer was scored (teacher-forced, so every spec flushes at the same steps); empty without flushes.
        departure: where the answer first leaves `dynamic`'s (`Departure`); None when they are identical.
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
    context_errors: tuple[float, ...] = ()
    departure: Departure | None = None


@dataclass(frozen=True)
class SpecResult:
    """One spec's figures and answers.

    Read a result by its fields (`backend`, `nbits`, `options`), never by cutting the label apart.

    Attributes:
        spec: `CacheSpec.label` (every option resolved); `spec_text` is `CacheSpec.text` (the options set only:
            short, and unique within a report).
        backend: the backend; nbits: its bits per value (None for `dynamic` and `fp8`); options: every option the
            backend takes, defaults filled in (`CacheSpec.resolved`).
        kv_bytes, quantized_bytes, residual_bytes: the cache after the prefill (bytes, `kv_memory`).
        kept_bytes: of kv_bytes, what a quantized backend keeps at full precision on a model of several layer kinds
            (sliding windows, conv and recurrent states: `MemoryReport.kept_bytes`); 0 where it quantizes every layer,
            and for `dynamic`.
        bytes_per_token: kv_bytes / context_tokens.
        ratio_to_dynamic: kv_bytes / `dynamic`'s kv_bytes (the cache in the model's dtype).
        prefill_seconds: the prefill's wall time.
        tokens_per_second: median over the answers of `Answer.tokens_per_second` (generated tokens over the
            answer's wall time, the question's own forward pass included).
        flushes: flushes summed over layers and answers, those of the question's own pass included;
            flush_seconds: summed `QuestionResult.flush_seconds` (decode steps after the question's pass).
        restored: every answer's cache_length_after equals context_tokens.
        kl: `fidelity.KLStats` over every position of `dynamic`'s answers (zeros and 100 % for `dynamic`).
        kv_error: `cache_error.KVError` of the cache after the prefill against `dynamic`'s full-precision keys and
            values ([layers][kv_heads]; zeros for `dynamic`).
        drift, drift_flushes: `cache_error.drift_ratio` over the scored answers' and the perplexity feed's flushes:
            the context's error after the last flush of the longest run / after the prefill, and that run's flushes
            (None and 0 without flushes).
        perplexity: `fidelity.PerplexityResult` with its ratio to `dynamic`'s (None without `perplexity_tokens`).
        deploy: the lines of the engines that store this cache the same way on the model (`CacheSpec.deployments`),
            kvdemo's own last.
    """

    spec: str
    spec_text: str
    backend: str
    nbits: int | None
    options: SpecOptions
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
    kl: KLStats
    kv_error: KVError
    drift: float | None
    drift_flushes: int
    perplexity: PerplexityResult | None = None
    kept_bytes: int = 0
    deploy: tuple[str, ...] = ()

    @property
    def deploy_cell(self) -> str:
        """The engines' lines for a table cell, joined by ` · ` (`vLLM: --kv-cache-dtype nvfp4 · SGLang: ...`), each
        without its shell comment (`deploy` keeps it); `every engine's default cache` for the full-precision baseline,
        `kvdemo only` where no engine stores this cache the same way."""
        engines = [line.split("  #")[0] for line in self.deploy if not line.startswith("kvdemo:")]
        if self.backend == BASELINE and len(engines) > 1:
            return "every engine's default cache"
        return " · ".join(engines) if engines else "kvdemo only"


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


def _none_to_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def json_ready(value: Any, nan: Any = "nan") -> Any:
    """`value` (dicts, lists, tuples, numbers, text) with every non-finite float written out, so that strict JSON
    carries it and no reader turns it into null without a word: +inf as `"inf"` (a KL divergence where the cache
    gives a token zero probability that `dynamic` does not, `kvdemo.evals.metrics.kl_divergence`), -inf as
    `"-inf"`, and NaN as `nan` (default `"nan"`; a table's missing figure, NaN in its frame, passes `nan=None`).
    Python's `json` would write `Infinity`, which JSON.parse refuses; pandas' `to_json` writes null."""
    if isinstance(value, dict):
        return {k: json_ready(v, nan) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v, nan) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return nan if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


@dataclass(frozen=True)
class ComparisonReport:
    """Every spec's `SpecResult`, `dynamic` first.

    Attributes:
        model: the model's name; max_new_tokens: the answers' limit (tokens).
        perplexity_source: where the perplexity's text came from (`PerplexityInputs.source`: `continuation` or
            `tail`), None without a perplexity run.
        plans: one line per per-layer plan chosen for the comparison (`kvdemo.evals.planner.LayerPlan.summary`:
            the plan, its bytes against the budget, its summed attention error against the best uniform spec's).
    """

    model: str
    max_new_tokens: int
    results: tuple[SpecResult, ...]
    perplexity_source: str | None = None
    plans: tuple[str, ...] = ()

    COLUMNS = (
        "spec",
        "spec text",
        "deploy",
        "backend",
        *SPEC_OPTIONS,  # nbits first, then the other options in the registry's order
        "KV bytes",
        "kept bytes",
        "bytes/token",
        "ratio to dynamic",
        "identical to dynamic",
        "common prefix (tokens)",
        "KL (nats)",
        "median KLD",
        "99.0% KLD",
        "99.9% KLD",
        "max KLD",
        "same top p (%)",
        "RMS Δp (%)",
        "mean |Δ log p|",
        "99.0% |Δ log p|",
        "positions",
        "PPL",
        "PPL ratio to dynamic",
        "perplexity tokens",
        "K error",
        "V error",
        "KV error",
        "drift (×)",
        "drift flushes",
        "exact match",
        "contains gold",
        "F1",
        "prefill s",
        "tokens/s",
        "flushes",
        "flush s",
        "restored",
    )
    """The full frame's columns, grouped: the spec and its options; memory; fidelity against `dynamic` (answers,
    distribution statistics, perplexity, cache error and drift); fidelity against the gold answers; speed."""

    def to_frame(self) -> pd.DataFrame:
        """The full table: one row per spec, `COLUMNS` (also when there is none).

        Columns: `spec` (label), `spec text`, `deploy` (`SpecResult.deploy_cell`), `backend`, `nbits` and the other
        options of `SPEC_OPTIONS` (the flush policy and `dynamic`'s storage included; empty where the backend does not
        take it);
        `KV bytes`, `bytes/token`, `ratio to dynamic`; `identical to dynamic` (share of answers), `common prefix
        (tokens)` (mean); `KL (nats)` (the mean KL per position, llama.cpp's "Mean KLD"), `median KLD`, `99.0% KLD`,
        `99.9% KLD`, `max KLD` (nats/token), `same top p (%)`, `RMS Δp (%)` (llama.cpp's), `mean |Δ log p|`,
        `99.0% |Δ log p|` (nats), `positions` (pooled answer tokens); `PPL`, `PPL ratio to dynamic`, `perplexity
        tokens` (NaN without a perplexity run); `K error`,
        `V error`, `KV error` (relative, after the prefill, all layers and heads); `drift (×)`, `drift flushes` (NaN
        and 0 without flushes); `exact match`, `contains gold`, `F1` (means; NaN without gold answers); `prefill s`,
        `tokens/s`, `flushes`, `flush s`, `restored`. `kvdemo.charts.reports.comparison_display_frame` makes the short
        table a reader sees from it.
        """
        rows = []
        for r in self.results:
            qs = r.questions
            gold = [q for q in qs if q.f1 is not None]
            ppl = r.perplexity
            rows.append(
                {
                    "spec": r.spec,
                    "spec text": r.spec_text,
                    "deploy": r.deploy_cell,
                    "backend": r.backend,
                    "nbits": r.nbits,
                    **{name: r.options.get(name) for name in SPEC_OPTIONS if name != "nbits"},
                    "KV bytes": r.kv_bytes,
                    "kept bytes": r.kept_bytes or None,  # no column where nothing is kept
                    "bytes/token": round(r.bytes_per_token, 1),
                    "ratio to dynamic": round(r.ratio_to_dynamic, 4),
                    "identical to dynamic": _mean([float(q.identical_to_dynamic) for q in qs]),
                    "common prefix (tokens)": _mean([q.common_prefix_tokens for q in qs]),
                    "KL (nats)": r.kl.mean_kld,
                    "median KLD": r.kl.median_kld,
                    "99.0% KLD": r.kl.p99_kld,
                    "99.9% KLD": r.kl.p999_kld,
                    "max KLD": r.kl.max_kld,
                    "same top p (%)": r.kl.same_top_p,
                    "RMS Δp (%)": r.kl.rms_dp,
                    "mean |Δ log p|": r.kl.mean_abs_dlogp,
                    "99.0% |Δ log p|": r.kl.p99_abs_dlogp,
                    "positions": r.kl.positions,
                    "PPL": float("nan") if ppl is None else ppl.perplexity,
                    "PPL ratio to dynamic": float("nan") if ppl is None else _none_to_nan(ppl.ratio_to_dynamic),
                    "perplexity tokens": 0 if ppl is None else ppl.tokens,
                    "K error": r.kv_error.keys_total,
                    "V error": r.kv_error.values_total,
                    "KV error": r.kv_error.total,
                    "drift (×)": _none_to_nan(r.drift),
                    "drift flushes": r.drift_flushes,
                    # `gold`: the answers scored against gold answers, whose three scores are set together
                    "exact match": _mean([cast(float, q.exact_match) for q in gold]),
                    "contains gold": _mean([cast(float, q.contains_gold) for q in gold]),
                    "F1": _mean([cast(float, q.f1) for q in gold]),
                    "prefill s": round(r.prefill_seconds, 2),
                    "tokens/s": round(r.tokens_per_second, 2),
                    "flushes": r.flushes,
                    "flush s": round(r.flush_seconds, 2),
                    "restored": r.restored,
                }
            )
        frame = pd.DataFrame(rows, columns=list(self.COLUMNS))
        options = {name: opt for backend in BACKENDS.values() for name, opt in backend.options.items()}
        integers = [name for name in SPEC_OPTIONS if not options[name].is_text]  # the registry's integer options
        return frame.astype({name: "Int64" for name in integers})

    ANSWER_COLUMNS = ("question", "spec", "answer", "finish", "first departure from dynamic")

    def answers_frame(self) -> pd.DataFrame:
        """The answers side by side: one row per question and spec (`ANSWER_COLUMNS`, also when there is none),
        question by question, each spec's right after `dynamic`'s: the answer, its `finish_reason`, and where it
        first departs from `dynamic`'s (`Departure.describe`; `identical` when it does not)."""
        rows = [
            {
                "question": q.question,
                "spec": r.spec_text,
                "answer": q.answer,
                "finish": q.finish_reason,
                "first departure from dynamic": (
                    "(the reference)"
                    if r is self.results[0]
                    else "identical"
                    if q.departure is None
                    else q.departure.describe(r.spec_text)
                ),
            }
            for i in range(len(self.results[0].questions) if self.results else 0)
            for r in self.results
            for q in r.questions[i : i + 1]
        ]
        return pd.DataFrame(rows, columns=list(self.ANSWER_COLUMNS))

    def to_dict(self) -> dict:
        """JSON-ready: model, max_new_tokens, perplexity_source, the plans' lines and every result with its answers
        and fidelity records (`SpecResult`'s fields; a missing figure is None, an infinite one `"inf"`: `json_ready`).
        `python -m kvdemo compare --json` prints exactly this (`to_json`)."""
        return {
            "model": self.model,
            "max_new_tokens": self.max_new_tokens,
            "perplexity_source": self.perplexity_source,
            "plans": list(self.plans),
            "results": json_ready([asdict(r) for r in self.results]),
        }

    def to_json(self) -> str:
        """`to_dict()` as the text `python -m kvdemo compare --json` prints (indented, UTF-8 kept)."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False, allow_nan=False)

    def to_csv(self) -> str:
        """The full table (`to_frame()`) as CSV text, one header line, no index; the answers are in `to_json`."""
        return self.to_frame().to_csv(index=False)


class ComparisonCancelled(Cancelled):
    """Raised by `compare` when its `cancel` event is set; `report` (`partial`) holds the specs finished before."""

    def __init__(self, report: ComparisonReport):
        super().__init__(f"comparison cancelled after {len(report.results)} spec(s)", report)

    @property
    def report(self) -> ComparisonReport:
        """The specs finished before the cancel."""
        return cast("ComparisonReport", self.partial)
