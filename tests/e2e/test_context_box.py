"""Chromium (Debian's, driven by Playwright) with a large Context box (`kvdemo.ui.context_box`): a 2 MB context costs
at most 10 kB of traffic per typed character, up and down together, and a prefill after such edits takes the edited
text; a large prefilled context is gated by its fingerprint, which the browser computes as the server does; a reload
says the large context was not kept. The app here treats a context over `LIMIT` characters as large (the page's is
`page_state.LARGE_CONTEXT_CHARS`, 65,536), so that a large context fits the embedded model's 8,192-token window and
its prefill takes a second; the 2 MB context is large at either. Saves screenshots under artifacts/context/ (not
committed).

Cost: 20 s for 2 tests in one process on 2 cores at load 3-4 (2026-12-04), the server's start included. Paid for by
the same change: tests/e2e/test_page_state.py's typing test fell from 77 s to 7 s at that load (Gradio's endless
requests while typing, `kvdemo.ui.context_box`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from kvdemo.evals.cases import example_path, load_case
from kvdemo.serve.server import App
from kvdemo.ui import page_state
from kvdemo.ui.context_box import FINGERPRINT_JS

from .conftest import opened_tab, serve
from .traffic import Traffic

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "context"
LIMIT = 512
MAX_BYTES_PER_CHARACTER = 10_000
PASTE = """([text]) => {
    const box = document.querySelector('textarea[data-testid="textbox"]');
    box.focus();
    box.value = text;
    box.dispatchEvent(new Event('input', {bubbles: true}));
    box.setSelectionRange(text.length, text.length);
}"""
"""A paste, as the page sees one: the box's value and an `input` event (Playwright's `fill` types a 2 MB text with
many lines through the editor for minutes)."""


@pytest.fixture(scope="module")
def served(embedded):
    """(url, the contexts the server was asked to prefill, in order): the embedded model, a context over `LIMIT`
    characters large."""
    app = App(loader=lambda source: embedded, recommended_start=False)  # the fixed start its tests drive
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(page_state, "LARGE_CONTEXT_CHARS", LIMIT)  # read when the page is built
        demo, url = serve(app)
    assert app.wait_for_model() is embedded
    prefilled, real_prefill = [], app.door.prefill_reserved

    def recorded(key, qa, context, *args, **kwargs):
        prefilled.append(context)
        return real_prefill(key, qa, context, *args, **kwargs)

    app.door.prefill_reserved = recorded
    yield url, prefilled
    demo.close()


@pytest.fixture()
def page(browser, served):
    with opened_tab(browser, served[0]) as page:
        yield page


@pytest.fixture(scope="module")
def two_megabytes() -> str:
    """2,000,000 characters of SQuAD articles, repeated."""
    text = "\n\n".join(load_case(example_path(name)).context for name in ("normans", "southern_california"))
    return ((text + "\n\n") * (2_000_000 // len(text) + 1))[:2_000_000]


def _box(page: Page):
    return page.get_by_label("context", exact=True)


def _ask_button(page: Page):
    return page.get_by_role("button", name="Ask", exact=True)


def _shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_a_2_mb_context_costs_little_per_keystroke_and_prefills_as_edited(page, served, two_megabytes, capsys):
    prefilled = served[1]
    # the browser's fingerprint is the server's (the lone surrogate is made in the page: Playwright sends UTF-8)
    texts = ["", "abc", "a\U0001f600b\r\nc", "é" * 70_000, "\ud800 lone", two_megabytes]
    printed = page.evaluate(
        f"([texts]) => {{ texts[4] = '\\ud800' + texts[4].slice(1); return texts.map({FINGERPRINT_JS}); }}", [texts]
    )
    assert printed == [page_state.fingerprint(text) for text in texts]
    traffic = Traffic(page)
    page.evaluate(PASTE, [two_megabytes])
    expect(page.get_by_text("ℹ 2,000,000 characters: a reload of the page will not keep a context")).to_be_visible()
    traffic.settle(after=0)  # the paste's gate and example questions
    traffic.start()
    started = time.monotonic()
    _box(page).press_sequentially("abcde")
    typed = time.monotonic() - started
    traffic.settle()
    up, down = traffic.stop()
    assert traffic.requests and (up + down) / 5 <= MAX_BYTES_PER_CHARACTER, (up, down, traffic.requests)
    kept = page.evaluate("() => Object.values(localStorage).reduce((sum, value) => sum + value.length, 0)")
    assert kept < 2_000  # the backend and options, not the text
    with capsys.disabled():
        print(f"\n2 MB context, per typed character: {up / 5:,.0f} B up, {down / 5:,.0f} B down; 5 in {typed:.2f} s")

    page.get_by_role("button", name="Prefill").click()
    refusal = re.compile(r"^⚠ the context is [\d,]+ tokens; .* exceeds the model's 8,192-token window")
    expect(page.get_by_text(refusal)).to_be_visible(timeout=120_000)
    assert prefilled[-1] == two_megabytes + "abcde"


def test_a_large_prefilled_context_is_gated_by_its_fingerprint(page, served):
    prefilled, context = served[1], load_case(example_path("normans")).select("0").context
    assert len(context) > LIMIT
    box, ask = _box(page), _ask_button(page)
    box.fill(context)
    page.get_by_role("button", name="Prefill").click()
    summary = page.get_by_text(re.compile(r"^Prefilled ([\d,]+) tokens in [\d.]+ s with quanto\b"))
    expect(summary).to_be_visible(timeout=180_000)
    expect(ask).to_be_enabled()
    tokens = re.search(r"Prefilled ([\d,]+) tokens", summary.inner_text()).group(1)
    changed = page.get_by_text(f"⚠ The Context box changed since the prefill (the cache holds {tokens} tokens")

    box.press("Control+End")  # an edit: the fingerprint differs
    box.press_sequentially(" Rollo")
    expect(ask).to_be_disabled()
    expect(changed).to_be_visible()
    _shot(page, "1-large-context-changed")
    for _ in " Rollo":  # set back: the browser's fingerprint is the prefilled text's, as the server computes it
        box.press("Backspace")
    expect(ask).to_be_enabled()
    expect(summary).to_be_visible()

    box.press_sequentially(" Rollo")
    expect(ask).to_be_disabled()
    page.get_by_role("button", name="Prefill").click()  # the edited text is prefilled, and the page shows it
    expect(page.get_by_text(re.compile(r"^Prefilled [\d,]+ tokens in [\d.]+ s with quanto\b"))).to_be_visible(
        timeout=180_000
    )
    assert prefilled[-1] == context + " Rollo"
    expect(ask).to_be_enabled()
    expect(changed).to_have_count(0)

    page.reload()  # too large to keep: the page says so, and nothing is prefilled in the tab
    expect(page.get_by_text("135 M parameters")).to_be_visible(timeout=60_000)
    not_kept = f"ℹ The last context ({len(context) + 6:,} characters) was not kept across the reload"
    expect(page.get_by_text(not_kept)).to_be_visible()
    expect(box).to_have_value("")
    expect(ask).to_be_disabled()
    _shot(page, "2-large-context-not-kept")
