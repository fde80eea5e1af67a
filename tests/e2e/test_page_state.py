"""Chromium (Debian's, driven by Playwright) checks that the page's state matches the server's at every moment,
on SQuAD articles: a changed Context box disables Ask; a refusal stays beside its button and keeps the rest;
a long prefill shows real progress and stops; a question shows at once; the residual chart says when a backend
keeps none; a reload brings back the Context box and options and says that nothing is prefilled in the tab, also
after the server restarted, where the server's session file reopens the prefill by itself; a session file dropped
in the box opens, a bad one is refused. Saves screenshots under artifacts/state/ (not committed).

Cost: 84 s in a pytest-xdist worker (the clean-clone CI of 2026-12-05), the restart test with session files
included.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from kvdemo.cache.spec import CacheSpec
from kvdemo.evals.cases import example_path, load_case
from kvdemo.qa.prefill import PREFILL_CHUNK_TOKENS
from kvdemo.qa.session import QASession
from kvdemo.qa.session_file import read_manifest, save_session
from kvdemo.serve.secret import ENV, SECRET_FILE
from kvdemo.serve.server import App
from kvdemo.serve.session_files import SessionFiles
from kvdemo.ui.ask_widgets import START_SPEC

from .conftest import free_port, opened_tab, serve

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "state"
LONGER_THAN_A_TOAST_MS = 12_000
"""How long a refusal must stay on the page: Gradio's toasts vanish after about 10 s."""
PROGRESS = re.compile(r"Prefilling: ([\d,]+) of ([\d,]+) tokens")


@pytest.fixture()
def page(browser, app_url):
    """A new browser context (its own localStorage, so no test sees another's kept Context box) and tab."""
    with opened_tab(browser, app_url) as page:
        yield page


@pytest.fixture(scope="module")
def normans():
    return load_case(example_path("normans"))


@pytest.fixture(scope="module")
def southern_california():
    return load_case(example_path("southern_california"))


def _shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _ask_button(page: Page):
    return page.get_by_role("button", name="Ask", exact=True)


def _box(page: Page):
    return page.get_by_label("context", exact=True)


def _prefill(page: Page, context: str, backend: str = START_SPEC.backend) -> int:
    """Fill the Context box, press Prefill and wait for the summary line (`backend`: the page's, by default its
    starting one); returns the tokens prefilled."""
    _box(page).fill(context)
    page.get_by_role("button", name="Prefill").click()
    line = page.get_by_text(re.compile(rf"^Prefilled [\d,]+ tokens in [\d.]+ s with {backend}\b"))
    expect(line).to_be_visible(timeout=180_000)
    expect(_ask_button(page)).to_be_enabled()
    return _number(re.search(r"Prefilled ([\d,]+) tokens", line.inner_text()).group(1))


def _ask(page: Page, question: str, max_new_tokens: int) -> None:
    """Ask a question and wait for the line shown once the answer is done, and the Ask button enabled again."""
    bots = page.locator('[data-testid="bot"]')
    before = bots.count()
    page.get_by_label("max_new_tokens", exact=True).first.fill(str(max_new_tokens))
    page.get_by_label("question", exact=True).fill(question)
    _ask_button(page).click()
    # the new message and "reading the question" come in one update, which replaces the last answer's line
    expect(bots).to_have_count(before + 1, timeout=60_000)
    expect(page.get_by_text("cache length after restore")).to_be_visible(timeout=180_000)
    expect(_ask_button(page)).to_be_enabled(timeout=30_000)


def _changed_warning(page: Page, what: str, tokens: int):
    return page.get_by_text(f"⚠ The {what} changed since the prefill (the cache holds {tokens:,} tokens")


