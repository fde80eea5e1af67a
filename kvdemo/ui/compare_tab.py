"""The Compare tab: the Ask tab's context and a list of questions run over several specs, one at a time in fresh
sessions (`kvdemo.compare.run`), with progress and Cancel; a table and two charts. `CompareTab` builds the widgets
and owns the handlers; the user's own prefilled cache is never touched."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, NamedTuple

import gradio as gr

from kvdemo.cache.catalogue import all_specs, default_compare_specs, defaults_for, examples
from kvdemo.cache.registry import BACKENDS, SPEC_OPTIONS
from kvdemo.charts.reports import DISPLAY_HELP
from kvdemo.compare.records import ComparisonCancelled, ComparisonReport
from kvdemo.evals.cases import continuation_for, gold_answers_for
from kvdemo.serve.store import request_key
from kvdemo.ui import times, views
from kvdemo.ui.ask_tab import AskTab
from kvdemo.ui.ask_widgets import START_SPEC
from kvdemo.ui.examples import suggested_questions
from kvdemo.ui.inputs import (
    COMPARE_MAX_NEW_TOKENS,
    COMPARE_MAX_PERPLEXITY_TOKENS,
    PLAN_BACKENDS,
    compare_inputs,
    perplexity_tokens,
    plan_request,
    refusal,
    user_errors,
)
from kvdemo.ui.tab_view import tab_view

_log = logging.getLogger(__name__)


class CompareView(NamedTuple):
    """What a comparison shows (`CompareTab.run`), in the order of its outputs; built by keyword, an output not
    named stays as it is on the page (`views.KEEP`)."""

    compare_status: Any = views.KEEP
    compare_table: Any = views.KEEP
    tradeoff_plot: Any = views.KEEP
    speed_plot: Any = views.KEEP
    files: Any = views.KEEP
    heatmap_spec: Any = views.KEEP
    heatmap_plot: Any = views.KEEP
    report: Any = views.KEEP
    answers_table: Any = views.KEEP

    @classmethod
    def refused(cls, message: str) -> CompareView:
        """A refusal: the message in the status line; the last table, charts and files stay."""
        return cls(compare_status=message)


def _view(report: ComparisonReport, note: str, load: tuple[float, float] | None = None) -> CompareView:
    """The outputs of a (possibly partial) report: table, charts, the CSV and JSON files, and the KV error heatmap
    of the quantized spec with the fewest bytes (the one whose error is largest to see). `load`: the 1-minute load
    average at the run's start and end (`views.comparison_outputs`)."""
    specs = [r.spec_text for r in report.results]
    quantized = [r for r in report.results if BACKENDS[r.backend].quantized]
    chosen = min(quantized, key=lambda r: r.kv_bytes).spec_text if quantized else (specs[0] if specs else None)
    files = views.comparison_files(report, tempfile.mkdtemp(prefix="kvdemo-compare-")) if report.results else None
    status, table, tradeoff, speed = views.comparison_outputs(report, note, load)
    return CompareView(
        compare_status=status,
        compare_table=table,
        tradeoff_plot=tradeoff,
        speed_plot=speed,
        files=files,
        heatmap_spec=gr.update(choices=specs, value=chosen),
        heatmap_plot=views.kv_error_plot(report, chosen),
        report=report,
        answers_table=report.answers_frame(),
    )


BUSY = "A comparison is already running in this session; wait or press Cancel"
"""The refusal of a second long job in one session (`SessionStore.long_job`)."""


