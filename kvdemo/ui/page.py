"""The page: the model bar over one tab per job (`AskTab`, `CompareTab`, `NeedleTab`, `RecommendTab`), composed
into one `gr.Blocks`.

Every event has an `api_name` for `gradio_client` (or is private); `mcp_tools` adds typed endpoints, the app's
MCP tools. One model is shared; each browser session (Gradio's `session_hash`) has its own `QASession`, kept
server-side in `kvdemo.serve.server.SessionStore` and freed on `demo.unload`. Adding a tab: CONTRIBUTING.md, "Adding
a tab".
"""

from __future__ import annotations

import importlib
from typing import Any, cast

import gradio as gr

from kvdemo.qa.packaged import offered_models
from kvdemo.serve.server import App
from kvdemo.ui import views
from kvdemo.ui.ask_tab import AskTab
from kvdemo.ui.compare_tab import CompareTab
from kvdemo.ui.inputs import refusal
from kvdemo.ui.mcp_tools import McpTools
from kvdemo.ui.needle_tab import NeedleTab
from kvdemo.ui.recommend_tab import RecommendTab

PAGE_CSS = """
.prose code { white-space: pre-wrap; overflow-wrap: anywhere; }
#backend-radio { padding-left: 6px !important; padding-right: 6px !important; }
#backend-radio div.wrap:not(.default) { gap: 2px !important; }
#backend-radio label { padding: 4px !important; font-size: 0.9em; }
#backend-radio label input { width: 12px !important; height: 12px !important; margin-right: 3px !important; }
"""
"""The page's own CSS, given to `demo.launch(css=PAGE_CSS)` (Gradio 6 takes CSS at launch): a spec written as code
(`quanto:4,q_group_size=64,...`, one word to the browser) wraps inside its column instead of running past it; the
backend's choices (nine formats) stay on one line beside the first fields at 1,280-1,400 px, so the Ask button stays
in view after a prefill (tests/e2e/test_new_user.py): compact chips, smaller radio circles."""


class ModelBar:
    """The model's status line and the Load field above the tabs."""

    def __init__(self, app: App):
        self.app = app

    def on_page_load(self, progress=gr.Progress()) -> str:
        """The model's status once the start-up load is done (the page shows real progress meanwhile), or why
        there is none."""
        progress(
            0,
            desc="Loading the model (a first start converts the embedded GGUF, ~20-60 s; later starts "
            "load the converted copy in seconds)…",
        )
        try:
            return views.model_status(self.app.wait_for_model())
        except ValueError as error:
            return refusal(error, "the page (no model)")

    def load(self, model_source: str, progress=gr.Progress()) -> str:
        """Load a model (a Hub id, a local folder or a .gguf file, typed or chosen among the installed ones; empty:
        the start-up model) for everyone. A refusal keeps the current model and says so under its status line."""
        try:
            if model_source is not None and not isinstance(model_source, str):  # the API can send any JSON
                raise ValueError("the model must be text: a Hub id, a local folder or a .gguf file")
            progress(0, desc=f"Loading {model_source.strip() if model_source else 'the start-up model'}…")

            def measuring(done: int, total: int, what: str) -> None:
                desc = f"Measuring the recommended KV setting for this model (once per model): {what}"
                progress((done, total), desc=desc, unit="steps")

            return views.model_status(self.app.load(model_source, on_progress=measuring))
        except ValueError as error:
            current = views.model_status(self.app.loaded) if self.app.loaded is not None else "No model is loaded."
            return f"{current}\n\n{refusal(error, 'a model load')}"

    def choices(self) -> list[tuple[str, str]]:
        """What the model box offers, read again from what is installed now (`offered_models`: the embedded model,
        Gemma 3 270M once `make gemma` ran, also while the app runs), by readable name, and the model loaded now
        when it is none of those (a Hub id or a path typed earlier). "" is the start-up model."""
        importlib.invalidate_caches()  # a package installed since start-up is found
        offered = [(model.label, model.source) for model in offered_models()]
        if self.app.model_source is not None:  # "" loads the start-up model, which is not the embedded one here
            offered[0] = ("the start-up model", "")
        loaded = self.app.loaded
        if loaded is not None and loaded.source and loaded.source not in {source for _, source in offered}:
            offered.append((loaded.name, loaded.source))
        return offered

    def box(self) -> Any:
        """The model box as the server stands: its choices, and the model loaded now as its value (a new tab shows
        the model every tab shares, not the start-up one)."""
        loaded = self.app.loaded
        value = "" if loaded is None or loaded.source in (None, self.app.model_source) else loaded.source
        return gr.update(choices=self.choices(), value=value)

    def refresh(self) -> Any:
        """The model box's choices when it is opened (what is installed now); its value as it is."""
        return gr.update(choices=self.choices())

    def build(self) -> None:
        with gr.Row():
            with gr.Column(scale=5):
                self.line = gr.Markdown("Loading the model…")
            with gr.Column(scale=4):  # wide enough for a model's whole name in the box
                with gr.Row():
                    # the models installed here (the start-up one; Gemma 3 270M after `make gemma`), or any typed;
                    # read again when the box is opened (`refresh`)
                    self.source = gr.Dropdown(
                        choices=self.choices(),
                        value="",
                        label="Model",  # a Hub id, a folder or a .gguf typed, or one installed here
                        allow_custom_value=True,
                        filterable=True,
                        scale=5,
                    )
                    self.button = gr.Button("Load", scale=1, min_width=80)


