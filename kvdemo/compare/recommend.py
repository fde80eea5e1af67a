"""Which KV setting for this model on this text (`recommend`): every candidate the registry gives for an engine
(`kvdemo.compare.candidates`) measured against `dynamic` on the user's own text, and the one that fits a target.

How, in one prefill: the text is prefilled once into `dynamic`, which answers every question greedily. Each candidate
then takes that prefill's full-precision keys and values (`QASession.prefill_from`: the cache a prefill of its own
gives, tensor for tensor, without the forward passes), and is scored teacher-forced on `dynamic`'s answers
(`QASession.score`: the same decode steps, flushes included), one answer token at a time. A `ggml` candidate, whose
prefill attends through its own blocks as llama.cpp's does (`Backend.prefill_reads_cache`), prefills on its own:
once, when it is measured.

**The search cannot miss a setting that fits.** With a KL ceiling the pick is the candidate with the fewest bytes
whose mean KL over every answer token is within it; candidates are measured by bytes, fewest first, so every one
with fewer bytes than the pick was measured over the ceiling before the pick is taken. A candidate is left for one
of three reasons only, each sound for the full measurement:
- *over the ceiling on a bound*: its KL summed over the tokens scored so far passes the ceiling times every answer
  token; each token's KL is >= 0, so the full mean is over the ceiling whatever the rest add (`BOUND`). A bad
  candidate is out after a token or two, and no row is ever left on another candidate's figure;
- *not fewer bytes than the pick* (or than `dynamic`): it cannot be the setting with the fewest bytes;
- *refused by the model* (`kvdemo.qa.probe.check_model`): it cannot be served right.
"Keep dynamic" therefore means that every candidate with fewer bytes than `dynamic` was measured over the ceiling or
refused. With a byte budget the candidates within it are measured by bytes, most first, each until it is shown worse
than the best mean so far (the same bound) or measured in full; the pick has the lowest mean KL.

**Near the decision** the pick and the next smaller setting are measured on every question (each one's KL is kept),
and the pick on the text's last `HELD_OUT_TOKENS` tokens too (held out of the context, fed after it: their KL and
perplexity against `dynamic`'s), so the record says how the pick holds on text it did not answer. With a KL ceiling
a per-layer plan between the pick and the next smaller one is measured too (`kvdemo.evals.planner`) and wins only
with fewer bytes within the ceiling.

Bytes per token come from the registry's formulas (every token stored, no residual), at the context's length and at
`LENGTHS` (a sliding window's bytes stop growing). A recommendation holds for this model, this text and these
questions (docs/recommend.md says how far it carried to other texts).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Sequence

import torch

from kvdemo import checks
from kvdemo.cache.deploy import ENGINES
from kvdemo.cache.layer_plan import PLAN
from kvdemo.cache.layers.attention import recording_queries
from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec, estimate_kv_bytes
from kvdemo.compare.candidates import ANY_ENGINE, candidate_specs, has_windows
from kvdemo.compare.recommendation import (
    BOUND,
    FULL,
    Recommendation,
    RecommendationCancelled,
    RecommendRow,
    TokenIds,
)
from kvdemo.compare.weights import read_weights
from kvdemo.evals import planner
from kvdemo.evals.cache_error import full_precision_kv
from kvdemo.evals.fidelity import kl_statistics
from kvdemo.evals.metrics import kl_divergence
from kvdemo.qa.job import ProgressCallback
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.session import QASession

DEFAULT_MAX_KL = 0.02
"""The default ceiling on the mean KL to `dynamic` (nats/token). llama.cpp's KL reports rate weight quantizations by
the same figure: Q8_0 about 0.001, Q4_K_M about 0.02-0.03, where answers keep their sense; measured here
(docs/recommend.md), specs at 0.02 keep 92-97 % of `dynamic`'s top tokens and the embedded model's answers, while
quanto:4 on Gemma 3 270M (mean KL 0.09, 82 % same top) already turns its first answer wrong."""

HELD_OUT_TOKENS = 32
"""Tokens of the text's end held out of the context and scored for the perplexity (fewer on a short text)."""
MIN_CONTEXT_TOKENS = 64
"""The fewest text tokens a recommendation takes (fewer say nothing of a long context)."""
LENGTHS = (8192, 32768)
"""The other context lengths each row's bytes per token are given at."""
MAX_NEW_TOKENS = 24
"""Tokens per `dynamic` answer that every candidate is scored on, by default (`recommend`'s `answer_tokens`)."""

