"""Each tab's first result at its defaults, read from the page's own configuration (the values its widgets start
with), on a shipped article with the embedded model: the headline must be true. How quick it is, is measured
side by side by `benchmarks/first_answer.py` (no timed assertion here). The Needle and Compare tabs' defaults run
in full in the browser walk (`tests/e2e/test_browser.py`), which reads them from the page the same way a user does:
by not touching them.

Cost: 11 s in a pytest-xdist worker on 2 cores (2026-12-04).
"""

from __future__ import annotations

import gradio as gr
import pytest

from kvdemo import QASession
from kvdemo.serve.server import App
from kvdemo.ui import build_demo
from kvdemo.ui.examples import example
from tests.helpers import named_handlers

pytestmark = pytest.mark.slow  # two prefills of an article on the embedded model


@pytest.fixture(scope="module")
def page(embedded):
    app = App(loader=lambda source=None: embedded)
    app.start_loading()
    demo = build_demo(app)
    app.wait_for_model()
    return app, demo, named_handlers(demo)


def _starting_values(demo, api_name: str) -> list:
    """The values the inputs of the event `api_name` start with on the page."""
    (event,) = [f for f in demo.fns.values() if f.api_name == api_name]
    return [block.value for block in event.inputs]


def test_the_ask_tab_first_answer_at_its_defaults_flushes_and_restores(page, embedded):
    app, demo, fns = page
    context, questions = example("Normans")  # the example button a new user presses first
    _, backend, *options = _starting_values(demo, "prefill")
    question_box, max_new_tokens, _ = _starting_values(demo, "ask")
    request = gr.Request(session_hash="defaults")
    view = fns["prefill"](context, backend, *options, request)
    assert view.prefill_info.startswith("Prefilled"), view.prefill_info
    qa = app.sessions.get("defaults").qa
    final = list(fns["ask"](questions[0], max_new_tokens, request, context))[-1]
    answer = qa.history[-1]
    # flushes show in the first answer (the reason for the short residual), and the cache is restored
    assert answer.flush_count > 0 and answer.cache_length_after == qa.prefill_report.context_tokens
    assert f"cache length after restore = {answer.cache_length_after:,} (context)" in final.stats
    assert answer.text.strip() and answer.finish_reason == "eos"  # a whole answer within max_new_tokens
    # the same question on a fresh session of the same spec: the page's answer is a fresh single-question run
    fresh = QASession(embedded, qa.spec)
    fresh.prefill(context)
    assert fresh.ask(questions[0], max_new_tokens).token_ids == answer.token_ids
    assert question_box in ("", None)  # the page suggests the example's questions, it asks none by itself
