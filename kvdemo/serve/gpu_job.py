"""The Space's one GPU job, for Hugging Face ZeroGPU: a prefill, an answer, a comparison or a needle grid, each one
call of `gpu_job(request)`, decorated with `@spaces.GPU(duration=job_seconds)` where the `spaces` package is installed
(a ZeroGPU Space provides it); elsewhere `gpu_job` is the plain function and nothing changes.

How ZeroGPU runs it (`spaces` 0.51.3, `spaces/zero/wrappers.py`): the first call forks one worker process for the
decorated function and the GPU lent; later calls reuse that worker while the scheduler reports it idle, else fork a
new one. The request and the result cross between the processes by pickle, and the GPU is taken back when the call
returns. So:
- the request (`GpuRequest`) and the result (a dict of str, int, float, bool, None, lists and dicts: a few kB; a
  comparison's or a grid's records tens of kB) hold no tensor;
- the model is loaded in the main process on the CPU before the first call (`serve_model`), and the fork inherits
  it; the job moves it to the GPU inside the worker (`torch.cuda.is_available()` is asked only there): the main
  process touches no CUDA;
- a prefill writes a session file (`kvdemo.qa.session_file`) and returns its path; an answer gets the path and the
  question. The worker keeps a few prefilled sessions warm (`kvdemo.serve.warm_sessions`): on a hit the answer runs
  on the warm session, restored in place after it as always; on a miss (a fresh worker, or another visitor's) it
  opens the file, one copy of the cache to the device. Both give the same answer (docs/DESIGN.md, invariant 2).
- A raised `ValueError` or `ImportError` (a refused context, spec or file) comes back as the result's `error`
  (ZeroGPU would pass on only its class name); `run_job` raises it again as `GpuJobError` in the caller.

What this module cannot show off ZeroGPU: tests/zerogpu_harness.py plays ZeroGPU's part on the CPU (fork, pickling
queues, four scheduler policies); docs/space.md lists what still needs a real ZeroGPU Space.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS
from kvdemo.qa.models import LoadedModel
from kvdemo.serve.session_files import SessionFiles
from kvdemo.serve.warm_sessions import WARM, device_model, quanto_on_device

KINDS = ("prefill", "answer", "compare", "needle")
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
MIN_SECONDS, MAX_SECONDS = 20, 300
"""The bounds of a job's duration (seconds)."""

_MODEL: Callable[[], LoadedModel] | None = None
_LOCK = threading.Lock()


class GpuJobError(ValueError):
    """A job refused its request (the message is the job's, e.g. a context too long or a session file of another
    model), raised by `run_job` in the caller's process."""


@dataclass(frozen=True)
class GpuRequest:
    """One GPU job, small and picklable (strings and numbers only).

    Attributes:
        kind: one of `KINDS`.
        spec: the spec's text (`hqq:4`) for a prefill; for an answer, the spec the session file must hold ("" takes
            the file's).
        context: the text to prefill (prefill, compare).
        session_path: the session file: where a prefill writes it ("" : a name made from the model, spec and context
            in `folder`), what an answer opens.
        question: an answer's question.
        max_new_tokens: per answer (tokens).
        folder: where a prefill writes its file when `session_path` is ""; "" is `kvdemo.paths.cache_dir()/sessions`.
        kv_budget_bytes: the session's out-of-memory guard (`QASession`); 0: none.
        questions, specs: a comparison's questions and specs (texts); a needle grid's specs.
        lengths, depths, seed: a needle grid's context lengths (tokens), depths (%) and seed.
    """

    kind: str
    spec: str = ""
    context: str = ""
    session_path: str = ""
    question: str = ""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    folder: str = ""
    kv_budget_bytes: int = 0
    questions: tuple[str, ...] = ()
    specs: tuple[str, ...] = ()
    lengths: tuple[int, ...] = ()
    depths: tuple[float, ...] = ()
    seed: int = 0


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
    question an answer and its scoring; a grid: per spec and length a prefill and per depth an answer and a score)."""
    prefill = PREFILL_SECONDS_PER_TOKEN / CHARS_PER_TOKEN
    steps = request.max_new_tokens * STEP_SECONDS
    if request.kind == "prefill":
        seconds = len(request.context) * prefill
    elif request.kind == "answer":
        seconds = OPEN_SECONDS + len(request.question) * prefill + steps
    elif request.kind == "compare":
        specs = len(set(request.specs) | {"dynamic"})
        seconds = specs * (len(request.context) * prefill + len(request.questions) * 2 * steps)
    else:
        grid = max(1, len(request.specs)) * len(request.lengths)
        seconds = grid * PREFILL_SECONDS_PER_TOKEN * (sum(request.lengths) / max(1, len(request.lengths)))
        seconds += grid * len(request.depths) * 2 * steps
    return int(min(MAX_SECONDS, max(MIN_SECONDS, round(START_SECONDS + seconds))))


def _model() -> LoadedModel:
    if _MODEL is None:
        raise ValueError("no model is served to the GPU job: call kvdemo.serve.gpu_job.serve_model first")
    return _MODEL()


SESSION_FILES_BYTES = 2 << 30
"""The bound of the jobs' folder of session files (`kvdemo.serve.session_files.SessionFiles`, least recently used
first out): 2 GiB, the app's `--session-files-mib` default."""


