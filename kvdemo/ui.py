"""The Gradio page: load a model, choose a KV cache backend, prefill a context once, ask questions in
turn and watch the cache's memory and residual flushes live.

No model logic lives here: the handlers call `kvdemo.load_model`, `QASession` and the chart-data
functions of `kvdemo.charts`, and read the backend options from the one registry, `kvdemo.BACKENDS`.
One model is shared; each browser session (Gradio's `session_hash`) has its own `QASession`, kept
server-side in a bounded `SessionStore` and freed on `demo.unload`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import gradio as gr

from kvdemo.backends import BACKENDS, GROUP_OPTIONS, CacheSpec
from kvdemo.cases import example_path, gold_answers_for, load_case
from kvdemo.charts import (
    MEMORY_SERIES,
    STEP_KINDS,
    answers_frame,
    flush_timing,
    memory_frame,
    residual_frame,
    speed_frame,
    step_time_frame,
    tradeoff_frame,
)
from kvdemo.compare import DEFAULT_SPECS, ComparisonCancelled, ComparisonReport, compare
from kvdemo.models import LoadedModel, is_hub_id, load_model
from kvdemo.session import DEFAULT_MAX_NEW_TOKENS, QASession

MAX_UPLOAD_BYTES = 2 * 1024 * 1024
EXAMPLES = {"Normans": ("normans", "0-7"), "Southern California": ("southern_california", "0-5")}
EXAMPLE_QUESTIONS = 6

EXPLAINER = """
**Prefill.** The model reads your whole context once and stores, for every layer, a *key* and a *value*
vector per token: the **KV cache**. Answers are generated on top of it, one **decode step** per token,
without reading the context again.

**Quantized cache.** `quanto` and `hqq` store the cache in 1-8 bit integers, in groups of `q_group_size`
values that share one scale and zero point; `fp8` stores 8-bit floats with one scale per tensor. The
memory chart shows the bytes really held against what full precision (`dynamic`) would hold.

**Residual and flush.** `quanto` and `hqq` keep the newest tokens in full precision, the **residual**.
When it reaches `residual_length` tokens, the layer **flushes**: the whole layer is de-quantized,
joined with the residual and quantized again, and the residual empties. The flush chart marks each one;
the residual chart shows the sawtooth. `fp8` has no residual: it appends with the scale frozen at the prefill.

