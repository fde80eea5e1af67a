"""The Recommend tab: which KV setting for the loaded model on the Ask tab's text (`kvdemo.compare.recommend`): every
candidate measured against `dynamic`, the frontier of bytes against KL as a chart and a table, the pick with its
deploy lines and why. It shares the Compare tab's long-job slot, Cancel and queue group; the user's own prefilled
cache is never touched."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import gradio as gr
import pandas as pd

from kvdemo.cache.deploy import ENGINES
from kvdemo.compare.candidates import ANY_ENGINE
from kvdemo.compare.recommend import DEFAULT_MAX_KL, check_target
from kvdemo.compare.recommendation import Recommendation, RecommendationCancelled
from kvdemo.serve.store import request_key
from kvdemo.ui import times, views
from kvdemo.ui.ask_tab import AskTab
from kvdemo.ui.inputs import refusal

_log = logging.getLogger(__name__)

BUSY = "A comparison, grid or recommendation is already running in this session; wait or press Cancel"


class RecommendView(NamedTuple):
    """What a recommendation shows, in the order of its outputs (`views.KEEP`: as it is)."""

    recommend_status: Any = views.KEEP
    pick: Any = views.KEEP
    frontier_plot: Any = views.KEEP
    recommend_table: Any = views.KEEP


CHART_CEILINGS = 4
"""The chart's KL axis ends at this many times the ceiling: a candidate above it is drawn on that edge, marked
`over the chart` (a 2-bit cache's KL of 3 nats would otherwise flatten every point near the ceiling)."""


def frontier_frame(found: Recommendation) -> pd.DataFrame:
    """The chart's points: every measured quantized candidate's bytes per token and KL (the full mean, else the lower
    bound a `bound` row proved; `dynamic`, at KL 0 and the most bytes, is left out so the axis fits the candidates),
    and which it is (`pick`, `frontier`, `measured`, `at least` for a bound, `over the chart`)."""
    frontier, top = {r.spec for r in found.frontier()}, CHART_CEILINGS * _ceiling(found)
    points = []
    for r in found.rows[1:]:  # `dynamic`'s row comes first
        if r.kl is None:
            continue
        kind = (
            "pick"
            if r.spec == found.pick
            else "over the chart"
            if r.kl > top
            else "frontier"
            if r.spec in frontier
            else "measured"
            if r.mean_kl is not None
            else "at least"
        )
        points.append({"spec": r.spec, "bytes per token": round(r.bytes_per_token[0]), "mean KL": min(r.kl, top),
                       "KL": r.kl, "point": kind, "how": r.measured})  # fmt: skip
    return pd.DataFrame(points, columns=["spec", "bytes per token", "mean KL", "KL", "point", "how"])


def _ceiling(found: Recommendation) -> float:
    """The KL the chart is scaled to: the ceiling, or the pick's KL under a byte budget."""
    if found.target == "max_kl":
        return found.limit
    return (found.picked.kl if found.picked is not None and found.picked.kl else None) or 0.02


def _view(found: Recommendation, status: str) -> RecommendView:
    picked = found.picked
    why = found.why.replace("*", "\\*")  # a plan's runs (k4v2h*12) are not emphasis
    lines = [f"### Pick: `{found.pick}`", why, *(f"- `{line}`" for line in picked.deploy)] if picked else []
    if found.plan:
        lines.append(f"\nPer-layer plan measured: `{found.plan}`")
    if found.weights:
        lines.append(f"\nWhat the weights say: {found.weights}.")
    lines.append(
        "\nThis holds for this model, this text and these questions: check the pick on another text in **Compare**."
    )
    return RecommendView(status, "\n".join(lines) if picked else "", frontier_frame(found), found.to_frame())


class RecommendTab:
    """The Recommend tab, sharing the Ask tab's sessions and the Compare tab's long-job slot."""

    def __init__(self, ask: AskTab):
        self.ask, self.app = ask, ask.app
        self.w: dict[str, Any] = {}

    def queued(self, request: gr.Request) -> str:
        """At the click, before the recommendation waits in the queue: from now on Cancel applies to it."""
        try:
            user = self.app.sessions.of_request(request)
        except ValueError as error:
            return refusal(error, "a recommendation")
        self.app.sessions.queue_long_job(user)
        return views.SUBMITTED.format(job="recommendation")

    def cancel_state(self, request: gr.Request) -> Any:
        """Cancel enabled only while a long job (this, a comparison or a grid) runs or waits in this session."""
        user = self.app.sessions.peek_request(request)
        return gr.update(interactive=user is not None and user.long_job_active)

    def run(
        self, context, questions_text, max_kl, engine, request: gr.Request, progress=gr.Progress()
    ) -> RecommendView:
        """Run `recommend` on the Context box's text; Cancel (the Compare tab's) keeps what was measured. A refusal
        is a message in the status line; the last results stay."""
        try:
            _, max_kl = check_target(max_kl, None)  # an emptied field: the default ceiling
            if not isinstance(context, str) or not context.strip():
                raise ValueError("the Context box is empty; paste or upload a text (or pick an example) in Ask")
            questions = [q.strip() for q in str(questions_text or "").splitlines() if q.strip()]
            with self.app.door.long_job(request_key(request), BUSY) as job:
                loaded = self.app.wait_for_model()
                tokens = len(loaded.prepare(context).ids)  # tokenized once more here: milliseconds
                estimate = times.recommend_estimate(self.app.recommended, loaded.name, tokens)
                progress(0, desc=f"Starting the recommendation{estimate}…")
                found = job.recommend(
                    context, questions, max_kl=max_kl, engine=str(engine),
                    on_progress=times.Paced(progress),
                )  # fmt: skip
                done = f"{len(found.rows)} candidates in {found.seconds:.0f} s on {found.context_tokens:,} tokens"
                return _view(found, f"Measured {done}.")
        except RecommendationCancelled as stopped:
            kept = stopped.recommendation
            return _view(kept, f"Cancelled: {len(kept.rows)} candidates measured so far, no pick.")
        except (ValueError, ImportError) as error:
            return RecommendView(recommend_status=refusal(error, "a recommendation"))
        except Exception as error:  # a fault inside a decode step: every session it used has restored
            _log.warning("a recommendation failed: %s: %s", type(error).__name__, error)
            return RecommendView(
                recommend_status=f"⚠ The recommendation failed ({type(error).__name__}); nothing else changed"
            )

    def build(self) -> None:
        """The tab's widgets, kept in `self.w`."""
        w = self.w
        gr.Markdown(
            "Which KV cache setting for **this model** on **your text** (the Ask tab's Context box): every candidate "
            "the registry gives for the engine you deploy with is measured against `dynamic` (teacher-forced KL on "
            "its answers, the same top token, the KL and perplexity of the text's held-out end, bytes per token), "
            "fewest bytes first: each until its own tokens prove it over the ceiling (`bound`: at least that KL, "
            "whatever the rest), or in full; the first within the ceiling is the pick. About a minute for a "
            "1,500-token text on 2 idle CPU cores with the embedded model."
        )
        with gr.Row():
            with gr.Column(scale=1, min_width=260):
                w["max_kl"] = gr.Number(
                    DEFAULT_MAX_KL, label="mean-KL ceiling (nats/token)", info="0.02: answers keep their sense"
                )
                w["engine"] = gr.Dropdown(
                    [ANY_ENGINE, *ENGINES], value=ANY_ENGINE, label="engine",
                    info="only settings this engine stores the same way",
                )  # fmt: skip
            with gr.Column(scale=2):
                w["questions"] = gr.Textbox(
                    label="questions, one per line (empty: taken from the text)", lines=3, placeholder="Who ...?"
                )
                with gr.Row():
                    w["button"] = gr.Button("Recommend", variant="primary")
                    w["cancel"] = gr.Button("Cancel", variant="stop", interactive=False)  # `cancel_state`
                # the run's progress bar, on a line of its own: drawn over the status line it covered its text
                w["recommend_progress"] = gr.Markdown("", min_height=60)
                w["recommend_status"] = gr.Markdown("")
        w["pick"] = gr.Markdown("")
        w["frontier_plot"] = gr.ScatterPlot(
            None, x="bytes per token", y="mean KL", color="point", title="Bytes against KL",
            x_title="KV bytes per context token", y_title="mean KL to dynamic (nats)", height=320,
            tooltip=["spec", "bytes per token", "KL", "how"], y_lim=[0, None],
            color_map={"pick": "#d62728", "frontier": "#1f77b4", "measured": "#b0b0b0", "at least": "#e0c080",
                       "over the chart": "#ff9896"},
        )  # fmt: skip
        w["recommend_table"] = gr.Dataframe(label="every candidate, by bytes", interactive=False, wrap=False)

    def wire(self) -> None:
        w = self.w
        private: dict[str, Any] = {"queue": False, "api_visibility": "private"}
        w["button"].click(
            self.queued, outputs=w["recommend_status"], concurrency_limit=None, api_visibility="private"
        ).then(self.cancel_state, outputs=w["cancel"], **private).then(
            self.run,
            inputs=[self.ask.w["context"], w["questions"], w["max_kl"], w["engine"]],
            outputs=[w[name] for name in RecommendView._fields],
            api_name="recommend",
            show_progress_on=w["recommend_progress"],  # one bar, under the buttons, over no text
            concurrency_limit=1,
            concurrency_id="compare",
        ).then(self.cancel_state, outputs=w["cancel"], **private)
        w["cancel"].click(self.cancel, api_name="cancel_recommend", concurrency_limit=None)

    def cancel(self, request: gr.Request) -> None:
        """Stop this session's recommendation after its current decode step; what was measured is shown."""
        views.acknowledge_cancel(
            self.app.sessions.cancel_long_job(self.app.sessions.peek_request(request)), "recommendation"
        )
