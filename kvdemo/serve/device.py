"""The door's model work on a device worker (a ZeroGPU Space): `Device` sends each job to `kvdemo.serve.gpu_job`'s
generator (on ZeroGPU a `@spaces.GPU` job in a forked worker) and turns the records it yields back into what the door
gives its callers in process: a `RemoteSession` in place of a `QASession`, `StepEvent`s as they come, progress
callbacks, the long jobs' reports, and their exceptions (`PrefillStopped`, `ComparisonCancelled`, `NeedleCancelled`,
`RecommendationCancelled`, `GpuJobError` for a refusal). Stop and Cancel write the job's stop file (`StopFile`),
which the worker reads after every step.

The server's process holds no cache and runs no forward pass: it tokenizes (the reservation, a question's ids) and
checks the window and the KV budget before any job, as the door does in process.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state.telemetry import StepEvent
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS, QUESTION_RESERVE_TOKENS
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prefill import PrefillStopped
from kvdemo.qa.prompt import PreparedContext, PreparedQuestion, PromptSplit
from kvdemo.qa.records import Answer, PrefillReport
from kvdemo.qa.session import check_answer, check_prefill
from kvdemo.qa.session_file import SUFFIX
from kvdemo.qa.text import check_question
from kvdemo.serve.gpu_job import (
    MAX_SECONDS,
    AnswerDone,
    GpuRequest,
    JobCancelled,
    JobDone,
    JobProgress,
    JobRefused,
    PrefillDone,
    estimated_seconds,
    link_file,
)


class GpuJobError(ValueError):
    """A job refused its request (the message is the job's, e.g. a context too long or a session file of another
    model), raised in the server's process."""


def check_duration(request: GpuRequest) -> None:
    """Refuse, before any GPU time is asked, a job whose estimate (`estimated_seconds`, this machine's CPU figures:
    an upper bound) passes the longest call kvdemo asks of ZeroGPU (`MAX_SECONDS`): the platform would end it midway
    with no result. Raises GpuJobError saying what to cut."""
    seconds = estimated_seconds(request)
    if seconds > MAX_SECONDS:
        what = {
            "compare": "fewer specs or questions, or fewer max_new_tokens or perplexity tokens",
            "needle": "fewer specs, lengths or depths",
            "recommend": "a shorter text",
        }.get(request.kind, "less")
        raise GpuJobError(
            f"this {request.kind} would take up to {seconds:,.0f} s of GPU time; one ZeroGPU call may take at most "
            f"{MAX_SECONDS} s here: ask for {what} (or run kvdemo on your own machine, where no such bound applies)"
        )  # fmt: skip