**Restore.** After every answer the cache is put back exactly as it was after the prefill (the same
tensors, no copy), so each question sees the context and nothing else, and gets the answer a fresh
single-question run would give. `cache length after restore = N (context)` shows it after each answer.
"""


@dataclass
class UserSession:
    """One browser session's state, kept on the server.

    Attributes:
        last_used: `SessionStore`'s clock reading at the last request (seconds).
    """

    qa: QASession | None = None
    chat: list[dict[str, str]] = field(default_factory=list)
    events: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    compare_cancel: threading.Event = field(default_factory=threading.Event)
    compare_lock: threading.Lock = field(default_factory=threading.Lock)
    compare_pending: bool = False
    last_used: float = 0.0

    @property
    def busy(self) -> bool:
        """An answer, a prefill or a comparison is running in this session."""
        return self.lock.locked() or self.compare_lock.locked()

    def release(self) -> None:
        """Stop what runs (it ends after its current decode step and restores) and drop the cache."""
        self.compare_cancel.set()
        if self.qa is not None:
            self.qa.request_stop()
        self.qa, self.events = None, []


class ServerFull(Exception):
    """No session can be created: the cap is reached and every session is busy."""


class SessionStore:
    """Per-browser-session state, keyed by Gradio's `session_hash`.

    Bounded two ways: at most `max_sessions` at once (the least recently used idle session is freed first to
    make room), and a session unused for `idle_seconds` is freed by `sweep` (run on every `get` and by the
    app's sweeper thread). A session is never swept while it is busy. The reason a session was freed is
    kept (for the last 4 x max_sessions keys), so its user can be told to prefill again.

    Args:
        max_sessions: most sessions held at once (>= 1).
        idle_seconds: free sessions unused this long (seconds); None: never.
        clock: the time source (seconds; tests pass a fake one).

    Raises:
        ValueError: max_sessions < 1 or idle_seconds <= 0.
    """

    def __init__(self, max_sessions: int = 32, idle_seconds: float | None = 1800.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_sessions < 1 or (idle_seconds is not None and idle_seconds <= 0):
            raise ValueError(f"max_sessions={max_sessions} must be >= 1 and idle_seconds={idle_seconds} > 0 (or None)")
        self.max_sessions = max_sessions
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._sessions: OrderedDict[str, UserSession] = OrderedDict()
        self._freed: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def peek(self, key: str) -> UserSession | None:
        """The session of `key` if it exists (marked as used), else None; never creates or evicts one."""
        with self._lock:
            user = self._sessions.get(key)
            if user is not None:
                user.last_used = self.clock()
            return user

    def get(self, key: str) -> UserSession:
        """The session of `key`, created when missing; frees idle sessions and, when full, the least recently
        used idle one.

        Raises:
            ServerFull: every session is busy and the cap is reached (a new session is not created, and
                nobody's running answer is cut).
        """
        with self._lock:
            if key in self._sessions:  # a request is a use: never sweep the session it is for
                self._sessions[key].last_used = self.clock()
        self.sweep()
        with self._lock:
            user = self._sessions.pop(key, None)
            if user is None and len(self._sessions) >= self.max_sessions:
                victim = next((k for k, u in self._sessions.items() if not u.busy), None)
                if victim is None:
                    raise ServerFull(
                        f"The server is full: all {self.max_sessions} sessions are busy answering. Try again in a minute"
                    )
                self._drop(victim, f"this server keeps at most {self.max_sessions} sessions and yours was the "
                                   "least recently used")
            user = user or UserSession()
            user.last_used = self.clock()
            self._sessions[key] = user
            return user

    def sweep(self) -> int:
        """Free the sessions idle longer than `idle_seconds` (not busy ones). Returns how many were freed."""
        if self.idle_seconds is None:
            return 0
        limit = self.clock() - self.idle_seconds
        with self._lock:
            idle = [k for k, u in self._sessions.items() if u.last_used < limit and not u.busy]
            for key in idle:
                self._drop(key, f"it was idle for more than {self.idle_seconds / 60:g} minutes")
        return len(idle)

    def free(self, key: str, reason: str = "its browser tab was closed") -> None:
        """Drop the session of `key` and its cache (an answer still running ends after its current step)."""
        with self._lock:
            self._drop(key, reason)

    def _drop(self, key: str, reason: str) -> None:
        user = self._sessions.pop(key, None)
        if user is None:
            return
        user.release()
        self._freed[key] = reason
        while len(self._freed) > 4 * self.max_sessions:
            self._freed.popitem(last=False)

    def touch(self, user: UserSession) -> None:
        """Mark `user` as used now (when a long answer or comparison ends)."""
        user.last_used = self.clock()

    def freed_reason(self, key: str) -> str | None:
        """Why the session of `key` was freed, or None when it was not (or has prefilled since)."""
        with self._lock:
            return self._freed.get(key)

    def forget_freed(self, key: str) -> None:
        """Clear the freed reason of `key` (after a new prefill)."""
        with self._lock:
            self._freed.pop(key, None)

    def __len__(self) -> int:
        return len(self._sessions)


class App:
    """The shared state behind the page: the model (one for every user) and the per-user sessions.

    Args:
        model_source: what `load_model` is given at start-up (None: the embedded model).
        max_sessions: most browser sessions kept at once.
        loader: the model loader (tests pass one that builds a small model).
        idle_seconds: free a session unused this long (seconds; None: never).
        kv_budget_bytes: the largest KV cache one prefill may build (estimated before it runs; None: no limit).
        allow_local_paths: whether the Load button may read local folders and files (else Hub ids only).
        public: a public server: the model is chosen by its operator and visitors cannot replace it (it
            would end every other user's session).
    """

    def __init__(
        self,
        model_source: str | None = None,
        max_sessions: int = 32,
        loader: Callable[..., LoadedModel] = load_model,
        idle_seconds: float | None = 1800.0,
        kv_budget_bytes: int | None = None,
        allow_local_paths: bool = True,
        public: bool = False,
    ):
        self.model_source = model_source
        self.loader = loader
        self.sessions = SessionStore(max_sessions, idle_seconds)
        self.kv_budget_bytes = kv_budget_bytes
        self.allow_local_paths = allow_local_paths
        self.public = public
        self.loaded: LoadedModel | None = None
        self.load_error: str | None = None
        self._ready = threading.Event()

    def start_sweeper(self, every_seconds: float | None = None) -> None:
        """Free idle sessions in a background thread, every `every_seconds` (default: a quarter of the idle
        time, at most a minute), also when nobody makes a request."""
        if self.sessions.idle_seconds is None:
            return
        every = every_seconds or min(60.0, self.sessions.idle_seconds / 4)

        def sweep_forever() -> None:
            while True:
                time.sleep(every)
                self.sessions.sweep()

        threading.Thread(target=sweep_forever, daemon=True, name="kvdemo-session-sweeper").start()

    def start_loading(self) -> None:
        """Load the start-up model in a background thread, so the page is served while it loads."""
        threading.Thread(target=self._load_startup, daemon=True).start()

    def _load_startup(self) -> None:
        try:
            self.loaded = self.loader(self.model_source)
            print(f"kvdemo: model loaded: {self.loaded.name}", flush=True)
        except Exception as error:  # shown on the page; the user can load another model
            self.load_error = f"{type(error).__name__}: {error}"
            print(f"kvdemo: the model did not load ({self.load_error}); load another on the page", flush=True)
        finally:
            self._ready.set()

    def wait_for_model(self, timeout: float | None = None) -> LoadedModel:
        """The shared model, once the start-up load is done. Raises gr.Error when there is none."""
        self._ready.wait(timeout)
        if self.loaded is None:
            raise gr.Error(f"No model is loaded ({self.load_error or 'still loading'}). Load one above.")
        return self.loaded


# ---- pure helpers (tested directly) ----------------------------------------------------------------


def model_status(loaded: LoadedModel) -> str:
    """The model's status line."""
    d = loaded.describe()
    return (
        f"**{d['name']}** · {d['parameters'] / 1e6:.0f} M parameters · {d['layers']} layers · "
        f"{d['kv_heads']} KV heads · head_dim {d['head_dim']} · max context {d['max_context_tokens']:,} tokens · "
        f"{d['device']} · {d['dtype']}"
    )


def spec_from_inputs(backend: str, nbits, q_group_size, residual_length, axis_key, axis_value) -> CacheSpec:
    """A `CacheSpec` from the page's option fields; options the backend does not take are ignored (they are
    hidden on the page), empty fields mean the backend's default.

    Raises:
        gr.Error: a value that is not a whole number, or a spec the registry refuses (its message).
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise gr.Error(f"backend={str(backend)[:40]!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    given = dict(zip(GROUP_OPTIONS, (nbits, q_group_size, residual_length, axis_key, axis_value)))
    options = {}
    for name in BACKENDS[backend].options:
        value = given[name]
        if value is None or value == "":
            continue
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not number.is_integer():
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise gr.Error(f"{name}={str(value)[:40]!r} must be a whole number") from None
        options[name] = int(number)
    return CacheSpec(backend, **options)


def backend_option_updates(backend: str, *current: Any) -> tuple[Any, ...]:
    """Visibility, choices and values of the five option fields for a backend, from `BACKENDS`, and the
    backend's description. A field keeps its current value when the new backend allows it (so switching
    away and back restores what was there), else it takes the backend's default.

    Args:
        backend: the chosen backend.
        current: the fields' current values, in `GROUP_OPTIONS` order (may be omitted).
    """
    info = BACKENDS.get(backend, BACKENDS["dynamic"])
    current = current + (None,) * (len(GROUP_OPTIONS) - len(current))
    updates = []
    for name, value in zip(GROUP_OPTIONS, current):
        option = info.options.get(name)
        if option is None:
            updates.append(gr.update(visible=False))
            continue
        allowed = value is not None and (
            value in option.choices if option.choices is not None else isinstance(value, (int, float)) and value >= option.minimum
        )
        keep = value if allowed else option.default
        if option.choices is not None:
            updates.append(gr.update(visible=True, choices=list(option.choices), value=keep))
        else:
            updates.append(gr.update(visible=True, value=keep))
    note = info.summary + "."
    if not info.has_residual:
        note += (
            " It appends every new token with the scale frozen at the prefill: no residual, never flushes."
            if info.is_quantized
            else " The full-precision baseline: no quantization, no flushes."
        )
    return (*updates, note)


def prefill_summary(qa: QASession) -> str:
    """The summary shown after a prefill."""
    r = qa.prefill_report
    return (
        f"Prefilled **{r.context_tokens:,} tokens** in {r.seconds:.2f} s with **{qa.spec.label}** · "
        f"KV cache {r.kv_bytes / 2**20:.2f} MiB ({r.bytes_per_token:,.0f} bytes/token) · "
        f"**{r.ratio_to_full_precision:.3f}×** full precision ({r.full_precision_bytes / 2**20:.2f} MiB)"
    )


def answer_stats(qa: QASession, first_token_seconds: float | None, events: list | None = None) -> str:
    """The line shown after an answer; with the answer's `StepEvent`s, also the time per flush step."""
    a = qa.history[-1]
    context = qa.prefill_report.context_tokens
    first = f" · first token after {first_token_seconds:.2f} s" if first_token_seconds is not None else ""
    if events:
        steps, flush_s, other_s = flush_timing(events)
        if steps and flush_s is not None:
            against = f" vs {other_s * 1000:.0f} ms per other step" if other_s is not None else ""
            first += f" · {steps} flush step(s), {flush_s * 1000:.0f} ms each (median){against}"
    stopped = " · stopped" if a.finish_reason == "stopped" else ""
    return (
        f"{len(a.token_ids)} tokens · {a.tokens_per_second:.1f} tokens/s · {a.flush_count} flushes "
        f"({a.flush_count // max(len(a.flushes), 1)} per layer){first}{stopped} · "
        f"**cache length after restore = {a.cache_length_after:,} ({'context' if a.cache_length_after == context else 'MISMATCH: context is ' + str(context)})**"
    )


def read_upload(path: str | None) -> str:
    """The text of an uploaded .txt / .md file.

    Raises:
        gr.Error: no file, a file over `MAX_UPLOAD_BYTES`, not UTF-8, binary (NUL bytes) or empty.
    """
    if not path:
        raise gr.Error("No file was uploaded; choose a .txt or .md file")
    file = Path(path)
    if file.suffix.lower() not in (".txt", ".md"):
        raise gr.Error(f"{file.name} is not a .txt or .md file; upload plain text")
    size = file.stat().st_size
    if size > MAX_UPLOAD_BYTES:
        raise gr.Error(f"{file.name} is {size / 2**20:.1f} MiB; the limit is {MAX_UPLOAD_BYTES / 2**20:.0f} MiB")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise gr.Error(f"{file.name} is not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    if "\x00" in text:
        raise gr.Error(f"{file.name} looks binary (it holds NUL bytes); upload a text file")
    if not text.strip():
        raise gr.Error(f"{file.name} is empty")
    return text


def example(name: str) -> tuple[str, list[str]]:
    """The context (chosen paragraphs) and the first answerable questions of a shipped example."""
    stem, paragraphs = EXAMPLES[name]
    case = load_case(example_path(stem)).select(paragraphs)
    return case.context, [q.question for q in case.answerable(EXAMPLE_QUESTIONS)]


def load_example(name: str) -> tuple[str, Any]:
    """The example's context for the text box, and its questions for the example-questions list."""
    context, questions = example(name)
    return context, gr.Dataset(samples=[[q] for q in questions])


COMPARE_CHOICES = tuple(
    CacheSpec(name, nbits=n).text if n is not None else name
    for name, info in BACKENDS.items()
    for n in (info.options["nbits"].choices if "nbits" in info.options else (None,))
)
"""The specs offered as checkboxes: every backend and nbits with the other options at their defaults."""


def compare_specs(chosen: list[str] | None, more: str | None) -> list[CacheSpec]:
    """The specs of the Compare tab: the ticked ones, then one per non-empty line of `more` (the
    `CacheSpec.parse` syntax, e.g. `hqq:4,residual_length=16`).

    Raises:
        gr.Error: a line that does not parse (its message, with the line number), or no spec at all.
    """
    specs = [CacheSpec.parse(text) for text in chosen or []]
    for number, line in enumerate((more or "").splitlines(), 1):
        if line.strip():
            try:
                specs.append(CacheSpec.parse(line))
            except ValueError as error:
                raise gr.Error(f"more specs, line {number}: {error}") from None
    if not specs:
        raise gr.Error("Tick at least one spec to compare (dynamic is always included as the baseline)")
    return specs


COMPARE_MAX_QUESTIONS = 20
COMPARE_MAX_NEW_TOKENS = 256
"""Limits of one comparison in the app (its reference keeps [tokens, vocab] float32 per question)."""


def compare_questions(text: str | None) -> list[str]:
    """The questions of the Compare tab: one per non-empty line.

    Raises:
        gr.Error: there is none, or more than `COMPARE_MAX_QUESTIONS`.
    """
    questions = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not questions:
        raise gr.Error("Give at least one question, one per line (or press 'Fill in questions')")
    if len(questions) > COMPARE_MAX_QUESTIONS:
        raise gr.Error(f"{len(questions)} questions is more than a comparison runs here; give at most "
                       f"{COMPARE_MAX_QUESTIONS}")
    return questions


def compare_inputs(chosen: list[str] | None, more: str | None, questions_text: str | None,
                   max_new_tokens: Any) -> tuple[list[CacheSpec], list[str], Any]:
    """The Compare tab's inputs checked, for the click and for the run: `compare_specs`, `compare_questions`,
    and max_new_tokens as a whole number when it is one, at most `COMPARE_MAX_NEW_TOKENS` (`compare` checks
    the rest).

    Raises:
        gr.Error: see `compare_specs` and `compare_questions`, or max_new_tokens over the limit.
    """
    specs = compare_specs(chosen, more)
    questions = compare_questions(questions_text)
    if isinstance(max_new_tokens, float) and max_new_tokens.is_integer():
        max_new_tokens = int(max_new_tokens)
    if isinstance(max_new_tokens, (int, float)) and max_new_tokens > COMPARE_MAX_NEW_TOKENS:
        raise gr.Error(f"max_new_tokens={max_new_tokens} is more than a comparison runs here; use at most "
                       f"{COMPARE_MAX_NEW_TOKENS}")
    return specs, questions, max_new_tokens


def suggested_questions(qa: QASession | None, context: str) -> list[str]:
    """The questions asked so far in this session (each once, in order); without any, the example
    questions when `context` is one of the shipped examples; else none."""
    asked = list(dict.fromkeys(a.question for a in qa.history)) if qa is not None else []
    if asked:
        return asked
    for name in EXAMPLES:
        text, questions = example(name)
        if isinstance(context, str) and context.strip() == text.strip():
            return questions
    return []


def comparison_outputs(report: ComparisonReport, note: str) -> tuple[str, Any, Any, Any]:
    """The Compare tab's status line, table (rounded to 4 decimals for reading) and two chart frames for a
    (possibly partial) report."""
    frame = report.to_frame()
    if report.results:
        tokens = report.results[0].context_tokens
        note += f" · context {tokens:,} tokens · max_new_tokens {report.max_new_tokens}"
    tradeoff = with_every_series(tradeoff_frame(frame), "backend", BACKENDS)
    return note, frame.round(4), tradeoff, speed_frame(frame)


def _step_times(events: list) -> Any:
    """The step-time chart's data with every `STEP_KINDS` series in its legend."""
    return with_every_series(step_time_frame(events), "kind", STEP_KINDS)


def with_every_series(frame: Any, column: str, names: Iterable[str]) -> Any:
    """`frame` plus one invisible row (NaN in its float columns, 0 in its integer ones) for each of `names`
    missing from `column`. Gradio's plots fix their colour legend at the first data they get, so a series
    that appears later (a flush step, another backend) would never be drawn; these rows put every series in
    the legend from the start, and Vega does not draw points whose value is NaN."""
    import pandas as pd

    missing = [name for name in names if name not in set(frame[column])]
    if not missing:
        return frame
    rows = []
    for name in missing:
        row = {}
        for col, dtype in frame.dtypes.items():
            if col == column:
                row[col] = name
            elif pd.api.types.is_float_dtype(dtype):
                row[col] = float("nan")
            elif pd.api.types.is_integer_dtype(dtype):
                row[col] = 0
            else:
                row[col] = ""
        rows.append(row)
    return pd.concat([frame, pd.DataFrame(rows).astype(frame.dtypes.to_dict())], ignore_index=True)


def _guarded(stream: Iterator, qa: QASession) -> Iterator:
    """`stream`, with an exception inside a decode step turned into a message for the user. The session has
    restored the cache and recorded the answer (`finish_reason="error"`) before the exception reaches here."""
    try:
        yield from stream
    except Exception as error:
        steps = qa.history[-1].steps if qa.history else 0
        raise gr.Error(
            f"The answer failed after {steps} decode step(s) ({type(error).__name__}: {str(error)[:200]}). The cache "
            "was restored to the prefilled context; ask again, or press Prefill to start over"
        ) from None


def _empty_charts() -> tuple[None, None, None]:
    """Cleared charts. An empty plot is `None`, not an empty DataFrame: Gradio's plot takes its series
    (the color legend) from the first data it gets, and an empty frame would leave it with none."""
    return None, None, None


# ---- the page ---------------------------------------------------------------------------------------


def build_demo(app: App) -> gr.Blocks:
    """The gr.Blocks page, wired to `app`. Every event has an `api_name` for `gradio_client`."""

    def key_of(request: gr.Request) -> str:
        return request.session_hash if request is not None else "api"

    def user_of(request: gr.Request) -> UserSession:
        """This tab's session, created when missing (Prefill and Compare only)."""
        try:
            return app.sessions.get(key_of(request))
        except ServerFull as error:
            raise gr.Error(str(error)) from None

    def existing_user(request: gr.Request) -> UserSession | None:
        """This tab's session if it has one; handlers that only read or stop never create (or evict) one."""
        return app.sessions.peek(key_of(request))

    def on_page_load(progress=gr.Progress()):
        progress(0, desc="Loading the model (a first start converts the embedded GGUF, ~20-30 s; later starts "
                         "load the converted copy in seconds)…")
        loaded = app.wait_for_model()
        return model_status(loaded)

    def load_model_handler(model_source: str, progress=gr.Progress()):
        """Load a model (a Hub id, a local folder or a .gguf file; empty: the start-up model) for everyone."""
        if app.public:
            name = app.loaded.name if app.loaded else "its start-up model"
            raise gr.Error(
                f"This public server serves one model to everyone ({name}); loading another would end the other "
                "users' sessions. Run kvdemo on your own machine to try other models"
            )
        source = model_source.strip() if isinstance(model_source, str) and model_source.strip() else app.model_source
        if source != app.model_source and source is not None and not app.allow_local_paths and not is_hub_id(source):
            raise gr.Error(
                f"{source[:80]!r} is not a Hugging Face Hub id; this server loads only the embedded model and Hub "
                "ids like HuggingFaceTB/SmolLM2-135M-Instruct (local paths are disabled)"
            )
        progress(0, desc=f"Loading {source or 'the embedded model'}…")
        try:
            loaded = app.loader(source)
        except Exception as error:  # any failure (bad id, offline, out of memory) keeps the current model
            previous = f" Keeping {app.loaded.name}." if app.loaded else ""
            kind = "" if isinstance(error, (ValueError, ImportError, OSError)) else f"{type(error).__name__}: "
            raise gr.Error(f"{kind}{str(error)[:400]}.{previous}") from None
        app.loaded, app.load_error = loaded, None
        return model_status(loaded)

    def prefill_handler(context, backend, nbits, q_group_size, residual_length, axis_key, axis_value,
                        request: gr.Request, progress=gr.Progress()):
        """Prefill `context` into a new KV cache of the chosen backend (replacing this session's context)."""
        spec = spec_from_inputs(backend, nbits, q_group_size, residual_length, axis_key, axis_value)
        loaded = app.wait_for_model()
        user = user_of(request)
        if user.qa is not None:
            user.qa.request_stop()
        with user.lock:
            try:
                qa = QASession(loaded, spec, kv_budget_bytes=app.kv_budget_bytes)
                qa.prefill(context)
            except (ValueError, ImportError) as error:
                raise gr.Error(str(error)) from None
            user.qa, user.chat, user.events = qa, [], []
            app.sessions.forget_freed(key_of(request))
        return (prefill_summary(qa), [], "", *_empty_charts(), answers_frame([]), gr.update(interactive=True))

    def ask_handler(question: str, max_new_tokens: float, request: gr.Request) -> Iterator[tuple]:
        """Answer `question` on the prefilled context, streaming the answer and the charts."""
        user = existing_user(request)
        if user is None or user.qa is None:
            reason = app.sessions.freed_reason(key_of(request))
            if reason:
                raise gr.Error(f"Your session was freed because {reason}; press Prefill again to rebuild the cache")
            raise gr.Error("Prefill a context first: paste or load a text and press Prefill")
        if isinstance(max_new_tokens, float) and max_new_tokens.is_integer():
            max_new_tokens = int(max_new_tokens)
        if not user.lock.acquire(blocking=False):
            raise gr.Error("An answer or a prefill is already running in this session; wait or press Stop")
        try:
            qa = user.qa  # read under the lock: a prefill that just finished has replaced it
            if qa is None:
                raise gr.Error("Your session was freed; press Prefill again to rebuild the cache")
            if app.loaded is not qa.loaded:
                raise gr.Error("The model changed since your prefill; press Prefill to rebuild the cache on it")
            try:
                stream = qa.stream(question, max_new_tokens)
            except ValueError as error:
                raise gr.Error(str(error)) from None
            user.chat = user.chat + [{"role": "user", "content": question.strip()}, {"role": "assistant", "content": ""}]
            user.events = []
            first_token = None
            with closing(stream):
                for event in _guarded(stream, qa):
                    if first_token is None:
                        first_token = event.elapsed
                    user.events.append(event)
                    user.chat[-1] = {"role": "assistant", "content": event.text}
                    yield (
                        user.chat, f"step {event.step + 1} · {event.memory.total_bytes / 2**20:.2f} MiB · "
                        f"cache length {event.cache_length:,}",
                        memory_frame(user.events), residual_frame(user.events), _step_times(user.events),
                        gr.skip(),
                    )
            if not user.events:
                user.chat[-1] = {"role": "assistant", "content": qa.history[-1].text}
            yield (
                user.chat, answer_stats(qa, first_token, user.events), memory_frame(user.events),
                residual_frame(user.events), _step_times(user.events),
                answers_frame(a.to_dict() for a in qa.history),
            )
        finally:
            app.sessions.touch(user)
            user.lock.release()

    def stop_handler(request: gr.Request) -> None:
        """Stop the answer streaming in this session after its current decode step; the cache is restored as
        after any answer, and the answer's last update says `stopped`. (No output of its own: a reply racing
        the answer's last update could overwrite it.)"""
        user = existing_user(request)
        if user is not None and user.qa is not None:
            user.qa.request_stop()

    def options_changed(backend, nbits, q_group_size, residual_length, axis_key, axis_value, request: gr.Request):
        user = existing_user(request)
        if user is None or user.qa is None:
            return gr.update(), gr.update()
        try:
            spec = spec_from_inputs(backend, nbits, q_group_size, residual_length, axis_key, axis_value)
            same = spec.resolved() == user.qa.spec.resolved() and spec.backend == user.qa.spec.backend
        except gr.Error:
            same = False
        if same:
            return prefill_summary(user.qa), gr.update(interactive=True)
        return (
            f"⚠ The cache was prefilled with **{user.qa.spec.label}**. Press **Prefill** to rebuild it with the "
            "new backend options; until then Ask is disabled, so states never mix.",
            gr.update(interactive=False),
        )

    def fill_questions_handler(context: str, request: gr.Request) -> str:
        """The questions asked so far in this session, or the example's questions."""
        user = existing_user(request)
        return "\n".join(suggested_questions(user.qa if user is not None else None, context))

    def compare_handler(context, chosen, more, questions_text, max_new_tokens, request: gr.Request,
                        progress=gr.Progress()):
        """Run `kvdemo.compare` on the Context box's text and the questions, one spec at a time, in fresh
        sessions: this session's own cache is untouched. Cancel stops it at the next decode step."""
        user = user_of(request)
        if not user.compare_lock.acquire(blocking=False):
            raise gr.Error("A comparison is already running in this session; wait or press Cancel")
        try:
            if not user.compare_pending:  # called through the API, not queued by the button
                user.compare_cancel.clear()
                user.compare_pending = True
            specs, questions, max_new_tokens = compare_inputs(chosen, more, questions_text, max_new_tokens)
            loaded = app.wait_for_model()
            golds = gold_answers_for(context, questions)
            progress(0, desc="Starting the comparison…")
            report = compare(
                loaded, context, questions, specs, max_new_tokens, golds, cancel=user.compare_cancel,
                on_progress=lambda done, total, what: progress((done, total), desc=what, unit="steps"),
                kv_budget_bytes=app.kv_budget_bytes,
            )
            note = f"Compared {len(report.results)} specs on {len(questions)} question{'s' if len(questions) > 1 else ''}"
            note += " (scored against the example's gold answers)." if golds else " (no gold answers for this text)."
            return comparison_outputs(report, note)
        except ComparisonCancelled as cancelled:
            return comparison_outputs(cancelled.report, f"Cancelled after {len(cancelled.report.results)} spec(s).")
        except (ValueError, ImportError) as error:
            raise gr.Error(str(error)) from None
        except gr.Error:
            raise
        except Exception as error:  # a fault inside a decode step: every session it used has restored
            raise gr.Error(f"The comparison failed ({type(error).__name__}: {str(error)[:200]}); your own "
                           "session is untouched") from None
        finally:
            user.compare_pending = False
            app.sessions.touch(user)
            user.compare_lock.release()

    def cancel_compare_handler(request: gr.Request) -> None:
        """Cancel this session's comparison at its next decode step (it returns what finished), also while
        it still waits in the queue; does nothing when none is running or waiting."""
        user = existing_user(request)
        if user is not None and user.compare_pending:
            user.compare_cancel.set()

    def compare_queued(chosen, more, questions_text, max_new_tokens, request: gr.Request) -> None:
        """Runs at the click, before the comparison waits in the queue: bad input is refused here (the last
        results stay on the page), and from now on Cancel applies to the run."""
        compare_inputs(chosen, more, questions_text, max_new_tokens)
        user = user_of(request)
        user.compare_cancel.clear()
        user.compare_pending = True

    def unload(request: gr.Request):
        app.sessions.free(request.session_hash)

    with gr.Blocks(title="kvdemo: KV cache quantization, live") as demo:
        gr.Markdown(
            "# kvdemo: a quantized KV cache, live\nPrefill a long context once, ask questions in turn, and watch "
            "the cache's real memory and every residual flush. After each answer the cache is restored exactly."
        )
        with gr.Row():
            with gr.Column(scale=3):
                model_line = gr.Markdown("Loading the model…")
            with gr.Column(scale=2):
                with gr.Row():
                    model_source = gr.Textbox(
                        label="Model", placeholder="empty: embedded SmolLM2-135M · or a Hub id / local folder / .gguf",
                        scale=3,
                    )
                    load_button = gr.Button("Load", scale=1)
        with gr.Tab("Ask", id="ask"):
            with gr.Row():
                with gr.Column(scale=1, min_width=280):
                    gr.Markdown("### Cache backend")
                    backend = gr.Radio(list(BACKENDS), value="hqq", label="backend")
                    hqq = BACKENDS["hqq"].options
                    nbits = gr.Dropdown(list(hqq["nbits"].choices), value=4, label="nbits", info=hqq["nbits"].help)
                    q_group_size = gr.Number(hqq["q_group_size"].default, label="q_group_size", precision=0,
                                             info=hqq["q_group_size"].help)
                    residual_length = gr.Number(16, label="residual_length", precision=0, minimum=1,
                                                info=hqq["residual_length"].help)
                    axis_key = gr.Dropdown(list(hqq["axis_key"].choices), value=0, label="axis_key")
                    axis_value = gr.Dropdown(list(hqq["axis_value"].choices), value=0, label="axis_value")
                    backend_note = gr.Markdown(BACKENDS["hqq"].summary + ".")
                with gr.Column(scale=3):
                    gr.Markdown("### Context")
                    context = gr.Textbox(label="context", lines=10, max_lines=18, placeholder="Paste a long text…")
                    with gr.Row():
                        upload = gr.File(label="or upload .txt / .md (≤ 2 MiB, UTF-8)", file_types=[".txt", ".md"],
                                         type="filepath", height=90)
                        with gr.Column():
                            example_buttons = {name: gr.Button(f"Example: {name}", size="sm") for name in EXAMPLES}
                    prefill_button = gr.Button("Prefill", variant="primary")
                    prefill_info = gr.Markdown("")
            gr.Markdown("### Questions")
            with gr.Row():
                with gr.Column(scale=3):
                    chat = gr.Chatbot(label="answers", height=320)
                    question = gr.Textbox(label="question", placeholder="Ask about the context…")
                    with gr.Row():
                        max_new_tokens = gr.Number(DEFAULT_MAX_NEW_TOKENS, label="max_new_tokens", precision=0, minimum=1)
                        ask_button = gr.Button("Ask", variant="primary", interactive=False)
                        stop_button = gr.Button("Stop", variant="stop")
                    example_questions = gr.Dataset(components=[question], samples=[], label="example questions")
                    stats = gr.Markdown("")
                with gr.Column(scale=2):
                    memory_plot = gr.LinePlot(
                        None, x="step", y="MiB", color="series", title="KV cache memory",
                        x_title="decode step", y_title="MiB", height=230, y_lim=[0, None],
                        color_map=dict(zip(MEMORY_SERIES, ("#1f77b4", "#ff7f0e", "#7f7f7f"))),
                    )
                    residual_plot = gr.LinePlot(
                        None, x="step", y="residual tokens", title="Residual fill (layer 0)",
                        x_title="decode step", height=180,
                    )
                    flush_plot = gr.ScatterPlot(
                        None, x="step", y="ms", color="kind", title="Time per decode step (flush steps marked)",
                        x_title="decode step", y_title="ms", height=220,
                        color_map=dict(zip(STEP_KINDS, ("#7f7f7f", "#1f77b4", "#d62728"))),
                        tooltip=["step", "ms", "kind", "layers flushed"],
                    )
            answers_table = gr.Dataframe(answers_frame([]), label="this session's answers", interactive=False)
            with gr.Accordion("What am I looking at?", open=False):
                gr.Markdown(EXPLAINER)

        with gr.Tab("Compare backends", id="compare"):
            gr.Markdown(
                "Run the text in the **Context** box and the questions below over several KV cache backends, one at "
                "a time, each in a fresh cache (your own prefilled cache is untouched): memory, fidelity against "
                "`dynamic` (identical answers, KL divergence teacher-forced on `dynamic`'s answer) and against the "
                "gold answers of the examples, and speed. About 2 × (questions × max_new_tokens) decode steps per spec."
            )
            with gr.Row():
                with gr.Column(scale=1, min_width=280):
                    compare_choice = gr.CheckboxGroup(list(COMPARE_CHOICES), value=list(DEFAULT_SPECS), label="specs",
                                                      info="backend:nbits; other options at their defaults (q_group_size 64, residual_length 128, "
                                                      "axes 0)")
                    compare_more = gr.Textbox(
                        label="more specs, one per line", lines=2,
                        placeholder="hqq:4,residual_length=16\nquanto:2,q_group_size=32,axis_key=-1",
                        info="backend[:nbits][,option=value...]; options q_group_size, residual_length, axis_key, "
                        "axis_value",
                    )
                    compare_max_new_tokens = gr.Number(32, label="max_new_tokens", precision=0, minimum=1,
                                                       maximum=COMPARE_MAX_NEW_TOKENS)
                with gr.Column(scale=2):
                    compare_questions_box = gr.Textbox(label="questions, one per line", lines=6,
                                                       placeholder="Who was the Norse leader?")
                    with gr.Row():
                        fill_button = gr.Button("Fill in questions (asked so far, or the example's)", size="sm")
                        compare_button = gr.Button("Run comparison", variant="primary")
                        cancel_button = gr.Button("Cancel", variant="stop")
            compare_status = gr.Markdown("")
            compare_table = gr.Dataframe(label="comparison", interactive=False, wrap=True)
            with gr.Row():
                tradeoff_plot = gr.ScatterPlot(
                    None, x="bytes per token", y="KL (nats)", color="backend", title="Memory against fidelity",
                    x_title="KV bytes per context token", y_title="mean KL to dynamic (nats)", height=300,
                    tooltip=["spec", "bytes per token", "KL (nats)", "identical", "contains gold"],
                )
                speed_plot = gr.BarPlot(
                    None, x="spec", y="tokens/s", title="Decode speed", x_title="spec", y_title="tokens/s (median)",
                    height=300, tooltip=["spec", "tokens/s", "flush s"], sort="-y", y_lim=[0, None],
                )

        option_fields = [nbits, q_group_size, residual_length, axis_key, axis_value]
        outputs_after_prefill = [prefill_info, chat, stats, memory_plot, residual_plot, flush_plot, answers_table,
                                 ask_button]

        demo.load(on_page_load, outputs=model_line, api_name="model_status")
        # prefills, answers and model loads share one queue group: `--concurrency` of them run at once
        model_work = {"concurrency_id": "model"}
        load_button.click(load_model_handler, inputs=model_source, outputs=model_line, api_name="load_model",
                          **model_work)
        backend.change(backend_option_updates, inputs=[backend, *option_fields], outputs=[*option_fields, backend_note],
                       api_visibility="private", queue=False).then(
            options_changed, inputs=[backend, *option_fields], outputs=[prefill_info, ask_button],
            api_visibility="private", queue=False)
        for field_ in option_fields:
            field_.change(options_changed, inputs=[backend, *option_fields], outputs=[prefill_info, ask_button],
                          api_visibility="private", queue=False)
        upload.upload(read_upload, inputs=upload, outputs=context, api_name="read_upload")
        for name, button in example_buttons.items():
            button.click(
                functools.partial(load_example, name),
                outputs=[context, example_questions], api_visibility="private", queue=False,
            )
        example_questions.click(lambda sample: sample[0], inputs=example_questions, outputs=question,
                                api_visibility="private", queue=False)
        prefill_button.click(
            prefill_handler, inputs=[context, backend, *option_fields], outputs=outputs_after_prefill,
            api_name="prefill", **model_work,
        )
        ask_outputs = [chat, stats, memory_plot, residual_plot, flush_plot, answers_table]
        # Ask is disabled while an answer streams; afterwards its state follows the options (see options_changed)
        for trigger, api in ((ask_button.click, {"api_name": "ask"}), (question.submit, {"api_visibility": "private"})):
            trigger(lambda: gr.update(interactive=False), outputs=ask_button, queue=False, api_visibility="private").then(
                ask_handler, inputs=[question, max_new_tokens], outputs=ask_outputs, **api, **model_work
            ).then(options_changed, inputs=[backend, *option_fields], outputs=[prefill_info, ask_button],
                   api_visibility="private", queue=False)
        stop_button.click(stop_handler, api_name="stop", queue=False)
        fill_button.click(fill_questions_handler, inputs=context, outputs=compare_questions_box,
                          api_name="compare_questions", queue=False)
        # one comparison at a time across users (minutes of CPU); answers keep their own queue slots
        compare_button.click(
            compare_queued, inputs=[compare_choice, compare_more, compare_questions_box, compare_max_new_tokens],
            concurrency_limit=None, api_visibility="private",  # queued (its error shows as a toast), never waits
        ).success(
            compare_handler,
            inputs=[context, compare_choice, compare_more, compare_questions_box, compare_max_new_tokens],
            outputs=[compare_status, compare_table, tradeoff_plot, speed_plot],
            api_name="compare", concurrency_limit=1, concurrency_id="compare",
        )
        cancel_button.click(cancel_compare_handler, api_name="cancel_compare", queue=False)
        demo.unload(unload)
    return demo
