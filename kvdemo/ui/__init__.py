"""The Gradio page (`build_demo`): `page` composes one module per tab (`ask_tab`, `compare_tab`); `views` holds
pure display functions, `inputs` pure parsing (ValueError, turned into gr.Error by `inputs.user_errors`),
`examples` the shipped examples, `session_box` the Ask tab's session file.
The state shared across users is `kvdemo.serve.server.App`."""

from kvdemo.serve.server import App
from kvdemo.ui.page import PAGE_CSS, build_demo

__all__ = [
    "PAGE_CSS",
    "App",
    "build_demo",
]
