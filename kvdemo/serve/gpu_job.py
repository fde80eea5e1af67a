"""The door's model work in a device worker, for Hugging Face ZeroGPU: one generator, `gpu_job(request)`, decorated
with `@spaces.GPU(duration=job_seconds)` where the `spaces` package is installed (a ZeroGPU Space provides it;
elsewhere `gpu_job` is the plain generator and nothing changes). `kvdemo.serve.door.Door` is its one caller, through
`kvdemo.serve.device.Device`: the page's tabs, the MCP tools and the command line reach it only there.

How ZeroGPU runs it (`spaces` 0.51.3, `spaces/zero/wrappers.py: generator_function_wrapper`): the first call forks one
worker process for the decorated function and the GPU lent; later calls reuse that worker while the scheduler reports
it idle, else fork a new one. The request goes to the worker pickled, and each value the generator yields comes back
pickled, as it is yielded; the GPU is taken back when the generator ends. So:
- the request (`GpuRequest`) and every record yielded hold no tensor: numbers, strings and the records' dataclasses
  (`JobProgress`, `StepEvent`, `PrefillDone`, `AnswerDone`, `JobDone`, `JobCancelled`, `JobRefused`), a few kB each
  (a comparison's report or a grid tens of kB);
- the model is loaded in the main process on the CPU before the first call (`serve_model`), and the fork inherits
  it; the job moves it to the GPU inside the worker (`torch.cuda.is_available()` is asked only there);
- a prefill writes a session file (`kvdemo.qa.session_file`) and yields its path; an answer gets the path and the
  question. The worker keeps a few prefilled sessions warm (`kvdemo.serve.warm_sessions`): on a hit the answer runs
  on the warm session, restored in place after it as always; on a miss (a fresh worker, or another visitor's) it
  opens the file, one copy of the cache to the device. Both give the same answer (docs/DESIGN.md, invariant 2);
- **Stop and Cancel** reach the worker through a file (`GpuRequest.stop_path`) that the server writes: the job looks
  for it after every decode step, prefill chunk and progress note, and ends as Stop ends an answer in process (the
  cache restored, the answer `stopped`; a long job's partial records in `JobCancelled`). A stop of `spaces`' own (the
  caller gone) closes the generator, which restores the cache the same way;
- a refused request (`ValueError`, `ImportError`: a context too long, a file of another model) is yielded as
  `JobRefused` with its message (ZeroGPU would pass on only an exception's class name); `Device` raises it again.

What this module cannot show off ZeroGPU: tests/zerogpu_harness.py plays ZeroGPU's part on the CPU (fork, pickling
queues, four scheduler policies), tests/stand_in/spaces a forking `spaces` for the whole app; docs/space.md lists what
still needs a real ZeroGPU Space.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvdemo.cache.registry import BACKENDS, BASELINE
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS
from kvdemo.qa.models import LoadedModel
from kvdemo.serve.session_files import SessionFiles
from kvdemo.serve.warm_sessions import WARM, device_model

KINDS = ("prefill", "open", "answer", "compare", "needle", "recommend")
"""The jobs `gpu_job` runs."""

# Duration (seconds): upper bounds from this machine's idle CPU figures (docs/benchmarks.md, `make bench` of
# 2026-11-30, SmolLM2-135M, float32 on 2 cores: a prefill of 1,341 tokens in 3-5 s, 3.7 ms per token; a decode step
# 0.057-0.115 s, an hqq flush step at 2,172 tokens 2.5 s). No GPU figure is measured here: a ZeroGPU H200 slice is
# taken to be no slower than 2 CPU cores for a 135M model, so these over-ask, which ZeroGPU tolerates (the
# duration is the longest a call may run; a shorter one only ranks higher in the queue).
START_SECONDS = 15.0
"""A cold worker: the fork, CUDA's start, the model moved to the GPU, the backends' imports (estimated)."""
PREFILL_SECONDS_PER_TOKEN = 0.004
"""One token of a prefill (3.7 ms on 2 idle CPU cores)."""
STEP_SECONDS = 0.12
"""One decode step or one teacher-forced token, a share of flushes included (0.057-0.115 s on 2 idle CPU cores)."""
OPEN_SECONDS = 5.0
"""Opening a session file on a miss (digest, model check, one copy to the device; far less than its prefill)."""
CHARS_PER_TOKEN = 3.0
"""Characters per token, on the low side (English runs at about 4 with SmolLM2's tokenizer): the duration is
computed in the main process from the request alone, without tokenizing."""
CANDIDATE_SECONDS = 4.0
"""One candidate of a recommendation (its hand-over and probe; 0.5-3 s on 2 idle CPU cores)."""
MIN_SECONDS, MAX_SECONDS = 20, 300
"""The bounds of a job's duration (seconds)."""
POLL_SECONDS = 0.2
"""How often a job running in a thread looks for its stop file (seconds)."""

_MODEL: Callable[[], LoadedModel] | None = None
_LOCK = threading.Lock()


@dataclass(frozen=True)
class GpuRequest:
    """One job, small and picklable (strings and numbers only).

    Attributes:
        kind: one of `KINDS`.
        spec: the spec's text (`hqq:4`) for a prefill; for an answer or an open, the spec the session file must hold
            ("" takes the file's).
        context: the text to prefill (prefill, compare, recommend).
        session_path: the session file: where a prefill writes it ("": a name made from the model, spec and context
            in `folder`), what an answer or an open reads.
        question: an answer's question.
        max_new_tokens: per answer (tokens).
        folder: where a prefill writes its file when `session_path` is ""; "" is `kvdemo.paths.cache_dir()/sessions`.
        folder_bytes: the bound of that folder (bytes, least recently used out); 0: `SESSION_FILES_BYTES`.
        hold_path: where a prefill links its file for the session alone (`link_file`), before the folder is trimmed:
            the session's own copy, which its answers open ("": none).
        kv_budget_bytes: the session's out-of-memory guard (`QASession`); 0: none.
        stop_path: a file the server writes to stop the job (Stop, Cancel); "": none.
        questions, specs: a comparison's questions and specs (texts); a needle grid's specs.
        golds: per question the accepted answers, or None (a comparison).
        perplexity_tokens, continuation, plans: a comparison's perplexity feed and per-layer plans
            ((base spec text, bytes per token), ...).
        lengths, depths, seed, needles_per_context: a needle grid's context lengths (tokens), depths (%), seed and
            needles per prefill (0: every depth in one).
        max_kl, bytes_per_token, engine, plan: a recommendation's ceiling (nats) or byte budget (bytes per token;
            neither: the default ceiling), engine, and whether it measures a per-layer plan.
    """

    kind: str
    spec: str = ""
    context: str = ""
    session_path: str = ""
    question: str = ""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    folder: str = ""
    folder_bytes: int = 0
    hold_path: str = ""
    kv_budget_bytes: int = 0
    stop_path: str = ""
    questions: tuple[str, ...] = ()
    specs: tuple[str, ...] = ()
    golds: tuple[tuple[str, ...], ...] | None = None
    perplexity_tokens: int = 0
    continuation: str | None = None
    plans: tuple[tuple[str, float], ...] = ()
    lengths: tuple[int, ...] = ()
    depths: tuple[float, ...] = ()
    seed: int = 0
    needles_per_context: int = 1
    max_kl: float | None = None
    bytes_per_token: float | None = None
    engine: str = "any"
    plan: bool = True


@dataclass(frozen=True)
class JobProgress:
    """Work done so far: `done` of `total` units, and what runs (`what`). A prefill's `unit` is `tokens` (its
    chunks) or `layers` (its quantizer's hand-over); a long job's `steps`."""

    done: int
    total: int
    what: str
    unit: str = "steps"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`from_dict` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobProgress:
        """The record `to_dict` gave."""
        return cls(**data)


@dataclass(frozen=True)
class PrefillDone:
    """A prefill's (or an opened file's) end: the session file, whether it was opened rather than prefilled, the
    spec it holds, the `PrefillReport` and the cache's decode floor (`kvdemo.cache.state.speedlimit.SpeedLimit`)."""

    session_path: str
    file_bytes: int
    opened: bool
    spec: str
    report: Any
    speed: Any


@dataclass(frozen=True)
class AnswerDone:
    """An answer's end: the `Answer` (the cache restored), `warm` (`hit`: the worker's warm session; `miss`: opened
    from the file), and the cache's decode floor."""

    answer: Any
    warm: str
    speed: Any


@dataclass(frozen=True)
class JobDone:
    """A long job's result: a `ComparisonReport`, a `NeedleGrid` or a `Recommendation`."""

    result: Any


@dataclass(frozen=True)
class JobCancelled:
    """A long job stopped by its stop file, or a prefill stopped: what finished before (the partial report, grid or
    recommendation; a prefill's message)."""

    partial: Any


@dataclass(frozen=True)
class JobRefused:
    """The job refused its request: the exception's class name and message (`ValueError`, `ImportError`)."""

    error_type: str
    message: str


def serve_model(model: LoadedModel | Callable[[], LoadedModel]) -> None:
    """Name the model the jobs run: a `LoadedModel` on the CPU, or a callable giving it (`App.wait_for_model`).
    Call it in the main process before the first job, so that a forked worker inherits it."""
    global _MODEL
    _MODEL = (lambda: model) if isinstance(model, LoadedModel) else model


def job_seconds(request: GpuRequest) -> int:
    """The duration ZeroGPU reserves for `request` (seconds, `MIN_SECONDS` to `MAX_SECONDS`), from the request
    alone (no model, no tokenizer, no CUDA): `START_SECONDS` plus, by kind, the context's tokens (characters /
    `CHARS_PER_TOKEN`) x `PREFILL_SECONDS_PER_TOKEN` and the answer tokens x `STEP_SECONDS` (an answer: its
    question and `max_new_tokens`, plus `OPEN_SECONDS` for a miss; a comparison: per spec a prefill and per
    question an answer and its scoring, with a perplexity feed another prefill and its tokens, with a per-layer plan
    two more specs; a grid: per spec and length a prefill and per depth an answer and a score; a recommendation: one
    prefill, `dynamic`'s answers and `CANDIDATE_SECONDS` per candidate, about 50)."""
    return int(min(MAX_SECONDS, max(MIN_SECONDS, round(estimated_seconds(request)))))


def estimated_seconds(request: GpuRequest) -> float:
    """The seconds `request`'s job may take (`job_seconds` before its bounds): `kvdemo.serve.device.check_duration`
    refuses a job over `MAX_SECONDS` rather than let ZeroGPU end it midway."""
    prefill = PREFILL_SECONDS_PER_TOKEN / CHARS_PER_TOKEN
    steps = request.max_new_tokens * STEP_SECONDS
    if request.kind == "prefill":
        seconds = len(request.context) * prefill
    elif request.kind in ("answer", "open"):
        seconds = OPEN_SECONDS + len(request.question) * prefill + (steps if request.kind == "answer" else 0)
    elif request.kind == "compare":
        specs = len(set(request.specs) | {BASELINE}) + 2 * len(request.plans)
        feed = (
            len(request.context) * prefill + request.perplexity_tokens * STEP_SECONDS
            if request.perplexity_tokens
            else 0
        )
        seconds = specs * (len(request.context) * prefill + len(request.questions) * 2 * steps + feed)
    elif request.kind == "recommend":
        seconds = len(request.context) * prefill + 3 * steps + 50 * CANDIDATE_SECONDS
    else:
        grid = max(1, len(request.specs)) * len(request.lengths)
        seconds = grid * PREFILL_SECONDS_PER_TOKEN * (sum(request.lengths) / max(1, len(request.lengths)))
        seconds += grid * len(request.depths) * 2 * steps
    return START_SECONDS + seconds


def _model() -> LoadedModel:
    if _MODEL is None:
        raise ValueError("no model is served to the GPU job: call kvdemo.serve.gpu_job.serve_model first")
    return _MODEL()


SESSION_FILES_BYTES = 2 << 30
"""The bound of the jobs' folder of session files (`kvdemo.serve.session_files.SessionFiles`, least recently used
first out): 2 GiB, the app's `--session-files-mib` default."""


def session_files(folder: str = "", max_bytes: int = 0) -> SessionFiles:
    """The jobs' folder of session files: `folder`, or "" for `kvdemo.paths.cache_dir()/sessions` (the app's), within
    `max_bytes` (0: `SESSION_FILES_BYTES`)."""
    from kvdemo.paths import cache_dir

    return SessionFiles(Path(folder) if folder else cache_dir() / "sessions", max_bytes or SESSION_FILES_BYTES)


def stopped(request: GpuRequest) -> bool:
    """Whether the server has asked `request`'s job to stop (its stop file exists)."""
    return bool(request.stop_path) and os.path.exists(request.stop_path)


def _threaded(request: GpuRequest, work: Callable[[Callable[..., None]], Any], on_stop: Callable[[], None]):
    """Run `work(emit)` in a thread and yield each `JobProgress` it emits (`emit(done, total, what, unit)`) as it
    comes; `on_stop()` once the stop file appears (the work then ends at its next check). Returns (to `yield from`)
    what `work` returned; raises what it raised."""
    notes: queue.Queue[Any] = queue.Queue()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work(lambda done, total, what, unit="steps": notes.put(JobProgress(done, total, what, unit)))
        except BaseException as error:  # handed to the generator's thread, raised there
            out["error"] = error
        finally:
            notes.put(None)

    thread = threading.Thread(target=run, daemon=True, name="kvdemo-gpu-job")
    thread.start()
    asked = False
    try:
        while True:
            try:
                note = notes.get(timeout=POLL_SECONDS)
            except queue.Empty:
                note = ...
            if not asked and stopped(request):
                asked = True
                on_stop()
            if note is None:
                break
            if note is not ...:
                yield note
    finally:
        if thread.is_alive():  # the generator was closed (the caller left): the work stops at its next check
            on_stop()
        thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _speed(session: Any) -> Any:
    from kvdemo.cache.state.speedlimit import speed_limit

    return speed_limit(session.loaded.model, session.cache)


def _prefill(loaded: LoadedModel, request: GpuRequest) -> Iterator[Any]:
    """Open the session file of the same context, model and spec when the folder holds one (as the app does), else
    prefill (progress per chunk and per quantized layer) and save it there (or to `request.session_path`)."""
    from kvdemo.cache.spec import CacheSpec
    from kvdemo.qa.prefill import PrefillStopped
    from kvdemo.qa.session import QASession
    from kvdemo.qa.session_file import save_session

    session = QASession(loaded, CacheSpec.parse(request.spec or BASELINE), request.kv_budget_bytes or None)
    files = session_files(request.folder, request.folder_bytes)
    prepared = session.prepare(request.context, max_tokens=loaded.max_context_tokens)
    path = Path(request.session_path) if request.session_path else files.path(loaded, session.spec, prepared)
    opened = files.open(session, prepared) if not request.session_path else None
    report, saved = opened, False
    if report is None:

        def work(emit: Callable[..., None]) -> Any:
            return session.prefill(
                prepared, max_new_tokens=request.max_new_tokens,
                on_progress=lambda done, total: emit(done, total, "prefilling", "tokens"),
                on_quantize=lambda done, total: emit(done, total, "quantizing", "layers"),
            )  # fmt: skip

        try:
            report = yield from _threaded(request, work, session.request_stop)
        except PrefillStopped as stopped_early:
            yield JobCancelled(str(stopped_early))
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        save_session(session, path)
        saved = True
    if request.hold_path:  # the session's own copy, before the bounded folder may drop the file
        path = link_file(path, Path(request.hold_path))
    if saved:
        files.trim()
    WARM.put(path, session)
    yield PrefillDone(str(path), path.stat().st_size, opened is not None, session.spec.text, report, _speed(session))


def link_file(path: Path, to: Path) -> Path:
    """`path` hard-linked at `to` (copied where they are on different disks), `to`'s folder made; returns `to`."""
    to.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(path, to)
    except OSError:
        shutil.copyfile(path, to)
    return to


def _warm_or_open(loaded: LoadedModel, request: GpuRequest) -> tuple[Any, bool]:
    """The session of `request.session_path`: the warm one (True) or opened from the file now (False)."""
    from kvdemo.cache.spec import CacheSpec
    from kvdemo.qa.session_file import open_session

    path = Path(request.session_path)
    spec = CacheSpec.parse(request.spec) if request.spec else None
    session = WARM.get(path, loaded)
    if session is not None and spec is not None and spec.validate(loaded.config).text != session.spec.text:
        session = None  # another spec asked: opening the file refuses it with the reason
    if session is not None:
        return session, True
    session = open_session(loaded, path, spec, request.kv_budget_bytes or None)
    WARM.put(path, session)
    return session, False


def _open(loaded: LoadedModel, request: GpuRequest) -> Iterator[Any]:
    """A session file opened (or found warm) in the worker, as a prefill's end."""
    session, _ = _warm_or_open(loaded, request)
    path = Path(request.session_path)
    yield PrefillDone(str(path), path.stat().st_size, True, session.spec.text, session.prefill_report, _speed(session))


def _answer(loaded: LoadedModel, request: GpuRequest) -> Iterator[Any]:
    """The answer's `StepEvent`s as they come, then `AnswerDone`; the stop file ends it after the current step."""
    session, warm = _warm_or_open(loaded, request)
    stream = session.stream(session.prepare_question(request.question, request.max_new_tokens))
    try:
        if stopped(request):  # a Stop that came before the job began: after the first step, as in process
            session.request_stop()
        for event in stream:
            yield event
            if stopped(request):
                session.request_stop()
    finally:
        stream.close()  # restored (also when the generator is closed: the caller left)
    yield AnswerDone(session.history[-1], "hit" if warm else "miss", _speed(session))


def _long(request: GpuRequest, work: Callable[[Callable[..., None], threading.Event], Any]) -> Iterator[Any]:
    """A long job (`work(emit, cancel)`) with progress, cancelled by the stop file: `JobDone`, or `JobCancelled`
    with what its cancellation carried."""
    from kvdemo.compare.recommendation import RecommendationCancelled
    from kvdemo.compare.records import ComparisonCancelled
    from kvdemo.needle.records import NeedleCancelled

    cancel = threading.Event()
    try:
        result = yield from _threaded(request, lambda emit: work(emit, cancel), cancel.set)
    except ComparisonCancelled as stopped_early:
        yield JobCancelled(stopped_early.report)
    except NeedleCancelled as stopped_early:
        yield JobCancelled(stopped_early.grid)
    except RecommendationCancelled as stopped_early:
        yield JobCancelled(stopped_early.recommendation)
    else:
        yield JobDone(result)


def _compare(loaded: LoadedModel, request: GpuRequest) -> Iterator[Any]:
    from kvdemo.cache.spec import CacheSpec
    from kvdemo.compare.run import compare

    specs = [CacheSpec.parse(text) for text in request.specs]
    golds = None if request.golds is None else [list(g) for g in request.golds]
    plans = [(CacheSpec.parse(base), budget) for base, budget in request.plans]
    yield from _long(
        request,
        lambda emit, cancel: compare(
            loaded, request.context, list(request.questions), specs, request.max_new_tokens, golds, cancel=cancel,
            on_progress=emit, kv_budget_bytes=request.kv_budget_bytes or None,
            perplexity_tokens=request.perplexity_tokens, continuation=request.continuation, plans=plans,
        ),
    )  # fmt: skip


def _needle(loaded: LoadedModel, request: GpuRequest) -> Iterator[Any]:
    from kvdemo.needle.grid import needle_grid

    yield from _long(
        request,
        lambda emit, cancel: needle_grid(
            loaded, list(request.specs), list(request.lengths), list(request.depths),
            needles_per_context=request.needles_per_context or None, seed=request.seed,
            max_new_tokens=request.max_new_tokens, cancel=cancel, on_progress=emit,
            kv_budget_bytes=request.kv_budget_bytes or None,
        ),
    )  # fmt: skip


def _recommend(loaded: LoadedModel, request: GpuRequest) -> Iterator[Any]:
    from kvdemo.compare.recommend import recommend

    yield from _long(
        request,
        lambda emit, cancel: recommend(
            loaded, request.context, list(request.questions), max_kl=request.max_kl,
            bytes_per_token=request.bytes_per_token, engine=request.engine, plans=request.plan, cancel=cancel,
            on_progress=emit,
        ),
    )  # fmt: skip


_JOBS: dict[str, Callable[[LoadedModel, GpuRequest], Iterator[Any]]] = {
    "prefill": _prefill,
    "open": _open,
    "answer": _answer,
    "compare": _compare,
    "needle": _needle,
    "recommend": _recommend,
}


def _gpu_job(request: GpuRequest) -> Generator[Any, None, None]:
    """Run one job (see the module docstring) on the served model, moved to the GPU where CUDA is available, and
    yield its records: `JobProgress` notes and `StepEvent`s as they come, then one end record (`PrefillDone`,
    `AnswerDone`, `JobDone`, `JobCancelled`), or `JobRefused` where the job refused the request with a ValueError or
    an ImportError. Any other exception (a bug, CUDA out of memory) is raised as it is."""
    with _LOCK:  # one job at a time per process (a ZeroGPU worker runs one anyway)
        try:
            if request.kind not in _JOBS:
                raise ValueError(f"kind={request.kind!r} is not a GPU job; use one of {', '.join(KINDS)}")
            loaded = device_model(_model())
            for backend in BACKENDS.values():  # each format's own set-up on the device (quanto's unpacking)
                backend.set_up(loaded.device)
            yield from _JOBS[request.kind](loaded, request)
        except (ValueError, ImportError) as error:
            yield JobRefused(type(error).__name__, str(error))


try:  # a ZeroGPU Space provides `spaces`; off ZeroGPU (SPACES_ZERO_GPU unset) its GPU decorator hands the function back
    import spaces  # type: ignore[import-not-found]
except ImportError:  # not installed (here, and on any other machine): the job is the plain generator
    gpu_job = _gpu_job
else:

    @spaces.GPU(duration=job_seconds)
    def gpu_job(request: GpuRequest) -> Generator[Any, None, None]:
        """`_gpu_job(request)` in ZeroGPU's worker, with the GPU for `job_seconds(request)` at most."""
        yield from _gpu_job(request)
