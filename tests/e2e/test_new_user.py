"""Chromium checks of the page as a new user meets it at 1,400 × 900 (issue 58), on a SQuAD article: after a prefill
the question box and Ask show without scrolling; a refusal beside Ask stays until the user acts again; a click on
a backend gives its own defaults, or the values last set on it, and the line under Prefill names the spec that will
run; the model box offers a model installed while the app runs; a model switch empties the tab, disables Ask and
says why, and a new tab's box names the model every tab shares; Compare's status sits under its button, and a failed
comparison leaves headers, not placeholders. The app here serves the embedded model and, under the Hub id
`kvdemo-test/tiny`, the tests' tiny random model; where Gemma 3 270M is installed (`make gemma`), the slow group loads
it from the model box and checks what the page says of its memory. Screenshots under artifacts/new-user/ (not
committed).

Cost: about 60 s in one pytest-xdist worker on 2 cores (2026-12-05).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from kvdemo import QASession
from kvdemo.cache.spec import CacheSpec
from kvdemo.evals.cases import example_path, load_case
from kvdemo.qa.models import load_model
from kvdemo.qa.packaged import GEMMA3_PIP, OfferedModel, gemma3_installed
from kvdemo.serve.recommended import PAGE_RESIDUAL_LENGTH, page_start
from kvdemo.serve.server import App
from kvdemo.ui import page as page_module
from kvdemo.ui.ask_widgets import START_SPEC

from .conftest import opened_tab, serve

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "new-user"
TINY = "kvdemo-test/tiny"


@pytest.fixture(scope="module")
def app_and_url(embedded, tiny):
    """(app, url, the second model): an app on the embedded model that loads the tiny model, as loaded from the Hub
    id `TINY`, for that id (its own app: a test switches models)."""
    second = dataclasses.replace(tiny, source=TINY)
    app = App(loader=lambda source: second if source == TINY else load_model(source) if source else embedded)
    demo, url = serve(app)
    assert app.wait_for_model() is embedded
    yield app, url, second
    demo.close()


@pytest.fixture()
def page(browser, app_and_url):
    with opened_tab(browser, app_and_url[1], height=900, timeout_ms=30_000) as page:
        yield page


def _shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def _ask_button(page: Page):
    return page.get_by_role("button", name="Ask", exact=True)


def _prefill(page: Page, context: str) -> None:
    page.get_by_label("context", exact=True).fill(context)
    page.get_by_role("button", name="Prefill").click()
    expect(page.get_by_text(re.compile(r"^(Prefilled|Opened) [\d,]+ (prefilled )?tokens"))).to_be_visible(
        timeout=120_000
    )
    expect(_ask_button(page)).to_be_enabled()


def _in_view(page: Page, locator) -> bool:
    """Whether `locator` lies wholly inside the viewport as the page stands, unscrolled."""
    box = locator.bounding_box()
    size = page.viewport_size
    return page.evaluate("window.scrollY") == 0 and box is not None and box["y"] + box["height"] <= size["height"]


def test_after_a_prefill_ask_shows_and_a_refusal_beside_it_stays(page, normans):
    _prefill(page, normans.select("0-1").context)
    page.evaluate("window.scrollTo(0, 0)")
    assert _in_view(page, page.get_by_label("question", exact=True)) and _in_view(page, _ask_button(page))
    _shot(page, "1-prefilled-1400x900")
    # an empty question: refused beside Ask, and the refusal stays (it vanished after about 70 ms)
    _ask_button(page).click()
    refusal = page.get_by_text("⚠ the question is empty; type a question about the context")
    expect(refusal).to_be_visible()
    page.wait_for_timeout(3_000)
    expect(refusal).to_be_visible()
    # the user acts again: a question is answered and the refusal gives way to the answer's line
    page.get_by_label("max_new_tokens", exact=True).fill("3")
    page.get_by_label("question", exact=True).fill("Who was the Norse leader?")
    _ask_button(page).click()
    expect(page.get_by_text("cache length after restore")).to_be_visible(timeout=120_000)
    expect(refusal).to_have_count(0)


def _wholly_in_view(page: Page, locator) -> bool:
    """Whether `locator` lies wholly inside the viewport where the page is scrolled now (to a pixel: a box scrolled
    into view ends a fraction past it)."""
    box = locator.bounding_box()
    return box is not None and box["y"] >= -1 and box["y"] + box["height"] <= page.viewport_size["height"] + 1


def test_the_first_answer_at_the_defaults_in_view_with_a_flush_and_full_precision_beside_it(page, app_and_url):
    """The page's first minute at 1,400 × 900 (issue 67) on paragraphs no other test reads, at the page's start (the
    recommended spec, its residual cut so that a flush shows): the prefill line names f16 and the peak; while the
    first answer streams, the chat and the memory and residual charts are in view together; the answer flushes;
    the full-precision answer shows beside it, the one a fresh `dynamic` session gives."""
    app = app_and_url[0]
    case = load_case(example_path("southern_california")).select("12-18")
    question = case.answerable(1)[0].question
    _prefill(page, case.context)
    assert page.evaluate("window.scrollY") == 0  # Prefill, and then Ask, in view without scrolling
    summary = page.get_by_text(re.compile(r"^(Prefilled|Opened) "))
    expect(summary).to_contain_text(re.compile(r"×\*?\*? a float32 cache .* this model's dtype"))
    expect(summary).to_contain_text(re.compile(r"× an f16 one \([\d.]+ MiB, the engines' default cache\)"))
    expect(summary).to_contain_text(re.compile(r"up to [\d.]+ MiB during an answer .* the snapshot's post-prefill"))
    page.get_by_label("question", exact=True).fill(question)
    _ask_button(page).click()
    expect(page.get_by_text(re.compile(r"^step \d+ ·"))).to_be_visible(timeout=120_000)
    assert page.evaluate("window.scrollY") == 0  # what follows is the first screen, unscrolled
    chat = page.get_by_label("answers", exact=True).or_(page.locator(".bubble-wrap")).first
    memory = page.locator(".vega-embed").filter(has_text="KV cache memory")
    residual = page.locator(".vega-embed").filter(has_text="Residual fill (layer 0)")
    assert all(_wholly_in_view(page, part) for part in (chat, memory, residual)), [
        (part, part.bounding_box()) for part in (chat, memory, residual)
    ]
    _shot(page, "3-first-answer-streaming-1400x900")
    stats = page.locator("p", has_text="cache length after restore").first  # the whole line, not its bold part
    expect(stats).to_be_visible(timeout=240_000)
    flushes = int(re.search(r"([\d,]+) in all", stats.inner_text()).group(1).replace(",", ""))
    assert flushes > 0, stats.inner_text()  # the first answer at the defaults flushes
    expect(residual).to_contain_text(f"flushes at residual_length={PAGE_RESIDUAL_LENGTH}")
    beside = page.get_by_text(re.compile(r"^Full precision \(dynamic, "))
    expect(beside).to_be_visible(timeout=240_000)
    full = QASession(app.loaded, CacheSpec())
    full.prefill(case.context)
    expected = full.ask(question).text.strip()
    assert " ".join(expected.split()) in " ".join(beside.inner_text().split())
    expect(beside).to_contain_text(re.compile(r"the same tokens|first differs at token \d+"))
    beside.scroll_into_view_if_needed()  # under the charts, in view with them and the chat
    assert all(_wholly_in_view(page, part) for part in (beside, residual, chat)), [
        part.bounding_box() for part in (beside, residual, chat)
    ]
    _shot(page, "4-full-precision-beside-1400x900")


def test_a_backend_click_gives_its_own_defaults_or_what_was_set_on_it(page, app_and_url):
    """The page starts on the model's recommended spec (`App.recommended`, stored by `make setup`), says so under the
    backend, and a click on a backend gives its own values."""
    line = page.locator("p", has_text=re.compile(r"^spec"))
    flush = page.get_by_label("flush", exact=True)
    residual = page.get_by_label("residual_length", exact=True)
    found = app_and_url[0].recommended
    assert found is not None, "no recommended start stored for the embedded model: run make setup"
    shown = page_start(CacheSpec.parse(found.pick))  # the pick, its residual cut so that a flush shows
    expect(line.first).to_contain_text(shown.full_text)
    expect(page.get_by_text("Recommended for this model:")).to_contain_text(found.pick)
    if shown != CacheSpec.parse(found.pick):
        cut = re.compile(f"shown at residual_length={PAGE_RESIDUAL_LENGTH} so that the first answer flushes")
        expect(page.get_by_text(cut)).to_be_visible()
    page.get_by_label("quanto", exact=True).check()
    expect(flush).to_have_value("requantize")
    expect(residual).to_have_value(str(START_SPEC.resolved()["residual_length"]))  # the page's fixed start, quanto's
    page.get_by_label("turboquant", exact=True).check()
    # turboquant's own flush (append), not quanto's requantize riding along; the line says what a Prefill runs
    expect(flush).to_have_value("append")
    expect(residual).to_have_value(str(PAGE_RESIDUAL_LENGTH))  # the page's start, the recommendation's backend
    expect(line.first).to_contain_text(f"residual_length={PAGE_RESIDUAL_LENGTH},flush=append")
    residual.fill("64")
    residual.blur()
    page.get_by_label("quanto", exact=True).check()
    expect(residual).to_have_value(str(START_SPEC.resolved()["residual_length"]))
    page.get_by_label("turboquant", exact=True).check()
    expect(residual).to_have_value("64")  # what the user set on turboquant, back
    _shot(page, "2-backend-fields")


def test_the_model_box_offers_a_model_installed_while_the_app_runs(page, monkeypatch):
    offered = page_module.offered_models()
    monkeypatch.setattr(page_module, "offered_models", lambda: [*offered, OfferedModel("A model installed now", TINY)])
    page.get_by_label("Model", exact=True).click()
    expect(page.get_by_role("option", name="A model installed now")).to_be_visible()


def test_compare_status_sits_under_its_button_and_a_failure_leaves_headers(page):
    page.get_by_role("tab", name="Compare backends").click()
    page.get_by_label("more specs, one per line").fill("quanto:3")  # not a quanto nbits: refused before any work
    run = page.get_by_role("button", name="Run comparison")
    run.click()
    status = page.get_by_text(re.compile(r"^⚠"))
    expect(status.first).to_be_visible()
    gap = status.first.bounding_box()["y"] - run.bounding_box()["y"]
    assert 0 < gap < 250, gap  # beside the button, not a screen below it
    expect(page.get_by_role("columnheader", name="KV MiB", exact=True)).to_be_attached()
    expect(page.get_by_role("columnheader", name="first departure from dynamic", exact=True)).to_be_attached()
    expect(page.get_by_role("columnheader", name="1", exact=True)).to_have_count(0)  # no placeholder "1 2 3"
    _shot(page, "3-compare-refused")


def test_a_model_switch_empties_the_tab_and_says_why(page, browser, app_and_url, normans, embedded):
    app, url, tiny = app_and_url
    _prefill(page, normans.select("0").context)
    page.get_by_label("max_new_tokens", exact=True).fill("2")
    page.get_by_label("question", exact=True).fill("Who was the Norse leader?")
    _ask_button(page).click()
    expect(page.get_by_text("cache length after restore")).to_be_visible(timeout=120_000)
    bots = page.locator('[data-testid="bot"]')
    expect(bots).to_have_count(1)
    try:
        page.get_by_label("Model", exact=True).fill(TINY)
        page.get_by_role("button", name="Load", exact=True).click()
        expect(page.get_by_text(f"freed because the model was switched to {tiny.name}")).to_be_visible()
        expect(bots).to_have_count(0)  # the old model's chat, charts and answers are gone
        expect(page.get_by_text("cache length after restore")).to_have_count(0)
        expect(_ask_button(page)).to_be_disabled()
        _shot(page, "4-model-switched")
        # a new tab names the model every tab shares, not the start-up one
        other = browser.new_page(viewport={"width": 1400, "height": 900})
        other.goto(url)
        expect(other.get_by_label("Model", exact=True)).to_have_value(tiny.name, timeout=60_000)
        other.close()
        # a prefill on the new model works
        _prefill(page, normans.select("0").context)
    finally:
        app.load("")  # the start-up model again, for the module's other tests
    assert app.loaded is embedded


@pytest.mark.slow
@pytest.mark.skipif(not gemma3_installed(), reason=f"Gemma 3 270M is not installed: {GEMMA3_PIP}")
def test_gemma_3_from_the_model_box_and_its_memory_named(page, app_and_url, embedded):
    app, southern_california = app_and_url[0], load_case(example_path("southern_california"))
    try:
        page.get_by_label("Model", exact=True).click()
        page.get_by_role("option", name=re.compile("^Gemma 3 270M")).click()
        page.get_by_role("button", name="Load", exact=True).click()
        expect(page.get_by_text(re.compile(r"^Gemma 3 270m \(gemma-3-270m"))).to_be_visible(timeout=300_000)
        _prefill(page, southern_california.select("0-3").context)
        # the bytes kept at full precision (15 sliding windows) and what the ratio compares
        summary = page.get_by_text(re.compile(r"^(Prefilled|Opened) "))
        expect(summary).to_contain_text(re.compile(r"of which [\d.]+ MiB in layers kept at full precision"))
        expect(summary).to_contain_text(re.compile(r"a float32 cache .* an f16 one"))
        page.get_by_label("max_new_tokens", exact=True).fill("24")
        page.get_by_label("question", exact=True).fill(southern_california.answerable(1)[0].question)
        _ask_button(page).click()
        # while it streams: what is held, the snapshot's copies named (the sliding windows an answer moves)
        held = re.compile(r"MiB held \(the cache [\d.]+ \+ the snapshot's post-prefill copies")
        expect(page.get_by_text(held)).to_be_visible(timeout=120_000)
        expect(page.get_by_text("cache length after restore")).to_be_visible(timeout=300_000)
        expect(page.locator(".vega-embed").first).to_contain_text("kept layers")  # the legend, whole
        _shot(page, "5-gemma")
    finally:
        app.load("")
    assert app.loaded is embedded