def build_demo(app: App) -> gr.Blocks:
    """The gr.Blocks page, wired to `app`.

    Example:
        >>> app = App(); app.start_loading(); build_demo(app).queue().launch(css=PAGE_CSS)
    """
    bar, ask = ModelBar(app), AskTab(app)
    compare, grid, recommend = CompareTab(ask), NeedleTab(ask), RecommendTab(ask)
    with gr.Blocks(title="kvdemo: KV cache quantization, live") as demo:
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                gr.Markdown(
                    "## kvdemo: a quantized KV cache, live\nPrefill a long context once, ask questions in turn, and "
                    "watch the cache's real memory and every residual flush. After each answer the cache is restored "
                    "exactly."
                )
            with gr.Column(scale=2, min_width=300):  # where a first visitor looks; it opens downward, in this column
                with gr.Accordion("What am I looking at? The KV cache, the residual, a flush, the restore", open=False):
                    gr.Markdown(views.EXPLAINER)
        bar.build()
        with gr.Tab("Ask", id="ask"):
            ask.build()
        with gr.Tab("Compare backends", id="compare"):
            compare.build()
        with gr.Tab("Needle in a haystack", id="needle"):
            grid.build()
        with gr.Tab("Recommend", id="recommend"):
            recommend.build()
        private: dict[str, Any] = {"api_visibility": "private", "queue": False}
        status = demo.load(bar.on_page_load, outputs=bar.line, api_name="model_status")
        status.then(bar.box, outputs=bar.source, **private)
        # the default comparison includes the Ask tab's start, once the model (and its recommendation) is there
        status.then(compare.start_more, inputs=compare.w["more"], outputs=compare.w["more"], **private)
        load = bar.button.click(
            bar.load, inputs=bar.source, outputs=bar.line, api_name="load_model", concurrency_id="model"
        )
        load.then(bar.box, outputs=bar.source, **private)
        load.then(compare.start_more, inputs=compare.w["more"], outputs=compare.w["more"], **private)
        bar.source.focus(bar.refresh, outputs=bar.source, **private)
        ask.wire(demo)
        ask.wire_model_load(load)
        compare.wire()
        grid.wire()
        recommend.wire()
        McpTools(app).register()  # typed endpoints, served as MCP tools by `launch(mcp_server=True)` (app.py --mcp)

        def unload(request: gr.Request) -> None:
            app.sessions.free(cast(str, request.session_hash))  # a page's unload comes with its session hash

        demo.unload(unload)
    return demo
