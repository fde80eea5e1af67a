"""What a page sends and receives, counted in Chromium: every HTTP request's headers and body and its response's
headers and body (Playwright's `Request.sizes`, which reads Chrome's own counts), and every WebSocket frame.
Used to bound what the Ask tab's Context box costs per typed character (tests/e2e/test_context_box.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from playwright.sync_api import Page, Request, WebSocket


@dataclass
class Traffic:
    """The bytes a page moves from `start()` on: `up` (requests: headers and bodies; frames sent) and `down`
    (responses: headers and bodies; frames received), and the requests counted. `settle()` waits until no request
    is in flight."""

    page: Page
    up: int = 0
    down: int = 0
    requests: list[str] = field(default_factory=list)
    sent: int = 0  # requests the page has sent, counted or not
    _pending: set = field(default_factory=set)
    _counted: set = field(default_factory=set)
    _done: list = field(default_factory=list)
    _on: bool = False

    def __post_init__(self) -> None:
        self.page.on("request", self._sent)
        self.page.on("requestfinished", self._finished)
        self.page.on("requestfailed", self._failed)
        self.page.on("websocket", self._socket)

    def start(self) -> None:
        self.up = self.down = 0
        self.requests, self._done = [], []
        self._on = True

    def stop(self) -> tuple[int, int]:
        """Stop counting; (bytes up, bytes down) since `start()` of the requests finished by now."""
        self._on = False
        for request in self._done:
            sizes = request.sizes()
            self.up += sizes["requestHeadersSize"] + sizes["requestBodySize"]
            self.down += sizes["responseHeadersSize"] + sizes["responseBodySize"]
            self.requests.append(request.url)
        self._done = []
        return self.up, self.down

    def settle(self, quiet_ms: int = 600, timeout_s: float = 30, after: int | None = None) -> None:
        """Wait until no request has been in flight for `quiet_ms`, and (`after`: a value of `sent`) the page has sent
        a request since then. Raises TimeoutError when the page is still sending after `timeout_s` (as Gradio's
        event loop of two listeners did, `kvdemo.ui.context_box`)."""
        deadline, quiet_since = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            self.page.wait_for_timeout(50)
            if self._pending or (after is not None and self.sent <= after):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif (time.monotonic() - quiet_since) * 1000 >= quiet_ms:
                return
        raise TimeoutError(f"requests still in flight: {[r.url for r in self._pending]}")

    def _sent(self, request: Request) -> None:
        self.sent += 1
        self._pending.add(request)
        if self._on:
            self._counted.add(request)

    def _finished(self, request: Request) -> None:
        self._pending.discard(request)
        if request in self._counted:  # its sizes are read in `stop` (no call back into the browser from a handler)
            self._counted.discard(request)
            self._done.append(request)

    def _failed(self, request: Request) -> None:
        self._pending.discard(request)
        self._counted.discard(request)

    def _socket(self, socket: WebSocket) -> None:
        socket.on("framesent", lambda payload: self._frame(payload, sent=True))
        socket.on("framereceived", lambda payload: self._frame(payload, sent=False))

    def _frame(self, payload: str | bytes, sent: bool) -> None:
        if not self._on:
            return
        size = len(payload.encode() if isinstance(payload, str) else payload)
        if sent:
            self.up += size
        else:
            self.down += size
