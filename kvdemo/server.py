"""What the page shares across users, with no Gradio in it: the loaded model (one for everyone) and the
per-tab session store (`SessionStore`, keyed by Gradio's `session_hash`), bounded in count and idle time.

The page (`kvdemo.ui`) reads and changes this state only through `App` and `SessionStore`; errors meant for
the user are `ValueError`s, turned into `gr.Error` by the page in one place.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvdemo.models import LoadedModel, is_hub_id, load_model
from kvdemo.session import QASession


@dataclass
class UserSession:
    """One browser session's state, kept on the server.

    Attributes:
        last_used: `SessionStore`'s clock reading at the last request (seconds).
    """

    qa: QASession | None = None
    chat: list[dict[str, str]] = field(default_factory=list)
    events: list = field(default_factory=list)
    answers: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    compare_cancel: threading.Event = field(default_factory=threading.Event)
    compare_lock: threading.Lock = field(default_factory=threading.Lock)
    compare_pending: bool = False
    prefilling: QASession | None = None
    last_used: float = 0.0

    def interrupt(self) -> None:
        """Stop this session's answer after its current decode step and its prefill before its next chunk
        (Stop, or a new prefill); a comparison has its own Cancel."""
        for qa in (self.qa, self.prefilling):
            if qa is not None:
                qa.request_stop()

    @property
    def busy(self) -> bool:
        """An answer, a prefill or a comparison is running in this session."""
        return self.lock.locked() or self.compare_lock.locked()

    def release(self) -> None:
        """Stop what runs (it ends after its current decode step and restores) and drop the cache."""
        self.compare_cancel.set()
        self.interrupt()
        self.qa, self.events = None, []


class ServerFull(ValueError):
    """No session can be created: the cap is reached and every session is busy (a message for the user)."""


class ModelNotLoaded(ValueError):
    """No model is loaded (the start-up load failed or is still running); the message says what to do."""


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
        """The shared model, once the start-up load is done.

        Raises:
            ModelNotLoaded: there is none (the message gives the load error).
        """
        self._ready.wait(timeout)
        if self.loaded is None:
            raise ModelNotLoaded(f"No model is loaded ({self.load_error or 'still loading'}). Load one above.")
        return self.loaded

    def load(self, source: str | None) -> LoadedModel:
        """Load a model for everyone (a Hub id, a local folder or a .gguf file; None or blank: the start-up
        model) and make it the shared one; on any failure the current model stays.

        Raises:
            ValueError: a public server (visitors cannot replace the shared model), a local path where only Hub
                ids are allowed, or the load failed (the loader's message, and which model is kept).
        """
        if self.public:
            name = self.loaded.name if self.loaded else "its start-up model"
            raise ValueError(
                f"This public server serves one model to everyone ({name}); loading another would end the other "
                "users' sessions. Run kvdemo on your own machine to try other models"
            )
        source = source.strip() if isinstance(source, str) and source.strip() else self.model_source
        if source != self.model_source and source is not None and not self.allow_local_paths and not is_hub_id(source):
            raise ValueError(
                f"{source[:80]!r} is not a Hugging Face Hub id; this server loads only the embedded model and Hub "
                "ids like HuggingFaceTB/SmolLM2-135M-Instruct (local paths are disabled)"
            )
        try:
            loaded = self.loader(source)
        except Exception as error:  # any failure (bad id, offline, out of memory) keeps the current model
            previous = f" Keeping {self.loaded.name}." if self.loaded else ""
            kind = "" if isinstance(error, (ValueError, ImportError, OSError)) else f"{type(error).__name__}: "
            raise ValueError(f"{kind}{str(error)[:400]}.{previous}") from None
        self.loaded, self.load_error = loaded, None
        return loaded
