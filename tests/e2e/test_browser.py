"""A real browser (Debian's chromium, driven by Playwright): paste a context, prefill, ask two questions,
see both answers and the charts, press Stop during a third; then compare two backends in the Compare tab.
Saves artifacts/app.png and artifacts/compare.png (not committed)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from kvdemo import QASession
from kvdemo.evals.cases import example_path, load_case
from kvdemo.ui.ask_widgets import START_SPEC

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


@pytest.fixture(scope="module")
def page(app_url):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed: apt-get install chromium (the Makefile's test set-up does it)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app_url)
        yield page
        browser.close()


def _words(text: str) -> str:
    return " ".join(text.split())


def test_a_person_prefills_asks_and_stops(page, embedded):
    expect(page.get_by_text("135 M parameters")).to_be_visible(timeout=90_000)
    context = load_case(example_path("normans")).select("0-3").context
    page.get_by_label("context", exact=True).fill(context)
    page.get_by_role("button", name="Prefill").click()
    expect(page.get_by_text(re.compile(r"Prefilled [\d,]+ tokens"))).to_be_visible(timeout=120_000)
    stats = page.get_by_text("cache length after restore")
    bots = page.locator('[data-testid="bot"]')

    page.get_by_label("max_new_tokens", exact=True).first.fill("16")
    reference = QASession(embedded, START_SPEC)  # the page's starting spec
    reference.prefill(context)
    for n, question in enumerate(["Who was the Norse leader?", "In what country is Normandy located?"], 1):
        page.get_by_label("question", exact=True).fill(question)
        page.get_by_role("button", name="Ask", exact=True).click()
        expect(bots).to_have_count(n, timeout=60_000)  # the answer streams into a new message
        expect(stats).to_be_visible(timeout=120_000)  # the line shown once the answer is done
        assert _words(bots.nth(n - 1).inner_text()) == _words(reference.ask(question, 16).text)
    expect(page.get_by_text("KV cache memory")).to_be_visible()
    assert page.locator(".vega-embed").count() == 3
    # every series is in the step-time chart's legend, also those that appeared after the first update
    step_chart = page.get_by_role("img").filter(has_text="Time per decode step (flush steps marked)")
    for kind in ("question pass", "decode step", "flush step"):
        expect(step_chart).to_contain_text(kind)
    assert page.locator(".vega-embed canvas, .vega-embed svg").count() >= 3

    page.get_by_label("max_new_tokens", exact=True).first.fill("400")
    page.get_by_label("question", exact=True).fill("Tell me everything about the Normans.")
    page.get_by_role("button", name="Ask", exact=True).click()
    expect(page.get_by_text(re.compile(r"^step \d+ ·"))).to_be_visible(timeout=60_000)
    page.get_by_role("button", name="Stop").click()
    expect(page.get_by_text(re.compile(r"· stopped · cache length after restore = [\d,]+ \(context\)"))).to_be_visible(
        timeout=60_000
    )
    expect(bots).to_have_count(3)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "app.png"), full_page=True)


def test_a_person_compares_two_backends(page):
    # runs after the test above: the Context box holds the Normans paragraphs, the session asked 3 questions
    page.get_by_role("tab", name="Compare backends").click()
    for spec in ("quanto:2", "quanto:4", "hqq:2", "hqq:4", "hqq:8"):  # keep dynamic and fp8 ticked
        page.get_by_label(spec, exact=True).uncheck()
    page.get_by_role("button", name=re.compile("Fill in questions")).click()
    questions = page.get_by_label("questions, one per line")
    expect(questions).to_have_value(re.compile("^Who was the Norse leader\\?\nIn what country"), timeout=10_000)
    questions.fill("Who was the Norse leader?")
    page.get_by_label("max_new_tokens", exact=True).nth(1).fill("4")
    page.get_by_role("button", name="Run comparison").click()
    expect(page.get_by_text(re.compile(r"Compared 2 specs on 1 question\b"))).to_be_visible(timeout=180_000)
    table = page.get_by_role("grid", name=re.compile("^comparison"))
    expect(table.get_by_role("gridcell", name="fp8", exact=True)).to_be_visible()
    # the answers side by side: dynamic's, then fp8's with where it departs from it (or "identical")
    answers = page.get_by_role("grid", name=re.compile("^the answers side by side"))
    expect(answers.get_by_role("gridcell", name="(the reference)", exact=True)).to_be_visible()
    departure = re.compile(r"^(identical|token \d+: .* where dynamic has )")
    expect(answers.get_by_role("gridcell", name=departure)).to_be_visible()
    expect(page.get_by_text("Memory against fidelity")).to_be_visible()
    # a bad spec line is refused at the click: the message shows and the results stay
    page.get_by_label("more specs, one per line").fill("hqq:9")
    page.get_by_role("button", name="Run comparison").click()
    expect(page.get_by_text("more specs, line 1: nbits=9 is not allowed for hqq").first).to_be_visible(timeout=10_000)
    expect(table.get_by_role("gridcell", name="fp8", exact=True)).to_be_visible()
    page.get_by_label("more specs, one per line").fill("")
    expect(page.get_by_text("Decode speed")).to_be_visible()
    assert page.get_by_role("tabpanel").locator(".vega-embed").count() == 2
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)
    # back on the Ask tab, the session's answers are still there
    page.get_by_role("tab", name="Ask").click()
    expect(page.locator('[data-testid="bot"]')).to_have_count(3)
