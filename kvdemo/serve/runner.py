"""Where a job runs: one interface (`Runner`) and its runner in this process (`InProcess`); the other runner is a
ZeroGPU worker's (`kvdemo.serve.device.Device`). The door (`kvdemo.serve.door.Door`) keeps the lock, the reservation
and the install, hands a job record (`kvdemo.serve.jobs`) to its runner and asks no question about where the work
runs: both give the same notes, the same results and the same exceptions, raised with their own type.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from contextlib import closing
from pathlib import Path
from typing import Any, Protocol

from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PreparedContext
from kvdemo.qa.session import QASession, Session
from kvdemo.qa.session_file import SavedSession, save_session
from kvdemo.serve.jobs import Job, JobProgress, Note, Stop
from kvdemo.serve.session_files import SessionFiles


class Runner(Protocol):
    """What runs the door's jobs."""

    def session(self, loaded: LoadedModel, spec: CacheSpec, kv_budget_bytes: int | None) -> Session:
        """A new, empty session of `spec` on `loaded` with the per-cache budget `kv_budget_bytes` (None: none).

        Raises:
            ValueError, ImportError: the spec does not validate, or the model cannot serve it.
        """

    def run(self, job: Job, session: Session | None = None, stop: Stop | None = None) -> Generator[Note, None, Any]:
        """Run `job` (on `session`, for a session's job): its notes as they come, then its result (the generator's
        return value). `stop` set from another thread ends it at its next check.

        Raises:
            What the job raises, with its own type: ValueError, ImportError (refused), `Cancelled` (stopped).
        """

    def save(self, session: Session, path: Path) -> SavedSession:
        """The prefilled `session` written to a session file at `path`.

        Raises:
            ValueError: nothing is prefilled; TypeError, OSError: as `kvdemo.qa.session_file.save_session`.
        """


def drive(notes: Generator[Note, None, Any], on_note: Callable[[Note], None] | None = None) -> Any:
    """Run a job's generator to its end, each note to `on_note`; returns its result. Where `on_note` raises, the job
    is closed (its work stopped at its next check) before the exception goes on."""
    with closing(notes):
        while True:
            try:
                note = next(notes)
            except StopIteration as done:
                return done.value
            if on_note is not None:
                on_note(note)


def progress(
    on_progress: Callable[..., None] | None, on_quantize: Callable[[int, int], None] | None = None
) -> Callable[[Note], None]:
    """The note handler of progress callbacks: a long job's `on_progress(done, total, what)`, or a prefill's
    `on_progress(done, total)` per chunk and `on_quantize(done, total)` per quantized layer."""

    def on_note(note: Note) -> None:
        if not isinstance(note, JobProgress):
            return
        if note.unit == "layers":
            if on_quantize is not None:
                on_quantize(note.done, note.total)
        elif note.unit == "tokens":
            if on_progress is not None:
                on_progress(note.done, note.total)
        elif on_progress is not None:
            on_progress(note.done, note.total, note.what)

    return on_note


class InProcess:
    """The jobs run in this process on the app's model; a session is a `QASession` holding its cache here, and a
    prefill opens or saves the app's folder of session files where it has one.

    Args:
        model: the model the long jobs run on (`App.wait_for_model`); a session's job runs on the session's.
        files: the app's folder of session files, read at each job (None: none).
    """

    def __init__(self, model: Callable[[], LoadedModel], files: Callable[[], SessionFiles | None]):
        self.model, self.files = model, files

    def session(self, loaded: LoadedModel, spec: CacheSpec, kv_budget_bytes: int | None) -> QASession:
        return QASession(loaded, spec, kv_budget_bytes=kv_budget_bytes)

    def run(self, job: Job, session: Session | None = None, stop: Stop | None = None) -> Generator[Note, None, Any]:
        assert session is None or isinstance(session, QASession)  # this runner's own sessions
        place = _Here(session.loaded if session is not None else self.model(), self.files())
        return job.run(place, session, stop if stop is not None else threading.Event())

    def save(self, session: Session, path: Path) -> SavedSession:
        assert isinstance(session, QASession)
        return save_session(session, path)


class _Here:
    """The `kvdemo.serve.jobs.Place` of this process: the app's folder of session files, where it has one."""

    def __init__(self, loaded: LoadedModel, files: SessionFiles | None):
        self.loaded, self.files = loaded, files

    def open(self, session: QASession, context: PreparedContext) -> str | None:
        opened = self.files.open(session, context) if self.files is not None else None
        return str(opened) if opened is not None else None

    def save(self, session: QASession, context: PreparedContext) -> str:
        saved = self.files.save(session, context) if self.files is not None else None
        return str(saved) if saved is not None else ""

    def keep(self, path: str) -> str:
        return path
