"""The runner of a device worker (a ZeroGPU Space): `Device` sends each job record (`kvdemo.serve.jobs`) to
`kvdemo.serve.gpu_job`'s generator (on ZeroGPU a `@spaces.GPU` job in a forked worker) and gives back what the
runner in this process gives (`kvdemo.serve.runner.InProcess`): the job's notes as they come, its result, and its
exceptions raised again with their own type. A session is a `RemoteSession`: its cache lives in the worker, in its
session file and warm there. Stop and Cancel write the job's stop file (`StopFile`), which the worker reads after
every step.

The server's process holds no cache and runs no forward pass: it tokenizes (the reservation, a question's ids) and
checks the window and the KV budget before any job, as the door does in process.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Generator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS, QUESTION_RESERVE_TOKENS
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PreparedQuestion, PromptSplit
from kvdemo.qa.records import Answer, PrefillReport
from kvdemo.qa.session import check_answer, check_prefill
from kvdemo.qa.session_file import SUFFIX, SavedSession
from kvdemo.qa.text import check_question
from kvdemo.serve.gpu_job import (
    DAILY_QUOTA_MINUTES,
    MAX_SECONDS,
    Answered,
    Finished,
    Raised,
    SessionRef,
    StopFile,
    WorkOrder,
)
from kvdemo.serve.jobs import POLL_SECONDS, Job, Note, PrefillDone, Stop


class GpuJobError(ValueError):
    """A job the worker could not run: passing the longest call kvdemo asks of ZeroGPU, or ended without a result."""


def check_duration(job: Job) -> None:
    """Refuse, before any GPU time is asked, a job whose estimate (`Job.estimated_seconds`, this machine's CPU
    figures: an upper bound) passes the longest call kvdemo asks of ZeroGPU (`MAX_SECONDS`): the platform would end
    it midway with no result. Raises GpuJobError saying what to cut (`Job.cut`) and a visitor's daily quota."""
    seconds = job.estimated_seconds()
    quota = ", ".join(f"{minutes} minutes {who}" for who, minutes in DAILY_QUOTA_MINUTES)
    if seconds > MAX_SECONDS:
        raise GpuJobError(
            f"this {job.kind} would take up to {seconds:,.0f} s of GPU time; one ZeroGPU call may take at most "
            f"{MAX_SECONDS} s here: ask for {job.cut} (or run kvdemo on your own machine, where no such bound "
            f"applies). A visitor's daily ZeroGPU time is {quota}"
        )


