"""The Needle tab: a needle-in-a-haystack grid (`kvdemo.needle.grid`) over chosen specs, context lengths and depths,
with progress and Cancel; one heatmap per spec for the hit and for the graded score, the table, and the grid as
CSV and JSON. It shares the Compare tab's queue group (one long job at a time across users), the session's Cancel
and lock, and the server's KV budget."""

from __future__ import annotations

import tempfile
from typing import Any, NamedTuple

import gradio as gr

from kvdemo import checks
from kvdemo.cache.catalogue import all_specs
from kvdemo.cache.spec import CacheSpec
from kvdemo.charts.needle import needle_heatmap_figure
from kvdemo.needle import grid as needle
from kvdemo.needle import records as needle_records
from kvdemo.needle.inputs import DEFAULT_MAX_NEW_TOKENS, DEFAULT_SPECS, parse_depths, parse_lengths
from kvdemo.serve.store import request_key
from kvdemo.ui import times, views
from kvdemo.ui.ask_tab import AskTab
from kvdemo.ui.inputs import NEEDLE_MAX_NEW_TOKENS, refusal

QUICK_LENGTHS, QUICK_DEPTHS = "512,1024", "0,50,100"
"""The tab's starting grid: a few minutes on 2 CPU cores for two specs."""


class NeedleView(NamedTuple):
    """What a grid shows (`NeedleTab.run`), in the order of its outputs; built by keyword, an output not named
    stays as it is on the page (`views.KEEP`)."""

    needle_status: Any = views.KEEP
    needle_table: Any = views.KEEP
    score_plot: Any = views.KEEP
    hit_plot: Any = views.KEEP
    needle_files: Any = views.KEEP

    @classmethod
    def refused(cls, message: str) -> NeedleView:
        """A refusal: the message in the status line; the last grid stays."""
        return cls(needle_status=message)


def _view(grid: needle_records.NeedleGrid, note: str) -> NeedleView:
    """The outputs of a (possibly partial) grid; the note says how many misses `max_new_tokens` ended."""
    table = grid.to_frame()
    cut = [c for c in grid.cells if c.cut]
    if cut:
        where = ", ".join(dict.fromkeys(c.spec_text for c in cut))
        note += (
            f" ⚠ {len(cut):,} miss(es) ({where}) ended at max_new_tokens={grid.max_new_tokens} (marked `cut`): the "
            "number may not have had room to appear; the score still says whether the model knew it. Raise "
            "max_new_tokens to tell."
        )
    if table.empty:
        return NeedleView(needle_status=note, needle_table=table, score_plot=None, hit_plot=None, needle_files=None)
    files = list(map(str, grid.write(tempfile.mkdtemp(prefix="kvdemo-needle-"))))
    return NeedleView(
        needle_status=note,
        needle_table=grid.summary_frame(),
        score_plot=needle_heatmap_figure(table, value="score"),
        hit_plot=needle_heatmap_figure(table, value="hit"),
        needle_files=files,
    )


BUSY = "A comparison or a grid is already running in this session; wait or press Cancel"
"""The refusal of a second long job in one session (`SessionStore.long_job`)."""


