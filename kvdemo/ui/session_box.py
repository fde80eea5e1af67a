"""The Ask tab's session file (`kvdemo.qa.session_file`): Save session writes this tab's prefilled context and cache to
a file the browser downloads; a session file uploaded to the same box is opened instead of a prefill, and the page then
shows its context and its spec (the Context box, the backend and the option fields), so the page shows what the cache
holds. After a reload, or an app restarted, the Context box and options the browser kept are reopened from the
server's folder of session files where it holds their file (`reopen`). A file the page cannot show (a per-layer
plan: no field holds one) or cannot open here (another model, spec or version, damaged) is refused beside Prefill and
the tab's session keeps its cache."""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import gradio as gr

from kvdemo.cache.registry import BACKENDS, GROUP_OPTIONS
from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.session import Session
from kvdemo.qa.session_file import SUFFIX
from kvdemo.serve.server import App
from kvdemo.serve.store import request_key
from kvdemo.ui import option_fields, page_state, views
from kvdemo.ui.ask_widgets import PrefillView
from kvdemo.ui.inputs import refusal, spec_from_inputs

_log = logging.getLogger(__name__)


def spec_fields(spec: CacheSpec) -> tuple[str, list[Any]]:
    """The backend and the option fields' values (`GROUP_OPTIONS` order) that show `spec` on the page.

    Raises:
        ValueError: the fields cannot show it (a per-layer plan); the message says where it can be opened.
    """
    options = BACKENDS[spec.backend].options
    given = spec.given()
    values = [
        given.get(name, option_fields.field_start(options[name])) if name in options else None for name in GROUP_OPTIONS
    ]
    shown = spec_from_inputs(spec.backend, dict(zip(GROUP_OPTIONS, values)))
    if shown.backend != spec.backend or shown.resolved() != spec.resolved() or spec.plan:
        raise ValueError(
            f"the page's option fields cannot show `{spec.text}`; open this file with the command line "
            f"(python -m kvdemo ask --session FILE) or in Python (kvdemo.qa.session_file.open_session)"
        )
    return spec.backend, values


def _file_name(qa: Session) -> Path:
    """A fresh temporary path named after the session's model, spec and tokens."""
    assert qa.prefill_report is not None  # saved once prefilled
    name = f"{qa.loaded.name.split('/')[-1]}-{qa.spec.text}-{qa.prefill_report.context_tokens}tokens"
    return Path(tempfile.mkdtemp(prefix="kvdemo-session-")) / (re.sub(r"[^A-Za-z0-9_.=-]+", "_", name) + SUFFIX)


def save(app: App, request: gr.Request) -> tuple[Any, Any]:
    """(the session file box, notice): this tab's prefill written to a file to download (`Door.save_file`), or a
    refusal."""
    try:
        qa, saved = app.door.save_file(request_key(request), _file_name)
    except (OSError, TypeError, ValueError) as error:
        return gr.skip(), refusal(error, "Save session")
    _log.info("saved a session file of %d bytes in %.2f s", saved.bytes, saved.seconds)
    tokens = qa.prefill_report.context_tokens if qa.prefill_report else 0
    return str(saved.path), (
        f"Saved the cache's `{qa.spec.full_text}` over {tokens:,} tokens ({saved.bytes / 2**20:,.2f} MiB in "
        f"{saved.seconds:.2f} s): download it from the session file box below."
    )


def open_file(app: App, path: str | None, request: gr.Request) -> tuple[Any, ...]:
    """(Context box, backend, the option fields, `PrefillView`'s outputs, the session file box) for an uploaded
    session file: the file opened into this tab's session through the door (`Door.open_file`, which first asks
    `spec_fields` whether the page can show its spec) and the page set to its context and spec, or a refusal beside
    Prefill with everything else as it was; either way the box is emptied, ready for the next file."""
    keep = (gr.skip(),) * (2 + len(GROUP_OPTIONS))
    if not path:
        return (*keep, *PrefillView(), gr.skip())
    try:
        user = app.sessions.of_request(request)
        qa = app.door.open_file(request_key(request), path, check=spec_fields)
        user.page_shows = (qa.context or "", qa.spec)
        backend, values = spec_fields(qa.spec)
    except (ValueError, ImportError) as error:
        held = app.sessions.peek_request(request)
        shown = held is not None and held.qa is not None and page_state.page_differs(held) is None
        return (*keep, *PrefillView.refused(refusal(error, "opening the session file"), shown), None)
    view = PrefillView.prefilled(qa, qa.speed_limit(), user.answers, ask_enabled=True)  # page set to the file's
    return (qa.context, backend, *values, *view, None)  # the box emptied for the next file (the line names this one)


