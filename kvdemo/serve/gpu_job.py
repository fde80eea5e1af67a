"""A job's run in a device worker, for Hugging Face ZeroGPU: one generator, `gpu_job(order)`, decorated with
`@spaces.GPU(duration=job_seconds)` where the `spaces` package is installed (a ZeroGPU Space provides it; elsewhere
`gpu_job` is the plain generator and nothing changes). Its one caller is the worker runner,
`kvdemo.serve.device.Device`; the page's tabs, the MCP tools and the command line reach it only through the door.

How ZeroGPU runs it (`spaces` 0.51.3, `spaces/zero/wrappers.py: generator_function_wrapper`): the first call forks one
worker process for the decorated function and the GPU lent; later calls reuse that worker while the scheduler reports
it idle, else fork a new one. The order goes to the worker pickled, and each value the generator yields comes back
pickled, as it is yielded; the GPU is taken back when the generator ends. So:
- the order (`WorkOrder`: a job record of `kvdemo.serve.jobs`, the session it runs on, its stop file) and every
  record yielded hold no tensor: numbers, strings, specs, token ids and the records' dataclasses, a few kB each (a
  comparison's report or a grid tens of kB);
- the model is loaded in the main process before the first call (`serve_model`; on ZeroGPU on `cuda` as its docs
  ask, which the main process emulates), and the fork inherits it; the job moves it to the GPU inside the worker
  where it is not there yet (`device_model`);
- a session's prefill writes a session file (`kvdemo.qa.session_file`) and yields its path; an answer gets the path
  and the question's ids. The worker keeps a few prefilled sessions warm (`kvdemo.serve.warm_sessions`): on a hit the
  answer runs on the warm session, restored in place after it as always; on a miss (a fresh worker, or another
  visitor's) it opens the file, one copy of the cache to the device. Both give the same answer (docs/DESIGN.md,
  invariant 2);
- **Stop and Cancel** reach the worker through a file (`WorkOrder.stop_path`, `kvdemo.serve.device.StopFile`) that
  the server writes: the job looks for it after every decode step, prefill chunk and progress note, and ends as in
  process (the cache restored, the answer `stopped`; a long job's partial result in its `Cancelled`). A stop of
  `spaces`' own (the caller gone) closes the generator, which restores the cache the same way;
- a refusal (`ValueError`, `ImportError`) or a stop (`Cancelled`) is yielded as `Raised` holding the exception itself
  (ZeroGPU would pass on only an exception's class name), and the server raises it again with its own type; any
  other exception (a bug, CUDA out of memory) is raised as it is.

What this module cannot show off ZeroGPU: tests/zerogpu_harness.py plays ZeroGPU's part on the CPU (fork, pickling
queues, four scheduler policies), tests/stand_in/spaces a forking `spaces` for the whole app; docs/space.md lists what
still needs a real ZeroGPU Space.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PreparedContext
from kvdemo.qa.records import Cancelled
from kvdemo.qa.session import QASession
from kvdemo.serve.jobs import Job, PrefillDone
from kvdemo.serve.session_files import SessionFiles
from kvdemo.serve.warm_sessions import WARM, device_model

MIN_SECONDS, MAX_SECONDS = 20, 300
"""The bounds of a job's duration (seconds): the longest call kvdemo asks of ZeroGPU is `MAX_SECONDS`."""
DAILY_QUOTA_MINUTES = (("unauthenticated", 2), ("with a free account", 5), ("with PRO", 40))
"""A visitor's daily ZeroGPU time (hub-docs `docs/hub/spaces-zerogpu.md`, 2026-08; reset 24 hours after the first
use): what the page says when it refuses a job past the call bound."""
SESSION_FILES_BYTES = 2 << 30
"""The bound of the jobs' folder of session files (`kvdemo.serve.session_files.SessionFiles`, least recently used
first out): 2 GiB, the app's `--session-files-mib` default."""

_MODEL: Callable[[], LoadedModel] | None = None
_LOCK = threading.Lock()


