"""The Ask tab: choose a backend, prefill a context once, ask questions in turn and watch the cache's memory,
residual and step times live. `AskTab` builds the widgets and owns the handlers; the handlers call
`QASession` and the chart-data functions, and return named outputs (`PrefillView`, `AnswerView`) whose field
names are the widgets' names."""

from __future__ import annotations

import functools
from contextlib import closing
from typing import Any, Iterator, NamedTuple

import gradio as gr

from kvdemo import checks
from kvdemo.backends import BACKENDS, GROUP_OPTIONS
from kvdemo.charts import MEMORY_SERIES, answers_frame, memory_frame, residual_frame
from kvdemo.server import App, UserSession
from kvdemo.session import DEFAULT_MAX_NEW_TOKENS, QASession
from kvdemo.spec import CacheSpec
from kvdemo.telemetry import STEP_KINDS
from kvdemo.ui import views
from kvdemo.ui.examples import EXAMPLES, example
from kvdemo.ui.inputs import read_upload, spec_from_inputs, user_errors

START_SPEC = CacheSpec("hqq", nbits=4, residual_length=16)
"""The Ask tab's starting spec: a short residual, so that flushes show within the first answers."""


class PrefillView(NamedTuple):
    """What a prefill shows (`AskTab.prefill`), in the order of its outputs."""

    prefill_info: Any
    chat: Any
    stats: Any
    memory_plot: Any
    residual_plot: Any
    step_plot: Any
    answers_table: Any
    ask_button: Any


class AnswerView(NamedTuple):
    """What each update of an answer shows (`AskTab.ask`), in the order of its outputs."""

    chat: Any
    stats: Any
    memory_plot: Any
    residual_plot: Any
    step_plot: Any
    answers_table: Any


def _guarded(stream: Iterator, qa: QASession) -> Iterator:
    """`stream`, with an exception inside a decode step turned into a message for the user. The session has
    restored the cache and recorded the answer (`finish_reason="error"`) before the exception reaches here."""
    try:
        yield from stream
    except Exception as error:
        steps = qa.history[-1].steps if qa.history else 0
        raise gr.Error(
            f"The answer failed after {steps} decode step(s) ({type(error).__name__}: {str(error)[:200]}). The cache "
            "was restored to the prefilled context; ask again, or press Prefill to start over"
        ) from None


