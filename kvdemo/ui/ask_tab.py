"""The Ask tab: choose a backend, prefill a context once, ask questions in turn and watch the cache's memory,
residual and step times live. `AskTab` builds the widgets and owns the handlers; the handlers call the app's door
(`kvdemo.serve.door.Door`: prefill, answer, Stop) and the chart-data functions, and return named outputs
(`PrefillView`, `AnswerView`) whose field names are the widgets' names."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from typing import Any

import gradio as gr

from kvdemo.cache.registry import GROUP_OPTIONS
from kvdemo.qa.prefill import PrefillStopped
from kvdemo.qa.session import Session
from kvdemo.serve.door import ANSWER_BUSY
from kvdemo.serve.runs import AnswerRun
from kvdemo.serve.server import App, switched_reason
from kvdemo.serve.store import UserSession, request_key
from kvdemo.ui import context_box, option_fields, page_state, session_box, times, views
from kvdemo.ui.ask_widgets import START_SPEC, AnswerView, AskWidgets, PrefillView
from kvdemo.ui.examples import example, suggested_questions
from kvdemo.ui.inputs import page_event, read_upload, refusal, spec_from_inputs
from kvdemo.ui.tab_view import tab_view

_log = logging.getLogger(__name__)


def _guarded(stream: Iterable, qa: Session) -> Iterator:
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


class AskTab(AskWidgets):
    """The Ask tab over the shared `App`.

    Args:
        app: the server state (model and per-tab sessions).
    """

    def __init__(self, app: App):
        self.app = app
        self.w: dict[str, Any] = {}
        self.reopen: Any = None  # the page's reopening of a saved prefill (`wire`)

    # ---- handlers -----------------------------------------------------------------------------------
    def prefill(self, context, backend, options: dict[str, Any], request: gr.Request, progress) -> PrefillView:
        """Prefill `context` into a new KV cache of the chosen backend (replacing this session's context) through the
        door (`Door.prefill`). `options`: the option fields by name (`GROUP_OPTIONS`); the page calls it through
        `page_event`. A refusal (bad options, a context over the window or the KV budget, a full server) is a message
        beside the button; the previous cache, chat and charts stay, and Ask stays enabled only if they still
        match."""
        spec, began = None, time.monotonic()
        try:
            spec = spec_from_inputs(backend, options)
            user = self.app.sessions.of_request(request)
            clicked, user.prefill_clicked = user.prefill_clicked or began, None
            user.page_shows = (context, spec)  # the page at the click; the gate records changes made meanwhile
            backend_name = spec.backend
            asked = time.monotonic()
            done = self.app.door.prefill(
                request_key(request),
                spec,
                context,
                on_progress=lambda done, total: progress(
                    (done, total), desc=f"Prefilling: {done:,} of {total:,} tokens", unit="tokens"
                ),
                on_quantize=lambda done, total: progress(
                    (done, total),
                    desc=f"Quantizing the cache ({backend_name}): {done} of {total} layers",
                    unit="layers",
                ),
            )
        except PrefillStopped as stopped:  # the session keeps its previous cache (replaced only after a prefill)
            _log.info("%s", stopped)
            kept = (
                f"The cache still holds the previous context: {page_state.page_line(user, context, spec)}"
                if user.qa is not None
                else "Nothing is prefilled now; press Prefill to start again."
            )
            return PrefillView(
                prefill_info=f"⚠ Stopped: {stopped}. {kept}",
                notice="",
                ask_button=gr.update(interactive=page_state.prefilled_matches(user, context, spec)),
            )
        except (ValueError, ImportError) as error:
            held = self.app.sessions.peek_request(request)  # the tab's session, if it has one
            kept = (
                f" The cache still holds the previous context ({views.prefilled_tokens(held.qa):,} tokens)."
                if held is not None and held.qa is not None
                else ""
            )
            matches = page_state.prefilled_matches(held, context, spec)
            message = refusal(error, "a prefill")
            message = message.rstrip(".") + "." + kept if kept else message  # "... tokens. The cache still ..."
            return PrefillView.refused(message, matches)
        qa = done.session
        cleared = (
            " · the chat starts afresh on this context; the answers table keeps earlier answers" if user.answers else ""
        )
        queued = asked - clicked + done.queued_seconds
        total = time.monotonic() - clicked
        tab_view(user).prefill_timing = times.from_click(qa, total, queued, done.set_up_seconds, _first_use(qa))
        # Ask as the page now stands: the options may have changed meanwhile
        matches = page_state.page_differs(user) is None
        return PrefillView.prefilled(
            qa, qa.speed_limit(), user.answers, matches, cleared, tab_view(user).prefill_timing
        )

    def _answerable_session(self, request: gr.Request | None, context: str | None) -> UserSession:
        """This tab's session with a prefilled cache of the page's context.

        Raises:
            ValueError: there is none (the message says why: freed, never prefilled, the context or the
                options changed).
        """
        user = self.app.sessions.peek_request(request)
        if user is None or user.qa is None:
            reason = self.app.sessions.freed_reason(request_key(request))
            if reason:
                raise ValueError(f"Your session was freed because {reason}; press Prefill again to rebuild the cache")
            raise ValueError("Prefill a context first: paste or load a text and press Prefill")
        if context is not None and context != user.qa.context:
            raise ValueError(
                "The Context box has changed since the prefill; press Prefill to prefill the text it "
                "shows (answers come only from the prefilled text)"
            )
        if self.app.loaded is not user.qa.loaded:
            raise ValueError("The model changed since your prefill; press Prefill to rebuild the cache on it")
        differs = page_state.page_differs(user)
        if differs:
            raise ValueError(differs)
        return user

    def ask(
        self, question: str, max_new_tokens: float, request: gr.Request, context: str | None = None
    ) -> Iterator[AnswerView]:
        """Answer `question` on the prefilled context, streaming the answer and the charts. `context` is the
        page's Context box: an answer is refused when it is no longer the prefilled text (None: not checked,
        for direct Python calls), or while the gate has seen options other than the cache's
        (`UserSession.page_shows`: Enter in the question box reaches the server even while the gate has
        disabled Ask). A refusal is a message beside Ask; the chat and charts stay."""
        try:
            yield from self._ask(question, max_new_tokens, request, context)
        finally:  # refused or run: the Ask click's answer has ended (`before_answer` queued it)
            held = self.app.sessions.peek_request(request)
            if held is not None:
                held.answer_ended()

    def _ask(self, question: str, max_new_tokens: float, request: gr.Request, context: str | None):
        with ExitStack() as held_answer:
            try:
                user = self._answerable_session(request, context)
                run = held_answer.enter_context(
                    self.app.door.answer(request_key(request), question, max_new_tokens, ANSWER_BUSY)
                )
            except ValueError as error:
                held = self.app.sessions.peek_request(request)
                # the chat without the question the click echoed
                yield AnswerView.refused(
                    refusal(error, "a question"), list(tab_view(held).chat) if held is not None else []
                )
                return
            yield from self._answer(user, run)

    def reference(self, request: gr.Request) -> Iterator[Any]:
        """The full-precision answer beside the last answer of this tab's session (`Door.reference`, at that answer's
        max_new_tokens; the page runs it after each answer, once the answer's lock is let go): said at once with its
        estimated time, then shown with where the two first differ. None for a cache that is full precision already,
        nor for an answer stopped or failed (Stop also ends the reference); after a refused question the line stays
        as it was."""
        user = self.app.sessions.peek_request(request)
        qa = user.qa if user is not None else None
        if user is None or qa is None or not qa.history or user.reference_due is None:
            yield views.KEEP  # no answer was given (a refusal beside Ask says why): the line stays
            return
        max_new_tokens, answer = user.reference_due, qa.history[-1]
        user.reference_due = None  # once per answer
        if not qa.spec.info.quantized:
            yield f"This cache is full precision (`{qa.spec.label}`): its answer is the reference."
            return
        if answer.finish_reason in ("stopped", "error"):
            ended = "was stopped" if answer.finish_reason == "stopped" else "failed"
            yield f"The answer {ended}: no full-precision answer beside it."
            return
        yield times.reference_estimate(qa)
        try:
            made = self.app.door.reference(request_key(request), answer.question, max_new_tokens)
        except PrefillStopped:
            yield "Stopped: no full-precision answer beside this one."
            return
        except ValueError as error:
            yield refusal(error, "the full-precision answer")
            return
        tokenizer = qa.loaded.tokenizer
        yield views.reference_line(answer, made, lambda tid: tokenizer.decode([tid]))

    def _answer(self, user: UserSession, run: AnswerRun) -> Iterator[AnswerView]:
        """The answer's updates, with the session's lock held (`Door.answer`)."""
        qa, question = run.session, run.question
        answered = len(qa.history)  # the answer is recorded once its stream closes (on a device, when its end came)
        view = tab_view(user)
        view.chat = view.chat + [
            {"role": "user", "content": question.text.strip()},
            {"role": "assistant", "content": "…"},
        ]
        view.events = []
        first_token = drawn_at = None
        # at once, before the question's own forward pass (seconds on a long context): what is happening
        yield AnswerView(
            chat=list(view.chat),
            stats=f"reading the question ({len(question.ids):,} tokens) on top of the {qa.cache_length:,}-token "
            "context…",
            step_plot=views.step_times([], streaming=True),  # drawn once, when the answer ends (`views.step_times`)
            speed_limit=views.speed_limit_after(qa.speed_limit(), []),  # the floor now, not the last step's
        )
        try:
            for event in _guarded(run, qa):
                if first_token is None:
                    first_token = event.elapsed
                view.events.append(event)
                view.chat = view.chat[:-1] + [{"role": "assistant", "content": event.text}]
                due = views.charts_due(event, drawn_at)  # at most 4 redraws a second, and at every flush
                drawn_at = event.elapsed if due else drawn_at
                yield AnswerView(
                    chat=view.chat,
                    stats=views.step_line(event, qa.spec),
                    memory_plot=views.memory_chart(view.events, qa.spec) if due else views.KEEP,
                    residual_plot=views.residual_chart(view.events, qa.spec) if due else views.KEEP,
                )
        finally:  # also a stopped, disconnected or failed answer: the session recorded it when its stream closed
            run.events.close()
            if len(qa.history) > answered:
                user.answers.append(dict(qa.history[-1].to_dict(), spec=views.table_spec(qa.spec)))
        if not view.events:
            view.chat[-1] = {"role": "assistant", "content": qa.history[-1].text}
        if qa.history[-1].finish_reason == "stopped":  # marked where the reader looks, not only in the line
            view.chat[-1] = {"role": "assistant", "content": f"{qa.history[-1].text} [stopped]"}
        view.answer_line = views.answer_stats(qa, first_token, view.events)
        user.reference_due = question.max_new_tokens  # the page's next event puts the full-precision one beside it
        yield AnswerView(
            chat=view.chat,
            stats=view.answer_line,
            memory_plot=views.memory_chart(view.events, qa.spec),
            residual_plot=views.residual_chart(view.events, qa.spec),
            step_plot=views.step_times(view.events),
            answers_table=views.answers_table(user.answers),
            speed_limit=views.speed_limit_after(qa.speed_limit(), view.events),
        )

    def stop(self, request: gr.Request) -> None:
        """Stop the answer streaming in this session after its current decode step (the cache is restored as
        after any answer, and the answer's last update says `stopped`), or the prefill running in it before its
        next chunk. (No output of its own: a reply racing the answer's last update could overwrite it.)"""
        self.app.door.stop(request_key(request))

    def before_answer(self, question: str, request: gr.Request) -> tuple[Any, Any, Any, str]:
        """(Ask, Stop, chat, the full-precision line) at an Ask click (or Enter), before the answer waits in the
        queue: the last answer's full-precision line emptied, Ask disabled, Stop
        enabled and applying to this answer from now (`UserSession.queue_answer`), and the question in the chat
        at once with a waiting reply, so that a queued user sees what they asked (when the answer is refused, its
        refusal puts the chat back)."""
        user = self.app.sessions.peek_request(request)
        chat: Any = views.KEEP
        if user is not None:
            user.queue_answer()
            if user.qa is not None and isinstance(question, str) and question.strip() and not user.lock.locked():
                chat = [
                    *tab_view(user).chat,
                    {"role": "user", "content": question.strip()},
                    {"role": "assistant", "content": "… waiting for the model"},
                ]
        return gr.update(interactive=False), gr.update(interactive=True), chat, ""

    def before_prefill(self, request: gr.Request) -> tuple[Any, Any]:
        """(Ask, Stop) at a Prefill click, before it waits in the queue: stop what runs in this session, disable
        Ask, enable Stop (it stops the prefill before its next chunk), and note the click's time (the prefill's
        line counts from it)."""
        try:
            user: UserSession | None = self.app.sessions.of_request(request)  # a first click too: its time counts
        except ValueError:  # a full server: the prefill says so
            user = None
        if user is not None:
            user.interrupt()
            user.prefill_clicked = time.monotonic()
        return gr.update(interactive=False), gr.update(interactive=True)

    def stop_state(self, request: gr.Request) -> Any:
        """Stop enabled only while a prefill or an answer runs or waits in this session."""
        user = self.app.sessions.peek_request(request)
        running = user is not None and (user.lock.locked() or user.answer_pending or user.prefilling is not None)
        return gr.update(interactive=running)

    def gate(self, context, backend, options: dict[str, Any], request: gr.Request) -> tuple[Any, Any, Any, Any]:
        """(prefill line, notice, Ask button, the line beside Ask) for what the page shows now: Ask is enabled only
        while the Context box and the options are exactly what the cache was prefilled with; otherwise the line
        says what differs, and `UserSession.page_shows` records the page so that `ask` refuses Enter in the question
        box (which the disabled button does not stop). Once the page matches again, a refusal beside Ask gives way
        to the last answer's line (`TabView.answer_line`). The page calls it through `page_event` (without
        progress: it runs outside the queue, before any queued answer), with a large Context box's fingerprint in
        place of its text (`context_box.sync_js`, compared by `page_state.same_context`)."""
        user, loaded = self.app.sessions.peek_request(request), self.app.loaded
        try:
            spec = spec_from_inputs(backend, options)
        except (ValueError, ImportError):
            spec = None
        if user is not None:
            user.page_shows = (context, spec)
        freed = self.app.sessions.freed_reason(request_key(request)) if user is None or user.qa is None else None
        line = page_state.page_line(user, context, spec, loaded, freed)
        if user is None or user.qa is None or not page_state.prefilled_matches(user, context, spec, loaded):
            return line, "", gr.update(interactive=False), views.KEEP
        idle = not (user.lock.locked() or user.answer_pending)  # a streaming answer keeps its own line
        return line, "", gr.update(interactive=True), tab_view(user).answer_line if idle else views.KEEP

    def gate_after_answer(self, context, backend, options: dict[str, Any], request: gr.Request) -> tuple[Any, ...]:
        """The gate's (prefill line, notice, Ask button) after an answer: the line beside Ask stays as the answer
        left it (its last line, or a refusal, which stays until the user acts again)."""
        return self.gate(context, backend, options, request)[:3]

    def after_model_load(self, context, backend, options: dict[str, Any], request: gr.Request) -> PrefillView:
        """What this tab shows after a Load: when the load switched the model (the server freed this tab's session,
        `App.load`), nothing of the old model's is left (chat, charts, answers, the line beside Ask), Ask is disabled
        and the line under Prefill says why; after a refused load or the same model, nothing changes."""
        user, loaded = self.app.sessions.peek_request(request), self.app.loaded
        freed = self.app.sessions.freed_reason(request_key(request))
        if (user is not None and user.qa is not None) or loaded is None or freed != switched_reason(loaded):
            return PrefillView()
        try:
            spec = spec_from_inputs(backend, options)
        except (ValueError, ImportError):
            spec = None
        return PrefillView.emptied(page_state.page_line(None, context, spec, loaded, freed), spec)

    def start_spec(self, saved: Any, request: gr.Request) -> list[Any]:
        """The backend, its option fields, its note, the recommendation's note and the fields' memory at the page's
        load and after a Load: the loaded model's recommended spec with the page's residual (`App.page_start`) and
        where it came from (`App.recommended`); unchanged where the browser kept the user's
        own (`page_state.restore` set them), where this tab holds a prefilled cache (the page shows the cache's
        spec), or where none is stored."""
        keep = [views.KEEP] * (len(GROUP_OPTIONS) + 4)
        user, found, shown = self.app.sessions.peek_request(request), self.app.recommended, self.app.page_start()
        if found is None or shown is None:
            return [*keep[:-2], "", views.KEEP]
        try:
            backend, values = session_box.spec_fields(shown)
        except ValueError:  # a pick the fields cannot show (none is stored so; a guard): the fixed start stays
            return [*keep[:-2], "", views.KEEP]
        note = views.recommended_note(found, shown)
        if (isinstance(saved, dict) and saved.get("backend")) or (user is not None and user.qa is not None):
            return [*keep[:-2], note, views.KEEP]
        *fields, backend_note = option_fields.backend_option_updates(backend, *values)
        start = dict([session_box.spec_fields(START_SPEC)])  # a click on the page's fixed start still gives its values
        return [backend, *fields, backend_note, note, {**start, backend: values}]

    def upload(self, path: str | None) -> tuple[Any, Any]:
        """(Context box, notice) for an uploaded file: its text, or a refusal beside Prefill (the box keeps
        its text)."""
        try:
            return read_upload(path), ""
        except ValueError as error:
            return gr.skip(), refusal(error, "an upload")

    @staticmethod
    def load_example(name: str) -> str:
        """The example's context for the text box (its questions follow the box: `example_questions`)."""
        return example(name)[0]

    def example_questions(self, context: str, request: gr.Request) -> Any:
        """The example-questions list for the Context box's text: the questions asked so far on it, or a shipped
        example's own questions; hidden for any other text, so that it never offers Normans' questions about
        another article. `context`: the box's text, or a large one's fingerprint (`context_box.wire`)."""
        user = self.app.sessions.peek_request(request)
        qa = user.qa if user is not None else None
        held = qa if qa is not None and page_state.same_context(context, qa.context) else None
        questions = suggested_questions(held, context)
        return gr.Dataset(samples=[[q] for q in questions], visible=bool(questions))

    # ---- the widgets and their events ---------------------------------------------------------------
    def wire(self, demo: gr.Blocks) -> None:
        """The tab's events. Prefills, answers and model loads share one queue group (`concurrency_id="model"`):
        `--concurrency` of them run at once across users. The gate (`AskTab.gate`) runs after every change of
        the Context box or the options, after a prefill and after an answer, so Ask is enabled only when the
        page shows what the cache holds."""
        w, model_work = self.w, {"concurrency_id": "model"}
        private: dict[str, Any] = {"api_visibility": "private", "queue": False}  # keywords of gradio's events
        fields = [w[name] for name in GROUP_OPTIONS]
        state_inputs = [w["context"], w["backend"], *fields]
        gate = {
            "fn": page_event(self.gate, progress=False),
            "inputs": [w["context_sent"], w["backend"], *fields],  # the box as sent: a large one's fingerprint
            "outputs": [w["prefill_info"], w["notice"], w["ask_button"], w["stats"]],
            **private,
        }
        after_answer = gate | {"fn": page_event(self.gate_after_answer, progress=False), "outputs": gate["outputs"][:3]}
        stop_state = {"fn": self.stop_state, "outputs": w["stop_button"], **private}
        # any change of the backend: the fields it takes shown, then the gate; a click on a backend: its defaults, or
        # what the user last set on it (`option_fields`); a reload or a session file writes the values itself
        memory = w["fields_memory"]
        w["backend"].input(
            option_fields.fields_for_backend,
            inputs=[w["backend"], memory],
            outputs=[*fields, w["backend_note"]],
            **private,
        )
        w["backend"].change(
            option_fields.fields_shown, inputs=w["backend"], outputs=[*fields, w["backend_note"]], **private
        ).then(**gate)
        for field_ in fields:
            field_.change(**gate)
            field_.change(option_fields.remember, inputs=[w["backend"], memory, *fields], outputs=memory, **private)
        restored = context_box.wire(self, demo, state_inputs, gate)  # the box: gate, questions, kept copy, upload, ...
        w["example_questions"].click(
            lambda sample: sample[0], inputs=w["example_questions"], outputs=w["question"], **private
        )
        # at the click, before the queue: Ask disabled while a prefill runs (a queued question would be answered on
        # the new cache), and this session's running prefill or answer stopped (the new prefill replaces it)
        w["prefill_button"].click(self.before_prefill, outputs=[w["ask_button"], w["stop_button"]], **private).then(
            page_event(self.prefill),
            inputs=state_inputs,
            outputs=[w[name] for name in PrefillView._fields],
            api_name="prefill",
            show_progress_on=w["notice"],  # the bar where the user looks (under Prefill), over no other text
            **model_work,
        ).then(**stop_state)
        answer_outputs = [w[name] for name in AnswerView._fields]
        # Ask is disabled while an answer streams; afterwards the gate decides
        for trigger, api in (
            (w["ask_button"].click, {"api_name": "ask"}),
            (w["question"].submit, {"api_visibility": "private"}),
        ):
            trigger(
                self.before_answer,
                inputs=w["question"],
                outputs=[w["ask_button"], w["stop_button"], w["chat"], w["reference"]],
                **private,
            ).then(
                self.ask,
                inputs=[w["question"], w["max_new_tokens"], w["context"]],
                outputs=answer_outputs,
                show_progress_on=w["chat"],  # the queue's place and the wait, once, over the chat
                **api,
                **model_work,
            ).then(**after_answer).then(
                self.reference,
                outputs=w["reference"],
                show_progress="hidden",  # the line itself says what runs and for about how long
                **({"api_name": "reference"} if "api_name" in api else {"api_visibility": "private"}),
                **model_work,
            ).then(**stop_state)
        w["stop_button"].click(self.stop, api_name="stop", queue=False)
        session_box.wire(self.app, w, self.before_prefill, stop_state)
        self.reopen = page_event(session_box.reopener(self.app, self.prefill))
        started = restored.then(self.start_spec, inputs=w["saved"], outputs=self._start_outputs(), **private)
        started.then(self.reopen, inputs=state_inputs, outputs=[w[name] for name in PrefillView._fields], **model_work)

    def _start_outputs(self) -> list[Any]:
        """What `start_spec` sets: the backend, its fields, its note, the recommendation's note, the fields' memory."""
        w = self.w
        fields = [w[name] for name in GROUP_OPTIONS]
        return [w["backend"], *fields, w["backend_note"], w["recommend_note"], w["fields_memory"]]

    def wire_model_load(self, load_event: Any) -> None:
        """After the model bar's Load (`load_event`, its click's event; after `wire`): this tab emptied of the old
        model's state (`after_model_load`), then the server's saved prefill of the page's text and spec on the new
        model reopened where there is one (`session_box.reopen`)."""
        w = self.w
        fields = [w[name] for name in GROUP_OPTIONS]
        outputs = [w[name] for name in PrefillView._fields]
        load_event.then(
            page_event(self.after_model_load, progress=False),
            inputs=[w["context_sent"], w["backend"], *fields],
            outputs=outputs,
            api_visibility="private",
            queue=False,
        ).then(
            self.start_spec, inputs=w["saved"], outputs=self._start_outputs(), api_visibility="private", queue=False
        ).then(
            self.reopen,
            inputs=[w["context"], w["backend"], *fields],
            outputs=outputs,
            api_visibility="private",
            concurrency_id="model",
        )


_SET_UP: set[tuple[int, str]] = set()
"""(model, backend) pairs whose cache this process has set up once: the first costs one-off work (a backend's
first use warms or compiles its kernels, the model's first pass allocates)."""
_SET_UP_LOCK = threading.Lock()


def _first_use(qa: Session) -> bool:
    """Whether `qa` is the first session of its model and backend in this process (then recorded)."""
    key = (id(qa.loaded), qa.spec.backend)
    with _SET_UP_LOCK:
        first = key not in _SET_UP
        _SET_UP.add(key)
    return first