def test_a_changed_context_disables_ask_until_it_is_prefilled(page, normans, southern_california, tmp_path):
    first, other = normans.select("0-1").context, southern_california.select("0").context
    tokens = _prefill(page, first)
    summary = page.get_by_text(re.compile(rf"^Prefilled {tokens:,} tokens"))
    ask, box = _ask_button(page), _box(page)

    box.fill(other)  # a paste of another article
    expect(ask).to_be_disabled()
    expect(_changed_warning(page, "Context box", tokens)).to_be_visible()
    expect(summary).to_have_count(0)
    _shot(page, "1-context-pasted")
    # Enter in the question box still reaches the server, which refuses to answer over a text the page does not show
    page.get_by_label("question", exact=True).fill("Who was the Norse leader?")
    page.get_by_label("question", exact=True).press("Enter")
    expect(page.get_by_text("⚠ The Context box has changed since the prefill; press Prefill")).to_be_visible(
        timeout=30_000
    )
    expect(page.locator('[data-testid="user"]')).to_have_count(0)

    box.fill(first)  # the prefilled text again: the cache matches the page
    expect(ask).to_be_enabled()
    expect(summary).to_be_visible()
    expect(_changed_warning(page, "Context box", tokens)).to_have_count(0)

    box.press("Control+End")  # an edit: one word typed at the end
    box.press_sequentially(" Rollo")
    expect(ask).to_be_disabled()
    expect(_changed_warning(page, "Context box", tokens)).to_be_visible()
    for _ in " Rollo":
        box.press("Backspace")
    expect(ask).to_be_enabled()
    expect(summary).to_be_visible()

    upload = tmp_path / "southern_california.txt"  # an upload
    upload.write_text(other, encoding="utf-8")
    page.locator('input[type="file"]').first.set_input_files(str(upload))
    expect(box).to_have_value(other, timeout=30_000)
    expect(ask).to_be_disabled()
    expect(_changed_warning(page, "Context box", tokens)).to_be_visible()
    _shot(page, "1-context-uploaded")

    box.fill(first)
    expect(ask).to_be_enabled()
    page.get_by_role("button", name="Example: Southern California").click()  # an example
    expect(box).to_have_value(re.compile("^Southern California, often abbreviated SoCal"), timeout=30_000)
    expect(ask).to_be_disabled()
    expect(_changed_warning(page, "Context box", tokens)).to_be_visible()


def test_a_refusal_stays_beside_its_button_and_keeps_the_page(page, normans, caplog, capfd):
    first = normans.select("0-1").context
    tokens = _prefill(page, first)
    _ask(page, "Who was the Norse leader?", 4)
    bots, users = page.locator('[data-testid="bot"]'), page.locator('[data-testid="user"]')
    answer = bots.first.inner_text()
    stats = page.get_by_text(re.compile(rf"cache length after restore = {tokens:,} \(context\)"))
    charts = page.locator(".vega-embed, #step-times img")  # memory and residual (Vega), step times (a PNG)
    expect(charts).to_have_count(3)
    caplog.set_level(logging.INFO, logger="kvdemo")  # the server's log (app.py prints it as `kvdemo: ...`)
    caplog.clear()
    capfd.readouterr()

    # a context over the model's window (three copies of the whole article), then a model id that does not exist
    _box(page).fill("\n\n".join([normans.context] * 3))
    page.get_by_role("button", name="Prefill").click()
    notice = page.get_by_text(
        re.compile(
            r"^⚠ the context is [\d,]+ tokens; .* exceeds the model's 8,192-token window\. Shorten the context to at "
            rf"most [\d,]+ tokens\. The cache still holds the previous context \({tokens:,} tokens\)\.$"
        )
    )
    expect(notice).to_be_visible(timeout=60_000)
    page.get_by_label("Model", exact=True).fill("kvdemo-test/no-such-model")
    page.get_by_role("button", name="Load", exact=True).click()
    refused = page.get_by_text(re.compile(r"^⚠ could not load 'kvdemo-test/no-such-model'.*Keeping HuggingFaceTB/"))
    expect(refused).to_be_visible(timeout=60_000)
    _shot(page, "2-refused")
    page.wait_for_timeout(LONGER_THAN_A_TOAST_MS)
    expect(notice).to_be_visible()
    expect(refused).to_be_visible()
    # the rest as it was, and consistent: the box is not what the cache holds, so Ask is disabled and says why
    expect(page.get_by_text("135 M parameters")).to_be_visible()
    expect(users).to_have_count(1)
    expect(bots).to_have_count(1)
    assert bots.first.inner_text() == answer
    expect(stats).to_be_visible()
    expect(charts).to_have_count(3)
    expect(_changed_warning(page, "Context box", tokens)).to_be_visible()
    expect(_ask_button(page)).to_be_disabled()
    expect(page.get_by_text("Error", exact=True)).to_have_count(0)  # no red badges over the outputs
    _shot(page, "2-refused-12s")
    log = [r.getMessage() for r in caplog.records if r.name.startswith("kvdemo")]
    assert sum(m.startswith("refused a prefill: the context is") for m in log) == 1
    assert sum(m.startswith("refused a model load: could not load 'kvdemo-test/no-such-model'") for m in log) == 1
    printed = capfd.readouterr()
    assert "Traceback" not in printed.out + printed.err and not any(r.exc_info for r in caplog.records)

    # the previous text: its cache is still there, Ask works on it, and the prefill's refusal is gone
    _box(page).fill(first)
    expect(_ask_button(page)).to_be_enabled()
    expect(notice).to_have_count(0)
    expect(page.get_by_text(re.compile(rf"^Prefilled {tokens:,} tokens"))).to_be_visible()
    _ask(page, "In what country is Normandy located?", 3)  # the cache still answers, restored to the context
    expect(bots).to_have_count(2)
    expect(stats).to_be_visible()


