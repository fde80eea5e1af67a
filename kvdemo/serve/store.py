"""The per-tab session store, with no Gradio in it: one `UserSession` per browser tab (keyed by Gradio's
`session_hash`), bounded in count (`ServerFull` when every session is busy) and in idle time. `kvdemo.serve.server.App`
holds one; the page reaches it only through the App.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.session import Session

API_KEY = "api"
"""The session key of a call that comes with no request (a direct call of a handler, a script)."""


class _Request(Protocol):
    """What `request_key` reads of a page request (`gr.Request`)."""

    session_hash: str | None


def request_key(request: _Request | None) -> str:
    """The session key of a page request: Gradio's `gr.Request.session_hash` (read by name, so no Gradio is
    imported here), `API_KEY` for a call without a request."""
    return str(request.session_hash) if request is not None else API_KEY


@dataclass
class UserSession:
    """One browser session's state, kept on the server.

    Attributes:
        last_used: `SessionStore`'s clock reading at the last request (seconds).
        page_shows: the Context box and the `CacheSpec` (None: options not valid) the page showed last: the Ask
            tab's gate writes it at every change, a prefill at its click; None where no page showed this session
            (an API or MCP caller). An answer is refused while it is not what `qa` holds.
        answer_stop: set by Stop (`interrupt`) since the answer was asked (`queue_answer`, `answering`): a Stop
            pressed while the answer waits in the queue, or before its stream has begun, still stops it.
        prefill_stop: set by Stop (`interrupt`) since the running prefill took the lock (`Door.prefill` clears it
            then): the prefill's job looks at it, so a Stop pressed while the prefill is set up still stops it.
        answers_queued: Ask clicks whose answer has not ended yet, refused or run (`queue_answer`,
            `answer_ended`); `answer_pending` while there is one.
        prefill_clicked: `time.monotonic()` at the last Prefill click (before the queue), which the prefill's line
            counts its time from; None where no page clicked (an API caller).
        references: the full-precision answers made for this tab (`Door.reference`), by (model, context, question,
            max_new_tokens): kept across prefills of the same text, whatever their spec.
        reference: the `dynamic` session `Door.reference` runs now (Stop reaches it), else None.
        reference_due: the max_new_tokens of an answer that ended since the page last put the full-precision
            answer beside one (the Ask tab's `reference` runs it once per answer); None: none is due.
        view: what the page shows of this tab's session (its chat, step events, answer line and prefill timing):
            the UI's own record (`kvdemo.ui.tab_view.TabView`), kept here for the tab and read by the UI alone.
    """

    qa: Session | None = None
    answers: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    compare_cancel: threading.Event = field(default_factory=threading.Event)
    compare_lock: threading.Lock = field(default_factory=threading.Lock)
    compare_pending: bool = False
    prefilling: Session | None = None
    last_used: float = 0.0
    page_shows: tuple[str, CacheSpec | None] | None = None
    answer_stop: threading.Event = field(default_factory=threading.Event)
    prefill_stop: threading.Event = field(default_factory=threading.Event)
    answers_queued: int = 0
    prefill_clicked: float | None = None
    references: dict[tuple, Any] = field(default_factory=dict)
    reference: Session | None = None
    reference_due: int | None = None
    view: Any = None

    def interrupt(self) -> None:
        """Stop this session's answer after its current decode step (also one asked that has not begun: see
        `answering`) and its prefill before its next chunk (Stop, or a new prefill); a comparison has its own
        Cancel."""
        self.answer_stop.set()
        self.prefill_stop.set()
        for qa in (self.qa, self.prefilling, self.reference):
            if qa is not None:
                qa.request_stop()

    def queue_answer(self) -> None:
        """At an Ask click, before the answer waits in the queue: from now on Stop applies to it, and it is
        pending until `answer_ended`."""
        self.answer_stop.clear()
        self.answers_queued += 1

    def answer_ended(self) -> None:
        """An answer an Ask click queued has ended, however: refused (before or after the lock), run, stopped or
        failed. The one place the pending mark comes off; the Ask tab's `ask` calls it once, in a `finally`."""
        self.answers_queued = max(self.answers_queued - 1, 0)

    @property
    def answer_pending(self) -> bool:
        """An Ask click has queued an answer that has not ended yet."""
        return self.answers_queued > 0

    @contextmanager
    def answering(self) -> Iterator[threading.Event]:
        """The one protocol of a session's answer (the Ask tab's, the `ask_question` tool's), entered with `lock`
        held: yields the answer's stop signal (`answer_stop`), from the Ask click (`queue_answer`) or, for a call
        that no button queued, from now. The answer's job looks at it after every decode step, so a Stop that came
        before the first ends the answer after it, with `finish_reason` `stopped` (the pattern of
        `SessionStore.long_job`'s Cancel)."""
        if not self.answer_pending:
            self.answer_stop.clear()
        yield self.answer_stop

    @property
    def long_job_active(self) -> bool:
        """A comparison or a needle grid runs in this session, or a click has queued one (what Cancel acts on)."""
        return self.compare_pending or self.compare_lock.locked()

    @property
    def busy(self) -> bool:
        """An answer, a prefill or a comparison is running in this session."""
        return self.lock.locked() or self.compare_lock.locked()

    def release(self) -> None:
        """Stop what runs (it ends after its current decode step and restores) and drop the cache."""
        self.compare_cancel.set()
        self.interrupt()
        self.qa = None


