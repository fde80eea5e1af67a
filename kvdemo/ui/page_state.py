"""What the Ask tab's page shows against what its session holds: whether the Context box and the options are the
prefilled context and spec, and the line that says so (the gate of Ask: answers never come from a state the page
does not show); and what the browser keeps of the page across a reload. Pure functions of a `UserSession` and the
page's values."""

from __future__ import annotations

from typing import Any

from kvdemo.cache.options import GROUP_OPTIONS
from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec
from kvdemo.serve.store import UserSession
from kvdemo.ui import views


def prefilled_matches(user: UserSession | None, context: str | None, spec: CacheSpec | None) -> bool:
    """Whether the page's Context box and options are what this session's cache holds."""
    if user is None or user.qa is None or spec is None:
        return False
    same_spec = spec.backend == user.qa.spec.backend and spec.resolved() == user.qa.spec.resolved()
    return same_spec and (context is None or context == user.qa.context)


def page_differs(user: UserSession) -> str | None:
    """What differs between the page's Context box and options (`UserSession.page_shows`) and the session's
    cache, said as a refusal; None when they match, or when no page showed this session (an API caller)."""
    if user.page_shows is None or user.qa is None:
        return None
    context, spec = user.page_shows
    if prefilled_matches(user, context, spec):
        return None
    what = "options" if context == user.qa.context else "Context box"
    now = f", the page shows {spec.full_text}" if spec is not None else ", the page's options are not valid"
    return (
        f"The {what} changed since the prefill: the cache holds {user.qa.spec.full_text}{now}; press Prefill to "
        f"rebuild it, or set the {what} back"
    )


def page_line(user: UserSession | None, context: str | None, spec: CacheSpec | None) -> str:
    """The line under Prefill: the prefill's summary while the page shows what the cache holds; otherwise
    what the page shows and what differs from the cache."""
    shown = f"**spec** `{spec.full_text}`" if spec is not None else "**spec**: options not valid yet"
    if user is None or user.qa is None:
        return f"{shown} · nothing prefilled in this tab yet"
    if prefilled_matches(user, context, spec):
        return views.prefill_summary(user.qa)
    what = "options" if context == user.qa.context else "Context box"
    return (
        f"⚠ The {what} changed since the prefill (the cache holds {views.prefilled_tokens(user.qa):,} "
        f"tokens with `{user.qa.spec.full_text}`). Press **Prefill** to rebuild it; until then Ask is "
        f"disabled, so answers never come from a state the page does not show. Now: {shown}"
    )


def remember(context, backend, *options) -> dict[str, Any]:
    """What the browser keeps across a reload (`gr.BrowserState`): the Context box, the backend and its options."""
    return {"context": context, "backend": backend, "options": list(options)}


def restore(saved: dict[str, Any] | None) -> list[Any]:
    """The Context box, backend and options as the browser kept them (`views.KEEP` for each when it kept nothing)."""
    if not isinstance(saved, dict) or saved.get("backend") not in BACKENDS:
        return [views.KEEP] * (2 + len(GROUP_OPTIONS))
    options = list(saved.get("options") or [])[: len(GROUP_OPTIONS)]
    return [
        saved.get("context") or "",
        saved["backend"],
        *options,
        *[views.KEEP] * (len(GROUP_OPTIONS) - len(options)),
    ]
