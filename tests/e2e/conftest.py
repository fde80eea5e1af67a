"""A running app on a free local port, with the embedded model, for gradio_client and browser tests."""

from __future__ import annotations

import socket

import pytest

from kvdemo.serve.server import App
from kvdemo.ui import build_demo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def app_url(embedded):
    app = App()  # loads the embedded model: the same object as the `embedded` fixture's
    app.start_loading()
    demo = build_demo(app)
    demo.queue(default_concurrency_limit=1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, ssr_mode=False, quiet=True)
    assert app.wait_for_model() is embedded
    yield f"http://127.0.0.1:{port}/"
    demo.close()
