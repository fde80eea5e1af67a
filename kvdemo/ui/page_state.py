"""What the Ask tab's page shows against what its session holds: whether the Context box and the options are the
prefilled context and spec, and the line that says so (the gate of Ask: answers never come from a state the page
does not show); and what the browser keeps of the page across a reload. Pure functions of a `UserSession` and the
page's values.

A large Context box (over `LARGE_CONTEXT_CHARS`) does not travel with each change: the page sends its `fingerprint`
instead, computed in the browser (`kvdemo.ui.context_box`), and the gate compares it with the prefilled text's
(`same_context`); a prefill and an answer still take the whole text, and an answer compares it exactly."""

from __future__ import annotations

import functools
import zlib
from typing import Any

from kvdemo.cache.registry import BACKENDS, GROUP_OPTIONS
from kvdemo.cache.spec import CacheSpec
from kvdemo.serve.store import UserSession
from kvdemo.ui import views
from kvdemo.ui.tab_view import tab_view

LARGE_CONTEXT_CHARS = 65_536
"""Above this many characters (UTF-16 code units, what the browser's `String.length` counts) the Context box is large:
each change sends its `fingerprint` (about 50 bytes) instead of the text, and the browser does not keep it across a
reload (`remember_js`). At or below it the page sends and keeps the text itself, as it always did. Measured in Chromium
on loopback (2026-12-04, 2 cores at load 2.5-3.5): with a 2 MB context, each typed character sent megabytes (up to
19 MB, in Gradio's endless re-sends: `kvdemo.ui.context_box`) and now 0.6 kB up and 0.4 kB down."""

FINGERPRINT_PREFIX = "kvdemo-context-fingerprint:"


def fingerprint(text: str) -> str:
    """The stand-in for a large Context box that the page sends at each change: `text`'s length in UTF-16 code units,
    and zlib's CRC-32 and Adler-32 of its UTF-16-LE bytes, as `kvdemo.ui.context_box.FINGERPRINT_JS` computes them in
    the browser (JavaScript strings are UTF-16; lone surrogates pass as they are).

    Example:
        >>> fingerprint("abc")
        'kvdemo-context-fingerprint:3:ad957ab0:049a0127'
    """
    return _fingerprint(text)


@functools.lru_cache(maxsize=4)  # the prefilled text, compared at every change: 5 ms for 2 MB, once
def _fingerprint(text: str) -> str:
    data = text.encode("utf-16-le", "surrogatepass")
    return f"{FINGERPRINT_PREFIX}{len(data) // 2}:{zlib.crc32(data):08x}:{zlib.adler32(data):08x}"


def same_context(shown: str | None, held: str | None) -> bool:
    """Whether the page's Context box, its text or (when large) its `fingerprint`, is the text `held`. A fingerprint
    matches a text of the same length, CRC-32 and Adler-32; an answer compares the whole text again."""
    if shown == held:
        return True
    return (
        held is not None
        and isinstance(shown, str)
        and shown.startswith(FINGERPRINT_PREFIX)
        and shown == fingerprint(held)
    )


def prefilled_matches(
    user: UserSession | None, context: str | None, spec: CacheSpec | None, loaded: object = None
) -> bool:
    """Whether the page's Context box (its text, or its `fingerprint`) and options are what this session's cache
    holds, and (given `loaded`, the server's model now) the cache was prefilled on that model."""
    if user is None or user.qa is None or spec is None:
        return False
    if loaded is not None and user.qa.loaded is not loaded:
        return False
    same_spec = spec.backend == user.qa.spec.backend and spec.resolved() == user.qa.spec.resolved()
    return same_spec and (context is None or same_context(context, user.qa.context))


def page_differs(user: UserSession) -> str | None:
    """What differs between the page's Context box and options (`UserSession.page_shows`) and the session's
    cache, said as a refusal; None when they match, or when no page showed this session (an API caller)."""
    if user.page_shows is None or user.qa is None:
        return None
    context, spec = user.page_shows
    if prefilled_matches(user, context, spec):
        return None
    what = "options" if same_context(context, user.qa.context) else "Context box"
    now = f", the page shows {spec.full_text}" if spec is not None else ", the page's options are not valid"
    return (
        f"The {what} changed since the prefill: the cache holds {user.qa.spec.full_text}{now}; press Prefill to "
        f"rebuild it, or set the {what} back"
    )