# Records, with the page's clock (ms), when each sign of an answer first shows: the click on Ask, the question
# in the chat, "reading the question", the first answer token (the assistant message is no longer "…"), and a
# streaming line that announces a flush. A MutationObserver sees every change, however brief.
WATCH_ANSWER = """question => {
    const seen = window.kvdemoSeen = {};
    const mark = (name) => { if (!(name in seen)) seen[name] = performance.now(); };
    document.addEventListener('click', (event) => {
        const button = event.target.closest('button');
        if (button && button.textContent.trim() === 'Ask' && button.getAttribute('role') !== 'tab') mark('click');
    }, {capture: true});
    new MutationObserver(() => {
        if (!('click' in seen)) return;
        const users = document.querySelectorAll('[data-testid="user"]');
        if ([...users].some(u => u.textContent.includes(question))) mark('question');
        const text = document.body.textContent;
        if (text.includes('reading the question (')) mark('reading');
        if (text.includes('the next step flushes')) mark('flush announced');
        const bots = document.querySelectorAll('[data-testid="bot"]');
        const last = bots.length ? bots[bots.length - 1].textContent.trim() : '';
        if (last.startsWith('… waiting')) mark('waiting');  // the click's echo, before the queue
        else if (last && last !== '…') mark('first token');
    }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def test_a_long_prefill_shows_progress_and_stops_and_a_question_shows_at_once(page, normans, capsys):
    _box(page).fill(normans.context)  # the whole article, about 5,600 tokens: 23 chunks
    page.get_by_role("button", name="Prefill").click()
    expect(_ask_button(page)).to_be_disabled(timeout=5_000)  # at the click, while the prefill runs
    progress, seen = page.locator(".progress-level-inner").first, []
    for _ in range(600):  # at most about 2.5 minutes
        match = PROGRESS.search(progress.inner_text()) if progress.count() else None
        if match and (not seen or _number(match.group(1)) != seen[-1][0]):
            seen.append((_number(match.group(1)), _number(match.group(2))))
            if len(seen) == 3:
                break
        page.wait_for_timeout(250)
    assert len(seen) == 3, f"the progress text showed {seen}"
    done, totals = [d for d, _ in seen], {t for _, t in seen}
    assert done == sorted(done) and len(totals) == 1 and min(totals) > 5_000
    assert all(d % PREFILL_CHUNK_TOKENS == 0 and d < min(totals) for d in done)  # whole chunks, not a guess
    expect(_ask_button(page)).to_be_disabled()
    _shot(page, "3-prefill-progress")

    page.get_by_role("button", name="Stop").click()
    total = min(totals)
    stopped = page.get_by_text(re.compile(rf"^⚠ Stopped: the prefill was stopped after ([\d,]+) of {total:,} tokens\."))
    expect(stopped).to_be_visible(timeout=60_000)
    at = _number(re.search(r"after ([\d,]+) of", stopped.inner_text()).group(1))
    assert done[-1] <= at < total and at % PREFILL_CHUNK_TOKENS == 0
    expect(
        page.get_by_text(re.compile("The cache still holds the previous context|Nothing is prefilled now"))
    ).to_be_visible()
    expect(_ask_button(page)).to_be_disabled()
    _shot(page, "3-prefill-stopped")

    # a question on a shorter prefill: it shows at once, with "reading the question", before the first token
    tokens = _prefill(page, normans.select("0-1").context)
    question = "What is the original meaning of the word Norman?"
    page.evaluate(WATCH_ANSWER, question)
    _ask(page, question, 24)
    seen = page.evaluate("window.kvdemoSeen")
    assert {"click", "question", "waiting", "reading", "first token"} <= set(seen), seen
    assert seen["question"] <= seen["waiting"] <= seen["reading"]  # echoed at the click, then read
    assert seen["question"] <= seen["first token"] and seen["reading"] <= seen["first token"]
    # the starting spec's residual_length 16: the question's ~20 tokens fill the residual, so the next step flushes
    assert "flush announced" in seen
    expect(page.get_by_text(re.compile(rf"cache length after restore = {tokens:,} \(context\)"))).to_be_visible()
    _shot(page, "3-answered")
    after = {name: f"{seen[name] - seen['click']:,.0f} ms" for name in ("question", "reading", "first token")}
    with capsys.disabled():
        print(f"\nafter the click on Ask: {after}")


@pytest.mark.parametrize("backend", ["dynamic", "fp8"])
def test_a_backend_without_residual_says_so_in_the_residual_chart(page, normans, backend):
    page.get_by_label(backend, exact=True).check()
    _prefill(page, normans.select("0").context, backend)
    title = page.get_by_text(f"Residual fill: {backend} keeps no residual (nothing to show)")
    expect(title).to_be_visible()  # already after the prefill, before any answer
    _ask(page, "Who was the Norse leader?", 4)
    expect(title).to_be_visible()
    memory = page.get_by_role("img").filter(has_text="KV cache memory")
    for series in ("KV cache", "held (cache + snapshot)", "full precision"):
        expect(memory).to_contain_text(series)
    expect(memory).not_to_contain_text("quantized store")  # no quantized store beside a residual here
    _shot(page, f"4-charts-{backend}")


def test_a_reload_keeps_the_context_and_options_and_says_nothing_is_prefilled(page, southern_california):
    context = southern_california.select("0-1").context
    _prefill(page, context)
    page.get_by_label("hqq", exact=True).check()  # another backend than the starting one
    # the backend's options are shown again after the change, at hqq's own defaults (not quanto's residual_length
    # of the page's start, issue 58): fill residual_length once they are
    expect(page.get_by_text(re.compile(r"Now: spec hqq:4,q_group_size=64,residual_length=128"))).to_be_visible()
    page.get_by_label("residual_length", exact=True).fill("48")
    page.get_by_label("residual_length", exact=True).press("Tab")
    expect(page.get_by_text(re.compile(r"^⚠ The options changed since the prefill"))).to_be_visible()
    expect(page.get_by_text(re.compile(r"Now: spec hqq:4,q_group_size=64,residual_length=48"))).to_be_visible()
    page.wait_for_timeout(1_000)  # the browser state is written after each change

    page.reload()
    expect(page.get_by_text("135 M parameters")).to_be_visible(timeout=60_000)
    expect(_box(page)).to_have_value(context, timeout=30_000)
    expect(page.get_by_label("hqq", exact=True)).to_be_checked()
    expect(page.get_by_label("residual_length", exact=True)).to_have_value("48")
    expect(page.get_by_label("nbits", exact=True)).to_have_value("4")
    expect(
        page.get_by_text(
            re.compile(
                r"^spec hqq:4,q_group_size=64,residual_length=48,axis_key=0,axis_value=0,flush=requantize,"
                r"rotation=none,optimize=true · "
                r"nothing prefilled in this tab yet$"
            )
        )
    ).to_be_visible()
    expect(_ask_button(page)).to_be_disabled()
    expect(page.locator('[data-testid="bot"]')).to_have_count(0)
    _shot(page, "7-after-reload")


def test_what_the_browser_kept_survives_a_server_restart(browser, embedded, normans, tmp_path, monkeypatch):
    """gradio-app/gradio#10263: `gr.BrowserState` is encrypted with a secret that Gradio draws anew at every start,
    so a restarted server could not read what the browser kept. With the secret from `kvdemo.serve.secret` (here
    the file in a fresh cache folder), a second server on the same port, built from scratch, reads it back; and with
    the server's folder of session files, the reload reopens the prefill without pressing Prefill (issue 44). A
    session file dropped in the Ask tab's box opens in place of a prefill; a bad one is refused beside Prefill."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    port = free_port()

    def start():
        files = SessionFiles(tmp_path / "sessions", 1 << 30)
        app = App(loader=lambda source: embedded, session_files=files, recommended_start=False)
        demo, _ = serve(app, port)
        app.wait_for_model()
        return demo

    context = normans.select("2").context
    demo = start()
    tab = browser.new_context(viewport={"width": 1400, "height": 1800})
    try:
        page = tab.new_page()
        page.goto(f"http://127.0.0.1:{port}/")
        expect(page.get_by_text("135 M parameters")).to_be_visible(timeout=120_000)
        page.get_by_label("residual_length", exact=True).fill("48")
        page.get_by_label("residual_length", exact=True).press("Tab")
        tokens = _prefill(page, context)
        page.get_by_role("button", name="Session file: save this session").click()
        page.get_by_role("button", name="Save session").click()
        expect(
            page.get_by_text(re.compile(r"^Saved the cache's quanto:4,q_group_size=64,residual_length=48,"))
        ).to_be_visible()
        expect(page.get_by_role("cell", name=re.compile(rf"-{tokens}tokens\.kvsession"))).to_be_visible()
        with page.expect_download() as download:
            page.get_by_role("link", name=re.compile(r"KB|MB")).click()
        saved = read_manifest(download.value.path())
        assert saved["spec"].startswith("quanto:4,residual_length=48,") and saved["context_tokens"] == tokens
        assert saved["context"] == context
        page.wait_for_timeout(1_000)  # the browser state is written after each change
        demo.close()  # the server goes away; the browser keeps its localStorage
        demo = start()  # a new server: a new page, new components, the secret read from the file
        page.reload()
        expect(page.get_by_text("135 M parameters")).to_be_visible(timeout=60_000)
        expect(_box(page)).to_have_value(context, timeout=30_000)
        expect(page.get_by_label("residual_length", exact=True)).to_have_value("48")
        assert (tmp_path / SECRET_FILE).is_file()
        opened = page.get_by_text(f"Opened {tokens:,} prefilled tokens from this server's saved copy of the same")
        expect(opened).to_be_visible(timeout=60_000)  # no Prefill pressed
        expect(_ask_button(page)).to_be_enabled()
        _shot(page, "8-reopened-after-restart")

        other = normans.select("3").context
        session = QASession(embedded, CacheSpec("dynamic"))
        session.prefill(other)
        save_session(session, tmp_path / "normans-3.kvsession")
        page.get_by_role("button", name="Session file: save this session").click()
        box = page.locator("div.block", has_text="session file (.kvsession)").last.locator("input[type=file]").first
        box.set_input_files(str(tmp_path / "normans-3.kvsession"))
        expect(
            page.get_by_text(re.compile(r"^Opened [\d,]+ prefilled tokens from the session file normans-3"))
        ).to_be_visible(timeout=60_000)
        expect(_box(page)).to_have_value(other)
        expect(page.get_by_label("dynamic", exact=True)).to_be_checked()
        expect(_ask_button(page)).to_be_enabled()
        question = "Who was the duke in the battle of Hastings?"
        _ask(page, question, 8)
        expect(page.locator('[data-testid="bot"]').last).to_have_text(session.ask(question, 8).text)
        (tmp_path / "notes.kvsession").write_text("not a session")
        box.set_input_files(str(tmp_path / "notes.kvsession"))
        expect(page.get_by_text("⚠ notes.kvsession is not a session file, or it was cut short")).to_be_visible()
        expect(_box(page)).to_have_value(other)  # the page keeps what the cache holds
        expect(_ask_button(page)).to_be_enabled()
        _shot(page, "9-session-file-refused")
    finally:
        tab.close()
        demo.close()