def session_files(folder: str = "") -> SessionFiles:
    """The jobs' folder of session files: `folder`, or "" for `kvdemo.paths.cache_dir()/sessions` (the app's)."""
    from kvdemo.paths import cache_dir

    return SessionFiles(Path(folder) if folder else cache_dir() / "sessions", SESSION_FILES_BYTES)


def _prefill(loaded: LoadedModel, request: GpuRequest) -> dict[str, Any]:
    """Open the session file of the same context, model and spec when the folder holds one (as the app does), else
    prefill and save it there (or to `request.session_path`)."""
    from kvdemo.cache.spec import CacheSpec
    from kvdemo.qa.session import QASession
    from kvdemo.qa.session_file import save_session

    session = QASession(loaded, CacheSpec.parse(request.spec or "dynamic"), request.kv_budget_bytes or None)
    files = session_files(request.folder)
    prepared = session.prepare(request.context, max_tokens=loaded.max_context_tokens)
    path = Path(request.session_path) if request.session_path else files.path(session, prepared)
    opened = files.open(session, prepared) if not request.session_path else None
    report = opened or session.prefill(prepared, max_new_tokens=request.max_new_tokens)
    if opened is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_session(session, path)
        files.trim()
    WARM.put(path, session)
    return {
        "session_path": str(path),
        "file_bytes": path.stat().st_size,
        "opened": opened is not None,
        "spec": session.spec.text,
        "context_tokens": report.context_tokens,
        "prefill_seconds": round(report.prefill_seconds or report.seconds, 4),
        "kv_bytes": report.kv_bytes,
        "full_precision_bytes": report.full_precision_bytes,
        "bytes_per_token": round(report.bytes_per_token, 2),
        "ratio_to_full_precision": round(report.ratio_to_full_precision, 5),
        "prompt_note": report.prompt_note,
        "clock_note": report.clock_note,
    }


def _answer(loaded: LoadedModel, request: GpuRequest) -> dict[str, Any]:
    from kvdemo.cache.spec import CacheSpec
    from kvdemo.qa.session_file import open_session

    path = Path(request.session_path)
    spec = CacheSpec.parse(request.spec) if request.spec else None
    session = WARM.get(path, loaded)
    if session is not None and spec is not None and spec.validate(loaded.config).text != session.spec.text:
        session = None  # another spec asked: opening the file refuses it with the reason
    warm = session is not None
    if session is None:
        session = open_session(loaded, path, spec, request.kv_budget_bytes or None)
        WARM.put(path, session)
    answer = session.ask(request.question, request.max_new_tokens)
    return {
        "warm": "hit" if warm else "miss",
        "session_path": str(path),
        "spec": session.spec.text,
        "context_tokens": session.cache_length,
        **answer.to_dict(),
    }


