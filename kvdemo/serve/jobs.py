"""The door's jobs, one small frozen record per kind: a prefill, a session file opened in its place, an answer, a
comparison, a needle grid, a recommendation. A record carries what its job reads (the spec, the context and question
as prepared ids, never a text to parse again) and owns what is particular to its kind: how it runs on a loaded model
(`run`, with a stop signal, yielding its progress as it comes), its estimated seconds on a device, what to cut when
it would pass a device call's bound, and (a long job) its KV reservation. `kvdemo.serve.runner` runs a record in
this process, `kvdemo.serve.device` in a ZeroGPU worker: the same object, pickled across. Adding a kind is one record
here and one entry in `JOBS`.

What crosses to a worker is small and holds no tensor: numbers, strings, `CacheSpec`s, prepared ids
(`PreparedContext` pickles without its tokenizer: `bound` gives it the worker's model's again).

Durations are upper bounds from this machine's idle CPU figures (docs/benchmarks.md, `make bench` of 2026-11-30,
SmolLM2-135M, float32 on 2 cores: a prefill of 1,341 tokens in 3-5 s, 3.7 ms per token; a decode step 0.057-0.115 s).
No GPU figure is measured here: a ZeroGPU slice (half an RTX Pro 6000 Blackwell) is taken to be no slower than 2 CPU
cores for a 135M model, so these over-ask, which ZeroGPU tolerates (the duration is the longest a call may run; a
shorter one only ranks higher in the queue).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from kvdemo import checks
from kvdemo.cache.registry import BASELINE
from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state.telemetry import StepEvent
from kvdemo.qa.limits import QUESTION_RESERVE_TOKENS
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prefill import PrefillStopped
from kvdemo.qa.prompt import PreparedContext, PreparedQuestion, PromptSplit
from kvdemo.qa.records import PrefillReport
from kvdemo.qa.session import QASession
from kvdemo.serve.accounting import session_kv_bytes

START_SECONDS = 15.0
"""A cold worker: the fork, CUDA's start, the backends' imports (estimated)."""
PREFILL_SECONDS_PER_TOKEN = 0.004
"""One token of a prefill (3.7 ms on 2 idle CPU cores)."""
STEP_SECONDS = 0.12
"""One decode step or one teacher-forced token, a share of flushes included (0.057-0.115 s on 2 idle CPU cores)."""
OPEN_SECONDS = 5.0
"""Opening a session file on a miss (digest, model check, one copy to the device; far less than its prefill)."""
CANDIDATE_SECONDS = 4.0
"""One candidate of a recommendation (its hand-over and probe; 0.5-3 s on 2 idle CPU cores); about 50 are measured."""
CHARS_PER_TOKEN = 3.0
"""Characters per token, on the low side (English runs at about 4 with SmolLM2's tokenizer), for a text the job
tokenizes itself (a recommendation's)."""
RECOMMEND_ANSWER_TOKENS = 32
"""The answer tokens a recommendation's reservation and estimate allow per answer: above the 24 it decodes
(`kvdemo.compare.recommend.MAX_NEW_TOKENS`), as the door reserved before the job records."""
POLL_SECONDS = 0.2
"""How often a job running in a thread looks at its stop signal (seconds)."""


class Stop(Protocol):
    """A job's stop signal: a `threading.Event` in this process, a `kvdemo.serve.device.StopFile` across processes."""

    def is_set(self) -> bool: ...


class Place(Protocol):
    """Where a job runs (`kvdemo.serve.runner.InProcess`, the worker's `kvdemo.serve.gpu_job.WorkerPlace`): the model,
    and the session files a prefill opens instead of running, or saves after."""

    loaded: LoadedModel

    def open(self, session: QASession, context: PreparedContext) -> str | None:
        """The file of the same context, model and spec opened into `session`: its path; None: none."""

    def save(self, session: QASession, context: PreparedContext) -> str:
        """`session`'s prefill of `context` saved where later jobs find it; its path ("": not saved)."""

    def keep(self, path: str) -> str:
        """A session file given by the caller (an upload) held for the session's life; the path to open."""


@dataclass(frozen=True)
class JobProgress:
    """Work done so far: `done` of `total` units, and what runs (`what`). A prefill's `unit` is `tokens` (its
    chunks) or `layers` (its quantizer's hand-over); a long job's `steps`."""

    done: int
    total: int
    what: str
    unit: str = "steps"


Note = JobProgress | StepEvent
"""What a job yields as it runs: its progress, or an answer's decode steps."""


@dataclass(frozen=True)
class PrefillDone:
    """A prefill's (or an opened file's) end: its report, the session file that holds it ("": none), the context and
    prompt split the session now holds, and the tokens it keeps free for a question and its answer."""

    report: PrefillReport
    path: str
    context: str
    split: PromptSplit
    reserve_tokens: int


def threaded(work: Callable[[Callable[..., None]], Any], stop: Stop, on_stop: Callable[[], None] | None = None):
    """Run `work(emit)` in a thread and yield each `JobProgress` it emits (`emit(done, total, what, unit)`) as it
    comes; `emit` returns once the note has been handled (the generator resumed), so a caller's Stop pressed in a
    progress callback applies before the next unit, as a callback in the work's own thread would (in a device worker the
    note is handled once it is sent: a Stop there lands a unit later). `on_stop()` is called while `stop` is set (the
    work then ends at its next check), and when the generator is closed early. Returns (to
    `yield from`) what `work` returned; raises what it raised."""
    notes: queue.Queue[Any] = queue.Queue()
    handled = threading.Semaphore(0)
    left = threading.Event()  # the generator was closed: emit no longer waits
    out: dict[str, Any] = {}

    def emit(done: int, total: int, what: str, unit: str = "steps") -> None:
        notes.put(JobProgress(done, total, what, unit))
        while not left.is_set() and not handled.acquire(timeout=POLL_SECONDS):
            pass

    def run() -> None:
        try:
            out["value"] = work(emit)
        except BaseException as error:  # handed to the generator's thread, raised there
            out["error"] = error
        finally:
            notes.put(None)

    thread = threading.Thread(target=run, daemon=True, name="kvdemo-job")
    thread.start()
    try:
        while True:
            if on_stop is not None and stop.is_set():  # again at each note: a prefill clears its flag as it starts
                on_stop()
            try:
                note = notes.get(timeout=POLL_SECONDS)
            except queue.Empty:
                note = ...
            if note is None:
                break
            if note is not ...:
                yield note
                handled.release()
    finally:
        left.set()
        if thread.is_alive() and on_stop is not None:  # the generator was closed (the caller left)
            on_stop()
        thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


class Job:
    """What every job record provides (module docstring)."""

    kind: ClassVar[str]
    cut: ClassVar[str] = "less"
    """What to ask for less of when the job would pass a device call's bound."""

    def run(self, place: Place, session: QASession | None, stop: Stop) -> Generator[Note, None, Any]:
        """Run on `place` (on `session` for a session's job), yielding its notes; returns its result.

        Raises:
            ValueError, ImportError: refused (nothing ran); `Cancelled`: stopped (its partial result).
        """
        raise NotImplementedError

    def estimated_seconds(self) -> float:
        """The seconds the job may take on a device, its start included (an upper bound)."""
        raise NotImplementedError


@dataclass(frozen=True)
class PrefillJob(Job):
    """Prefill `context` into the session, or open the file of the same prefill where the place keeps one (and save
    it there after a prefill). Returns a `PrefillDone`."""

    context: PreparedContext
    max_new_tokens: int
    kind: ClassVar[str] = "prefill"

    def run(self, place: Place, session: QASession | None, stop: Stop) -> Generator[Note, None, Any]:
        assert session is not None
        context = self.context.bound(place.loaded.tokenizer)
        opened = place.open(session, context)
        if opened is not None:
            assert session.prefill_report is not None  # the file's
            return PrefillDone(session.prefill_report, opened, context.text, session.split, session.reserve_tokens)
        if stop.is_set():  # a Stop while the prefill was set up (the session clears its own flag as it starts)
            raise PrefillStopped("the prefill was stopped before it began")
        report = yield from threaded(
            lambda emit: session.prefill(
                context, self.max_new_tokens,
                on_progress=lambda done, total: emit(done, total, "prefilling", "tokens"),
                on_quantize=lambda done, total: emit(done, total, "quantizing", "layers"),
            ),
            stop, session.request_stop,
        )  # fmt: skip
        path = place.save(session, context)
        return PrefillDone(report, path, context.text, session.split, session.reserve_tokens)

    def estimated_seconds(self) -> float:
        return START_SECONDS + len(self.context.ids) * PREFILL_SECONDS_PER_TOKEN


@dataclass(frozen=True)
class OpenJob(Job):
    """Open the session file at `path` (its spec checked against the session's) into the session, in place of a
    prefill. Returns a `PrefillDone`."""

    path: str
    kind: ClassVar[str] = "open"

    def run(self, place: Place, session: QASession | None, stop: Stop) -> Generator[Note, None, Any]:
        from kvdemo.qa.session_file import open_session

        assert session is not None
        path = place.keep(self.path)  # the session's own copy, for its answers; the given path read, named in refusals
        open_session(place.loaded, self.path, session.spec, session=session)
        assert session.prefill_report is not None and session.context is not None
        return PrefillDone(session.prefill_report, path, session.context, session.split, session.reserve_tokens)
        yield  # a generator, as every job's `run`

    def estimated_seconds(self) -> float:
        return START_SECONDS + OPEN_SECONDS


@dataclass(frozen=True)
class AnswerJob(Job):
    """Answer `question` (tokenized and checked on the server) on the session's prefill: its `StepEvent`s as they
    come; the cache is restored after it as always, and the `Answer` is the session's last. Returns the `Answer`."""

    question: PreparedQuestion
    kind: ClassVar[str] = "answer"

    def run(self, place: Place, session: QASession | None, stop: Stop) -> Generator[Note, None, Any]:
        assert session is not None
        stream = session.stream(self.question)
        try:
            for event in stream:
                if stop.is_set():  # a Stop since the Ask click: the answer ends after this step
                    session.request_stop()
                yield event
        finally:
            stream.close()  # restored, also when this generator is closed (the caller left)
        return session.history[-1]

    def estimated_seconds(self) -> float:
        return START_SECONDS + OPEN_SECONDS + (len(self.question.ids) + self.question.max_new_tokens) * STEP_SECONDS


class _Halt:
    """A long job's cancel event: its caller's `stop`, or set here when the caller has left."""

    def __init__(self, stop: Stop):
        self.stop, self.left = stop, threading.Event()

    def set(self) -> None:
        self.left.set()

    def is_set(self) -> bool:
        return self.left.is_set() or self.stop.is_set()


class LongJobRecord(Job):
    """A job of no session, holding its own KV bytes for its run (`reservation`): its `work` runs in a thread
    (`threaded`), its progress streamed as it comes, `stop` handed to it as its cancel event."""

    holder: ClassVar[str]
    """The reservation's name before `:<key>` (`compare`, `grid`)."""

    def run(self, place: Place, session: QASession | None, stop: Stop) -> Generator[Note, None, Any]:
        halt = _Halt(stop)  # also set when the caller leaves: the work ends at its next check, not at its end
        return (yield from threaded(lambda emit: self.work(place.loaded, emit, halt), stop, halt.set))

    def work(self, loaded: LoadedModel, emit: Callable[..., None], stop: Stop) -> Any:
        """The job on `loaded`: `emit(done, total, what)` after each unit, `stop.is_set()` checked between units.
        Returns its result; raises as `run`."""
        raise NotImplementedError

    def reservation(self, loaded: LoadedModel) -> tuple[int, str]:
        """The most KV bytes the job holds at once on `loaded`, and what they are for (the refusal's words)."""
        raise NotImplementedError


@dataclass(frozen=True)
class CompareJob(LongJobRecord):
    """`kvdemo.compare.run.compare`: one spec at a time, so it holds the largest `session_kv_bytes` of its specs.
    Returns a `ComparisonReport`; raises `ComparisonCancelled` with the specs finished."""

    context: PreparedContext
    questions: tuple[str, ...]
    specs: tuple[CacheSpec, ...]
    max_new_tokens: int
    gold_answers: tuple[tuple[str, ...], ...] | None = None
    perplexity_tokens: int = 0
    continuation: str | None = None
    plans: tuple[tuple[CacheSpec, float], ...] = ()
    kv_budget_bytes: int | None = None
    kind: ClassVar[str] = "compare"
    holder: ClassVar[str] = "compare"
    cut: ClassVar[str] = "fewer specs or questions, or fewer max_new_tokens or perplexity tokens"

    def work(self, loaded: LoadedModel, emit: Callable[..., None], stop: Stop) -> Any:
        from kvdemo.compare.run import compare

        golds = None if self.gold_answers is None else [list(g) for g in self.gold_answers]
        return compare(
            loaded, self.context.bound(loaded.tokenizer), list(self.questions), list(self.specs), self.max_new_tokens,
            golds, cancel=stop, on_progress=emit, kv_budget_bytes=self.kv_budget_bytes,  # type: ignore[arg-type]
            perplexity_tokens=self.perplexity_tokens, continuation=self.continuation, plans=list(self.plans),
        )  # fmt: skip

    def reservation(self, loaded: LoadedModel) -> tuple[int, str]:
        reserve = QUESTION_RESERVE_TOKENS + checks.max_new_tokens(self.max_new_tokens)
        tokens = len(self.context.ids)
        nbytes = max(
            session_kv_bytes(spec.validate(loaded.config), loaded, tokens, reserve)
            for spec in [CacheSpec(BASELINE), *self.specs]
        )
        return nbytes, f"a comparison of {len(self.specs)} spec(s) on {tokens:,} context tokens"

    def estimated_seconds(self) -> float:
        prefill = len(self.context.ids) * PREFILL_SECONDS_PER_TOKEN
        steps = self.max_new_tokens * STEP_SECONDS
        specs = len({s.text for s in self.specs} | {BASELINE}) + 2 * len(self.plans)
        feed = prefill + self.perplexity_tokens * STEP_SECONDS if self.perplexity_tokens else 0
        return START_SECONDS + specs * (prefill + len(self.questions) * 2 * steps + feed)


@dataclass(frozen=True)
class NeedleJob(LongJobRecord):
    """`kvdemo.needle.grid.needle_grid`: one spec at a time, so at most the largest `session_kv_bytes` of its specs
    at the longest length. Returns a `NeedleGrid`; raises `NeedleCancelled` with the cells finished."""

    specs: tuple[CacheSpec, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    max_new_tokens: int
    needles_per_context: int | None = 1
    seed: int = 0
    kv_budget_bytes: int | None = None
    kind: ClassVar[str] = "needle"
    holder: ClassVar[str] = "grid"
    cut: ClassVar[str] = "fewer specs, lengths or depths"

    def work(self, loaded: LoadedModel, emit: Callable[..., None], stop: Stop) -> Any:
        from kvdemo.needle.grid import needle_grid

        return needle_grid(
            loaded, list(self.specs), list(self.lengths), list(self.depths),
            needles_per_context=self.needles_per_context, seed=self.seed, max_new_tokens=self.max_new_tokens,
            cancel=stop, on_progress=emit, kv_budget_bytes=self.kv_budget_bytes,  # type: ignore[arg-type]
        )  # fmt: skip

    def reservation(self, loaded: LoadedModel) -> tuple[int, str]:
        longest, reserve = max(self.lengths, default=0), QUESTION_RESERVE_TOKENS + self.max_new_tokens
        nbytes = max((session_kv_bytes(s, loaded, longest, reserve) for s in self.specs), default=0)
        return nbytes, f"a needle grid of {len(self.specs)} spec(s) up to {longest:,} tokens"

    def estimated_seconds(self) -> float:
        grid = max(1, len(self.specs)) * len(self.lengths)
        seconds = grid * PREFILL_SECONDS_PER_TOKEN * (sum(self.lengths) / max(1, len(self.lengths)))
        return START_SECONDS + seconds + grid * len(self.depths) * 2 * self.max_new_tokens * STEP_SECONDS


@dataclass(frozen=True)
class RecommendJob(LongJobRecord):
    """`kvdemo.compare.recommend.recommend` on `text` (which it splits itself: a held-out end for the perplexity):
    `dynamic`'s reference cache for the whole run and one candidate's at a time, at most as large, so twice
    `dynamic`'s bytes. Returns a `Recommendation`; raises `RecommendationCancelled` with the rows measured."""

    text: str
    questions: tuple[str, ...] = ()
    max_kl: float | None = None
    bytes_per_token: float | None = None
    engine: str = "any"
    plans: bool = True
    kind: ClassVar[str] = "recommend"
    holder: ClassVar[str] = "compare"
    cut: ClassVar[str] = "a shorter text"

    def work(self, loaded: LoadedModel, emit: Callable[..., None], stop: Stop) -> Any:
        from kvdemo.compare.recommend import recommend

        return recommend(
            loaded, self.text, list(self.questions), max_kl=self.max_kl, bytes_per_token=self.bytes_per_token,
            engine=self.engine, plans=self.plans, cancel=stop, on_progress=emit,  # type: ignore[arg-type]
        )  # fmt: skip

    def reservation(self, loaded: LoadedModel) -> tuple[int, str]:
        from kvdemo.serve.accounting import prefill_tokens

        tokens = prefill_tokens(loaded, self.text)
        reserve = QUESTION_RESERVE_TOKENS + RECOMMEND_ANSWER_TOKENS
        nbytes = 2 * session_kv_bytes(CacheSpec(BASELINE).validate(loaded.config), loaded, tokens, reserve)
        return nbytes, f"a recommendation on {tokens:,} context tokens"

    def estimated_seconds(self) -> float:
        prefill = len(self.text) / CHARS_PER_TOKEN * PREFILL_SECONDS_PER_TOKEN
        return START_SECONDS + prefill + 3 * RECOMMEND_ANSWER_TOKENS * STEP_SECONDS + 50 * CANDIDATE_SECONDS


JOBS: tuple[type[Job], ...] = (PrefillJob, OpenJob, AnswerJob, CompareJob, NeedleJob, RecommendJob)
"""Every kind of job, in the order the docs list them."""