def page_line(
    user: UserSession | None,
    context: str | None,
    spec: CacheSpec | None,
    loaded: Any = None,
    freed: str | None = None,
) -> str:
    """The line under Prefill: the prefill's summary while the page shows what the cache holds; otherwise
    what the page shows (the spec a Prefill will run) and what differs from the cache: the Context box, the
    options, or the model (`loaded`, the server's now); with no cache, why the session was `freed` if it was."""
    shown = f"**spec** `{spec.full_text}`" if spec is not None else "**spec**: options not valid yet"
    if user is None or user.qa is None:
        if freed:
            return f"{shown} · nothing prefilled in this tab: your last prefill was freed because {freed}"
        return f"{shown} · nothing prefilled in this tab yet"
    if loaded is not None and user.qa.loaded is not loaded:
        return (
            f"⚠ The model changed since the prefill (the cache holds {views.prefilled_tokens(user.qa):,} tokens "
            f"prefilled on {user.qa.loaded.name}; the server now runs {loaded.name}). Press **Prefill** to prefill "
            f"this text on it; until then Ask is disabled. Now: {shown}"
        )
    if prefilled_matches(user, context, spec):
        return views.prefill_summary(user.qa, tab_view(user).prefill_timing)
    what = "options" if same_context(context, user.qa.context) else "Context box"
    return (
        f"⚠ The {what} changed since the prefill (the cache holds {views.prefilled_tokens(user.qa):,} "
        f"tokens with `{user.qa.spec.full_text}`). Press **Prefill** to rebuild it; until then Ask is "
        f"disabled, so answers never come from a state the page does not show. Now: {shown}"
    )


def remember_js(limit: int) -> str:
    """What the browser keeps across a reload (`gr.BrowserState`), as the `js=` of a listener without a server
    function (`fn=None`: no request; Gradio's BrowserState encrypts it in the browser), run at each change of the
    Context box, the backend or an option: the Context box when it holds at most `limit` characters
    (`LARGE_CONTEXT_CHARS` on the page), the backend and the options; of a larger box only its length,
    `context_chars`, so that `restore` says it was not kept."""
    return f"""(context, backend, ...options) => {{
    const large = typeof context === "string" && context.length > {limit};
    const kept = {{context: large ? "" : context, backend: backend, options: options.slice(0, {len(GROUP_OPTIONS)})}};
    if (large) kept.context_chars = context.length;
    return kept;
}}"""


def restore(saved: dict[str, Any] | None) -> list[Any]:
    """The Context box, backend, options and the note under the Context box as the browser kept them (`views.KEEP`
    for each when it kept nothing; the note says so when the Context box was too large to keep)."""
    if not isinstance(saved, dict) or saved.get("backend") not in BACKENDS:
        return [views.KEEP] * (3 + len(GROUP_OPTIONS))
    options = list(saved.get("options") or [])[: len(GROUP_OPTIONS)]
    dropped = saved.get("context_chars")
    dropped = dropped if isinstance(dropped, int) and not isinstance(dropped, bool) and dropped > 0 else None
    return [
        views.KEEP if dropped else saved.get("context") or "",
        saved["backend"],
        *options,
        *[views.KEEP] * (len(GROUP_OPTIONS) - len(options)),
        not_kept_note(dropped) if dropped else views.KEEP,
    ]


def not_kept_note(chars: int) -> str:
    """The note under the Context box after a reload that did not bring back a large context of `chars` characters."""
    return (
        f"ℹ The last context ({chars:,} characters) was not kept across the reload: the browser keeps a context of at "
        f"most {LARGE_CONTEXT_CHARS:,} characters. Paste or upload it again; the backend and options were kept."
    )
