"""What the door's session jobs give their callers (`kvdemo.serve.door.Door`): a prefill's end (`Prefilled`), an
answer as it runs (`AnswerRun`), and the full-precision answer beside one (`FullPrecisionAnswer`). The same records
whether the model work ran in this process or in a ZeroGPU worker."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass

from kvdemo.cache.state.telemetry import StepEvent
from kvdemo.qa.prompt import PreparedQuestion
from kvdemo.qa.records import Answer
from kvdemo.qa.session import Session


@dataclass(frozen=True)
class Prefilled:
    """A prefill's end as the door gives it: the session (installed in the store) and where the time went before
    the prefill itself: `queued_seconds` waiting for the session's lock (its running answer), `set_up_seconds`
    building the session (a backend's first use on a model probes it and warms its kernels)."""

    session: Session
    queued_seconds: float
    set_up_seconds: float


@dataclass
class AnswerRun:
    """An answer as it runs (`Door.answer`): iterate it for its `StepEvent`s; `answer` is the finished `Answer`
    once the iteration has ended (stopped, finished or failed: the session restored its cache)."""

    session: Session
    question: PreparedQuestion
    events: Generator[StepEvent, None, None]

    def __iter__(self) -> Iterator[StepEvent]:
        return self.events

    @property
    def answer(self) -> Answer:
        """The session's last answer (this one, once ended)."""
        return self.session.history[-1]


@dataclass(frozen=True)
class FullPrecisionAnswer:
    """A full-precision answer as `Door.reference` gives it: the `Answer` of a `dynamic` cache, the seconds it took
    (its prefill, or the session file opened, and its decode steps; 0 when `cached`), and whether it was kept from
    an earlier ask of the same question."""

    answer: Answer
    seconds: float
    cached: bool