@dataclass(eq=False)
class RemoteSession:
    """A session whose cache lives in a device worker, in its session file (`session_path`) and warm there: what the
    page, the MCP tools and the door read of a session (`kvdemo.qa.session.Session`) and check before a job (the
    window and the KV budget), with `request_stop` reaching the running job.

    Attributes:
        speed: the cache's decode floor as the worker measured it (`SpeedLimit`), after the prefill and each answer.
        split: the prefill's prompt split, as the worker made it: a question's ids are made on it here.
        running: the stop file of the job running on it, else None.
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
    hold: str = ""

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

    def speed_limit(self) -> Any:
        """The decode floor as the worker last measured it."""
        return self.speed

    def ref(self) -> SessionRef:
        """This session as the worker finds it."""
        return SessionRef(self.spec, self.kv_budget_bytes, self.session_path, self.hold)

    def take(self, done: Finished) -> None:
        """What a job's end changed: a prefill's (or an opened file's) report, file and split; an answer added to
        the history; the floor."""
        if isinstance(done.result, PrefillDone):
            self.prefill_report, self.session_path = done.result.report, done.result.path
            self.context, self.split, self.history = done.result.context, done.result.split, []
            self.reserve_tokens = done.result.reserve_tokens
        elif isinstance(done.result, Answer):
            self.history.append(done.result)
        self.speed = done.speed


class Device:
    """The runner of a device worker (module docstring).

    Args:
        job: the job generator; None: `kvdemo.serve.gpu_job.gpu_job` (on ZeroGPU `@spaces.GPU`), read at each call.
        folder: where the worker's session files go ("": `kvdemo.paths.cache_dir()/sessions`); folder_bytes: their
            bound (0: `kvdemo.serve.gpu_job.SESSION_FILES_BYTES`).
        stops: where stop files go (None: `kvdemo.paths.cache_dir()/stops`); each session's own file is linked in
            its sibling `held-sessions`.
    """

    def __init__(
        self,
        job: Callable[[WorkOrder], Generator[Any, None, None]] | None = None,
        folder: str = "",
        stops: str | Path | None = None,
        folder_bytes: int = 0,
    ):
        from kvdemo.paths import cache_dir

        self.job, self.folder, self.folder_bytes = job, folder, folder_bytes
        self.stops = Path(stops) if stops is not None else cache_dir() / "stops"
        self.held = self.stops.parent / "held-sessions"

    def session(self, loaded: LoadedModel, spec: CacheSpec, kv_budget_bytes: int | None) -> RemoteSession:
        """A new, empty session of `spec` (validated here; the worker probes the model when it builds its own), with
        its own path for its file, removed when the session is gone. The jobs' folder of session files is bounded
        and drops its least recently used files (another visitor's prefill may drop this one), and an uploaded file
        lives in Gradio's temporary folder: the session's own copy (a hard link) is what its answers open on a miss
        and what Save session writes, as long as the session lives (as its cache would in process)."""
        session = RemoteSession(loaded, spec.validate(loaded.config), kv_budget_bytes)
        session.hold = str(self.held / f"{uuid.uuid4().hex}{SUFFIX}")
        weakref.finalize(session, Path(session.hold).unlink, missing_ok=True)
        return session

    def run(self, job: Job, session: Any = None, stop: Stop | None = None) -> Generator[Note, None, Any]:
        """`job` in the worker (`kvdemo.serve.runner.Runner.run`): refused here first where it would pass a call's
        bound (GpuJobError); `stop`, or the session's `request_stop`, writes the job's stop file."""
        check_duration(job)
        return self._run(job, session, stop)

    def _run(self, job: Job, session: RemoteSession | None, stop: Stop | None) -> Generator[Note, None, Any]:
        self.stops.mkdir(parents=True, exist_ok=True)
        file = StopFile(self.stops / f"{uuid.uuid4().hex}.stop")
        if session is not None:
            session.running = file
        order = WorkOrder(
            job, session.ref() if session is not None else None, session.loaded.name if session is not None else "",
            str(file.path), self.folder, self.folder_bytes,
        )  # fmt: skip
        if stop is not None and stop.is_set():  # a Stop before the job: the worker sees it at its first check
            file.set()
        records = self._records(order)
        with _watching(stop, file), closing(records):
            try:
                for record in records:
                    if isinstance(record, Finished | Raised):
                        return _ended(record, session)
                    if isinstance(record, Answered):  # an answer that failed in the worker: recorded, as in process
                        if session is not None:
                            session.history.append(record.answer)
                        continue
                    yield record
                    if stop is not None and stop.is_set():  # set while the note was handled: on at once
                        file.set()
            except GeneratorExit:  # the caller left: the job is stopped and its end read, as closing it in process
                file.set()
                for record in records:
                    if isinstance(record, Finished | Raised):
                        if isinstance(record, Finished) and session is not None:
                            session.take(record)
                        break
                raise
            finally:
                if session is not None and session.running is file:
                    session.running = None
                file.close()
        raise GpuJobError(f"the worker ended the {order.job.kind} job without a result")

    def _records(self, order: WorkOrder) -> Generator[Any, None, None]:
        from kvdemo.serve import gpu_job

        with closing((self.job or gpu_job.gpu_job)(order)) as records:
            yield from records

    def save(self, session: Any, path: Path) -> SavedSession:
        """A copy of the session's own file at `path` (the worker saved it after the prefill; answers restore it)."""
        if not session.session_path:
            raise ValueError("nothing is prefilled in this tab; press Prefill first")
        start = time.perf_counter()
        shutil.copyfile(session.session_path, path)
        return SavedSession(Path(path), Path(path).stat().st_size, time.perf_counter() - start)


def _ended(record: Finished | Raised, session: RemoteSession | None) -> Any:
    """A job's end record: its result (the session told what changed), or its exception raised with its own type."""
    if isinstance(record, Raised):
        raise record.error
    if session is not None:
        session.take(record)
    return record.result


class _watching:
    """For a `with` block: `stop` (set from another thread) written to the job's stop file, looked at every
    `POLL_SECONDS` (the worker looks at the file as often: `kvdemo.serve.jobs.threaded`, and after each decode step)."""

    def __init__(self, stop: Stop | None, file: StopFile):
        self.stop, self.file, self.ended = stop, file, threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> None:
        if self.stop is None:
            return
        stop, file, ended = self.stop, self.file, self.ended

        def watch() -> None:
            while not ended.is_set():
                if stop.is_set():
                    file.set()
                    return
                ended.wait(POLL_SECONDS)

        self.thread = threading.Thread(target=watch, daemon=True, name="kvdemo-stop-watch")
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.ended.set()
        if self.thread is not None:
            self.thread.join()