class CompareTab:
    """The Compare tab, sharing the Ask tab's sessions (its Cancel and lock live in the same `UserSession`).

    Args:
        ask: the Ask tab (its session helpers and its Context box).
    """

    def __init__(self, ask: AskTab):
        self.ask = ask
        self.app = ask.app
        self.w: dict[str, Any] = {}

    @user_errors
    def fill_questions(self, context: str, request: gr.Request) -> str:
        """The questions asked so far in this session, or the example's questions."""
        user = self.app.sessions.peek_request(request)
        return "\n".join(suggested_questions(user.qa if user is not None else None, context))

    def queued(self, chosen, more, questions_text, max_new_tokens, request: gr.Request) -> str:
        """Runs at the click, before the comparison waits in the queue: bad input is refused here, beside the
        button (the last results stay on the page), and from now on Cancel applies to the run."""
        try:
            compare_inputs(chosen, more, questions_text, max_new_tokens)
            user = self.app.sessions.of_request(request)
        except ValueError as error:
            return refusal(error, "a comparison")
        self.app.sessions.queue_long_job(user)
        return views.SUBMITTED.format(job="comparison")

    def run(
        self,
        context,
        chosen,
        more,
        questions_text,
        max_new_tokens,
        request: gr.Request,
        perplexity=0,
        plan_base=PLAN_BACKENDS[0],
        plan_budget=0,
        progress=gr.Progress(),
    ) -> CompareView:
        """Run `kvdemo.compare.run` on the Context box's text and the questions, one spec at a time, in fresh
        sessions: this session's own cache is untouched. Cancel stops it at the next decode step. A refusal is
        a message in the status line; the last results stay."""
        began_load = os.getloadavg()[0]  # the speeds move with the machine's load: the chart says when it changed
        try:
            with self.app.door.long_job(request_key(request), BUSY) as job:
                left_out: list[str] = []
                loaded = self.app.loaded
                if loaded is not None and sorted(chosen or []) == sorted(s.text for s in default_compare_specs()):
                    kept, left_out = defaults_for(loaded.config)  # the defaults this model serves
                    chosen = [s.text for s in kept]
                specs, questions, max_new_tokens = compare_inputs(chosen, more, questions_text, max_new_tokens)
                ppl_tokens = perplexity_tokens(perplexity)
                plans = plan_request(plan_base, plan_budget)
                golds = gold_answers_for(context, questions)
                user = self.app.sessions.peek_request(request)
                qa, events = (user.qa, tab_view(user).events) if user is not None else (None, [])
                estimate = times.compare_estimate(len(specs) + len(plans), len(questions), max_new_tokens, qa, events)
                progress(0, desc=f"Starting the comparison{estimate}…")
                report = job.compare(
                    context,
                    questions,
                    specs,
                    max_new_tokens,
                    golds,
                    perplexity_tokens=ppl_tokens,
                    continuation=continuation_for(context) if ppl_tokens else None,
                    plans=plans,
                    on_progress=times.Paced(progress),
                )
                plural = "s" if len(questions) > 1 else ""
                note = f"Compared {len(report.results)} specs on {len(questions)} question{plural}"
                note += (
                    " (scored against the example's gold answers)." if golds else " (no gold answers for this text)."
                )
                note += "".join(f"\n\nPer-layer plan: `{line}`" for line in report.plans)
                note += "".join(f"\n\n⚠ A default spec {line}" for line in left_out)
                return _view(report, note, (began_load, os.getloadavg()[0]))
        except ComparisonCancelled as cancelled:
            note = f"Cancelled after {len(cancelled.report.results)} spec(s)."
            return _view(cancelled.report, note, (began_load, os.getloadavg()[0]))
        except (ValueError, ImportError) as error:
            return CompareView.refused(refusal(error, "a comparison"))
        except Exception as error:  # a fault inside a decode step: every session it used has restored
            _log.warning("a comparison failed: %s: %s", type(error).__name__, error)
            return CompareView.refused(
                f"⚠ The comparison failed ({type(error).__name__}: {str(error)[:200]}); your own session is untouched"
            )

    def start_more(self, more: str) -> Any:
        """The "more specs" box at the page's load and after a model Load: the Ask tab's starting spec for the model
        loaded (`App.page_start`, else `START_SPEC`), so that the default comparison includes what the Ask tab starts
        on; what the user typed stays."""
        if isinstance(more, str) and more.strip():
            return views.KEEP
        return (self.app.page_start() or START_SPEC).text

    def cancel_state(self, request: gr.Request) -> Any:
        """Cancel enabled only while a comparison or a grid runs or waits in this session (before a click and after
        the run, a red enabled button would offer to cancel nothing)."""
        user = self.app.sessions.peek_request(request)
        return gr.update(interactive=user is not None and user.long_job_active)

    def cancel(self, request: gr.Request) -> None:
        """Cancel this session's comparison at its next decode step (it returns what finished), also while
        it still waits in the queue; does nothing when none is running or waiting."""
        views.acknowledge_cancel(
            self.app.sessions.cancel_long_job(self.app.sessions.peek_request(request)), "comparison"
        )

    def build(self) -> None:
        """The tab's widgets (inside a `gr.Blocks` and `gr.Tab` context), kept in `self.w` by name."""
        gr.Markdown(
            "Run the text in the **Context** box and the questions below over several KV cache backends, one at "
            "a time, each in a fresh cache (your own prefilled cache is untouched): memory, fidelity against "
            "`dynamic` (identical answers, KL divergence teacher-forced on `dynamic`'s answer) and against the "
            "gold answers of the examples, and speed. About 2 × (questions × max_new_tokens) decode steps per spec."
        )
        self._build_inputs()
        self._build_results()

    def _build_inputs(self) -> None:
        """The questions with the buttons and the status line under them, beside the numbers and the specs (the
        checkboxes folded: a comparison's results come right under the status line, in view after a run)."""
        w = self.w
        defaults = {
            name: opt.default for b in BACKENDS.values() for name, opt in b.options.items() if opt.canonical is None
        }  # not the plan: none by default, and written per model (below, Per-layer plan)
        chosen = [s.text for s in default_compare_specs()]
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                w["questions"] = gr.Textbox(
                    label="questions, one per line", lines=4, placeholder="Who was the Norse leader?"
                )
                with gr.Row():
                    w["fill_button"] = gr.Button("Fill in questions (asked so far, or the example's)", size="sm")
                    w["compare_button"] = gr.Button("Run comparison", variant="primary")
                    w["cancel_button"] = gr.Button("Cancel", variant="stop", interactive=False)  # `cancel_state`
                # the run's progress bar, on a line of its own: drawn over the status line it covered its text
                w["compare_progress"] = gr.Markdown("", min_height=60)
                w["compare_status"] = gr.Markdown("")  # right under the buttons: progress, refusals, the summary
            with gr.Column(scale=2, min_width=320):
                w["more"] = gr.Textbox(
                    label="more specs, one per line",
                    lines=2,
                    placeholder="\n".join(examples("more")),
                    info="the Ask tab's starting spec at the page's load; backend[:nbits][,option=value...]; "
                    "options " + ", ".join(name for name in SPEC_OPTIONS if name != "nbits"),
                )
                with gr.Row():
                    # no precision or bounds on the numbers: `compare_inputs` and `perplexity_tokens` refuse what
                    # Gradio would round silently or refuse with a bare "Error", and say what to change
                    w["max_new_tokens"] = gr.Number(
                        32, label="max_new_tokens", info=f"1 to {COMPARE_MAX_NEW_TOKENS} tokens per answer"
                    )
                    w["perplexity"] = gr.Number(
                        0,
                        label="perplexity tokens",
                        info=f"0 to {COMPARE_MAX_PERPLEXITY_TOKENS}. 0: none. N > 0: read N tokens of the text that "
                        "follows (an example's next paragraphs, or the tail of your text) one decode step at a time "
                        "through each cache: perplexity and its ratio to dynamic",
                    )
                with gr.Accordion(f"specs to compare: {', '.join(chosen)} (change)", open=False):
                    w["choice"] = gr.CheckboxGroup(
                        [s.text for s in all_specs()],
                        value=chosen,
                        label="specs",
                        info="backend:nbits; other options at their defaults ("
                        + ", ".join(f"{k} {v}" for k, v in defaults.items() if k != "nbits")
                        + ")",
                    )
                with gr.Accordion("Per-layer plan", open=False):
                    w["plan_base"] = gr.Dropdown(
                        list(PLAN_BACKENDS),
                        value=PLAN_BACKENDS[0],
                        label="plan backend",
                        allow_custom_value=True,  # a base with options: hqq,q_group_size=32
                        info="its options (q_group_size, residual_length, flush...) stay; the plan gives each layer "
                        "its key bits, value bits and rotation",
                    )
                    w["plan_budget"] = gr.Number(
                        0,
                        label="plan budget (bytes per token)",
                        info="0: no plan. B > 0: choose, on this context, the per-layer plan of least measured "
                        "attention error within B bytes per quantized token, and compare it beside the best "
                        "uniform spec within B (embedded model: quanto:2 4,320, quanto:4,nbits_value=2 5,760, "
                        "quanto:4 7,200). One more full-precision prefill and a measure: 12 s (quanto) or 47 s "
                        "(hqq) at 1,341 tokens, growing with the text",
                    )

    def _build_results(self) -> None:
        """The table and its files, the tradeoff and speed plots, the KV error heatmap."""
        w = self.w
        # not wrapped: a narrow column would break its header mid-word ("bytes/to ken"); the table scrolls
        table, answers = views.empty_comparison()  # the headers a comparison fills, not "1 2 3"
        w["compare_table"] = gr.Dataframe(
            table, label="comparison (memory · fidelity against dynamic · speed)", interactive=False, wrap=False
        )
        w["answers_table"] = gr.Dataframe(
            answers,
            label="the answers side by side: each spec's after dynamic's, and where it first departs from it "
            "(the token, and the log-probability of each answer's token under each cache)",
            interactive=False,
            wrap=True,
            column_widths=["16%", "12%", "30%", "12%", "30%"],
        )
        with gr.Accordion("What each column means", open=False):
            gr.Markdown("\n".join(f"- **{name}**: {text}" for name, text in DISPLAY_HELP.items()))
        w["files"] = gr.File(
            label="the full table (CSV) and the whole report (JSON, as the CLI's --json)",
            file_count="multiple",
            interactive=False,
            height=100,
        )
        w["report"] = gr.State(None)
        with gr.Row():
            w["tradeoff_plot"] = gr.ScatterPlot(
                None,
                x="bytes per token",
                y="KL (nats)",
                color="spec",  # each point named in the legend, not only its backend
                title="Memory against fidelity",
                x_title="KV bytes per context token",
                y_title="mean KL to dynamic (nats)",
                height=300,
                tooltip=["spec", "bytes per token", "KL (nats)", "identical", "contains gold"],
            )
            w["speed_plot"] = gr.BarPlot(
                None,
                x="spec",
                y="tokens/s",
                title="Decode speed",
                x_title="spec",
                y_title="tokens/s (median)",
                height=300,
                tooltip=["spec", "tokens/s", "flush s"],
                sort="-y",
                y_lim=[0, None],
                x_label_angle=-35,  # spec names side by side would overlap
            )
        with gr.Row():
            w["heatmap_spec"] = gr.Dropdown(
                [],
                label="where the error sits: spec",
                scale=1,
                info="relative error ||K - K^|| / ||K|| per layer and KV head after the "
                "prefill, against dynamic's keys and values",
            )
            w["heatmap_plot"] = gr.Plot(label="relative KV error per layer and KV head", scale=3, show_label=False)

    def wire(self) -> None:
        """The tab's events: one comparison at a time across users (minutes of CPU); answers keep their own
        queue slots."""
        w = self.w
        settings = [w["choice"], w["more"], w["questions"], w["max_new_tokens"]]
        w["fill_button"].click(
            self.fill_questions,
            inputs=self.ask.w["context"],
            outputs=w["questions"],
            api_name="compare_questions",
            queue=False,
        )
        w["compare_button"].click(
            self.queued,
            inputs=settings,
            outputs=w["compare_status"],
            concurrency_limit=None,
            api_visibility="private",  # never waits in the queue: it answers at once
        ).then(self.cancel_state, outputs=w["cancel_button"], queue=False, api_visibility="private").then(
            self.run,
            inputs=[self.ask.w["context"], *settings, w["perplexity"], w["plan_base"], w["plan_budget"]],
            outputs=[w[name] for name in CompareView._fields],
            api_name="compare",
            show_progress_on=w["compare_progress"],  # one bar, under the buttons, over no text
            concurrency_limit=1,
            concurrency_id="compare",
        ).then(self.cancel_state, outputs=w["cancel_button"], queue=False, api_visibility="private")
        w["cancel_button"].click(
            self.cancel, api_name="cancel_compare", concurrency_limit=None
        )  # at once, with a toast
        w["heatmap_spec"].change(
            views.kv_error_plot,
            inputs=[w["report"], w["heatmap_spec"]],
            outputs=w["heatmap_plot"],
            api_visibility="private",
        )
