"""Needle in a haystack: can the model still find one short fact in a long context under each KV cache?

A grid of context lengths x depths per `CacheSpec`. For each cell a short fact (the **needle**) is hidden at
a depth of a real text (the **haystack**), the context is prefilled into a cache of the spec's backend, and
a question that needs the fact is asked on top of it (`QASession`, the cache restored after every answer).

Method (after G. Kamradt's LLMTest_NeedleInAHaystack, 2023, and the single-needle tasks of RULER: Hsieh
et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"):

- **haystack**: the shipped SQuAD articles' paragraphs (`kvdemo/data/cases/*.json`, Wikipedia text, CC BY-SA
  4.0), in file order, joined with blank lines: about 9,800 tokens of running text with the embedded
  model's tokenizer, no sentence repeated below that (a longer window reads the text again from the start).
- **needle**: RULER's sentence `"The special magic number for {name} is {value}."`, with an invented name
  (two to three random syllables each for a first and a last name) and a 6-digit number drawn from `seed`,
  neither of which occurs in the haystack: runs are reproducible and the model cannot know the answer.
  Every needle of one length gets its own name and value; the same seed, length and depths give the same
  needles, whatever `needles_per_context` is.
- **depth** d %: the needle goes after d % of the haystack's tokens, moved back to the nearest sentence end
  before that point (Kamradt's rule), so it never splits a sentence; 100 % puts it at the very end of the
  context. `placed_depth` reports where it landed (the haystack tokens before it, in %).
- **length**: the tokens prefilled, chat template's opening included (`PrefillReport.context_tokens`), equal
  to the requested length exactly: the haystack is cut at a token boundary, and the cut is corrected until
  the tokenized context has that length. A length must leave `QUESTION_RESERVE_TOKENS + max_new_tokens`
  of the model's window free for the question and the answer.
- **hit**: the greedy answer (`max_new_tokens` at most) holds the value as a whole number (digits grouped
  with commas or spaces count: "482,913").
- **score** (graded): log P(value | context, question, answer prefix) in nats, the sum over the value's
  tokens of their log-probabilities teacher-forced after the question and the answer prefix
  `"The special magic number for {name} is"` (`QASession.score`, fed one decode step at a time as in
  generation). 0 is certainty; a guess among 10^6 numbers is about -13.8. It separates caches where the
  small model misses every needle.

Cost, and several needles in one context. A cell needs a context of its length with its needle at its
depth. With `needles_per_context=None` (the default) the needles of every depth of a length share one
context: one prefill per (spec, length) instead of one per cell, then per needle one answer and one
teacher-forced scoring, each followed by the restore. On a CPU a prefill of 7,936 tokens costs about as
much as all the decode steps of a few needles, so this divides a grid's time by up to the number of
depths. The price: the other needles are distractors of the same form (the model must pick the number of
the name asked: RULER's multi-key retrieval, a harder task than a lone needle), and they replace a little
haystack. `needles_per_context=1` is the classic grid (one needle, one prefill per cell); values in
between put that many needles per context, spread over the depths (depths i, i + n, i + 2n, ... of the
sorted list share a context). Every cell reports its context's prefill seconds, how many needles shared
that prefill, and its answer's and scoring's seconds.

Example:
    >>> grid = needle_grid(load_model(), ["dynamic", "hqq:2"], lengths=[1024, 4096], depths=[0, 50, 100])
    >>> grid.to_frame()[["spec text", "length", "depth", "hit", "score"]]
"""

from __future__ import annotations

import math
import numbers
import re
import threading
import time
from collections.abc import Sequence

from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state.budget import KVBudgetError
from kvdemo.checks import shown
from kvdemo.needle.haystack import (
    Needle,
    NeedleContext,
    Placement,
    TokenizedText,
    build_context,
    encode_with_offsets,
    haystack_text,
    make_needles,
)
from kvdemo.needle.inputs import (
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_SPECS,
    check_count,
    check_depths,
    check_lengths,
)
from kvdemo.needle.records import NeedleCancelled, NeedleCell, NeedleGrid
from kvdemo.qa.job import JobCancelled, JobRun, ProgressCallback
from kvdemo.qa.limits import QUESTION_RESERVE_TOKENS
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import TOKENIZER_LOCK
from kvdemo.qa.records import PrefillReport
from kvdemo.qa.session import QASession


