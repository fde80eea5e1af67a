"""What the Ask tab shows of one browser tab's session: its chat, the last answer's step events (the charts' data),
its answer line and its prefill's timing. The page's own record, held in the tab's `UserSession` (`view`) and read and
written by the UI alone: the server's door installs a session and never touches it. A view belongs to the session it
was made for, so a new prefill (or a freed session) shows an empty one, with no reset anywhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvdemo.cache.state.telemetry import StepEvent
from kvdemo.serve.store import UserSession


@dataclass(eq=False)
class TabView:
    """The Ask tab's view of `session`.

    Attributes:
        chat: the chat's messages (`{"role", "content"}`), question and answer in turn.
        events: the last answer's `StepEvent`s, as they came (the memory, residual and step charts draw them).
        answer_line: the last answer's line under the chat (`kvdemo.ui.views.answer_stats`).
        prefill_timing: where the prefill's time went from the click (`kvdemo.ui.times.from_click`).
    """

    session: Any
    chat: list[dict[str, str]] = field(default_factory=list)
    events: list[StepEvent] = field(default_factory=list)
    answer_line: str = ""
    prefill_timing: str = ""


def tab_view(user: UserSession) -> TabView:
    """The view of `user`'s session now: the one kept while it is the session it was made for, else a new, empty one
    (a new prefill, a session file opened, the session freed)."""
    view = user.view
    if not isinstance(view, TabView) or view.session is not user.qa:
        view = user.view = TabView(user.qa)
    return view
