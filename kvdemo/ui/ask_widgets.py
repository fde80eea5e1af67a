"""The Ask tab's widgets: `AskWidgets.build` lays out the options, the context, the questions and the charts into
`self.w` by name, and the handlers' named outputs (`PrefillView`, `AnswerView`) whose field names are the widgets'
names; `kvdemo.ui.ask_tab.AskTab` adds the handlers and wires the events."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import gradio as gr

from kvdemo.cache.catalogue import examples
from kvdemo.cache.options import Option
from kvdemo.cache.registry import BACKENDS, GROUP_OPTIONS
from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state.speedlimit import SpeedLimit
from kvdemo.charts.steps import KEPT_SERIES, MEMORY_SERIES, answers_frame
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS
from kvdemo.qa.session import Session
from kvdemo.serve.secret import browser_state_secret
from kvdemo.ui import option_fields, views
from kvdemo.ui.examples import EXAMPLES
from kvdemo.ui.option_fields import FIRST_FIELDS

START_SPEC = CacheSpec.parse(examples("start")[0])
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
    reference: Any = views.KEEP  # the full-precision answer beside the last one: emptied by a new cache (last: the
    # API's outputs keep their places)

    @classmethod
    def prefilled(
        cls, qa: Session, speed: SpeedLimit, answers: list, ask_enabled: bool, note: str = "", timing: str = ""
    ) -> PrefillView:
        """What a prefill, or a session file opened in its place, shows: the summary line (with `timing` after its
        time, then `note`), an empty chat and charts, the tab's answers table, Ask as `ask_enabled` says, and the new
        cache's speed floor `speed` (`Session.speed_limit`; no step measured yet)."""
        return cls.emptied(views.prefill_summary(qa, timing) + note, qa.spec)._replace(
            answers_table=views.answers_table(answers),
            ask_button=gr.update(interactive=ask_enabled),
            speed_limit=views.speed_limit_after(speed, []),
        )

    @classmethod
    def emptied(cls, line: str, spec: CacheSpec | None) -> PrefillView:
        """A tab with nothing of an earlier cache (after a prefill, or once the session was freed): `line` under
        Prefill, the chat, the charts (of `spec`'s backend; None: the page's start), the answers and the lines
        beside Prefill and Ask emptied, Ask disabled."""
        spec = spec or START_SPEC
        return cls(
            prefill_info=line,
            chat=[],
            stats="",
            memory_plot=views.memory_chart([], spec),
            residual_plot=views.residual_chart([], spec),
            step_plot=views.step_times([]),
            answers_table=views.answers_table([]),
            notice="",
            ask_button=gr.update(interactive=False),
            speed_limit="",
            reference="",
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
        """The tab's widgets (inside a `gr.Blocks` and `gr.Tab` context), kept in `self.w` by name. At 1,400 × 900,
        without scrolling: the options in one row (backend and the fields a user of
        the field sets most; the rest and the backend's description folded under them), then the context with
        Prefill, the chat with Ask, and the memory and residual charts side by side, so that the charts and the chat
        are in view together while an answer streams. Below: the step-time chart, the answers table. (The explainer,
        "What am I looking at?", sits in the page's header: `kvdemo.ui.page.build_demo`.)"""
        w = self.w
        self._build_options()
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=300):
                self._build_context()
            with gr.Column(scale=2, min_width=340):
                self._build_questions()
            with gr.Column(scale=3, min_width=480):  # wide enough for the memory chart's legend on one line
                self._build_live_charts()
        # what a reload should keep: the Context box and the options, in the browser's localStorage, encrypted with
        # a secret that a restarted server finds again (kvdemo.serve.secret)
        w["saved"] = gr.BrowserState(None, storage_key="kvdemo-ask-tab", secret=browser_state_secret())
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=480):
                # a log axis: matplotlib's (`views.step_times`), a PNG
                w["step_plot"] = gr.Plot(views.step_times([]), show_label=False, format="png", elem_id="step-times")
            with gr.Column(scale=2, min_width=320):
                w["speed_limit"] = gr.Markdown("")
        w["answers_table"] = gr.Dataframe(
            answers_frame([]),
            label="this session's answers (spec: nbits and the options that differ from the defaults; the line "
            "under Prefill gives the whole spec)",
            interactive=False,
            wrap=True,  # the question and the answer wrap in their columns; no horizontal scroll hides them
        )

    def _build_context(self) -> None:
        """The Context box with Prefill right under it (in view at 1,400 × 900), its progress and refusals and its line
        under it, then the upload and the examples, and the session file box."""
        w = self.w
        w["context"] = gr.Textbox(label="context", lines=6, max_lines=10, placeholder="Paste a long text…")
        w["context_note"] = gr.Markdown("")  # a large context: what a reload keeps (`context_box`)
        # what the server's gate sees of the box: its text, or a large one's fingerprint (`context_box`)
        w["context_sent"] = gr.Textbox("", visible=False)
        w["prefill_button"] = gr.Button("Prefill", variant="primary")
        # refusals, right under the button they refuse; and the prefill's progress (`show_progress_on`), drawn over
        # this line, empty meanwhile, not over the spec line below it
        w["notice"] = gr.Markdown("", min_height=60)
        w["prefill_info"] = gr.Markdown(f"**spec** `{START_SPEC.full_text}` · nothing prefilled in this tab yet")
        with gr.Row(equal_height=True):
            w["upload"] = gr.File(
                label="or upload .txt / .md (≤ 2 MiB, UTF-8)",
                file_types=[".txt", ".md"],
                type="filepath",
                height=90,
                scale=3,
            )
            with gr.Column(scale=2, min_width=120):
                w["examples"] = {name: gr.Button(f"Example: {name}", size="sm") for name in EXAMPLES}
        with gr.Accordion("Session file: save this session, or open a saved one", open=False):
            # `session_box`: a download after Save session; an upload is opened instead of a prefill
            w["session_file"] = gr.File(
                label="session file (.kvsession): drop one here to open it without a prefill",
                file_types=[".kvsession"],
                type="filepath",
                height=110,
            )
            w["save_session"] = gr.Button("Save session", size="sm")

    def _build_questions(self) -> None:
        """The chat, the question box with Ask and Stop, the line beside Ask (an answer's figures, or a refusal that
        stays until the user acts again) and the example questions."""
        w = self.w
        w["chat"] = gr.Chatbot(label="answers", height=220)
        w["question"] = gr.Textbox(label="question", placeholder="Ask about the context…")
        with gr.Row():
            # no precision or minimum: Gradio would round 2.5 silently and refuse 0 with a bare "Error"
            # over the chat and charts; `checks.max_new_tokens` refuses them beside Ask, saying what to change
            w["max_new_tokens"] = gr.Number(DEFAULT_MAX_NEW_TOKENS, label="max_new_tokens", min_width=100)
            w["ask_button"] = gr.Button("Ask", variant="primary", interactive=False, min_width=80)
            # enabled while a prefill or an answer runs or waits (`AskTab.stop_state`)
            w["stop_button"] = gr.Button("Stop", variant="stop", interactive=False, min_width=80)
        w["stats"] = gr.Markdown("")
        w["example_questions"] = gr.Dataset(
            components=[w["question"]], samples=[], label="example questions", visible=False
        )

    def _build_options(self) -> None:
        """The backend radio and one field per option in `GROUP_OPTIONS`, set to `START_SPEC` from the registry: the
        backend and `FIRST_FIELDS` in one row; under it the recommendation's note beside the other fields and the
        backend's description, folded under "More options" (each field still shown only for a backend that takes
        it)."""
        w = self.w
        # each option as the registry has it, START_SPEC's backend's own first
        options = {n: opt for b in reversed(list(BACKENDS.values())) for n, opt in b.options.items()}
        options.update(START_SPEC.info.options)
        start, start_values = START_SPEC.resolved(), {}
        with gr.Row(equal_height=False):
            w["backend"] = gr.Radio(
                list(BACKENDS),
                value=START_SPEC.backend,
                label="cache backend",
                scale=5,
                min_width=600,
                elem_id="backend-radio",
            )  # every backend on one line at 1,400 px: wide, and its choices compact (`kvdemo.ui.page.PAGE_CSS`)
            for name in FIRST_FIELDS:
                start_values[name] = self._build_field(options[name], start, scale=1, min_width=120)
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                w["recommend_note"] = gr.Markdown("")  # the model's recommended start (`AskTab.start_spec`), whence
            with gr.Column(scale=1, min_width=260):  # folded: it opens downward, in this column
                with gr.Accordion("More options, and what this backend does", open=False):
                    w["backend_note"] = gr.Markdown(option_fields.backend_option_updates(START_SPEC.backend)[-1])
                    for name in GROUP_OPTIONS:
                        if name not in FIRST_FIELDS:
                            start_values[name] = self._build_field(options[name], start)
        # backend -> the values last set on it (`option_fields.remember`), so a switch never carries another's
        w["fields_memory"] = gr.State({START_SPEC.backend: [start_values[name] for name in GROUP_OPTIONS]})

    def _build_field(self, option: Option, start: Mapping[str, Any], **layout: Any) -> int | str | None:
        """The field of `option`, shown when `START_SPEC`'s backend takes it, set to its value in `start`
        (`START_SPEC.resolved()`); returns that value (None when hidden). `layout`: its place in a row (`scale`,
        `min_width`)."""
        name = option.name
        value = cast("int | str", start.get(name, option.default))
        if option.same_as is not None and name not in START_SPEC.given():
            value = option_fields.field_start(option)  # "same as nbits": the field left empty
        visible = name in START_SPEC.info.options
        if option.choices is not None:
            # the choices follow the backend in a browser (`backend_option_updates`); an API caller keeps the
            # page's first ones, so a value outside them (quanto's axis -1) reaches `spec_from_inputs`, which
            # checks it against the registry and says what is allowed
            self.w[name] = gr.Dropdown(
                option_fields.field_choices(option),
                value=value,
                label=name,
                info=None if name in FIRST_FIELDS else option.help,  # the first row's help: in the backend's note
                visible=visible,
                allow_custom_value=True,
                **layout,
            )
        else:  # no precision or minimum, as max_new_tokens: the registry's check names the option
            info = None if name in FIRST_FIELDS else option.help
            self.w[name] = gr.Number(cast(int, value), label=name, info=info, visible=visible, **layout)
        return value if visible else None

    def _build_live_charts(self) -> None:
        """The memory and residual charts one above the other, each titled and with its whole legend from the start:
        what an answer redraws as it streams (the step-time chart, drawn at its end, sits below); under them the
        full-precision answer beside the last one."""
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
            height=200,
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
            height=170,
            x_lim=[0, views.MIN_STEPS_SHOWN],
            y_lim=[0, START_SPEC.resolved()["residual_length"] * 1.1],
            color_map=dict(zip(views.RESIDUAL_SERIES, ("#ff7f0e", "#7f7f7f"))),
        )
        # the full-precision answer beside the last one (`AskTab.reference`), in view with the chat and the charts
        w["reference"] = gr.Markdown("")