class AskTab:
    """The Ask tab over the shared `App`.

    Args:
        app: the server state (model and per-tab sessions).
    """

    def __init__(self, app: App):
        self.app = app
        self.w: dict[str, Any] = {}

    # ---- sessions -----------------------------------------------------------------------------------
    @staticmethod
    def key_of(request: gr.Request | None) -> str:
        """The session key of a request (Gradio's `session_hash`; `api` without one)."""
        return request.session_hash if request is not None else "api"

    def user_of(self, request: gr.Request | None) -> UserSession:
        """This tab's session, created when missing (Prefill and Compare only).

        Raises:
            ServerFull (a ValueError): the cap is reached and every session is busy.
        """
        return self.app.sessions.get(self.key_of(request))

    def existing_user(self, request: gr.Request | None) -> UserSession | None:
        """This tab's session if it has one; handlers that only read or stop never create (or evict) one."""
        return self.app.sessions.peek(self.key_of(request))

    # ---- handlers -----------------------------------------------------------------------------------
    @user_errors
    def prefill(self, context, backend, nbits, q_group_size, residual_length, axis_key, axis_value,
                request: gr.Request, progress=gr.Progress()) -> PrefillView:
        """Prefill `context` into a new KV cache of the chosen backend (replacing this session's context)."""
        spec = spec_from_inputs(backend, nbits, q_group_size, residual_length, axis_key, axis_value)
        loaded = self.app.wait_for_model()
        user = self.user_of(request)
        if user.qa is not None:
            user.qa.request_stop()
        with user.lock:
            qa = QASession(loaded, spec, kv_budget_bytes=self.app.kv_budget_bytes)
            qa.prefill(context)
            user.qa, user.chat, user.events = qa, [], []
            self.app.sessions.forget_freed(self.key_of(request))
        return PrefillView(views.prefill_summary(qa), [], "", *views.empty_charts(), answers_frame([]),
                           gr.update(interactive=True))

    def _answerable_session(self, request: gr.Request | None) -> UserSession:
        """This tab's session with a prefilled cache, or a `gr.Error` that says why there is none."""
        user = self.existing_user(request)
        if user is None or user.qa is None:
            reason = self.app.sessions.freed_reason(self.key_of(request))
            if reason:
                raise gr.Error(f"Your session was freed because {reason}; press Prefill again to rebuild the cache")
            raise gr.Error("Prefill a context first: paste or load a text and press Prefill")
        return user

    @user_errors
    def ask(self, question: str, max_new_tokens: float, request: gr.Request) -> Iterator[AnswerView]:
        """Answer `question` on the prefilled context, streaming the answer and the charts."""
        user = self._answerable_session(request)
        max_new_tokens = checks.max_new_tokens(max_new_tokens)
        if not user.lock.acquire(blocking=False):
            raise gr.Error("An answer or a prefill is already running in this session; wait or press Stop")
        try:
            qa = user.qa  # read under the lock: a prefill that just finished has replaced it
            if qa is None:
                raise gr.Error("Your session was freed; press Prefill again to rebuild the cache")
            if self.app.loaded is not qa.loaded:
                raise gr.Error("The model changed since your prefill; press Prefill to rebuild the cache on it")
            stream = qa.stream(question, max_new_tokens)
            user.chat = user.chat + [{"role": "user", "content": question.strip()},
                                     {"role": "assistant", "content": ""}]
            user.events = []
            first_token = None
            with closing(stream):
                for event in _guarded(stream, qa):
                    if first_token is None:
                        first_token = event.elapsed
                    user.events.append(event)
                    user.chat[-1] = {"role": "assistant", "content": event.text}
                    yield AnswerView(
                        user.chat,
                        f"step {event.step + 1} · {event.memory.total_bytes / 2**20:.2f} MiB · "
                        f"cache length {event.cache_length:,}",
                        memory_frame(user.events), residual_frame(user.events), views.step_times(user.events),
                        gr.skip(),
                    )
            if not user.events:
                user.chat[-1] = {"role": "assistant", "content": qa.history[-1].text}
            yield AnswerView(
                user.chat, views.answer_stats(qa, first_token, user.events), memory_frame(user.events),
                residual_frame(user.events), views.step_times(user.events),
                answers_frame(a.to_dict() for a in qa.history),
            )
        finally:
            self.app.sessions.touch(user)
            user.lock.release()

    def stop(self, request: gr.Request) -> None:
        """Stop the answer streaming in this session after its current decode step; the cache is restored as
        after any answer, and the answer's last update says `stopped`. (No output of its own: a reply racing
        the answer's last update could overwrite it.)"""
        user = self.existing_user(request)
        if user is not None and user.qa is not None:
            user.qa.request_stop()

    def options_changed(self, backend, nbits, q_group_size, residual_length, axis_key, axis_value,
                        request: gr.Request) -> tuple[Any, Any]:
        """(prefill line, Ask button): Ask is enabled only while the options equal the prefilled cache's."""
        user = self.existing_user(request)
        if user is None or user.qa is None:
            return gr.update(), gr.update()
        try:
            spec = spec_from_inputs(backend, nbits, q_group_size, residual_length, axis_key, axis_value)
            same = spec.resolved() == user.qa.spec.resolved() and spec.backend == user.qa.spec.backend
        except ValueError:
            same = False
        if same:
            return views.prefill_summary(user.qa), gr.update(interactive=True)
        return (
            f"⚠ The cache was prefilled with **{user.qa.spec.label}**. Press **Prefill** to rebuild it with the "
            "new backend options; until then Ask is disabled, so states never mix.",
            gr.update(interactive=False),
        )

    @staticmethod
    def load_example(name: str) -> tuple[str, Any]:
        """The example's context for the text box, and its questions for the example-questions list."""
        context, questions = example(name)
        return context, gr.Dataset(samples=[[q] for q in questions])

    # ---- the widgets and their events ---------------------------------------------------------------
    def build(self) -> None:
        """The tab's widgets (inside a `gr.Blocks` and `gr.Tab` context), kept in `self.w` by name."""
        w = self.w
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                self._build_options()
            with gr.Column(scale=3):
                gr.Markdown("### Context")
                w["context"] = gr.Textbox(label="context", lines=10, max_lines=18, placeholder="Paste a long text…")
                with gr.Row():
                    w["upload"] = gr.File(label="or upload .txt / .md (≤ 2 MiB, UTF-8)", file_types=[".txt", ".md"],
                                          type="filepath", height=90)
                    with gr.Column():
                        w["examples"] = {name: gr.Button(f"Example: {name}", size="sm") for name in EXAMPLES}
                w["prefill_button"] = gr.Button("Prefill", variant="primary")
                w["prefill_info"] = gr.Markdown("")
        gr.Markdown("### Questions")
        with gr.Row():
            with gr.Column(scale=3):
                w["chat"] = gr.Chatbot(label="answers", height=320)
                w["question"] = gr.Textbox(label="question", placeholder="Ask about the context…")
                with gr.Row():
                    w["max_new_tokens"] = gr.Number(DEFAULT_MAX_NEW_TOKENS, label="max_new_tokens", precision=0,
                                                    minimum=1)
                    w["ask_button"] = gr.Button("Ask", variant="primary", interactive=False)
                    w["stop_button"] = gr.Button("Stop", variant="stop")
                w["example_questions"] = gr.Dataset(components=[w["question"]], samples=[], label="example questions")
                w["stats"] = gr.Markdown("")
            with gr.Column(scale=2):
                self._build_charts()
        w["answers_table"] = gr.Dataframe(answers_frame([]), label="this session's answers", interactive=False)
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
            option, value = options[name], start.get(name, options[name].default)
            visible = name in START_SPEC.info.options
            if option.choices is not None:
                w[name] = gr.Dropdown(list(option.choices), value=value, label=name, info=option.help, visible=visible)
            else:
                w[name] = gr.Number(value, label=name, precision=0, minimum=option.minimum, info=option.help,
                                    visible=visible)
        w["backend_note"] = gr.Markdown(views.backend_option_updates(START_SPEC.backend)[-1])

    def _build_charts(self) -> None:
        w = self.w
        w["memory_plot"] = gr.LinePlot(
            None, x="step", y="MiB", color="series", title="KV cache memory",
            x_title="decode step", y_title="MiB", height=230, y_lim=[0, None],
            color_map=dict(zip(MEMORY_SERIES, ("#1f77b4", "#ff7f0e", "#7f7f7f"))),
        )
        w["residual_plot"] = gr.LinePlot(
            None, x="step", y="residual tokens", title="Residual fill (layer 0)", x_title="decode step", height=180,
        )
        w["step_plot"] = gr.ScatterPlot(
            None, x="step", y="ms", color="kind", title="Time per decode step (flush steps marked)",
            x_title="decode step", y_title="ms", height=220,
            color_map=dict(zip(STEP_KINDS, ("#7f7f7f", "#1f77b4", "#d62728"))),
            tooltip=["step", "ms", "kind", "layers flushed"],
        )

    def wire(self) -> None:
        """The tab's events. Prefills, answers and model loads share one queue group (`concurrency_id="model"`):
        `--concurrency` of them run at once across users."""
        w, model_work = self.w, {"concurrency_id": "model"}
        option_fields = [w[name] for name in GROUP_OPTIONS]
        options_inputs = [w["backend"], *option_fields]
        gate = {"fn": self.options_changed, "inputs": options_inputs, "outputs": [w["prefill_info"], w["ask_button"]],
                "api_visibility": "private", "queue": False}
        w["backend"].change(views.backend_option_updates, inputs=options_inputs,
                            outputs=[*option_fields, w["backend_note"]], api_visibility="private",
                            queue=False).then(**gate)
        for field_ in option_fields:
            field_.change(**gate)
        w["upload"].upload(user_errors(read_upload), inputs=w["upload"], outputs=w["context"], api_name="read_upload")
        for name, button in w["examples"].items():
            button.click(functools.partial(self.load_example, name), outputs=[w["context"], w["example_questions"]],
                         api_visibility="private", queue=False)
        w["example_questions"].click(lambda sample: sample[0], inputs=w["example_questions"], outputs=w["question"],
                                     api_visibility="private", queue=False)
        w["prefill_button"].click(self.prefill, inputs=[w["context"], *options_inputs],
                                  outputs=[w[name] for name in PrefillView._fields], api_name="prefill", **model_work)
        answer_outputs = [w[name] for name in AnswerView._fields]
        # Ask is disabled while an answer streams; afterwards its state follows the options (see options_changed)
        for trigger, api in ((w["ask_button"].click, {"api_name": "ask"}),
                             (w["question"].submit, {"api_visibility": "private"})):
            trigger(lambda: gr.update(interactive=False), outputs=w["ask_button"], queue=False,
                    api_visibility="private").then(
                self.ask, inputs=[w["question"], w["max_new_tokens"]], outputs=answer_outputs, **api, **model_work
            ).then(**gate)
        w["stop_button"].click(self.stop, api_name="stop", queue=False)