def _compare(loaded: LoadedModel, request: GpuRequest) -> dict[str, Any]:
    from kvdemo.cache.spec import CacheSpec
    from kvdemo.compare.run import compare

    specs = [CacheSpec.parse(text) for text in request.specs]
    report = compare(
        loaded, request.context, list(request.questions), specs, request.max_new_tokens,
        kv_budget_bytes=request.kv_budget_bytes or None,
    )  # fmt: skip
    return {"report": report.to_dict()}


def _needle(loaded: LoadedModel, request: GpuRequest) -> dict[str, Any]:
    from kvdemo.needle.grid import needle_grid

    grid = needle_grid(
        loaded, list(request.specs), list(request.lengths), list(request.depths), seed=request.seed,
        max_new_tokens=request.max_new_tokens, kv_budget_bytes=request.kv_budget_bytes or None,
    )  # fmt: skip
    return {"grid": grid.to_dict()}


_JOBS: dict[str, Callable[[LoadedModel, GpuRequest], dict[str, Any]]] = {
    "prefill": _prefill,
    "answer": _answer,
    "compare": _compare,
    "needle": _needle,
}


def _gpu_job(request: GpuRequest) -> dict[str, Any]:
    """Run one job (see the module docstring) on the served model, moved to the GPU where CUDA is available.

    Args:
        request: a `GpuRequest`.

    Returns:
        A dict of plain values: `kind`, `ok`, `device` (`cuda` or `cpu`), `quanto` (on CUDA: whether quanto's CUDA
        extension or its pure-torch unpack runs; None on the CPU), `seconds` (the job's wall time), and either the
        kind's fields (prefill: `session_path`, `file_bytes`, `context_tokens`, `kv_bytes`, ...; answer: `warm`
        (`hit` | `miss`), `answer`, `token_ids`, ... (`Answer.to_dict`); compare: `report`
        (`ComparisonReport.to_dict`); needle: `grid` (`NeedleGrid.to_dict`)) or, where the job refused the request
        with a ValueError or ImportError, `error` (its message) and `error_type` (its class name).

    Raises:
        Nothing for a refused request (see above); any other exception (a bug, CUDA out of memory) as it is.
    """
    start = time.perf_counter()
    out: dict[str, Any] = {"kind": request.kind, "ok": True, "device": "cpu", "quanto": None}
    with _LOCK:  # one job at a time per process (a ZeroGPU worker runs one anyway)
        try:
            if request.kind not in _JOBS:
                raise ValueError(f"kind={request.kind!r} is not a GPU job; use one of {', '.join(KINDS)}")
            loaded = device_model(_model())
            out["device"] = loaded.device.type
            out["quanto"] = quanto_on_device(loaded.device)
            out.update(_JOBS[request.kind](loaded, request))
        except (ValueError, ImportError) as error:
            out.update(ok=False, error=str(error), error_type=type(error).__name__)
    out["seconds"] = round(time.perf_counter() - start, 4)
    return out


try:  # a ZeroGPU Space provides `spaces`; off ZeroGPU (SPACES_ZERO_GPU unset) its GPU decorator hands the function back
    import spaces  # type: ignore[import-not-found]
except ImportError:  # not installed (here, and on any other machine): the job is the plain function
    gpu_job = _gpu_job
else:

    @spaces.GPU(duration=job_seconds)
    def gpu_job(request: GpuRequest) -> dict[str, Any]:
        """`_gpu_job(request)` in ZeroGPU's worker, with the GPU for `job_seconds(request)` at most."""
        return _gpu_job(request)


def run_job(request: GpuRequest, job: Callable[[GpuRequest], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run `request` through `job` (default `gpu_job`: on ZeroGPU in its worker) and hand back its result.

    Raises:
        GpuJobError: the job refused the request; the message is the job's.
    """
    result = (job or gpu_job)(request)
    if not result.get("ok"):
        raise GpuJobError(str(result.get("error")))
    return result