class NeedleTab:
    """The Needle tab over the Ask tab's sessions (`UserSession.compare_lock` and `compare_cancel` serve every
    long job of a session: a comparison or a grid).

    Args:
        ask: the Ask tab (its session helpers).
    """

    def __init__(self, ask: AskTab):
        self.ask = ask
        self.app = ask.app
        self.w: dict[str, Any] = {}

    def queued(self, request: gr.Request) -> str:
        """At the click, before the grid waits in the queue: from now on Cancel applies to it."""
        try:
            user = self.app.sessions.of_request(request)
        except ValueError as error:
            return refusal(error, "a needle grid")
        self.app.sessions.queue_long_job(user)
        return views.SUBMITTED.format(job="long job (a comparison or a grid)")

    def run(
        self,
        specs,
        lengths,
        depths,
        seed,
        max_new_tokens,
        request: gr.Request,
        one_needle: bool = True,
        progress=gr.Progress(),
    ) -> NeedleView:
        """Run `kvdemo.needle.grid.needle_grid` with the tab's settings; Cancel stops it at the next decode step and
        shows the cells finished. `one_needle`: one needle per prefill (the standard test); False: every depth's
        needle in one prefill per length. A refusal is a message in the status line; the last grid stays."""
        try:
            with self.app.door.long_job(request_key(request), BUSY) as job:
                loaded = self.app.wait_for_model()
                chosen, token_lengths, token_depths = (
                    [CacheSpec.parse(s) for s in specs or []],
                    parse_lengths(lengths or ""),
                    parse_depths(depths or ""),
                )
                answer_tokens = checks.max_new_tokens(
                    DEFAULT_MAX_NEW_TOKENS if max_new_tokens in (None, "") else max_new_tokens,
                    NEEDLE_MAX_NEW_TOKENS,
                    what="a needle grid",
                )
                needle_seed = int(seed or 0)
                needed = needle.answer_tokens_needed(loaded, token_lengths, token_depths, seed=needle_seed)
                if answer_tokens < needed:
                    raise ValueError(
                        f"max_new_tokens={answer_tokens} cannot hold the answer: the needle's own sentence "
                        f"takes {needed} tokens, so every cell would miss; set max_new_tokens to at least "
                        f"{needed} ({DEFAULT_MAX_NEW_TOKENS} leaves room for the model's wording)"
                    )
                grid = job.needle(
                    chosen,
                    token_lengths,
                    token_depths,
                    answer_tokens,
                    needles_per_context=1 if one_needle else None,
                    seed=needle_seed,
                    on_progress=times.Paced(progress),
                )
                return _view(grid, f"{len(grid.cells):,} cells in {grid.seconds:,.0f} s on {grid.device}.")
        except needle_records.NeedleCancelled as cancelled:
            return _view(cancelled.grid, f"Cancelled after {len(cancelled.grid.cells):,} cells.")
        except (ValueError, ImportError, TypeError) as error:
            return NeedleView.refused(refusal(error, "a needle grid"))

    def build(self) -> None:
        """The tab's widgets (inside a `gr.Blocks` and `gr.Tab` context), kept in `self.w` by name."""
        w = self.w
        gr.Markdown(
            "A short fact (the **needle**: an invented name and a 6-digit number) hidden at several **depths** of "
            "real text (SQuAD articles) cut to several **lengths** in tokens; the model is asked for the number. "
            "Per cell: **hit** (the answer holds the number) and a graded **score**, the log-probability of the "
            "number teacher-forced after the question (higher is better; it separates caches when the model "
            "misses). Each needle gets its own prefill (or, unticked below, one prefill per length holds every "
            "depth's needle); each question is answered on the restored cache."
        )
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                w["specs"] = gr.CheckboxGroup(
                    [s.text for s in all_specs()], value=list(DEFAULT_SPECS[:2]), label="specs"
                )
                w["seed"] = gr.Number(0, label="seed (draws the needles)", precision=0)
                w["one_needle"] = gr.Checkbox(
                    True,
                    label="one needle per prefill",
                    info="the standard test; off: every depth's needle in one prefill per length (fewer "
                    "prefills, but the model may answer with another needle's number)",
                )
                w["max_new_tokens"] = gr.Number(  # no bounds: `run` refuses a bad value beside the button
                    DEFAULT_MAX_NEW_TOKENS,
                    label="max_new_tokens",
                    info=f"tokens per answer, up to {NEEDLE_MAX_NEW_TOKENS}: enough to state the number "
                    "(about 18 tokens) in the model's own words",
                )
            with gr.Column(scale=2):
                w["lengths"] = gr.Textbox(
                    QUICK_LENGTHS,
                    label="context lengths (tokens)",
                    info="comma-separated, e.g. 1024,2048,4096,7936 (the model's window "
                    "less room for the question and the answer)",
                )
                w["depths"] = gr.Textbox(QUICK_DEPTHS, label="depths (%)", info="comma-separated, 0 to 100")
                with gr.Row():
                    w["run_button"] = gr.Button("Run grid", variant="primary")
                    w["cancel_button"] = gr.Button("Cancel", variant="stop", interactive=False)  # `cancel_state`
                # the run's progress bar, on a line of its own: drawn over the status line it covered its text
                w["needle_progress"] = gr.Markdown("", min_height=60)
                w["needle_status"] = gr.Markdown("")  # right under the buttons: progress, refusals, the summary
        with gr.Row():
            # the figures carry their own titles; Gradio's label would be drawn over them
            w["score_plot"] = gr.Plot(label="graded score: log P(number) per depth and length", show_label=False)
            w["hit_plot"] = gr.Plot(label="hit: the answer holds the number", show_label=False)
        w["needle_table"] = gr.Dataframe(label="per spec and length", interactive=False, wrap=True)
        w["needle_files"] = gr.File(
            label="every cell (CSV) and the whole grid (JSON)", file_count="multiple", interactive=False, height=100
        )

    def wire(self) -> None:
        """The tab's events: the grid shares the comparisons' queue group (one long job at a time)."""
        w = self.w
        w["run_button"].click(
            self.queued, outputs=w["needle_status"], concurrency_limit=None, api_visibility="private"
        ).then(self.cancel_state, outputs=w["cancel_button"], queue=False, api_visibility="private").then(
            self.run,
            inputs=[w["specs"], w["lengths"], w["depths"], w["seed"], w["max_new_tokens"], w["one_needle"]],
            outputs=[w[name] for name in NeedleView._fields],
            api_name="needle",
            show_progress_on=w["needle_progress"],  # one bar, under the buttons, over no text
            concurrency_limit=1,
            concurrency_id="compare",
        ).then(self.cancel_state, outputs=w["cancel_button"], queue=False, api_visibility="private")
        w["cancel_button"].click(self.cancel, api_name="cancel_needle", concurrency_limit=None)  # at once, with a toast

    def cancel_state(self, request: gr.Request) -> Any:
        """Cancel enabled only while a grid or a comparison runs or waits in this session."""
        user = self.app.sessions.peek_request(request)
        return gr.update(interactive=user is not None and user.long_job_active)

    def cancel(self, request: gr.Request) -> None:
        """Cancel this session's grid at its next decode step; does nothing when none runs or waits."""
        views.acknowledge_cancel(
            self.app.sessions.cancel_long_job(self.app.sessions.peek_request(request)), "needle grid"
        )
