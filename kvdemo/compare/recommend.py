"""Which KV setting for this model on this text (`recommend`): every candidate the registry gives for an engine
(`kvdemo.compare.candidates`) measured against `dynamic` on the user's own text, and the one that fits a target.

How, in one prefill: the text is prefilled once into `dynamic`, which answers every question greedily. Each candidate
then takes that prefill's full-precision keys and values (`QASession.prefill_from`: the cache a prefill of its own
gives, tensor for tensor, without the forward passes), and is scored teacher-forced on `dynamic`'s answers
(`QASession.score`: the same decode steps, flushes included). First a **probe**: the first question's first
`PROBE_TOKENS` answer tokens, for every candidate, which drops what is clearly out (a probe KL over `PROBE_OUT` x the
ceiling, more bytes than the budget) or clearly beaten (another candidate with no more bytes and at most
1/`PROBE_MARGIN` of its probe KL). Then the **full measurement** of the rest, in the order that finds the pick first:
mean KL, same top token and 99th-percentile KL over every answer token, and the perplexity of the text's last
`HELD_OUT_TOKENS` tokens (held out of the context, fed after it) over `dynamic`'s. With a KL ceiling the candidates
are measured by bytes, fewest first, until one is within it: that is the pick, unless the per-layer planner's plan
between it and the next smaller one is within it too (`kvdemo.evals.planner`, measured the same way). With a byte
budget the candidates within it are measured by probe KL, and the pick has the lowest mean KL.

Bytes per token come from the registry's formulas (every token stored, no residual), at the context's length and at
`LENGTHS` (a sliding window's bytes stop growing). A recommendation holds for this model, this text and these
questions (docs/recommend.md says how far it carried to another text).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Sequence

import torch

from kvdemo.cache.deploy import ENGINES
from kvdemo.cache.layer_plan import PLAN
from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec, estimate_kv_bytes
from kvdemo.compare.candidates import ANY_ENGINE, candidate_specs
from kvdemo.compare.recommendation import (
    FULL,
    PROBE,
    Recommendation,
    RecommendationCancelled,
    RecommendRow,
)
from kvdemo.evals import planner
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

PROBE_TOKENS = 8
"""Answer tokens of the first question each candidate is scored on in the probe."""
PROBE_OUT = 4.0
"""A candidate whose probe KL passes this many times the ceiling is left after the probe."""
PROBE_MARGIN = 2.0
"""A candidate is left after the probe when another has no more bytes and at most 1/PROBE_MARGIN of its probe KL."""
FULL_AT_MOST = 8
"""Candidates measured in full at most (the plan besides)."""
HELD_OUT_TOKENS = 32
"""Tokens of the text's end held out of the context and scored for the perplexity (fewer on a short text)."""
MIN_CONTEXT_TOKENS = 64
"""The fewest text tokens a recommendation takes (fewer say nothing of a long context)."""
LENGTHS = (8192, 32768)
"""The other context lengths each row's bytes per token are given at."""
MAX_NEW_TOKENS = 24
"""Tokens per `dynamic` answer that every candidate is scored on."""


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

    Raises:
        ValueError: before any work: a bad target, an unknown engine, an engine that deploys nothing quantized on
            this model, a budget below the smallest candidate's bytes, an empty text or question, a text under
            `MIN_CONTEXT_TOKENS` tokens (each message says what would work).
        RecommendationCancelled: `cancel` was set.

    Example:
        >>> found = recommend(loaded, open("article.txt").read(), max_kl=0.02)
        >>> found.pick, found.why, found.picked.deploy
    """
    target, limit = check_target(max_kl, bytes_per_token)
    return _Run(loaded_model, text, questions, target, limit, engine, plans, cancel, on_progress).run()


class _Run:
    """One recommendation's state: the checks, the reference, the probe, the full measurement and the pick."""

    def __init__(self, loaded, text, questions, target, limit, engine, plans, cancel, on_progress):
        self.loaded, self.target, self.limit, self.engine = loaded, target, limit, engine
        self.cancel, self.on_progress, self.start, self.done = cancel, on_progress, time.perf_counter(), 0
        self.specs = candidate_specs(loaded.config, engine)  # raises on an unknown engine
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
        self.plan_line = ""
        self.total = 3 + 2 * len(self.questions) + len(self.specs) + FULL_AT_MOST

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
            time.perf_counter() - self.start, finished,
        )  # fmt: skip

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
        self.reference.prefill(self.prepared, max_new_tokens=MAX_NEW_TOKENS, on_progress=chunk)
        self.step("answering with dynamic")
        self.answers: list[tuple[str, list[int]]] = []
        self.logprobs: list[torch.Tensor] = []
        for question in self.questions:
            answer = self.reference.ask(question, MAX_NEW_TOKENS)
            if not answer.token_ids:
                continue
            self.step(f"dynamic answered {len(self.answers) + 1} of {len(self.questions)}")
            self.answers.append((question, list(answer.token_ids)))
            self.logprobs.append(self.reference.score(question, answer.token_ids))
            self.step("scored dynamic's answer")
        if not self.answers:
            raise ValueError("dynamic answered none of the questions with a token; give other questions")
        self.tail_nll = self._nll(self.reference)
        dynamic = self.specs[0]
        self.row(dynamic, probe_kl=0.0, mean_kl=0.0, same_top_p=100.0, p99_kl=0.0, perplexity_ratio=1.0, measured=FULL)
        for spec in self.specs[1:]:
            self._probe(spec)
        pick = self._measure_kl() if self.target == "max_kl" else self._measure_budget()
        self.done = self.total  # the estimate counted every full measurement the run may have skipped
        self.step(f"picked {pick.spec}", 0)
        return self.record(pick=pick.spec, why=self._why(pick))

    def _nll(self, session: QASession) -> float | None:
        """Mean negative log-likelihood of the held-out tokens through the session's cache (None without them)."""
        if len(self.tail) < 2:
            return None
        rows = session.score_text(self.tail)
        index = torch.tensor(self.tail[1:]).unsqueeze(-1)
        return -float(rows.gather(-1, index).mean())

    def _session(self, spec: CacheSpec) -> QASession | None:
        """A session of `spec` prefilled from the reference, or None (the row notes why) where the model refuses it."""
        try:
            session = QASession(self.loaded, spec)
        except (ValueError, ImportError) as error:
            self.row(spec, note=f"refused: {str(error)[:200]}")
            return None
        session.prefill_from(self.reference)
        return session

    def _probe(self, spec: CacheSpec) -> RecommendRow | None:
        if self.target == "bytes_per_token" and self.bytes[spec.label][0] > self.limit:
            self.step(f"{spec.short_text}: over the budget")
            self.row(spec, note="over the byte budget")
            return None
        session = self._session(spec)
        if session is None:
            return None
        question, ids = self.answers[0]
        probe = session.score(question, ids[:PROBE_TOKENS])
        kl = float(kl_divergence(self.logprobs[0][:PROBE_TOKENS], probe).mean())
        self.step(f"probed {spec.short_text}: KL {kl:.4f}")
        return self.row(spec, probe_kl=kl, measured=PROBE)

    def _full(self, spec: CacheSpec) -> RecommendRow | None:
        session = self._session(spec)
        if session is None:
            return None
        scored = [session.score(question, ids) for question, ids in self.answers]
        stats = kl_statistics(self.logprobs, scored, [ids for _, ids in self.answers])
        nll = self._nll(session)
        ratio = None if nll is None or self.tail_nll is None else math.exp(nll - self.tail_nll)
        self.step(f"measured {spec.short_text}: mean KL {stats.mean_kld:.4f}")
        return self.row(
            spec, mean_kl=stats.mean_kld, same_top_p=stats.same_top_p, p99_kl=stats.p99_kld,
            perplexity_ratio=ratio, measured=FULL,
        )  # fmt: skip

    def _kept(self) -> list[RecommendRow]:
        """The probed rows the probe does not rule out (see the module's docstring)."""
        probed = [r for r in self.rows.values() if r.measured == PROBE and r.probe_kl is not None]
        kept = []
        for row in probed:
            assert row.probe_kl is not None
            if self.target == "max_kl" and row.probe_kl > PROBE_OUT * self.limit:
                self.rows[self._label(row)] = RecommendRow(**{**row.__dict__, "note": "probe KL far over the ceiling"})
                continue
            beaten = [o for o in probed if o is not row and o.bytes_per_token[0] <= row.bytes_per_token[0]
                      and o.probe_kl is not None and o.probe_kl * PROBE_MARGIN <= row.probe_kl]  # fmt: skip
            if beaten:
                note = f"beaten in the probe by {beaten[0].spec}"
                self.rows[self._label(row)] = RecommendRow(**{**row.__dict__, "note": note})
                continue
            kept.append(row)
        return kept

    def _label(self, row: RecommendRow) -> str:
        return next(label for label, r in self.rows.items() if r.spec == row.spec)

    def _measure_kl(self) -> RecommendRow:
        """Full measurement by bytes, fewest first, until one is within the ceiling; then the plan between it and
        the next smaller one. Returns the pick (`dynamic`'s row when none is within)."""
        pick = None
        for row in sorted(self._kept(), key=lambda r: r.bytes_per_token[0])[:FULL_AT_MOST]:
            full = self._full(CacheSpec.parse(row.spec))
            if full is not None and full.mean_kl is not None and full.mean_kl <= self.limit:
                pick = full
                break
        if pick is None:
            return self.rows[self.specs[0].label]
        smaller = max(
            (r for r in self.rows.values() if r.measured == FULL and r.bytes_per_token[0] < pick.bytes_per_token[0]),
            key=lambda r: r.bytes_per_token[0],
            default=None,
        )
        if self.plans and smaller is not None:  # a plan between the two may keep the ceiling with fewer bytes
            planned = self._plan(pick, (pick.bytes_per_token[0] + smaller.bytes_per_token[0]) / 2)
            if planned is not None and planned.mean_kl is not None and planned.mean_kl <= self.limit:
                return planned if planned.bytes_per_token[0] < pick.bytes_per_token[0] else pick
        return pick

    def _measure_budget(self) -> RecommendRow:
        """Full measurement of the kept candidates by probe KL, lowest first; the pick has the lowest mean KL, a
        per-layer plan at the budget included."""
        kept = sorted(self._kept(), key=lambda r: (r.probe_kl, r.bytes_per_token[0]))[:FULL_AT_MOST]
        measured = [f for row in kept if (f := self._full(CacheSpec.parse(row.spec))) is not None]
        if self.plans and measured:
            planned = self._plan(min(measured, key=lambda r: r.mean_kl or 0.0), self.limit)
            measured += [planned] if planned is not None and planned.bytes_per_token[0] <= self.limit else []
        quantized = [r for r in measured if r.mean_kl is not None]
        return min(quantized, key=lambda r: r.mean_kl or 0.0) if quantized else self.rows[self.specs[0].label]

    def _plan(self, near: RecommendRow, budget: float) -> RecommendRow | None:
        """The per-layer plan at `budget` bytes per token, on the backend of `near` where it takes plans (else the
        first that does among the candidates), measured in full; None where no plan fits (the record says why)."""
        backends = [near.backend, *(s.backend for s in self.specs)]
        name = next((b for b in backends if PLAN in CacheSpec(b).info.options), None)
        if name is None:
            return None
        # the plan keeps which layers `near` quantizes (its sliding windows), and gives each its bits
        sliding = CacheSpec.parse(near.spec).given().get("sliding")
        base = (
            CacheSpec(name, sliding=sliding)
            if sliding and "sliding" in CacheSpec(name).info.options
            else CacheSpec(name)
        )
        self.step(f"planning {name} per layer at {budget:,.0f} bytes per token", 0)
        try:
            plan = planner.plan_layers(self.loaded, self.reference.split.prefix, base, budget)
        except ValueError as error:
            self.plan_line = f"no plan: {error}"
            return None
        self.plan_line = plan.summary()
        return self._full(plan.spec.validate(self.loaded.config)) if plan.spec is not None else None

    def _why(self, pick: RecommendRow) -> str:
        """One sentence: what the pick keeps, and what the next smaller measured setting would have cost."""
        dynamic_bytes = self.rows[self.specs[0].label].bytes_per_token[0]
        share = f"{pick.bytes_per_token[0] / dynamic_bytes:.0%} of dynamic's bytes"
        measured = [r for r in self.rows.values() if r.kl is not None and r.spec != pick.spec]
        if not BACKENDS[pick.backend].quantized:
            best = min((r for r in measured if BACKENDS[r.backend].quantized), key=lambda r: r.kl or 0.0, default=None)
            closest = f" the closest, {best.spec}, moved it by KL {best.kl:.4f}" if best else ""
            within = f"within mean KL {self.limit:g}" if self.target == "max_kl" else "within the budget"
            return f"No quantized setting kept this model {within} on this text;{closest}: keep dynamic."
        if self.target == "bytes_per_token":
            return (f"{pick.spec} moves this model least within {self.limit:,.0f} bytes per token: mean KL "
                    f"{pick.mean_kl:.4f}, {pick.same_top_p:.1f} % the same top token, {share}.")  # fmt: skip
        smaller = [r for r in measured if r.bytes_per_token[0] < pick.bytes_per_token[0]]
        smaller = [r for r in smaller if r.measured == FULL] or smaller  # a full figure says more than a probe's
        if not smaller:
            return f"{pick.spec} is the smallest setting measured and keeps mean KL {pick.mean_kl:.4f}, {share}."
        uniform = [r for r in smaller if PLAN not in CacheSpec.parse(r.spec).given()]
        near = max(uniform or smaller, key=lambda r: (r.bytes_per_token[0], -(r.kl or 0.0)))  # a plain setting first
        saved = 1 - near.bytes_per_token[0] / pick.bytes_per_token[0]
        how = "mean KL" if near.mean_kl is not None else "KL (probe)"
        return (f"{near.spec} would take {saved:.0%} fewer bytes but moves this model's answers by {how} "
                f"{near.kl:.4f}, over the ceiling {self.limit:g}; {pick.spec} keeps them at {pick.mean_kl:.4f} "
                f"with {share}.")  # fmt: skip
