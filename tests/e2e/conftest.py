"""Running apps on free local ports for gradio_client, MCP and browser tests: `app_url` with the embedded model,
`mcp_app` with the tiny model and the MCP server; `opened_tab`, a browser tab of its own on one of them."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import gradio as gr
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from kvdemo.serve.server import App
from kvdemo.ui import PAGE_CSS, build_demo
from kvdemo.ui.mcp_tools import serve_only_tools


@contextmanager
def opened_tab(browser: Browser, url: str, height: int = 1800, timeout_ms: int = 15_000) -> Iterator[Page]:
    """A new browser context (its own localStorage, so no test sees another's kept Context box) and tab, 1,400 px
    wide and `height` high, on the embedded model's page at `url` once its model line shows. Playwright's
    `expect` waits `timeout_ms` meanwhile (a busy 2-core CI runner: the page's own updates may take seconds), and
    its default, 5 s, for the other modules after."""
    context = browser.new_context(viewport={"width": 1400, "height": height})
    page = context.new_page()
    expect.set_options(timeout=timeout_ms)
    try:
        page.goto(url)
        expect(page.get_by_text("135 M parameters")).to_be_visible(timeout=120_000)
        yield page
    finally:
        expect.set_options(timeout=5_000)
        context.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(app: App, port: int | None = None, **launch) -> tuple[gr.Blocks, str]:
    """`app` started loading its model, its page built, queued one event at a time (as on CPU) and launched on
    `port` (default: a free one) without blocking; `launch` adds `demo.launch` options. Returns (demo, url)."""
    app.start_loading()
    demo = build_demo(app)
    demo.queue(default_concurrency_limit=1)
    port = port or free_port()
    demo.launch(
        server_name="127.0.0.1",
        server_port=port,
        prevent_thread_lock=True,
        ssr_mode=False,
        quiet=True,
        css=PAGE_CSS,
        **launch,
    )
    return demo, f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="session")
def app_url(embedded):
    # loads the embedded model: the same object as the `embedded` fixture's; the page starts on its fixed spec, which
    # the page tests drive (the recommended start has its own test, tests/e2e/test_new_user.py)
    app = App(recommended_start=False)
    demo, url = serve(app)
    assert app.wait_for_model() is embedded
    yield url
    demo.close()


@pytest.fixture(scope="module")
def mcp_app(tiny):
    """(url, app, the MCP tool names served): the tiny model (another model source goes to `load_model`), the MCP
    server on, errors shown as app.py shows them (`show_error=True`)."""
    from kvdemo.qa.models import load_model

    app = App(loader=lambda source: tiny if source is None else load_model(source), recommended_start=False)
    demo, url = serve(app, mcp_server=True, show_error=True)
    served = serve_only_tools(demo)
    assert app.wait_for_model() is tiny
    yield url, app, served
    demo.close()
    for key in list(app.sessions._sessions):  # what the module's clients left: freed, so no later test sees it
        app.sessions.free(key, "the test module ended")


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by Playwright, one per test module (the browser tests' pages open in it)."""
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed: apt-get install chromium (the Makefile's test set-up does it)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        yield browser
        browser.close()
