"""What the page shares across users, with no Gradio in it: the loaded model (one for everyone), the
per-tab session store (`SessionStore`, keyed by Gradio's `session_hash`), bounded in count and idle time, and
the server-wide KV budget (`KVAccount`): the bytes every session's cache, every prefill in progress and every
running comparison may hold together, reserved before anything is allocated.

The page (`kvdemo.ui`) reads and changes this state only through `App` and `SessionStore`; errors meant for
the user are `ValueError`s, turned into `gr.Error` by the page in one place.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvdemo import checks
from kvdemo.accounting import KVAccount, prefill_tokens, session_kv_bytes
from kvdemo.models import LoadedModel, is_hub_id, load_model
from kvdemo.session import DEFAULT_MAX_NEW_TOKENS, QUESTION_RESERVE_TOKENS, PrefillReport, QASession
from kvdemo.spec import CacheSpec


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
        on_free: called with the key of every session freed (swept, evicted, closed), after its cache is dropped
            (`App` releases the session's KV reservation there).

    Raises:
        ValueError: max_sessions < 1 or idle_seconds <= 0.
    """

    def __init__(
        self,
        max_sessions: int = 32,
        idle_seconds: float | None = 1800.0,
        clock: Callable[[], float] = time.monotonic,
        on_free: Callable[[str], None] | None = None,
    ):
        if max_sessions < 1 or (idle_seconds is not None and idle_seconds <= 0):
            raise ValueError(f"max_sessions={max_sessions} must be >= 1 and idle_seconds={idle_seconds} > 0 (or None)")
        self.max_sessions = max_sessions
        self.idle_seconds = idle_seconds
        self.clock = clock
        self.on_free = on_free
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
                        f"The server is full: all {self.max_sessions} sessions are busy answering. "
                        "Try again in a minute"
                    )
                self._drop(
                    victim,
                    f"this server keeps at most {self.max_sessions} sessions and yours was the least recently used",
                )
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
        if self.on_free is not None:
            self.on_free(key)
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

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._sessions


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
        server_kv_budget_bytes: the server-wide KV budget (`KVAccount`): every session's cache and snapshot,
            every prefill in progress and every running comparison together (bytes; None: no limit).

    Attributes:
        kv: the `KVAccount`; a freed session's cache is released from it (`SessionStore.on_free`).
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
        server_kv_budget_bytes: int | None = None,
    ):
        self.model_source = model_source
        self.loader = loader
        self.kv = KVAccount(server_kv_budget_bytes)
        self.sessions = SessionStore(max_sessions, idle_seconds, on_free=lambda key: self.kv.release(f"cache:{key}"))
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

    # ---- the server-wide KV budget ------------------------------------------------------------------
    def prefill(
        self,
        key: str,
        qa: QASession,
        context: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> PrefillReport:
        """`qa.prefill(context, max_new_tokens, on_progress=...)` for the session of `key`, within the server-wide
        KV budget.

        The session's most bytes (`session_kv_bytes`, with `QUESTION_RESERVE_TOKENS + max_new_tokens` decoded)
        are reserved as `prefill:<key>` before the prefill runs; the session's previous cache still counts
        meanwhile (it is alive until the new one replaces it). When the prefill succeeds the reservation becomes
        `cache:<key>` (replacing the old cache's); when it fails it is released and the old one stays.

        Example:
            >>> qa = QASession(app.wait_for_model(), CacheSpec.parse("hqq:4"), kv_budget_bytes=app.kv_budget_bytes)
            >>> app.prefill(request.session_hash, qa, context).context_tokens
            2172

        Raises:
            ServerKVBudgetError (a ValueError): the reservation would pass the budget; nothing ran.
            ValueError, ImportError: what `QASession.prefill` raises (the reservation is released).
        """
        reserve = QUESTION_RESERVE_TOKENS + checks.max_new_tokens(max_new_tokens)
        tokens = prefill_tokens(qa, context)
        nbytes = session_kv_bytes(qa.spec, qa.loaded, tokens, reserve)
        holder = f"prefill:{key}"
        self.kv.reserve(
            holder,
            nbytes,
            f"a {qa.spec.label} KV cache for {tokens:,} context tokens + {reserve} for a question and its answer",
        )
        try:
            report = qa.prefill(context, max_new_tokens, on_progress=on_progress)
        except BaseException:
            self.kv.release(holder)
            raise
        self.kv.transfer(holder, f"cache:{key}")
        if key not in self.sessions:  # freed (its tab closed) while prefilling: nothing will hold this cache
            self.kv.release(f"cache:{key}")
        return report

    def reserve_answer(self, key: str, qa: QASession, question: str, max_new_tokens: int) -> None:
        """Before `qa.stream(question, max_new_tokens)`: grow the session's reservation `cache:<key>` to cover
        that answer (the prefill reserved `QUESTION_RESERVE_TOKENS` + its own max_new_tokens); never shrinks it.

        Raises:
            ServerKVBudgetError (a ValueError): the larger reservation would pass the budget; nothing ran.
            ValueError: an empty question, no prefill, a bad max_new_tokens (the session's messages).
        """
        max_new_tokens = checks.max_new_tokens(max_new_tokens)
        if qa.prefill_report is None:
            raise ValueError("prefill a context before asking a question")
        decoded = len(qa.question_ids(question)) + max_new_tokens
        nbytes = session_kv_bytes(qa.spec, qa.loaded, qa.prefill_report.context_tokens, decoded)
        self.kv.reserve(
            f"cache:{key}",
            nbytes,
            f"an answer of up to {max_new_tokens} tokens on your "
            f"{qa.prefill_report.context_tokens:,}-token {qa.spec.label} cache",
            grow_only=True,
        )
        if key not in self.sessions:  # freed meanwhile: its cache goes once this answer ends
            self.kv.release(f"cache:{key}")

    @contextmanager
    def holding(self, holder: str, nbytes: int, what: str) -> Iterator[int]:
        """Reserve `nbytes` under `holder` for the `with` block (a comparison, a grid of runs) and release them
        at its end, however it ends. Yields `nbytes`.

        Raises:
            ServerKVBudgetError (a ValueError): the reservation would pass the budget; the block does not run.
        """
        self.kv.reserve(holder, nbytes, what)
        try:
            yield nbytes
        finally:
            self.kv.release(holder)

    def comparison(self, key: str, loaded: LoadedModel, context: str, specs: Sequence[CacheSpec], max_new_tokens: int):
        """`holding` for `kvdemo.compare.compare(loaded, context, questions, specs, max_new_tokens)` run by the
        session of `key` (holder `compare:<key>`): it runs one spec at a time, `dynamic` first, so it holds at
        most the largest `session_kv_bytes` of those specs (its reference log-probabilities are not KV and are
        not counted).

        Example:
            >>> with app.comparison(key, loaded, context, specs, 32):
            ...     report = compare(loaded, context, questions, specs, 32)

        Raises:
            ServerKVBudgetError (a ValueError): the comparison would pass the budget; ValueError, ImportError: a
                spec that does not validate on the model.
        """
        reserve = QUESTION_RESERVE_TOKENS + checks.max_new_tokens(max_new_tokens)
        tokens = prefill_tokens(QASession(loaded, CacheSpec("dynamic")), context)
        nbytes = max(
            session_kv_bytes(spec.validate(loaded.config), loaded, tokens, reserve)
            for spec in [CacheSpec("dynamic"), *specs]
        )
        what = f"a comparison of {len(specs)} spec(s) on {tokens:,} context tokens"
        return self.holding(f"compare:{key}", nbytes, what)