@dataclass(frozen=True)
class SessionRef:
    """The session a job runs on, as the worker finds it: `path` "" for a new, empty one of `spec` (a prefill, an
    opened file), else its session file (warm, or opened now), which must hold `spec`.

    Attributes:
        spec: the session's spec (validated on the server). kv_budget_bytes: its out-of-memory guard (None: none).
        path: its session file ("": none yet). hold: where the worker links a new session's file for the session alone
            (`link_file`), before the bounded folder may drop it ("": nowhere).
    """

    spec: CacheSpec
    kv_budget_bytes: int | None
    path: str = ""
    hold: str = ""


@dataclass(frozen=True)
class WorkOrder:
    """What crosses to the worker for one job.

    Attributes:
        job: the job record. session: the session it runs on (None: a long job). model: the name of the model the
            server prepared it for (the worker refuses another). stop_path: the file whose existence stops it.
        folder, folder_bytes: the jobs' folder of session files ("": `kvdemo.paths.cache_dir()/sessions`) and its
            bound (0: `SESSION_FILES_BYTES`).
    """

    job: Job
    session: SessionRef | None
    model: str
    stop_path: str
    folder: str = ""
    folder_bytes: int = 0

    @property
    def kind(self) -> str:
        """The job's kind (`prefill`, `answer`, ...)."""
        return self.job.kind


@dataclass(frozen=True)
class Finished:
    """A job's end: its result, and for a session's job the cache's decode floor now
    (`kvdemo.cache.state.speedlimit.SpeedLimit`) and whether the session was warm (`hit`) or opened (`miss`; "" for a
    new one)."""

    result: Any
    speed: Any = None
    warm: str = ""


@dataclass(frozen=True)
class Answered:
    """An answer that ended with an error in the worker (a decode step failed): the `Answer` the session recorded
    (`finish_reason` "error"), sent before the exception so that the server's session records it too."""

    answer: Any


@dataclass(frozen=True)
class Raised:
    """A job refused (`ValueError`, `ImportError`) or stopped (`Cancelled`): the exception itself, raised again in
    the server."""

    error: BaseException


class StopFile:
    """A file whose existence asks one job to stop: made by `set`, removed by `close` (the server's side), read by
    `is_set` (the worker's, forked on the same machine: it sees the server's files)."""

    def __init__(self, path: str | Path):
        self.path, self.closed = Path(path), not str(path)  # "": no file, never set
        self._lock = threading.Lock()  # a Stop from another thread never writes the file after `close`

    def set(self) -> None:
        """Ask the job to stop (idempotent; nothing once the job has ended)."""
        with self._lock:
            if not self.closed:
                self.path.touch()

    def is_set(self) -> bool:
        """Whether the job has been asked to stop."""
        return not self.closed and os.path.exists(self.path)

    def close(self) -> None:
        """Remove the file (the job has ended)."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self.path.unlink(missing_ok=True)


def serve_model(model: LoadedModel | Callable[[], LoadedModel]) -> None:
    """Name the model the jobs run: a `LoadedModel`, or a callable giving it (`App.wait_for_model`). Call it in the
    main process before the first job, so that a forked worker inherits it."""
    global _MODEL
    _MODEL = (lambda: model) if isinstance(model, LoadedModel) else model


def job_seconds(order: WorkOrder) -> int:
    """The duration ZeroGPU reserves for `order` (seconds, `MIN_SECONDS` to `MAX_SECONDS`), from its job's estimate
    (`Job.estimated_seconds`: no model, no tokenizer, no CUDA needed)."""
    return int(min(MAX_SECONDS, max(MIN_SECONDS, round(order.job.estimated_seconds()))))


def link_file(path: Path, to: Path) -> Path:
    """`path` hard-linked at `to` (copied where they are on different disks), `to`'s folder made; returns `to`."""
    to.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(path, to)
    except OSError:
        shutil.copyfile(path, to)
    return to


def session_files(folder: str = "", max_bytes: int = 0) -> SessionFiles:
    """The jobs' folder of session files: `folder`, or "" for `kvdemo.paths.cache_dir()/sessions` (the app's), within
    `max_bytes` (0: `SESSION_FILES_BYTES`)."""
    from kvdemo.paths import cache_dir

    return SessionFiles(Path(folder) if folder else cache_dir() / "sessions", max_bytes or SESSION_FILES_BYTES)


