"""One long job's bookkeeping over sessions, shared by the comparison (`kvdemo.compare.run`) and the needle grid
(`kvdemo.needle.grid`): its units of work counted and told (`on_progress(done, total, what)`), what runs now between
two units (`note`), the cancel event checked at every prefill chunk, quantized layer and decode step
(`JobCancelled`), and a prefill whose chunks and layers are told and checked. Each job turns `JobCancelled` into its
own record of what finished (`ComparisonCancelled`, `NeedleCancelled`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvdemo.qa.prompt import PreparedContext
from kvdemo.qa.records import PrefillReport
from kvdemo.qa.session import QASession

ProgressCallback = Callable[[int, int, str], None]
"""`on_progress(done, total, what)`: units of work done so far, the total, and what runs now."""


def seconds_left(elapsed: float, done: float, total: float) -> float | None:
    """The time a job has left at its own pace so far: `elapsed` seconds over `done` units × the units left; None
    before a unit is done or once all are (what a progress line then leaves out)."""
    return elapsed / done * (total - done) if 0 < done < total else None


class JobCancelled(Exception):
    """Raised inside a job's work once its cancel event is set (the session it was using restores or drops its
    cache as it unwinds)."""


class JobRun:
    """A job's units of work and its cancel event.

    Args:
        total: the units of work the job will do (a prefill, an answer, a score, ...); may be set again later.
        cancel: set it (from another thread) to stop at the next check.
        on_progress: told after each unit (`step`) and of what runs between two (`note`).
    """

    def __init__(
        self, total: int = 0, cancel: threading.Event | None = None, on_progress: ProgressCallback | None = None
    ):
        self.total, self.done, self.cancel, self.on_progress = total, 0, cancel, on_progress

    def step(self, what: str) -> None:
        """One unit done; `what` says what comes next or what finished."""
        self.done += 1
        self.note(what)

    def note(self, what: str) -> None:
        """What runs now, with the units done so far (no unit done)."""
        if self.on_progress is not None:
            self.on_progress(self.done, self.total, what)

    def check_cancel(self) -> None:
        """Raises `JobCancelled` once `cancel` is set."""
        if self.cancel is not None and self.cancel.is_set():
            raise JobCancelled

    def prefill(self, session: QASession, context: str | PreparedContext, label: str, **options: Any) -> PrefillReport:
        """`session.prefill(context, **options)` with each chunk and each quantized layer told (`note`, prefixed with
        `label`) and `cancel` checked after each (a prefill takes seconds to a minute).

        Raises:
            JobCancelled: `cancel` was set; the session's unfinished cache is dropped with it.
        """

        def chunk(done: int, total: int) -> None:
            self.check_cancel()
            self.note(f"{label}: prefilling {done:,} of {total:,} tokens")

        def layer(done: int, total: int) -> None:
            self.check_cancel()
            self.note(f"{label}: quantizing the cache, {done} of {total} layers")

        return session.prefill(context, on_progress=chunk, on_quantize=layer, **options)
