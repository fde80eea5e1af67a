"""What the page says about the model and the session's state, called directly on the tiny model (issue 58): a model
switch frees the sessions of the old model and the tab says why; a prefill that finished on the old model cannot be
asked; the prefill line counts from the click and names one-off work; a backend click takes its own defaults or
what the user set on it; the step line names the snapshot's copies; a reload names the model whose saved prefill
the server keeps. The browser half is tests/e2e/test_new_user.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from kvdemo.cache.registry import GROUP_OPTIONS
from kvdemo.cache.state.telemetry import LayerMemory, MemoryReport
from kvdemo.qa.session import QASession
from kvdemo.serve.server import App
from kvdemo.serve.session_files import SessionFiles
from kvdemo.ui import build_demo, option_fields, page_state, session_box, times, views
from kvdemo.ui.ask_widgets import START_SPEC
from kvdemo.ui.tab_view import tab_view
from tests.helpers import named_handlers

CONTEXT = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them."
QUANTO = ("quanto", 4, 64, 16, 0, 0)


def _request(key: str = "tab") -> SimpleNamespace:
    return SimpleNamespace(session_hash=key, headers={}, client=None, query_params={})


def test_a_model_switch_frees_the_old_models_sessions_and_the_tab_says_why(tiny):
    other = dataclasses.replace(tiny, name="second-model", source="org/second")
    app = App(loader=lambda source=None: other if source == "org/second" else tiny)
    app.start_loading()
    fns = named_handlers(build_demo(app))
    fns["prefill"](CONTEXT, *QUANTO, _request())
    fns["prefill"](CONTEXT, *QUANTO, _request("other-tab"))
    assert app.sessions.peek("tab").qa.loaded is tiny
    app.load("org/second")
    assert app.sessions.peek("tab") is None and app.sessions.peek("other-tab") is None  # freed, the old model's
    reason = app.sessions.freed_reason("tab")
    assert reason == "the model was switched to second-model"
    line, _notice, ask, _stats = fns["gate"](CONTEXT, *QUANTO, _request())
    assert "nothing prefilled in this tab: your last prefill was freed because the model was switched" in line
    assert ask["interactive"] is False
    answer = list(fns["ask"]("Who led them?", 4, _request()))[-1]
    assert "Your session was freed because the model was switched to second-model" in answer[1]
    # the same model again frees nothing
    fns["prefill"](CONTEXT, *QUANTO, _request())
    app.load("org/second")
    assert app.sessions.peek("tab").qa.loaded is other


def test_a_cache_prefilled_on_a_model_no_longer_served_cannot_be_asked(tiny):
    other = dataclasses.replace(tiny, name="second-model")
    app = App(loader=lambda source=None: tiny)
    app.start_loading()
    fns = named_handlers(build_demo(app))
    fns["prefill"](CONTEXT, *QUANTO, _request())
    user = app.sessions.peek("tab")
    app.loaded = other  # as a prefill that finished while another tab switched models
    line = page_state.page_line(user, CONTEXT, START_SPEC, other)
    assert line.startswith("⚠ The model changed since the prefill") and "the server now runs second-model" in line
    assert not page_state.prefilled_matches(user, CONTEXT, user.qa.spec, other)
    assert page_state.prefilled_matches(user, CONTEXT, user.qa.spec, tiny)


def test_the_prefill_line_counts_from_the_click(tiny):
    qa = QASession(tiny, START_SPEC)
    qa.prefill(CONTEXT)
    prefill = qa.prefill_report.seconds
    assert times.from_click(qa, prefill + 0.2, 0.1, 0.05, True) == ""  # within half a second: nothing to add
    line = times.from_click(qa, prefill + 9.0, 2.0, 6.0, True)
    assert line == (
        f" · **{prefill + 9.0:.1f} s from the click** (2.0 s waiting in the queue; 6.0 s one-off set-up: the first "
        "quanto cache on this model here; 1.0 s installing and saving the cache)"
    )
    assert "6.0 s set-up;" in times.from_click(qa, prefill + 9.0, 2.0, 6.0, False)
    assert line in views.prefill_summary(qa, line)


def test_a_prefill_through_the_page_says_its_time_from_the_click(tiny):
    app = App(loader=lambda source=None: tiny)
    app.start_loading()
    fns = named_handlers(build_demo(app))
    fns["before_prefill"](_request())  # a first click: the session is made, the click's time noted
    user = app.sessions.peek("tab")
    assert user is not None and user.prefill_clicked is not None
    fns["prefill"](CONTEXT, *QUANTO, _request())
    assert user.prefill_clicked is None  # used by that prefill
    fns["before_prefill"](_request())
    user.prefill_clicked -= 5.0  # the click, five seconds before the prefill began
    summary = fns["prefill"](CONTEXT, *QUANTO, _request())[0]
    assert " s from the click** (" in summary and "waiting in the queue" in summary
    assert tab_view(user).prefill_timing and tab_view(user).prefill_timing in page_state.page_line(
        user, CONTEXT, user.qa.spec
    )


def test_a_backend_click_takes_its_defaults_or_what_the_user_set_on_it():
    quanto = option_fields.fields_for_backend("quanto", {})
    turbo = option_fields.fields_for_backend("turboquant", {})
    flush = GROUP_OPTIONS.index("flush")
    residual = GROUP_OPTIONS.index("residual_length")
    assert quanto[flush]["value"] == "requantize" and turbo[flush]["value"] == "append"  # each its own default
    values = [update.get("value") for update in turbo[:-1]]
    values[residual] = 64
    memory = option_fields.remember("turboquant", {}, *values)
    assert option_fields.fields_for_backend("turboquant", memory)[residual]["value"] == 64
    assert option_fields.fields_for_backend("quanto", memory)[residual]["value"] == 128  # not turboquant's 64
    # any change of the backend (a reload, a session file too) shows its fields and leaves their values alone
    *shown, note = option_fields.fields_shown("turboquant")
    assert all("value" not in update for update in shown) and note == turbo[-1]
    assert [u["visible"] for u in shown] == [u["visible"] for u in turbo[:-1]]


def _memory(snapshot: int) -> MemoryReport:
    layer = LayerMemory(quantized_bytes=2**20, residual_bytes=2**20, residual_tokens=3, seq_length=10)
    return MemoryReport(layers=(dataclasses.replace(layer, snapshot_bytes=snapshot),))


def test_the_step_line_names_the_snapshots_copies():
    event = SimpleNamespace(step=4, cache_length=10, memory=_memory(3 * 2**20))
    line = views.step_line(event, START_SPEC.replace(residual_length=128))
    assert line.startswith("step 5 · 5.00 MiB held (the cache 2.00 + the snapshot's post-prefill copies 3.00)")
    plain = views.step_line(SimpleNamespace(step=0, cache_length=10, memory=_memory(0)), START_SPEC)
    assert plain.startswith("step 1 · 2.00 MiB held · cache length 10")


def test_a_reload_names_the_model_whose_saved_prefill_the_server_keeps(tiny, tmp_path):
    files = SessionFiles(tmp_path, 2**30)
    other = dataclasses.replace(tiny, name="second-model")
    qa = QASession(other, START_SPEC)
    qa.prefill(CONTEXT)
    files.save(qa, qa.prepare(CONTEXT, max_tokens=other.max_context_tokens))
    assert files.saved_of(CONTEXT) == [("second-model", START_SPEC.text)] and files.saved_of("other text") == []
    app = App(loader=lambda source=None: tiny, session_files=files)
    app.start_loading()
    app.wait_for_model()
    view = session_box.reopen(app, None, CONTEXT, *QUANTO[:1], dict(zip(GROUP_OPTIONS, QUANTO[1:])), _request(), None)
    assert view.prefill_info.startswith(
        f"ℹ Nothing is prefilled in this tab: the saved prefill of this text is second-model's (`{START_SPEC.text}`)"
    )
    reopening = f"Load second-model above to reopen it, or press **Prefill** to prefill it on {tiny.name}"
    assert reopening in view.prefill_info