class WorkerPlace:
    """The `kvdemo.serve.jobs.Place` of a worker: every prefill is saved to the jobs' folder and linked at the
    session's own path (`SessionRef.hold`) before the bounded folder is trimmed, so the session keeps its file
    whatever another visitor's prefill drops."""

    def __init__(self, loaded: LoadedModel, files: SessionFiles, hold: str):
        self.loaded, self.files, self.hold = loaded, files, hold

    def open(self, session: QASession, context: PreparedContext) -> str | None:
        opened = self.files.open(session, context)
        return self.keep(str(opened)) if opened is not None else None

    def save(self, session: QASession, context: PreparedContext) -> str:
        from kvdemo.qa.session_file import save_session

        path = self.files.path(self.loaded, session.spec, context)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_session(session, path)
        kept = self.keep(str(path))
        self.files.trim()
        return kept

    def keep(self, path: str) -> str:
        if not self.hold or not Path(path).is_file():  # a path that is no file: opening it refuses it with why
            return path
        return str(link_file(Path(path), Path(self.hold)))

    def session(self, ref: SessionRef | None) -> tuple[QASession | None, str]:
        """The session `ref` names, and `hit`/`miss` for one found warm or opened from its file ("" for a new one).

        Raises:
            SessionFileError (a ValueError): its file cannot be opened here, or holds another spec.
        """
        from kvdemo.qa.session_file import open_session

        if ref is None:
            return None, ""
        if not ref.path:
            return QASession(self.loaded, ref.spec, ref.kv_budget_bytes), ""
        path = Path(ref.path)
        warm = WARM.get(path, self.loaded)
        if warm is not None and ref.spec.validate(self.loaded.config).full_text == warm.spec.full_text:
            return warm, "hit"
        session = open_session(self.loaded, path, ref.spec, ref.kv_budget_bytes)  # another spec: refused with why
        WARM.put(path, session)
        return session, "miss"


def _model() -> LoadedModel:
    if _MODEL is None:
        raise ValueError("no model is served to the GPU job: call kvdemo.serve.gpu_job.serve_model first")
    return _MODEL()


def _gpu_job(order: WorkOrder) -> Generator[Any, None, None]:
    """Run one job (see the module docstring) on the served model, moved to the GPU where CUDA is available, and
    yield its notes (`JobProgress`, `StepEvent`) as they come, then `Finished`, or `Raised` where the job refused or
    was stopped. Any other exception (a bug, CUDA out of memory) is raised as it is."""
    with _LOCK:  # one job at a time per process (a ZeroGPU worker runs one anyway)
        try:
            loaded = device_model(_model())
            if order.model and order.model != loaded.name:
                raise ValueError(f"this job was prepared for {order.model}; the worker serves {loaded.name}")
            for backend in BACKENDS.values():  # each format's own set-up on the device (quanto's unpacking)
                backend.set_up(loaded.device)
            hold = order.session.hold if order.session is not None else ""
            place = WorkerPlace(loaded, session_files(order.folder, order.folder_bytes), hold)
            session, warm = place.session(order.session)
            answered = len(session.history) if session is not None else 0
            try:
                result = yield from order.job.run(place, session, StopFile(order.stop_path))
            except Exception:
                if session is not None and len(session.history) > answered:  # a failed answer, recorded here
                    yield Answered(session.history[-1])
                raise
        except (ValueError, ImportError, Cancelled) as error:
            yield Raised(error)
            return
        if session is None:
            yield Finished(result)
            return
        if isinstance(result, PrefillDone) and result.path:  # a session's new file: the next answer finds it warm
            WARM.put(Path(result.path), session)
        yield Finished(result, session.speed_limit(), warm)


try:  # a ZeroGPU Space provides `spaces`; off ZeroGPU (SPACES_ZERO_GPU unset) its GPU decorator hands the function back
    import spaces  # type: ignore[import-not-found]
except ImportError:  # not installed (here, and on any other machine): the job is the plain generator
    gpu_job = _gpu_job
else:

    @spaces.GPU(duration=job_seconds)
    def gpu_job(order: WorkOrder) -> Generator[Any, None, None]:
        """`_gpu_job(order)` in ZeroGPU's worker, with the GPU for `job_seconds(order)` at most."""
        yield from _gpu_job(order)