class StopFile:
    """A file whose existence asks one job to stop (`kvdemo.serve.gpu_job.stopped`): made by `set`, removed by
    `close`. The worker is forked on the same machine, so it sees the server's files."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.path, self.closed = folder / f"{uuid.uuid4().hex}.stop", False

    def set(self) -> None:
        """Ask the job to stop (idempotent; nothing once the job has ended)."""
        if not self.closed:
            self.path.touch()

    def close(self) -> None:
        """Remove the file (the job has ended)."""
        self.closed = True
        self.path.unlink(missing_ok=True)


@dataclass(eq=False)
class RemoteSession:
    """A session whose cache lives in a device worker, in its session file (`session_path`) and warm there: what the
    page, the MCP tools and the door read of a `QASession` (its model, spec, context, prefill report, answers and
    cache length) and check before a job (the window and the KV budget), with `request_stop` reaching the running job.

    Attributes:
        speed: the cache's decode floor as the worker measured it (`SpeedLimit`), after the prefill and each answer.
        split: the prefill's prompt split, tokenized here: a question's ids for the reservation.
    """

    loaded: LoadedModel
    spec: CacheSpec
    kv_budget_bytes: int | None = None
    context: str | None = None
    prefill_report: PrefillReport | None = None
    history: list[Answer] = field(default_factory=list)
    session_path: str = ""
    speed: Any = None
    split: PromptSplit | None = None
    reserve_tokens: int = QUESTION_RESERVE_TOKENS + DEFAULT_MAX_NEW_TOKENS
    running: StopFile | None = None
    cache: None = None
    """No cache in this process (the page reads the floor from `speed`)."""

    def end_job(self, stop: StopFile | None = None) -> None:
        """The running job has ended (or never started: an answer whose stream was closed before its first step):
        its stop file removed and forgotten (`stop`: only if it is still this one)."""
        running = self.running
        if running is not None and (stop is None or running is stop):
            running.close()
            self.running = None

    @property
    def cache_length(self) -> int:
        """Tokens in the cache (its context's; 0 before a prefill): the worker restores it after every answer."""
        return self.prefill_report.context_tokens if self.prefill_report is not None else 0

    def request_stop(self) -> None:
        """Stop the running job (an answer after its current decode step, a prefill before its next chunk)."""
        if self.running is not None:
            self.running.set()

    def check_prefill(self, context_tokens: int, reserve_tokens: int) -> None:
        """`kvdemo.qa.session.check_prefill` for this session. Raises ValueError, KVBudgetError: it does not fit."""
        check_prefill(self.loaded, self.spec, self.kv_budget_bytes, context_tokens, reserve_tokens)

    def prepare_question(self, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> PreparedQuestion:
        """`question` tokenized on the prefill's split here and checked against the window and the budget, as
        `QASession.prepare_question`. Raises ValueError: no prefill, an empty question, it does not fit."""
        if self.split is None or self.prefill_report is None:
            raise ValueError("prefill a context before asking a question")
        ids = self.loaded.layout.question_ids(self.split, check_question(question))
        check_answer(self.loaded, self.spec, self.kv_budget_bytes, self.cache_length, len(ids), max_new_tokens)
        return PreparedQuestion(question, tuple(ids), max_new_tokens, self.split)


class Device:
    """The door's model work sent to `kvdemo.serve.gpu_job` (module docstring).

    Args:
        job: the job generator; None: `kvdemo.serve.gpu_job.gpu_job` (on ZeroGPU `@spaces.GPU`), read at each call.
        folder: where the worker's session files go ("" : `kvdemo.paths.cache_dir()/sessions`).
        stops: where stop files go (None: `kvdemo.paths.cache_dir()/stops`).
    """

    def __init__(
        self,
        job: Callable[[GpuRequest], Generator[Any, None, None]] | None = None,
        folder: str = "",
        stops: str | Path | None = None,
        folder_bytes: int = 0,
    ):
        from kvdemo.paths import cache_dir

        self.job, self.folder, self.folder_bytes = job, folder, folder_bytes
        self.stops = Path(stops) if stops is not None else cache_dir() / "stops"
        self.held = self.stops.parent / "held-sessions"

    def held_path(self, session: RemoteSession) -> Path:
        """A new path in `held` for `session`'s own copy of its session file, removed when the session is gone. The
        jobs' folder of session files is bounded and drops its least recently used files (another visitor's prefill
        may drop this one), and an uploaded file lives in Gradio's temporary folder: the session's own copy (a hard
        link) is what its answers open on a miss and what Save session writes, as long as the session lives (as its
        cache would in process)."""
        path = self.held / f"{uuid.uuid4().hex}{SUFFIX}"
        weakref.finalize(session, path.unlink, missing_ok=True)
        return path

    def _records(self, request: GpuRequest) -> Iterator[Any]:
        """The job's records, a refusal raised as `GpuJobError`."""
        from kvdemo.serve import gpu_job

        with closing((self.job or gpu_job.gpu_job)(request)) as records:
            for record in records:
                if isinstance(record, JobRefused):
                    raise GpuJobError(record.message)
                yield record

    def session(self, loaded: LoadedModel, spec: CacheSpec, kv_budget_bytes: int | None) -> RemoteSession:
        """A new, empty session of `spec` (validated here; the worker probes the model when it builds its own)."""
        return RemoteSession(loaded, spec.validate(loaded.config), kv_budget_bytes)

    def prefill(
        self,
        session: RemoteSession,
        context: PreparedContext,
        max_new_tokens: int,
        on_progress: Callable[[int, int], None] | None = None,
        on_quantize: Callable[[int, int], None] | None = None,
    ) -> PrefillReport:
        """Prefill `context` in the worker (or open its saved file there) into `session`; progress per chunk and per
        quantized layer. Raises PrefillStopped: Stop, before the next chunk; GpuJobError: the worker refused it."""
        request = GpuRequest(
            "prefill", session.spec.text, context.text, max_new_tokens=max_new_tokens, folder=self.folder,
            folder_bytes=self.folder_bytes, hold_path=str(self.held_path(session)),
            kv_budget_bytes=session.kv_budget_bytes or 0,
        )  # fmt: skip
        return self._prefilled(session, request, context.split, on_progress, on_quantize)

    def open(self, session: RemoteSession, path: str, context: str, split: PromptSplit) -> PrefillReport:
        """Open the session file at `path` in the worker into `session` (its `context` and `split` read here), from
        the session's own copy (`hold`)."""
        held = str(link_file(Path(path), self.held_path(session)))
        request = GpuRequest("open", session.spec.text, session_path=held, kv_budget_bytes=session.kv_budget_bytes or 0)
        session.context = context
        return self._prefilled(session, request, split, None, None)

    def _prefilled(
        self,
        session: RemoteSession,
        request: GpuRequest,
        split: PromptSplit,
        on_progress: Callable[[int, int], None] | None,
        on_quantize: Callable[[int, int], None] | None,
    ) -> PrefillReport:
        stop = session.running = StopFile(self.stops)
        try:
            for record in self._records(replace(request, stop_path=str(stop.path))):
                if isinstance(record, JobProgress):
                    call = on_quantize if record.unit == "layers" else on_progress
                    if call is not None:
                        call(record.done, record.total)
                elif isinstance(record, JobCancelled):
                    raise PrefillStopped(record.partial)
                elif isinstance(record, PrefillDone):
                    session.prefill_report, session.session_path = record.report, record.session_path
                    session.speed, session.split, session.history = record.speed, split, []
                    session.context = request.context or session.context  # an open's was read here
        finally:
            session.end_job(stop)
        if session.prefill_report is None:
            raise GpuJobError("the worker ended without a prefill report")
        return session.prefill_report

    def answer(self, session: RemoteSession, prepared: PreparedQuestion) -> Generator[StepEvent, None, None]:
        """The answer's `StepEvent`s from the worker as they come; at its end the `Answer` is in `session.history`
        and the floor in `session.speed`. `session.request_stop()` applies from now (the stop file is made before the
        first step is asked for)."""
        stop = session.running = StopFile(self.stops)
        request = GpuRequest(
            "answer", session.spec.text, session_path=session.session_path, question=prepared.text,
            max_new_tokens=prepared.max_new_tokens, kv_budget_bytes=session.kv_budget_bytes or 0,
            stop_path=str(stop.path),
        )  # fmt: skip
        return self._answer(session, request, stop)

    def _answer(self, session: RemoteSession, request: GpuRequest, stop: StopFile) -> Generator[StepEvent, None, None]:
        try:
            for record in self._records(request):
                if isinstance(record, StepEvent):
                    yield record
                elif isinstance(record, AnswerDone):
                    session.history.append(record.answer)
                    session.speed = record.speed
        finally:
            session.end_job(stop)

    def long_job(
        self,
        request: GpuRequest,
        cancelled: Callable[[Any], Exception],
        cancel: threading.Event,
        on_progress: Callable[[int, int, str], None] | None = None,
    ) -> Any:
        """Run a comparison, a needle grid or a recommendation in the worker: its progress to `on_progress`, `cancel`
        (set from another thread) written to its stop file. Returns its result; raises `cancelled(partial)` when it
        was cancelled, GpuJobError when refused."""
        check_duration(request)
        stop = StopFile(self.stops)
        ended = threading.Event()

        def watch() -> None:
            while not ended.is_set():
                if cancel.wait(0.1):
                    stop.set()
                    return

        watcher = threading.Thread(target=watch, daemon=True, name="kvdemo-cancel-watch")
        watcher.start()
        try:
            for record in self._records(replace(request, stop_path=str(stop.path))):
                if isinstance(record, JobProgress) and on_progress is not None:
                    on_progress(record.done, record.total, record.what)
                elif isinstance(record, JobCancelled):
                    raise cancelled(record.partial)
                elif isinstance(record, JobDone):
                    return record.result
        finally:
            ended.set()
            watcher.join()
            stop.close()
        raise GpuJobError(f"the worker ended the {request.kind} job without a result")