MAX_ANSWER_TOKENS = 256
"""The most `answer_tokens` a recommendation takes (every candidate decodes that many per question)."""


def text_questions(text: str, count: int = 3) -> list[str]:
    """Questions taken from the text when none are given: a sentence at each of `count` depths (10 % to 90 %), asked
    for by its opening words, so each answer reads the context where that sentence sits (the Needle tab's idea:
    retrieval at several depths, here of the text's own sentences).

    Raises:
        ValueError: the text has no sentence of at least 6 words."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if len(s.split()) >= 6]
    if not sentences:
        raise ValueError("the text has no sentence of 6 words or more to ask about; give questions")
    depths = [0.1 + 0.8 * i / max(count - 1, 1) for i in range(count)]
    picked = dict.fromkeys(sentences[min(int(d * len(sentences)), len(sentences) - 1)] for d in depths)
    return [f'What does the text say right after "{" ".join(s.split()[:5])}"?' for s in picked]


def check_target(max_kl: float | None, bytes_per_token: float | None) -> tuple[str, float]:
    """The target: (`max_kl`, ceiling) or (`bytes_per_token`, budget); neither given: the default ceiling.

    Raises:
        ValueError: both given, or a value <= 0, not a finite number."""
    if max_kl is not None and bytes_per_token is not None:
        raise ValueError("give a KL ceiling or a byte budget per token, not both")
    name, value = ("bytes_per_token", bytes_per_token) if bytes_per_token is not None else ("max_kl", max_kl)
    value = DEFAULT_MAX_KL if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        what = "a mean-KL ceiling in nats per token, e.g. 0.02" if name == "max_kl" else "bytes per context token"
        raise ValueError(f"{name}={value!r} must be a number > 0: {what}")
    return name, float(value)


def recommend(
    loaded_model: LoadedModel,
    text: str,
    questions: Sequence[str] = (),
    *,
    max_kl: float | None = None,
    bytes_per_token: float | None = None,
    engine: str = ANY_ENGINE,
    plans: bool = True,
    cancel: threading.Event | None = None,
    on_progress: ProgressCallback | None = None,
    answer_tokens: int = MAX_NEW_TOKENS,
) -> Recommendation:
    """Measure the candidates on `text` and pick the setting for `loaded_model` (see the module's docstring).

    Args:
        text: the context. questions: asked on it; none: `text_questions`.
        max_kl: the ceiling on the mean KL to `dynamic` (nats/token); bytes_per_token: a budget per context token
            instead (at the context's length). Neither: `DEFAULT_MAX_KL`.
        engine: `any`, or one of `ENGINES`: only the specs that engine stores the same way.
        plans: also measure a per-layer plan (kvdemo only; one more prefill-sized pass).
        cancel: set it to stop at the next decode step; `RecommendationCancelled` then holds what was measured.
        on_progress: `on_progress(done, total, what)`.
        answer_tokens: the tokens of each of `dynamic`'s answers every candidate is scored on, 1 to
            `MAX_ANSWER_TOKENS`: fewer is faster and says less (a notebook's quick run), more says more.

    Raises:
        ValueError: before any work: a bad target or `answer_tokens`, an unknown engine, an engine that deploys
            nothing quantized on this model, a budget below the smallest candidate's bytes, an empty text or
            question, a text under `MIN_CONTEXT_TOKENS` tokens (each message says what would work).
        RecommendationCancelled: `cancel` was set.

    Example:
        >>> found = recommend(loaded, open("article.txt").read(), max_kl=0.02)
        >>> found.pick, found.why, found.picked.deploy
    """
    target, limit = check_target(max_kl, bytes_per_token)
    answer_tokens = checks.max_new_tokens(answer_tokens, MAX_ANSWER_TOKENS, "a recommendation", name="answer_tokens")
    return _Run(loaded_model, text, questions, target, limit, engine, plans, cancel, on_progress, answer_tokens).run()


class _Run:
    """One recommendation's state: the checks, the reference, the search and the pick."""

    def __init__(self, loaded, text, questions, target, limit, engine, plans, cancel, on_progress, answer_tokens):
        self.loaded, self.target, self.limit, self.engine = loaded, target, limit, engine
        self.answer_tokens = answer_tokens
        self.cancel, self.on_progress, self.start, self.done = cancel, on_progress, time.perf_counter(), 0
        self.weights = read_weights(loaded)  # before anything runs: an outlier layer adds protected candidates
        self.specs = candidate_specs(loaded.config, engine, self.weights.protect)  # raises on an unknown engine
        if len(self.specs) < 2:
            works = [e for e in (ANY_ENGINE, *ENGINES) if len(candidate_specs(loaded.config, e)) > 1]
            others = ", ".join(e for e in works if e != engine)
            raise ValueError(
                f"kvdemo stores none of {engine}'s quantized cache formats for this model, so it cannot measure what "
                f"{engine} would do; choose --engine among {others}"
            )
        self.context, self.tail = self._split(text)
        self.questions = [str(q).strip() for q in questions] or text_questions(self.context)
        if not all(self.questions):
            raise ValueError("a question is empty; give the text of every question, or none to take them from the text")
        self.prepared = loaded.prepare(self.context)  # tokenized once: the bytes and the reference's prefill
        self.tokens = len(self.prepared.ids)
        self.bytes = {s.label: self._bytes(s) for s in self.specs}
        if target == "bytes_per_token" and limit < (least := min(b[0] for b in self.bytes.values())):
            raise ValueError(
                f"no candidate fits {limit:,.0f} bytes per token at {self.tokens:,} tokens: the smallest takes "
                f"{least:,.0f}; give at least that, or a KL ceiling instead"
            )
        self.plans = plans and engine in (ANY_ENGINE, "kvdemo")
        self.rows: dict[str, RecommendRow] = {}
        self.answers: list[tuple[str, list[int]]] = []  # each question and `dynamic`'s answer ids, once answered
        self.positions = 0  # the answer tokens every candidate is scored on
        self.plan_line = ""
        self.total = 3 + 2 * len(self.questions) + len(self.specs) + 2

    def _split(self, text: str) -> tuple[str, list[int]]:
        """The context (the text less its held-out end) and the held-out token ids (none on a short text)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the text is empty; paste or upload the text the model will read")
        ids = self.loaded.text_ids(text)
        if len(ids) < MIN_CONTEXT_TOKENS:
            raise ValueError(f"the text holds {len(ids)} tokens; a recommendation needs {MIN_CONTEXT_TOKENS} or more")
        held = min(HELD_OUT_TOKENS + 1, len(ids) - MIN_CONTEXT_TOKENS)
        if held < 2:
            return text, []
        return self.loaded.tokenizer.decode(ids[:-held]), ids[-held:]

    def _bytes(self, spec: CacheSpec) -> tuple[float, ...]:
        lengths = (self.tokens, *LENGTHS)
        return tuple(estimate_kv_bytes(spec, self.loaded.config, n, self.loaded.dtype) / n for n in lengths)

    # ---- progress, stop and the record -------------------------------------------------------------------------
    def step(self, what: str, units: int = 1) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise RecommendationCancelled(self.record(finished=False))
        self.done += units
        if self.on_progress is not None:
            self.on_progress(min(self.done, self.total), self.total, what)

    def record(self, finished: bool = True, pick: str = "", why: str = "") -> Recommendation:
        return Recommendation(
            self.loaded.name, self.tokens, self.target, self.limit, self.engine, tuple(self.questions), LENGTHS,
            tuple(self.rows.values()), pick, why, self.plan_line, max(len(self.tail) - 1, 0),
            time.perf_counter() - self.start, finished, weights=self.weights.summary(), token_ids=self._token_ids(),
        )  # fmt: skip

    def _token_ids(self) -> TokenIds | None:
        """The ids scored, once `dynamic` has answered (None before)."""
        if not self.positions:
            return None
        return TokenIds(
            tuple(self.prepared.split.prefix),
            tuple(tuple(self.reference.question_ids(q)) for q, _ in self.answers),
            tuple(tuple(ids) for _, ids in self.answers),
        )

    def row(self, spec: CacheSpec, **figures) -> RecommendRow:
        label = spec.label
        old = self.rows.get(label) or RecommendRow(
            spec.short_text, spec.backend, self.bytes.get(label) or self._bytes(spec),
            deploy=tuple(d.line for d in spec.deployments(self.loaded.config)),
        )  # fmt: skip
        self.rows[label] = new = RecommendRow(**{**old.__dict__, **figures})
        return new

    # ---- the run -----------------------------------------------------------------------------------------------
    def run(self) -> Recommendation:
        self.step("prefilling dynamic (the reference)", 0)
        self.reference = QASession(self.loaded)
        chunk = lambda done, total: self.step(f"prefilling dynamic (the reference): {done:,} of {total:,} tokens", 0)  # noqa: E731
        with recording_queries(planner.QUERY_TOKENS) as self.queries:  # what a per-layer plan measures with
            self.reference.prefill(self.prepared, max_new_tokens=self.answer_tokens, on_progress=chunk)
        self.step("answering with dynamic")
        self.logprobs: list[torch.Tensor] = []
        for question in self.questions:
            rows: list[torch.Tensor] = []  # `score` of the answer, from the answer's own decode steps
            answer = self.reference.ask(question, self.answer_tokens, logprobs=rows)
            self.step(f"dynamic answered {len(self.answers) + 1} of {len(self.questions)}", 2)
            if answer.token_ids:
                self.answers.append((question, list(answer.token_ids)))
                self.logprobs.append(torch.stack(rows))
        if not self.answers:
            raise ValueError("dynamic answered none of the questions with a token; give other questions")
        self.positions = sum(len(ids) for _, ids in self.answers)
        self.tail_rows = self.reference.score_text(self.tail) if len(self.tail) >= 2 else None
        dynamic = self.specs[0]
        self.row(dynamic, mean_kl=0.0, positions=self.positions, same_top_p=100.0, p99_kl=0.0, p999_kl=0.0,
                 rms_dp=0.0, question_kl=(0.0,) * len(self.answers), held_out_kl=0.0 if self.tail_rows is not None
                 else None, perplexity_ratio=1.0 if self.tail_rows is not None else None, measured=FULL)  # fmt: skip
        pick = self._search_kl() if self.target == "max_kl" else self._search_budget()
        self.done = self.total  # the estimate counted every candidate the search may have left unmeasured
        self.step(f"picked {pick.spec}", 0)
        return self.record(pick=pick.spec, why=self._why(pick))

    def _session(self, spec: CacheSpec) -> QASession | None:
        """A session of `spec` prefilled from the reference, or None (the row notes why) where the model refuses it."""
        try:
            session = QASession(self.loaded, spec)
        except (ValueError, ImportError) as error:
            self.row(spec, note=f"refused: {str(error)[:200]}")
            self.step(f"{spec.short_text}: refused by the model")
            return None
        if spec.info.prefill_reads_cache:  # its prefill attends through its own cache (ggml: llama.cpp's blocks)
            session.prefill(self.prepared, reserve_tokens=self.reference.reserve_tokens)
        else:
            session.prefill_from(self.reference)
        return session

    def _measure(self, spec: CacheSpec, over: float | None = None, held_out: bool = True) -> RecommendRow | None:
        """Score `spec` on every answer token, one decode step at a time, and stop as soon as the KL summed so far
        passes `over` x every answer token (a `BOUND` row: its full mean is over `over`, see the module's
        docstring); None: to the end. Measured to the end, the row is `FULL`: llama.cpp's report, each question's
        KL, and (with `held_out`) the held-out tokens' KL and perplexity. None where the model refuses the spec."""
        session = self._session(spec)
        if session is None:
            return None
        bound = math.inf if over is None else over * self.positions
        summed, scored, rows = 0.0, list[torch.Tensor](), list[torch.Tensor]()

        def until(row: torch.Tensor) -> bool:  # each row as it comes: does the KL so far prove the mean over?
            nonlocal summed
            reference = self.logprobs[len(scored)][len(rows)]  # `dynamic`'s row at this question and token
            summed += float(kl_divergence(reference.unsqueeze(0), row.unsqueeze(0)))
            rows.append(row)
            return summed > bound

        for question, ids in self.answers:
            rows = []
            scored.append(session.score(question, ids, until=until))
            if summed > bound:
                tokens = sum(len(part) for part in scored)
                self.step(f"{spec.short_text}: KL at least {summed / self.positions:.4f} after {tokens} tokens")
                return self.row(spec, kl_at_least=summed / self.positions, positions=tokens, measured=BOUND)
        stats = kl_statistics(self.logprobs, scored, [ids for _, ids in self.answers])
        held_out_kl = ratio = None
        if self.tail_rows is not None and held_out:
            tail = session.score_text(self.tail)
            held_out_kl = float(kl_divergence(self.tail_rows, tail).mean())
            ratio = math.exp(self._nll(tail) - self._nll(self.tail_rows))
        self.step(f"measured {spec.short_text}: mean KL {stats.mean_kld:.4f}")
        return self.row(
            spec, mean_kl=stats.mean_kld, kl_at_least=None, positions=stats.positions, same_top_p=stats.same_top_p,
            p99_kl=stats.p99_kld, p999_kl=stats.p999_kld, rms_dp=stats.rms_dp, held_out_kl=held_out_kl,
            question_kl=tuple(float(kl_divergence(r, s).mean()) for r, s in zip(self.logprobs, scored)),
            perplexity_ratio=ratio, measured=FULL,
        )  # fmt: skip

    def _nll(self, rows: torch.Tensor) -> float:
        """Mean negative log-likelihood of the held-out tokens from `score_text`'s rows."""
        return -float(rows.gather(-1, torch.tensor(self.tail[1:]).unsqueeze(-1)).mean())

    def _quantized(self) -> list[CacheSpec]:
        """The quantized candidates with fewer bytes than `dynamic` (more could never be the answer), by bytes,
        fewest first; the others' rows say why they were not measured."""
        dynamic = self.bytes[self.specs[0].label][0]
        ordered = sorted(self.specs[1:], key=lambda s: self.bytes[s.label][0])
        for spec in ordered:
            if self.bytes[spec.label][0] >= dynamic:
                self.row(spec, note="not measured: no fewer bytes than dynamic")
        return [s for s in ordered if self.bytes[s.label][0] < dynamic]

    def _search_kl(self) -> RecommendRow:
        """The fewest bytes within the ceiling (see the module's docstring): `dynamic`'s row when none is."""
        pick = None
        for spec in self._quantized():
            if pick is not None:  # every candidate from here has at least the pick's bytes
                self.row(spec, note=f"not measured: no fewer bytes than the pick, {pick.spec}")
                continue
            row = self._measure(spec, over=self.limit)
            pick = row if row is not None and row.measured == FULL else None
        if pick is None:
            return self.rows[self.specs[0].label]
        smaller = self._next_smaller(pick)
        if smaller is not None and smaller.measured == BOUND:  # near the decision: its figures on every question
            smaller = self._measure(CacheSpec.parse(smaller.spec), held_out=False) or smaller
        if self.plans and smaller is not None:  # a plan between the two may keep the ceiling with fewer bytes
            planned = self._plan(pick, (pick.bytes_per_token[0] + smaller.bytes_per_token[0]) / 2, self.limit)
            if planned is not None and planned.mean_kl is not None and planned.mean_kl <= self.limit:
                return planned if planned.bytes_per_token[0] < pick.bytes_per_token[0] else pick
        return pick

    def _next_smaller(self, pick: RecommendRow) -> RecommendRow | None:
        """The measured row with the most bytes under the pick's (the setting the pick was chosen over), or None."""
        below = [r for r in self.rows.values() if r.measured in (FULL, BOUND) and r.bytes_per_token[0] <
                 pick.bytes_per_token[0] and PLAN not in CacheSpec.parse(r.spec).given()]  # fmt: skip
        return max(below, key=lambda r: r.bytes_per_token[0], default=None)

    def _search_budget(self) -> RecommendRow:
        """The lowest mean KL within the budget: by bytes, most first (more bytes, less error: the best is likely
        found early), each measured until shown over the best mean so far; a per-layer plan at the budget too."""
        best = None
        for spec in reversed(self._quantized()):
            if self.bytes[spec.label][0] > self.limit:
                self.row(spec, note="over the byte budget")
                continue
            row = self._measure(spec, over=None if best is None else best.mean_kl)
            if row is not None and row.measured == FULL and (best is None or self._better(row, best)):
                best = row
        if self.plans and best is not None:
            planned = self._plan(best, self.limit, best.mean_kl)
            if planned is not None and planned.measured == FULL and planned.bytes_per_token[0] <= self.limit:
                best = planned if self._better(planned, best) else best
        return best or self.rows[self.specs[0].label]

    @staticmethod
    def _better(row: RecommendRow, best: RecommendRow) -> bool:
        """Lower mean KL, or the same with fewer bytes."""
        assert row.mean_kl is not None and best.mean_kl is not None
        return (row.mean_kl, row.bytes_per_token[0]) < (best.mean_kl, best.bytes_per_token[0])

    def _plan(self, near: RecommendRow, budget: float, over: float | None) -> RecommendRow | None:
        """The per-layer plan at `budget` bytes per token, on the backend of `near` where it takes plans (else the
        first that does among the candidates), measured as `_measure` does (stopped once shown over `over`); None
        where no plan fits (the record says why)."""
        backends = [near.backend, *(s.backend for s in self.specs)]
        name = next((b for b in backends if PLAN in CacheSpec(b).info.options), None)
        if name is None:
            return None
        # the plan keeps which layers `near` quantizes (its sliding windows: ggml quantizes them by default), and
        # gives each its bits
        sliding = CacheSpec.parse(near.spec).resolved().get("sliding")
        windows = has_windows(self.loaded.config)
        plain = CacheSpec(name)
        base = (
            plain.replace(sliding=sliding)
            if windows and sliding and "sliding" in plain.info.options and sliding != plain.resolved().get("sliding")
            else plain
        )
        self.step(f"planning {name} per layer at {budget:,.0f} bytes per token", 0)
        try:
            assert self.reference.cache is not None  # prefilled in `run`
            prefilled = (full_precision_kv(self.reference.cache), self.queries)  # the reference's: no second prefill
            plan = planner.plan_layers(self.loaded, self.reference.split.prefix, base, budget, prefilled=prefilled)
        except ValueError as error:
            self.plan_line = f"no plan: {error}"
            return None
        self.plan_line = plan.summary()
        return self._measure(plan.spec.validate(self.loaded.config), over) if plan.spec is not None else None

    def _why(self, pick: RecommendRow) -> str:
        """One sentence: what the pick keeps and how it holds, and what the next smaller measured setting would have
        cost. Every figure named is measured in full, or said to be a bound."""
        dynamic_bytes = self.rows[self.specs[0].label].bytes_per_token[0]
        share = f"{pick.bytes_per_token[0] / dynamic_bytes:.0%} of dynamic's bytes"
        rows = [r for r in self.rows.values() if r.spec != self.specs[0].short_text]
        if not BACKENDS[pick.backend].quantized:
            return self._why_dynamic(rows)
        holds = _holds(pick)
        if self.target == "bytes_per_token":
            return (f"{pick.spec} moves this model least within {self.limit:,.0f} bytes per token: mean KL "
                    f"{pick.mean_kl:.4f}{holds}, {pick.same_top_p:.1f} % the same top token, {share}.")  # fmt: skip
        near = self._next_smaller(pick)
        if near is None:
            return f"{pick.spec} is the smallest setting measured and keeps mean KL {pick.mean_kl:.4f}{holds}, {share}."
        saved = 1 - near.bytes_per_token[0] / pick.bytes_per_token[0]
        below = sum(1 for r in rows if r.measured in (FULL, BOUND) and r.bytes_per_token[0] < pick.bytes_per_token[0])
        return (f"{near.spec} would take {saved:.0%} fewer bytes but moves this model's answers by {_figure(near)}, "
                f"over the ceiling {self.limit:g}, as did all {below} settings with fewer bytes; {pick.spec} keeps "
                f"them at {pick.mean_kl:.4f}{holds} with {share}.")  # fmt: skip

    def _why_dynamic(self, rows: list[RecommendRow]) -> str:
        """Why nothing quantized was picked: every smaller candidate's fate, counted."""
        within = f"within mean KL {self.limit:g}" if self.target == "max_kl" else "within the budget"
        over = [r for r in rows if r.measured in (FULL, BOUND)]
        refused = [r for r in rows if r.note.startswith("refused")]
        full = [r for r in over if r.measured == FULL]
        closest = min(full or over, key=lambda r: r.kl or 0.0, default=None)
        named = f"; the closest, {closest.spec}, moved it by {_figure(closest)}" if closest else ""
        return (f"No quantized setting kept this model {within} on this text: {len(over)} measured over it ("
                f"{len(full)} in full, {len(over) - len(full)} on a bound), {len(refused)} refused by the model"
                f"{named}: keep dynamic.")  # fmt: skip


def _figure(row: RecommendRow) -> str:
    """A row's KL in words: the full mean, or the bound and the tokens it rests on."""
    if row.mean_kl is not None:
        return f"mean KL {row.mean_kl:.4f}"
    return f"mean KL at least {row.kl_at_least:.4f} (a bound from {row.positions} answer tokens)"


def _holds(row: RecommendRow) -> str:
    """How the pick holds across questions and on the held-out text, in words ("" where not measured)."""
    parts = []
    if len(row.question_kl) > 1:
        parts.append(f"{min(row.question_kl):.4f}-{max(row.question_kl):.4f} by question")
    if row.held_out_kl is not None:
        parts.append(f"{row.held_out_kl:.4f} on the held-out text")
    return f" ({', '.join(parts)})" if parts else ""