def reopen(
    app: App, prefill: Any, context: Any, backend: Any, options: dict[str, Any], request: Any, progress: Any
) -> PrefillView:
    """After the page's load has restored the Context box and the options the browser kept (`page_state.restore`):
    when the server's folder of session files holds the file of that context, model and spec and this tab holds no
    prefill, `prefill` (the Ask tab's, which then opens the file: `Door.prefill`), so a reload or a restarted app
    shows the last context prefilled without a new prefill; when the folder holds this context only with another model
    or spec, a line under Prefill that says whose it is and what reopens it; else a `PrefillView` that changes
    nothing."""
    files, loaded, user = app.session_files, app.loaded, app.sessions.peek_request(request)
    if files is None or loaded is None or not isinstance(context, str) or not context.strip():
        return PrefillView()
    if user is not None and user.qa is not None:
        return PrefillView()
    try:
        spec = spec_from_inputs(backend, options).validate(loaded.config)
        if not files.path(loaded, spec, loaded.prepare(context)).is_file():
            return PrefillView(prefill_info=_not_reopened(files.saved_of(context), loaded.name, spec))
    except (ValueError, ImportError):  # what the page shows cannot be prefilled: Prefill will say why
        return PrefillView()
    return prefill(context, backend, options, request, progress)


def _not_reopened(saved: list[tuple[str, str]], model: str, spec: CacheSpec) -> Any:
    """The line under Prefill after a reload that reopened nothing although the server keeps this text's prefill
    with another model or spec (`saved`: (model name, spec text), the most recent first); `views.KEEP` when it
    keeps none."""
    if not saved:
        return views.KEEP
    name, spec_text = saved[0]
    if name != model:
        return (
            f"ℹ Nothing is prefilled in this tab: the saved prefill of this text is {name}'s (`{spec_text}`), and the "
            f"server now runs {model}. Load {name} above to reopen it, or press **Prefill** to prefill it on {model}"
        )
    return (
        f"ℹ Nothing is prefilled in this tab: the saved prefill of this text is with `{spec_text}`, the page shows "
        f"`{spec.text}`. Set those options to reopen it, or press **Prefill**"
    )


def reopener(app: App, prefill: Any) -> Any:
    """`reopen` for `app` and the Ask tab's `prefill`, as `page_event` takes a handler (named `reopen`)."""

    def reopen_saved(context: Any, backend: Any, options: dict[str, Any], request: Any, progress: Any) -> PrefillView:
        return reopen(app, prefill, context, backend, options, request, progress)

    reopen_saved.__name__ = reopen_saved.__qualname__ = "reopen"
    return reopen_saved


def wire(app: App, w: dict[str, Any], before: Any, after: dict[str, Any]) -> None:
    """Save session and the session file box's upload (`w`: the Ask tab's widgets by name), in the model's queue
    group. An upload first runs `before` outside the queue (the Ask tab's step before a prefill: this tab's running
    answer or prefill stopped, Ask disabled) and `after` (the keywords of the Stop button's state event) at its end."""
    outputs = [w["context"], w["backend"], *(w[name] for name in GROUP_OPTIONS)]
    outputs += [*(w[name] for name in PrefillView._fields), w["session_file"]]
    private: dict[str, Any] = {"api_visibility": "private", "concurrency_id": "model"}

    def saving(request: gr.Request) -> tuple[Any, Any]:
        return save(app, request)

    def opening(path: str | None, request: gr.Request) -> tuple[Any, ...]:
        return open_file(app, path, request)

    w["save_session"].click(saving, outputs=[w["session_file"], w["notice"]], **private)
    upload = w["session_file"].upload(
        before, outputs=[w["ask_button"], w["stop_button"]], api_visibility="private", queue=False
    )
    upload.then(opening, inputs=w["session_file"], outputs=outputs, **private).then(**after)
