"""The Gradio page (`build_demo`): `page` composes the model bar and one module per tab (`ask_tab` with its
widgets `ask_widgets`, `compare_tab`, `needle_tab`, `recommend_tab`); the Ask tab's parts: its option fields from the
registry (`option_fields`), the page against its session (`page_state`), the Context box on the wire (`context_box`),
what it shows of a session (`tab_view`) and its session file (`session_box`); `views` holds pure display functions,
`times` what the page says of time, `inputs` pure parsing (ValueError, turned into gr.Error by `inputs.user_errors`),
`examples` the shipped examples; the MCP tools (`mcp_tools`) and their calls' progress and leaving (`mcp_calls`).
The state shared across users is `kvdemo.serve.server.App`."""

from kvdemo.serve.server import App
from kvdemo.ui.page import PAGE_CSS, build_demo

__all__ = [
    "PAGE_CSS",
    "App",
    "build_demo",
]
