"""The Ask tab's widgets: `AskWidgets.build` lays out the options, the context, the questions and the charts into
`self.w` by name, and the handlers' named outputs (`PrefillView`, `AnswerView`) whose field names are the widgets'
names; `kvdemo.ui.ask_tab.AskTab` adds the handlers and wires the events."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import gradio as gr

from kvdemo.cache.options import GROUP_OPTIONS
from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.speedlimit import speed_limit
from kvdemo.charts.steps import KEPT_SERIES, MEMORY_SERIES, answers_frame
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS
from kvdemo.qa.session import QASession
from kvdemo.serve.secret import browser_state_secret
from kvdemo.ui import option_fields, views
from kvdemo.ui.examples import EXAMPLES

START_SPEC = CacheSpec("quanto", nbits=4, residual_length=16)
"""The Ask tab's starting spec: a short residual, so that flushes show within the first answers, on the backend
whose flush (transformers' own, `flush=requantize`) costs least. Measured by `benchmarks/first_answer.py` on
2 cores (2026-12-01, load 1.4-1.6), prefill + the first answer (64 tokens) against `dynamic`'s: 0.95x on the
Normans example (1,341 tokens) and 1.02x on 4,707 tokens, with a flush of every layer at the question's pass
and every 16 tokens after. `hqq:4,residual_length=16` took 4.5x there (each flush re-runs hqq's optimiser over
the whole layer; 2.4x with `flush=append`)."""


class PrefillView(NamedTuple):
    """What a prefill shows (`AskTab.prefill`), in the order of its outputs; built by keyword, an output not
    named stays as it is on the page (`views.KEEP`)."""

    prefill_info: Any = views.KEEP
    chat: Any = views.KEEP
    stats: Any = views.KEEP
    memory_plot: Any = views.KEEP
    residual_plot: Any = views.KEEP
    step_plot: Any = views.KEEP
    answers_table: Any = views.KEEP
    notice: Any = views.KEEP
    ask_button: Any = views.KEEP
    speed_limit: Any = views.KEEP  # the new cache's floor (no step measured yet); a refusal keeps the line

    @classmethod
    def prefilled(cls, qa: QASession, answers: list, ask_enabled: bool, note: str = "") -> PrefillView:
        """What a prefill, or a session file opened in its place, shows: the summary line (then `note`), an empty
        chat and charts, the tab's answers table, Ask as `ask_enabled` says, and the new cache's speed floor (no step
        measured yet)."""
        assert qa.cache is not None  # prefilled
        return cls(
            prefill_info=views.prefill_summary(qa) + note,
            chat=[],
            stats="",
            memory_plot=views.memory_chart([], qa.spec),
            residual_plot=views.residual_chart([], qa.spec),
            step_plot=views.step_times([]),
            answers_table=views.answers_table(answers),
            notice="",
            ask_button=gr.update(interactive=ask_enabled),
            speed_limit=views.speed_limit_after(speed_limit(qa.loaded.model, qa.cache), []),
        )

    @classmethod
    def refused(cls, message: str, ask_enabled: bool | None) -> PrefillView:
        """A refusal: the message beside Prefill, every other output as it was (the previous cache stays)."""
        return cls(notice=message, ask_button=views.KEEP if ask_enabled is None else gr.update(interactive=ask_enabled))


class AnswerView(NamedTuple):
    """What each update of an answer shows (`AskTab.ask`), in the order of its outputs; built by keyword, an
    output not named stays as it is on the page (`views.KEEP`)."""

    chat: Any = views.KEEP
    stats: Any = views.KEEP
    memory_plot: Any = views.KEEP
    residual_plot: Any = views.KEEP
    step_plot: Any = views.KEEP
    answers_table: Any = views.KEEP
    speed_limit: Any = views.KEEP  # the line under the step-time chart, at the answer's end

    @classmethod
    def refused(cls, message: str, chat: Any = views.KEEP) -> AnswerView:
        """A refusal: the message beside Ask; the charts and table stay as they were, and the chat is `chat` (the
        session's, without the question the click echoed)."""
        return cls(stats=message, chat=chat)


class AskWidgets:
    """The Ask tab's widgets (its handlers and events are `AskTab`'s)."""

    w: dict[str, Any]

    def build(self) -> None:
        """The tab's widgets (inside a `gr.Blocks` and `gr.Tab` context), kept in `self.w` by name."""
        w = self.w
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                self._build_options()
            with gr.Column(scale=3):
                gr.Markdown("### Context")
                w["context"] = gr.Textbox(label="context", lines=10, max_lines=18, placeholder="Paste a long text…")
                w["context_note"] = gr.Markdown("")  # a large context: what a reload keeps (`context_box`)
                # what the server's gate sees of the box: its text, or a large one's fingerprint (`context_box`)
                w["context_sent"] = gr.Textbox("", visible=False)
                with gr.Row():
                    w["upload"] = gr.File(
                        label="or upload .txt / .md (≤ 2 MiB, UTF-8)",
                        file_types=[".txt", ".md"],
                        type="filepath",
                        height=130,
                    )
                    with gr.Column():
                        w["examples"] = {name: gr.Button(f"Example: {name}", size="sm") for name in EXAMPLES}
                w["prefill_button"] = gr.Button("Prefill", variant="primary")
                with gr.Accordion("Session file: save this session, or open a saved one", open=False):
                    # `session_box`: a download after Save session; an upload is opened instead of a prefill
                    w["session_file"] = gr.File(
                        label="session file (.kvsession): drop one here to open it without a prefill",
                        file_types=[".kvsession"],
                        type="filepath",
                        height=110,
                    )
                    w["save_session"] = gr.Button("Save session", size="sm")
                w["notice"] = gr.Markdown("")  # refusals, beside the button they refuse
                w["prefill_info"] = gr.Markdown(
                    f"**spec** `{START_SPEC.full_text}` · nothing prefilled in this tab yet"
                )
        # what a reload should keep: the Context box and the options, in the browser's localStorage, encrypted with
        # a secret that a restarted server finds again (kvdemo.serve.secret)
        w["saved"] = gr.BrowserState(None, storage_key="kvdemo-ask-tab", secret=browser_state_secret())
        gr.Markdown("### Questions")
        with gr.Row():
            with gr.Column(scale=3):
                w["chat"] = gr.Chatbot(label="answers", height=320)
                w["question"] = gr.Textbox(label="question", placeholder="Ask about the context…")
                with gr.Row():
                    # no precision or minimum: Gradio would round 2.5 silently and refuse 0 with a bare "Error"
                    # over the chat and charts; `checks.max_new_tokens` refuses them beside Ask, saying what to change
                    w["max_new_tokens"] = gr.Number(DEFAULT_MAX_NEW_TOKENS, label="max_new_tokens")
                    w["ask_button"] = gr.Button("Ask", variant="primary", interactive=False)
                    # enabled while a prefill or an answer runs or waits (`AskTab.stop_state`)
                    w["stop_button"] = gr.Button("Stop", variant="stop", interactive=False)
                w["example_questions"] = gr.Dataset(
                    components=[w["question"]], samples=[], label="example questions", visible=False
                )
                w["stats"] = gr.Markdown("")
            with gr.Column(scale=2):
                self._build_charts()
        w["answers_table"] = gr.Dataframe(
            answers_frame([]),
            label="this session's answers (spec: nbits and the options that differ from the defaults; the line "
            "under Prefill gives the whole spec)",
            interactive=False,
            wrap=False,  # each column as wide as its widest cell: a narrow one would break its header mid-word
        )
        with gr.Accordion("What am I looking at?", open=False):
            gr.Markdown(views.EXPLAINER)

    def _build_options(self) -> None:
        """The backend radio and one field per option in `GROUP_OPTIONS`, set to `START_SPEC` from the registry."""
        w = self.w
        gr.Markdown("### Cache backend")
        w["backend"] = gr.Radio(list(BACKENDS), value=START_SPEC.backend, label="backend")
        start = START_SPEC.resolved()
        options = {name: opt for b in reversed(list(BACKENDS.values())) for name, opt in b.options.items()}
        options.update(START_SPEC.info.options)
        for name in GROUP_OPTIONS:
            option = options[name]
            value = cast("int | str", start.get(name, options[name].default))
            if option.same_as is not None and name not in START_SPEC.given():
                value = option_fields.field_start(option)  # "same as nbits": the field left empty
            visible = name in START_SPEC.info.options
            if option.choices is not None:
                # the choices follow the backend in a browser (`backend_option_updates`); an API caller keeps the
                # page's first ones, so a value outside them (quanto's axis -1) reaches `spec_from_inputs`, which
                # checks it against the registry and says what is allowed
                w[name] = gr.Dropdown(
                    option_fields.field_choices(option),
                    value=value,
                    label=name,
                    info=option.help,
                    visible=visible,
                    allow_custom_value=True,
                )
            else:  # no precision or minimum, as max_new_tokens: the registry's check names the option
                w[name] = gr.Number(cast(int, value), label=name, info=option.help, visible=visible)
        w["backend_note"] = gr.Markdown(option_fields.backend_option_updates(START_SPEC.backend)[-1])

    def _build_charts(self) -> None:
        w = self.w
        # each chart starts empty with its title and legend (`views`); a bare None draws an untitled box
        w["memory_plot"] = gr.LinePlot(
            views.memory_data([], START_SPEC),
            x="step",
            y="MiB",
            color="series",
            title=f"{views.MEMORY_TITLE}: ask a question to see it",
            x_title="decode step",
            y_title="MiB",
            height=230,
            x_lim=[0, views.MIN_STEPS_SHOWN],
            y_lim=[0, 1],
            color_map=dict(zip((*MEMORY_SERIES, KEPT_SERIES), ("#1f77b4", "#ff7f0e", "#d62728", "#7f7f7f", "#2ca02c"))),
        )
        w["residual_plot"] = gr.LinePlot(
            views.residual_data([], START_SPEC),
            x="step",
            y="residual tokens",
            color="series",
            title="Residual fill (layer 0): prefill a context and ask to see it",
            x_title="decode step",
            y_title="tokens",
            height=200,
            x_lim=[0, views.MIN_STEPS_SHOWN],
            y_lim=[0, START_SPEC.resolved()["residual_length"] * 1.1],
            color_map=dict(zip(views.RESIDUAL_SERIES, ("#ff7f0e", "#7f7f7f"))),
        )
        # a log axis: matplotlib's (`views.step_times`), a PNG
        w["step_plot"] = gr.Plot(views.step_times([]), show_label=False, format="png", elem_id="step-times")
        w["speed_limit"] = gr.Markdown("")