class ServerFull(ValueError):
    """No session can be created: the cap is reached and every session is busy (a message for the user)."""


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
        on_free: Callable[[str], object] | None = None,
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

    def of_request(self, request: _Request | None) -> UserSession:
        """The session of a page request (`request_key`), created when missing (Prefill, Compare, Needle only).

        Raises:
            ServerFull (a ValueError): the cap is reached and every session is busy.
        """
        return self.get(request_key(request))

    def peek_request(self, request: _Request | None) -> UserSession | None:
        """The session of a page request if it has one; handlers that only read or stop never create (or evict)
        one."""
        return self.peek(request_key(request))

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

    def free_other_models(self, loaded: object, reason: str) -> int:
        """Drop every session whose cache was prefilled (or opened) on a model other than `loaded` (after a model
        switch: its cache and the old model's memory go; an answer still running ends after its current step), each
        remembered with `reason`. Returns how many were dropped."""
        with self._lock:
            stale = [k for k, u in self._sessions.items() if u.qa is not None and u.qa.loaded is not loaded]
            for key in stale:
                self._drop(key, reason)
        return len(stale)

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

    @staticmethod
    def queue_long_job(user: UserSession) -> None:
        """At a long job's click, before it waits in the queue: from now on Cancel applies to it."""
        user.compare_cancel.clear()
        user.compare_pending = True

    @staticmethod
    def cancel_long_job(user: UserSession | None) -> bool:
        """Cancel the session's long job at its next prefill chunk or decode step, also while it waits in the
        queue; nothing when none is running or waiting. Returns whether there was one to cancel."""
        if user is not None and user.compare_pending:
            user.compare_cancel.set()
            return True
        return False

    @contextmanager
    def long_job(self, user: UserSession, busy: str) -> Iterator[threading.Event]:
        """The one protocol of a session's long job (a comparison or a needle grid, from a tab or an MCP tool):
        one at a time per session, refused rather than queued; Cancel applies from the click (`queue_long_job`)
        or, for a call that was not queued by a button, from now; at the end the session is marked used and
        free again, however the job ends. Yields the cancel event to hand to the job.

        Raises:
            ValueError(busy): another long job of this session is running (nothing ran).
        """
        if not user.compare_lock.acquire(blocking=False):
            raise ValueError(busy)
        try:
            if not user.compare_pending:  # called through the API, not queued by a button
                self.queue_long_job(user)
            yield user.compare_cancel
        finally:
            user.compare_pending = False
            self.touch(user)
            user.compare_lock.release()

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
