"""What the page says of time, from what this machine measured: a prefill's time from the click and where it went
(`from_click`), a long job's time left at its own pace (`Paced`), the estimates Compare and Recommend give before
their first unit, and the full-precision answer's. Pure functions of records, as `views`: a time this machine did
not measure is never promised."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvdemo.charts.steps import flush_timing
from kvdemo.compare.recommendation import Recommendation
from kvdemo.qa.job import seconds_left
from kvdemo.qa.session import Session


def from_click(qa: Session, total: float, queued: float, set_up: float, first_use: bool) -> str:
    """What the prefill line adds about time (seconds): the whole wait from the Prefill click, and where it went
    beside the prefill itself (`PrefillReport.seconds`): the queue (`queued`, other users' work or this tab's
    running answer), the cache's set-up (`set_up`: building the session; one-off on the first use of a backend with
    this model in the process, `first_use`, when kernels compile or warm), and the rest (installing the cache,
    saving its session file). Parts under 0.5 s are left out; "" when the whole is within 0.5 s of the prefill's."""
    assert qa.prefill_report is not None  # shown after a prefill
    prefill = qa.prefill_report.seconds
    if total - prefill < 0.5:
        return ""
    rest = total - prefill - queued - set_up
    named = (
        (queued, "waiting in the queue"),
        (set_up, f"one-off set-up: the first {qa.spec.backend} cache on this model here" if first_use else "set-up"),
        (rest, "installing and saving the cache"),
    )
    parts = [f"{seconds:.1f} s {what}" for seconds, what in named if seconds >= 0.5]
    return f" · **{total:.1f} s from the click**" + (f" ({'; '.join(parts)})" if parts else "")


def reference_estimate(qa: Session) -> str:
    """What the page says while the full-precision answer runs (`Door.reference`): what it does and about how long
    it takes, from this session's own prefill time and last answer's (a `dynamic` prefill of the same tokens and
    the same number of decode steps take about as long)."""
    assert qa.prefill_report is not None and qa.history  # after an answer on a prefilled cache
    estimate = qa.prefill_report.seconds + qa.history[-1].seconds
    return (
        f"Making the full-precision answer: a `dynamic` cache of the same {qa.prefill_report.context_tokens:,} tokens, "
        f"asked the same question (about {estimate:,.0f} s here: this prefill's time and this answer's; once per "
        "question, kept for later asks on this text)…"
    )


class Paced:
    """The `on_progress(done, total, what)` of a long job (Compare, Needle, Recommend) drawing its bar on `progress`
    (`gr.Progress`), with the time left once a unit is done: the seconds per unit so far × the units left, this
    machine's measured pace under its load now, revised at every update (an estimate promised in advance did not
    follow a busy machine: "about 1-2 minutes" had done 16 of 68 steps after 200 s)."""

    def __init__(self, progress: Any, clock: Callable[[], float] = time.monotonic):
        self.progress, self.clock, self.began = progress, clock, clock()

    def __call__(self, done: float, total: float, what: str) -> None:
        left = seconds_left(self.clock() - self.began, done, total)
        if left is not None:
            what += f" · about {duration(left)} left at this run's pace"
        self.progress((done, total), desc=what, unit="steps")


def duration(seconds: float) -> str:
    """`seconds` as a reader takes it in: `40 s`, `3 min 20 s`."""
    seconds = max(round(seconds), 0)
    return f"{seconds} s" if seconds < 90 else f"{seconds // 60} min {seconds % 60:02d} s"


def compare_estimate(specs: int, questions: int, max_new_tokens: int, qa: Session | None, events: list) -> str:
    """What Compare says before its first unit: about how long it will take, from this tab's own measurements on this
    machine (its prefill's seconds and its last answer's median decode step, `flush_timing`): per spec one prefill
    and 2 × questions × max_new_tokens decode steps (the answers, and each scored teacher-forced), `specs` times; ""
    where the tab has measured neither (the bar's pace says it once the first unit is done)."""
    step = flush_timing(events)[2] if events else None
    if qa is None or qa.prefill_report is None or step is None:
        return ""
    seconds = specs * (qa.prefill_report.seconds + 2 * questions * max_new_tokens * step)
    return (
        f" (about {duration(seconds)}: {specs} prefills of {qa.prefill_report.seconds:.1f} s and "
        f"{2 * questions * max_new_tokens * specs:,} decode steps of {step * 1000:,.0f} ms, as this tab measured them; "
        "at most, since answers often end early)"
    )


def recommend_estimate(found: Recommendation | None, model: str, tokens: int) -> str:
    """What Recommend says before its first unit: about how long it may take, from the page default this machine
    measured for the model (`kvdemo.serve.recommended`: its seconds over its tokens, scaled to `tokens` of the user's
    text; at most, since the search stops once the pick is sure); "" where none was measured for `model`."""
    if found is None or found.model != model or not found.seconds or not found.context_tokens:
        return ""
    seconds = found.seconds * max(tokens / found.context_tokens, 1.0)
    return (
        f" (about {duration(seconds)} at most: the page's default took {found.seconds:.0f} s on "
        f"{found.context_tokens:,} tokens here, and this text has {tokens:,})"
    )