def hit(answer: str, value: str) -> bool:
    """True when `answer` holds `value` as a whole number: digits grouped with commas or spaces
    (`482,913`, `482 913`) count, a longer number that contains it (`4829130`) does not."""
    joined = re.sub(r"(?<=\d)[,\s](?=\d)", "", answer)
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", joined) is not None


def longest_length(loaded_model: LoadedModel, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    """The longest context (tokens) a grid can prefill: `max_context_tokens - QUESTION_RESERVE_TOKENS -
    max_new_tokens`, e.g. 8,192 - 64 - 32 = 8,096 for the embedded model with 32 new tokens."""
    return loaded_model.max_context_tokens - QUESTION_RESERVE_TOKENS - max_new_tokens


def plan_contexts(
    loaded_model: LoadedModel,
    lengths: Sequence[int],
    depths: Sequence[float],
    needles_per_context: int | None = None,
    seed: int | str = 0,
    haystack: str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> list[NeedleContext]:
    """The contexts `needle_grid` prefills (for every spec alike), length by length: tokenization only.

    Needles: per length, `make_needles(depths, seed=f"{seed}:{length}")`, so a cell's needle does not depend on
    `needles_per_context`. With n contexts per length (`ceil(len(depths) / needles_per_context)`), context i
    holds the needles of the sorted depths i, i + n, i + 2n, ...

    Raises:
        ValueError: bad lengths, depths or counts (see `check_lengths`, `check_depths`), a length too long for
            the window with `max_new_tokens` or too short for its needles (the messages give the bounds).
    """
    max_new_tokens = check_count(max_new_tokens, "max_new_tokens")
    if isinstance(seed, bool) or not isinstance(seed, (numbers.Integral, str)):
        raise ValueError(f"seed={shown(seed)} must be a whole number or a text")
    most = longest_length(loaded_model, max_new_tokens)
    lengths = check_lengths(lengths, most)
    depths = check_depths(depths)
    per = check_count(needles_per_context, "needles_per_context", allow_none=True) or len(depths)
    groups = math.ceil(len(depths) / per)
    text = haystack if haystack is not None else haystack_text()
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the haystack is empty; give a text to hide the needles in (or None for the SQuAD articles)")
    hay = TokenizedText(loaded_model, text)
    contexts = []
    for length in lengths:
        needles = _needles(length, depths, seed, text)
        for g in range(groups):
            contexts.append(build_context(loaded_model, length, needles[g::groups], _hay=hay))
    return contexts


def _needles(length: int, depths: Sequence[float], seed: int | str, haystack: str) -> list[Needle]:
    """The needles of one length's contexts (`plan_contexts`)."""
    return make_needles(depths, seed=f"{seed}:{length}", avoid=haystack)


def answer_tokens_needed(
    loaded_model: LoadedModel,
    lengths: Sequence[int],
    depths: Sequence[float],
    seed: int | str = 0,
    haystack: str | None = None,
) -> int:
    """The fewest `max_new_tokens` that can hold every needle's answer: the tokens of the longest needle sentence
    (`"The special magic number for {name} is {value}."`, the answer that only restates it) among the needles
    `plan_contexts` draws for these lengths, depths and seed. A model that words its answer at more length
    (`"... mentioned in the text is ..."`) needs more: `DEFAULT_MAX_NEW_TOKENS` leaves that room. Tokenization
    only; lengths and depths are taken as given (`plan_contexts` checks them)."""
    text = haystack if haystack is not None else haystack_text()
    tokenizer = loaded_model.tokenizer
    with TOKENIZER_LOCK:
        return max(
            len(tokenizer(needle.text, add_special_tokens=False)["input_ids"])
            for length in lengths
            for needle in _needles(length, depths, seed, text)
        )


def _score_ids(loaded_model: LoadedModel, needle: Needle) -> tuple[list[int], int]:
    """The answer ids teacher-forced for the score (answer prefix, a space, the value) and the index of the
    value's first token in them."""
    text = f"{needle.answer_prefix} {needle.value}"
    encoded = encode_with_offsets(loaded_model, text)
    start = len(text) - len(needle.value)
    first = next(i for i, (s, e) in enumerate(encoded["offset_mapping"]) if e > start and s >= start)
    return list(encoded["input_ids"]), first


def _ordered_specs(loaded_model: LoadedModel, specs: Sequence[CacheSpec | str]) -> list[CacheSpec]:
    """The specs parsed and validated against the model, each once, in the order given."""
    if isinstance(specs, (str, CacheSpec)) or not isinstance(specs, Sequence) or not specs:
        raise ValueError("give a list of specs, e.g. ['dynamic', 'hqq:4']")
    ordered: list[CacheSpec] = []
    for spec in specs:
        spec = (CacheSpec.parse(spec) if isinstance(spec, str) else spec).validate(loaded_model.config)
        if spec.label not in [s.label for s in ordered]:
            ordered.append(spec)
    return ordered


def _check_kv_budget(
    loaded_model: LoadedModel, ordered: Sequence[CacheSpec], longest: int, reserve: int, kv_budget_bytes: int | None
) -> None:
    """Raise `KVBudgetError` when a spec's cache at the longest length would exceed `kv_budget_bytes` (None: no
    limit)."""
    if kv_budget_bytes is None:
        return
    for spec in ordered:
        probe = QASession(loaded_model, spec, kv_budget_bytes=kv_budget_bytes)
        estimate = probe.estimate_kv_bytes(longest, reserve)
        if estimate > kv_budget_bytes:
            raise KVBudgetError(
                f"a {spec.text} KV cache for the longest context ({longest:,} tokens + {reserve} for a "
                f"question and its answer) would hold about {estimate / 2**20:,.1f} MiB; the KV budget is "
                f"{kv_budget_bytes / 2**20:,.1f} MiB. Drop the longest lengths or this spec",
                estimate,
                kv_budget_bytes,
            )


class _GridRun(JobRun):
    """One grid's bookkeeping: the job's units and cancel event (`kvdemo.qa.job.JobRun`, shared with the
    comparison), the cells so far, the scoring ids."""

    def __init__(self, total: int, cancel: threading.Event | None, on_progress: ProgressCallback | None):
        super().__init__(total, cancel, on_progress)
        self.cells: list[NeedleCell] = []
        self.score_ids: dict[str, tuple[list[int], int]] = {}

    def sorted_cells(self, ordered: Sequence[CacheSpec]) -> tuple[NeedleCell, ...]:
        """The cells so far, spec by spec (in `ordered`'s order), then by length and depth."""
        rank = {s.text: i for i, s in enumerate(ordered)}
        return tuple(sorted(self.cells, key=lambda c: (rank[c.spec_text], c.length, c.depth)))

    def prefill_context(
        self, session: QASession, spec: CacheSpec, context: NeedleContext, reserve: int
    ) -> PrefillReport:
        """One context prefilled (its prepared ids, not tokenized again), told before and after, Cancel acting
        within one chunk."""
        self.check_cancel()
        self.note(f"{spec.text}: prefilling {context.length:,} tokens")
        report = self.prefill(session, context.prepared, spec.text, reserve_tokens=reserve)
        if report.context_tokens != context.length:  # the prepared ids are the length
            raise RuntimeError(f"prefilled {report.context_tokens} tokens for a {context.length}-token context")
        self.step(f"{spec.text}: prefilled {context.length:,} tokens")
        return report

    def needle(
        self,
        session: QASession,
        spec: CacheSpec,
        context: NeedleContext,
        index: int,
        placement: Placement,
        report: PrefillReport,
        max_new_tokens: int,
    ) -> None:
        """Ask for one needle, score its value, and add its cell."""
        needle = placement.needle
        stream = session.stream(needle.question, max_new_tokens)
        try:
            for _ in stream:
                self.check_cancel()
        finally:
            stream.close()
        answer = session.history[-1]
        self.step(f"{spec.text} {context.length:,} tokens: answered the needle at {needle.depth:g} %")
        self.check_cancel()
        if needle.name not in self.score_ids:
            self.score_ids[needle.name] = _score_ids(session.loaded, needle)
        ids, first = self.score_ids[needle.name]
        scored_at = time.perf_counter()
        logprobs = session.score(needle.question, ids)
        score_seconds = time.perf_counter() - scored_at
        score = float(sum(logprobs[i, ids[i]] for i in range(first, len(ids))))
        del logprobs
        self.cells.append(
            NeedleCell(
                spec=spec.label,
                spec_text=spec.text,
                length=context.length,
                depth=needle.depth,
                placed_depth=placement.placed_depth,
                position=placement.position,
                needle_tokens=placement.tokens,
                name=needle.name,
                value=needle.value,
                question=needle.question,
                answer=answer.text,
                hit=hit(answer.text, needle.value),
                score=score,
                value_tokens=len(ids) - first,
                finish_reason=answer.finish_reason,
                context=index,
                needles_in_context=len(context.placements),
                prefill_seconds=report.seconds,
                answer_seconds=answer.seconds,
                score_seconds=score_seconds,
                cache_length_after=answer.cache_length_after,
                kv_bytes=report.kv_bytes,
            )
        )
        self.step(f"{spec.text} {context.length:,} tokens: scored the needle at {needle.depth:g} %")


def needle_grid(
    loaded_model: LoadedModel,
    specs: Sequence[CacheSpec | str] = DEFAULT_SPECS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    needles_per_context: int | None = None,
    seed: int | str = 0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    haystack: str | None = None,
    cancel: threading.Event | None = None,
    on_progress: ProgressCallback | None = None,
    kv_budget_bytes: int | None = None,
) -> NeedleGrid:
    """Run the needle grid: for every spec, length and depth, hide a needle, prefill, ask, score.

    Per spec one `QASession` (freed before the next spec); per context one prefill; per needle one greedy
    answer and one teacher-forced scoring, each followed by the restore. The contexts are the same for every
    spec. See the module docstring for the method and the cost.

    Args:
        loaded_model: from `kvdemo.load_model`.
        specs: `CacheSpec`s or their text (`"hqq:4"`); each validated against the model before anything runs;
            a repeated spec runs once.
        lengths: context lengths (tokens prefilled), each at most `longest_length(loaded_model, max_new_tokens)`.
        depths: needle depths (%), 0 to 100.
        needles_per_context: needles per prefill; None: every depth of a length in one context.
        seed: draws the needles (names and values).
        max_new_tokens: per answer (tokens).
        haystack: the text to hide the needles in; None: `haystack_text()`.
        cancel: set it (from another thread) to stop at the next decode step of an answer, or before the next
            prefill or scoring; the cache is restored as after any answer.
        on_progress: `ProgressCallback`, called before each prefill and after each prefill, answer and scoring.
        kv_budget_bytes: each session's out-of-memory guard (`QASession`); checked for the longest length of
            every spec before anything runs. None: no limit.

    Returns:
        The `NeedleGrid`.

    Raises:
        ValueError: no spec, a spec the model cannot run, bad lengths, depths, counts or haystack (nothing
            has run then; the message says what to change).
        KVBudgetError (a ValueError): a spec's cache at the longest length would exceed `kv_budget_bytes`.
        ImportError: a spec's backend package is missing.
        NeedleCancelled: `cancel` was set; its `grid` holds the cells finished before.
    """
    start = time.perf_counter()
    ordered = _ordered_specs(loaded_model, specs)
    contexts = plan_contexts(loaded_model, lengths, depths, needles_per_context, seed, haystack, max_new_tokens)
    lengths, depths = check_lengths(lengths), check_depths(depths)
    reserve = QUESTION_RESERVE_TOKENS + max_new_tokens
    _check_kv_budget(loaded_model, ordered, max(lengths), reserve, kv_budget_bytes)
    run = _GridRun(len(ordered) * sum(1 + 2 * len(c.placements) for c in contexts), cancel, on_progress)

    def grid(complete: bool) -> NeedleGrid:
        return NeedleGrid(
            model=loaded_model.name,
            device=str(loaded_model.device),
            specs=tuple(s.text for s in ordered),
            lengths=tuple(lengths),
            depths=tuple(depths),
            needles_per_context=needles_per_context,
            seed=seed,
            max_new_tokens=max_new_tokens,
            seconds=time.perf_counter() - start,
            complete=complete,
            cells=run.sorted_cells(ordered),
        )

    try:
        for spec in ordered:
            session = QASession(loaded_model, spec, kv_budget_bytes=kv_budget_bytes)
            for index, context in enumerate(contexts):
                report = run.prefill_context(session, spec, context, reserve)
                for placement in context.placements:
                    run.needle(session, spec, context, index, placement, report, max_new_tokens)
            del session  # freed by reference counting before the next spec's (no cycle holds a session)
    except JobCancelled:
        raise NeedleCancelled(grid(complete=False)) from None
    return grid(complete=True)
