"""Pure display functions of the page: status lines, option-field updates, chart frames with every series,
the comparison's outputs. They read records and the registry, never a live cache, and are tested directly."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from kvdemo.cache.model.geometry import element_size
from kvdemo.cache.registry import BASELINE
from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state.budget import held_bytes_estimate
from kvdemo.cache.state.speedlimit import SpeedLimit
from kvdemo.charts.reports import comparison_display_frame, kv_error_figure, speed_frame, tradeoff_frame
from kvdemo.charts.steps import (
    answers_frame,
    flush_timing,
    memory_frame,
    memory_series,
    residual_frame,
    residual_layer,
    step_time_figure,
)
from kvdemo.compare.recommendation import Recommendation
from kvdemo.compare.records import ComparisonReport
from kvdemo.evals.metrics import common_prefix
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.records import Answer
from kvdemo.qa.session import Session
from kvdemo.serve.runs import FullPrecisionAnswer
from kvdemo.serve.session_files import SAVED_COPY

EXPLAINER = """
**Prefill.** The model reads your whole context once and stores, for every layer, a *key* and a *value*
vector per token: the **KV cache**. Answers are generated on top of it, one **decode step** per token,
without reading the context again.

**Quantized cache.** `quanto`, `hqq` and `turboquant` store the cache in 1-8 bit integers (`nbits`; `nbits_value`
for the values alone), `ggml` in llama.cpp's blocks (`type_k`/`type_v`: q8_0, q4_0, ...), `fp8` in 8-bit floats.
The **memory chart** shows the bytes really held against what full precision would hold; the line under Prefill
gives the ratio to this machine's dtype (float32 on a CPU) and to f16, the engines' default, and the most the
session holds during an answer.

**Residual and flush.** `quanto`, `hqq` and `turboquant` keep the newest tokens in full precision, the
**residual**. When it reaches `residual_length` tokens, the layer **flushes** and the residual empties: with
`flush=requantize` (transformers') the whole layer is de-quantized, joined with the residual and quantized
again; with `flush=append` (KIVI's way) only the residual block is quantized and appended. The **residual chart**
shows the sawtooth; the step-time chart marks each flush step. The page starts at `residual_length=16` so that the
first answer flushes; `fp8` and `ggml` have no residual (every token is quantized as it is written).

**Full precision beside it.** After each answer the page asks the same question of a `dynamic` (full-precision)
cache of the same text, once per question, and says where the two answers first differ: the cache's fault, not the
model's.

**Storage of `dynamic`.** transformers' `DynamicCache` (`storage=concat`) copies the whole cache into a new
tensor at every decode step; `storage=growing` writes only the new token into spare room it keeps (counted in
the memory chart), so no step copies the cache (attention still reads all of it at every step).

**Restore.** After every answer the cache is put back exactly as it was after the prefill (the same
tensors, no copy), so each question sees the context and nothing else, and gets the answer a fresh
single-question run would give. `cache length after restore = N (context)` shows it after each answer.
"""

KEEP = gr.skip()
"""The update that leaves an output as the page shows it (Gradio's `gr.skip()`): the default of every field of the
tabs' views (`PrefillView`, `AnswerView`, `CompareView`, `NeedleView`), one object."""


SUBMITTED = (
    "Submitted. One {job} runs at a time on this server: the bar shows this one's place in the queue while it "
    "waits, then its progress."
)
"""What a long job's status says at the click (Compare, Needle): true whether it waits or starts at once (the bar
that Gradio draws over the status tells which; a "Queued" line stayed under a running job's progress)."""


def acknowledge_cancel(cancelled: bool, job: str) -> None:
    """A toast at a Cancel click (`gr.Info`: the event must be queued, with no concurrency limit, so that it runs at
    once): that the session's `job` stops after the prefill chunk or decode step now running (about a second) and
    shows what finished, or that there was nothing to cancel."""
    if cancelled:
        gr.Info(
            f"Cancelling the {job}: it stops after the prefill chunk or decode step now running and shows what "
            "finished."
        )
    else:
        gr.Info(f"No {job} is running or waiting in this session: nothing to cancel.")


def model_status(loaded: LoadedModel) -> str:
    """The model's status line."""
    d = loaded.describe()
    kinds = "" if d["layer_kinds"] == f"{d['layers']} full_attention layers" else f" ({d['layer_kinds']})"
    by_kind = d["cache_by_kind"]
    if by_kind["kept"] != "none" and by_kind["quantized"] != "none":  # what a quantized backend shrinks, by context
        shares = ", ".join(f"{share:.0%} at {tokens:,}" for tokens, share in by_kind["quantized_share"].items())
        kinds += f" · a quantized backend shrinks its {by_kind['quantized']} ({shares} tokens of a full cache)"
    shape = (
        f"latent cache (MLA): width {d['head_dim']} and a rotary part"
        if d["latent"]
        else f"{d['kv_heads']} KV heads · head_dim {d['head_dim']}"
    )
    return (
        f"**{d['name']}** · {d['parameters'] / 1e6:.0f} M parameters · {d['layers']} layers{kinds} · "
        f"{shape} · max context {d['max_context_tokens']:,} tokens · {d['device']} · {d['dtype']}"
    )


def prefill_summary(qa: Session, timing: str = "") -> str:
    """The summary shown after a prefill (`timing`, what `from_click` says, after its time), and below it what the
    prompt check found (`PrefillReport.prompt_note`) and which date the chat template writes
    (`PrefillReport.clock_note`), where either applies."""
    r = qa.prefill_report
    assert r is not None  # shown after a prefill
    notes = [f"\n\n{note}." for note in (r.prompt_note and f"Prompt check: {r.prompt_note}", r.clock_note) if note]
    source = r.opened_from if r.opened_from in (None, SAVED_COPY) else f"the session file `{r.opened_from}`"
    done = f"Prefilled **{r.context_tokens:,} tokens** in {r.seconds:.2f} s" if source is None else (
        f"Opened **{r.context_tokens:,} prefilled tokens** from {source} in {r.seconds:.2f} s (its prefill took "
        f"{r.prefill_seconds or 0:.2f} s)"
    )  # fmt: skip
    kept = r.memory.kept_bytes
    kept_part = ""
    if kept and qa.spec.info.quantized:  # sliding windows, states: what the quantized backend leaves as it is
        kept_part = f", of which {kept / 2**20:.2f} MiB in layers kept at full precision"
    return (
        f"{done} with **{qa.spec.label}**{timing} · "
        f"KV cache {r.kv_bytes / 2**20:.2f} MiB ({r.bytes_per_token:,.0f} bytes/token{kept_part}) · "
        f"{memory_against_full(qa)}\n\n{deploy_text(r.deploy)}" + (f"\n\n{r.decode_read}." if r.decode_read else "")
    ) + "".join(notes)


def memory_against_full(qa: Session) -> str:
    """The prefilled cache's bytes against full precision, each ratio naming its baseline: the model's own dtype
    (float32 on a CPU) and, where that is wider, f16, the default cache of llama.cpp and vLLM; then the most the
    session holds during an answer of its reserve (`QASession.reserve_tokens`: a question and `max_new_tokens`):
    the cache grown by it plus the snapshot's post-prefill copies the restore puts back
    (`kvdemo.cache.state.budget.held_bytes_estimate`, the estimate the server's KV account reserves)."""
    r = qa.prefill_report
    assert r is not None  # shown after a prefill
    loaded = qa.loaded
    width = element_size(loaded.dtype)
    own = str(loaded.dtype).removeprefix("torch.")
    parts = [
        f"**{r.ratio_to_full_precision:.3f}×** a {own} cache "
        f"({r.full_precision_bytes / 2**20:.2f} MiB, this model's dtype)"
    ]
    if width > 2:
        f16 = r.full_precision_bytes * 2 / width
        parts.append(f"**{r.kv_bytes / f16:.3f}×** an f16 one ({f16 / 2**20:.2f} MiB, the engines' default cache)")
    peak = held_bytes_estimate(qa.spec, loaded.config, loaded.dtype, r.context_tokens, qa.reserve_tokens)
    copies = " plus the snapshot's post-prefill copies" if qa.spec.info.quantized else ""
    parts.append(
        f"**up to {peak / 2**20:.2f} MiB during an answer** (the cache grown by {qa.reserve_tokens} tokens of "
        f"question and answer{copies})"
    )
    return " · ".join(parts)


def deploy_text(lines: tuple[str, ...]) -> str:
    """The engines that store this cache the same way (`PrefillReport.deploy`), for the page: `Deploy: `llama.cpp:
    llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on``; kvdemo's own line is left out, and where it is the
    only one, the page says so."""
    engines = [line for line in lines if not line.startswith("kvdemo:")]
    if not engines:
        return "Deploy: kvdemo only (no engine stores this cache byte for byte)"
    return "Deploy: " + " · ".join(f"`{line}`" for line in engines)


def prefilled_tokens(qa: Session) -> int:
    """The tokens `qa` prefilled (a tab keeps its session's `qa` once it has prefilled)."""
    assert qa.prefill_report is not None
    return qa.prefill_report.context_tokens


def answer_stats(qa: Session, first_token_seconds: float | None, events: list | None = None) -> str:
    """The line shown after an answer: tokens, the question's own pass apart from the decode speed, flushes
    (those of the decode steps apart from the question pass's, which the step-time chart marks as its first
    point; with the time per flush step, from the answer's `StepEvent`s), and the cache length after the
    restore."""
    a = qa.history[-1]
    context = prefilled_tokens(qa)
    parts = [
        f"{len(a.token_ids):,} token{'' if len(a.token_ids) == 1 else 's'}",
        f"question pass {a.question_seconds:,.2f} s ({a.question_tokens:,} tokens, {a.question_flushes:,} flushes)",
        f"decode {a.decode_tokens_per_second:,.1f} tokens/s" if len(a.token_ids) > 1 else "no decode step",
        f"{a.flush_count - a.question_flushes:,} flushes in decode steps, "
        # per layer that flushes: the quantized ones (a sliding window kept at full precision never flushes)
        f"{a.flush_count:,} in all ({a.flush_count // max(sum(1 for f in a.flushes if f), 1):,} per layer)",
    ]
    if events:
        steps, flush_s, other_s = flush_timing(events)
        if steps and flush_s is not None:
            against = f" vs {other_s * 1000:,.0f} ms per other step" if other_s is not None else ""
            parts.append(f"{steps:,} flush step(s), {flush_s * 1000:,.0f} ms each (median){against}")
    if a.finish_reason == "stopped":
        parts.append("stopped")
    restored = "context" if a.cache_length_after == context else f"MISMATCH: context is {context:,}"
    parts.append(f"**cache length after restore = {a.cache_length_after:,} ({restored})**")
    return " · ".join(parts)


def reference_line(quantized: Answer, reference: FullPrecisionAnswer, token_text: Callable[[int], str]) -> str:
    """The full-precision answer (`Door.reference`) beside the quantized one: its text, its cost, and where the two
    first differ (the first differing token id, each side's token text by `token_text`), or that they are the same
    tokens (as far as a stopped answer went)."""
    ref = reference.answer
    cost = "kept from an earlier ask" if reference.cached else f"{reference.seconds:,.1f} s, once per question"
    head = f"**Full precision** (`dynamic`, {cost}): «{ref.text.strip()}»"
    if ref.finish_reason == "stopped":
        return head + " · stopped before its end: not compared"
    mine, theirs = quantized.token_ids, ref.token_ids
    common = common_prefix(mine, theirs)
    if mine == theirs:
        return head + " · **the same tokens** as this cache's answer"
    if common == len(mine) and quantized.finish_reason == "stopped":
        return head + f" · the same tokens as far as this cache's stopped answer went ({len(mine):,})"

    def shown(ids: tuple[int, ...]) -> str:
        return repr(token_text(ids[common])) if common < len(ids) else "the end"

    return head + (
        f" · **first differs at token {common + 1:,}**: {shown(mine)} with this cache, {shown(theirs)} at full "
        "precision (the tokens before it are the same)"
    )


def step_line(event: Any, spec: CacheSpec) -> str:
    """The line shown while an answer streams: the step, the bytes held, the cache length, and, when the next
    decode step will flush, what it will re-quantize (a flush step takes far longer than the others)."""
    memory = event.memory
    held = f"{memory.total_bytes / 2**20:,.2f} MiB held"
    if memory.snapshot_bytes:  # what an answer changes in place, kept as it was after the prefill for the restore
        held += (
            f" (the cache {memory.cache_bytes / 2**20:,.2f} + the snapshot's post-prefill copies "
            f"{memory.snapshot_bytes / 2**20:,.2f})"
        )
    line = f"step {event.step + 1:,} · {held} · cache length {event.cache_length:,}"
    if spec.keeps_residual and event.memory.layers:
        if event.memory.layers[0].residual_tokens + 1 >= spec.resolved()["residual_length"]:
            line += (
                f" · the next step flushes: every layer re-quantizes its {event.cache_length + 1:,} tokens, "
                "which takes longer than a plain step"
            )
    return line


def comparison_outputs(
    report: ComparisonReport, note: str, load: tuple[float, float] | None = None
) -> tuple[str, Any, Any, Any]:
    """The Compare tab's status line, the short table a reader sees (`charts.comparison_display_frame`: MiB,
    rounded, grouped memory · fidelity · speed, empty columns dropped) and the two charts' updates, for a (possibly
    partial) report. A spec whose mean KL is infinite (its cache gives zero probability to a token `dynamic`
    does not: `kvdemo.evals.metrics.kl_divergence`) shows `inf` in the table, and the line says that the chart,
    which cannot place it, leaves it out.

    The memory-against-fidelity chart leaves out `dynamic`, the reference (KL 0 at the most bytes, which would
    squeeze every other point into a corner), and names it in its title; its axes hold every point it draws. The
    speed chart's title and the line say when other work shared the cores (`load`: the 1-minute load average at the
    run's start and end, over the core count; None: not measured), which moves the speeds more than the caches do."""
    frame = report.to_frame()
    if report.results:
        tokens = report.results[0].context_tokens
        note += f" · context {tokens:,} tokens · max_new_tokens {report.max_new_tokens:,}"
        if report.perplexity_source:
            note += f" · perplexity on the {report.perplexity_source}"
        infinite = [r.spec_text for r in report.results if math.isinf(r.kl.mean_kld)]
        if infinite:
            note += (
                f" · ⚠ mean KL is infinite for {', '.join(infinite)}: its cache gives zero probability to a token "
                "dynamic's does not, so the memory-against-fidelity chart leaves it out"
            )
    tradeoff = tradeoff_frame(frame)  # one point per spec, coloured and named by its spec
    reference = tradeoff["backend"] == BASELINE
    drawn = tradeoff[~reference & tradeoff["KL (nats)"].map(math.isfinite)]
    title = "Memory against fidelity"
    if reference.any():
        bytes_ = tradeoff.loc[reference, "bytes per token"].iloc[0]
        title += f" (dynamic, the reference: {bytes_:,.0f} bytes/token at KL 0, off the chart)"
    x_top = float(drawn["bytes per token"].max()) * 1.1 if len(drawn) else None
    y_top = float(drawn["KL (nats)"].max()) * 1.15 if len(drawn) else None
    speed_title = "Decode speed"
    cores = os.cpu_count() or 1
    if load is not None and max(load) > cores + 0.5:  # the run's own threads fill the cores; more is other work
        speed_title += " ⚠ on a busy machine"  # short: a long title squeezes Vega's plot to nothing
        note += (
            f" · ⚠ decode speeds measured on a busy machine (1-min load average {load[0]:.1f} → {load[1]:.1f} on "
            f"{cores} cores): other work shared the cores, so they differ by more than the caches do"
        )
    return (
        note,
        comparison_display_frame(frame),
        gr.update(
            value=tradeoff[~reference],
            title=title,
            x_lim=[0, x_top] if x_top else None,
            y_lim=[0, y_top] if y_top else None,
        ),
        gr.update(value=speed_frame(frame), title=speed_title),
    )


def empty_comparison() -> tuple[Any, Any]:
    """The Compare tab's two tables before any comparison (or after one that failed before its first spec): no
    row, and the headers a comparison fills, never a table's placeholder headers."""
    report = ComparisonReport(model="", max_new_tokens=0, results=())
    return comparison_display_frame(report.to_frame()), report.answers_frame()


def comparison_files(report: ComparisonReport, folder: str) -> list[str]:
    """The full table as CSV and the whole report as JSON (what `python -m kvdemo compare --json` prints), written
    into `folder`; their paths, for a download."""
    base = Path(folder)
    base.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = base / "kvdemo-comparison.csv", base / "kvdemo-comparison.json"
    csv_path.write_text(report.to_csv(), encoding="utf-8")
    json_path.write_text(report.to_json(), encoding="utf-8")
    return [str(csv_path), str(json_path)]


def kv_error_plot(report: ComparisonReport | None, spec_text: str | None) -> Any:
    """The heatmap of the relative KV error per layer and KV head (keys and values) of one spec of the report
    (`charts.kv_error_figure`), or None when there is no such spec."""
    results = {r.spec_text: r for r in report.results} if report is not None else {}
    result = results.get(spec_text) if spec_text is not None else None
    if result is None:
        return None
    return kv_error_figure(result.kv_error, title=f"Relative KV error after the prefill: {result.spec_text}")


STEP_TITLE = "Time per decode step (flush steps marked)"
CHART_INTERVAL_SECONDS = 0.25
"""The least time between two redraws of the live memory and residual charts while an answer streams: 4 per
second, where a `dynamic` step on the embedded model takes 70-80 ms. Each redraw rebuilds both charts' frames from
every step so far and sends them to the browser (about 3.5 ms a step, 5 % of a `dynamic` step, when drawn at every
step: `benchmarks/overhead.py`). The chat and the step line still change at every step, and no step is left out of
the charts' data: a redraw shows every step up to it."""


def charts_due(event: Any, drawn_at: float | None) -> bool:
    """Whether the live charts are redrawn at `event` (a `StepEvent`): at the first step, at every step in which a
    layer flushed (so each flush shows as it happens), and else once `CHART_INTERVAL_SECONDS` passed since
    `drawn_at` (the `elapsed` seconds of the last redraw; None before the first)."""
    return drawn_at is None or bool(event.flushed_layers) or event.elapsed - drawn_at >= CHART_INTERVAL_SECONDS


MEMORY_TITLE = "KV cache memory"


def step_times(events: list, streaming: bool = False) -> Any:
    """The step-time chart for `gr.Plot`: `charts.step_time_figure` (a log axis of ms, every `STEP_KINDS` kind in
    its legend, no point clipped), titled. Before an answer, and while one streams (`streaming`: the title says
    so), an empty chart, drawn once per process; the answer's own is drawn once, when it ends (0.1-0.3 s for a
    figure: too long for every decode step). Gradio's native plots, which stream the other two charts, have no
    log axis.

    Returns:
        A matplotlib `Figure` for the answer's steps, or the empty chart as `gr.Plot`'s `PlotData` (a PNG).
    """
    if events and not streaming:
        return step_time_figure(events, STEP_TITLE, min_steps=MIN_STEPS_SHOWN, size=STEP_FIGURE_SIZE)
    return _empty_step_chart(waiting_step_title(streaming))


def waiting_step_title(streaming: bool) -> str:
    """The empty step-time chart's title: while an answer streams, or before any (short enough for the figure's
    width; there is no flush step to mark yet)."""
    return f"Time per decode step: {'drawn when the answer ends' if streaming else 'ask a question to see it'}"


STEP_FIGURE_SIZE = (6.4, 3.0)
"""The step-time chart's size on the page, in inches (at matplotlib's 100 dpi: 640 x 300 px, scaled to the column)."""


@cache
def _empty_step_chart(title: str) -> Any:
    """The step-time chart without a step, titled `title`, encoded once (`gr.Plot`'s own PNG encoding)."""
    return gr.Plot(format="png", render=False).postprocess(
        step_time_figure([], title, min_steps=MIN_STEPS_SHOWN, size=STEP_FIGURE_SIZE)
    )


MIN_STEPS_SHOWN = 8
"""The x-axis of the Ask tab's charts spans at least this many decode steps: an empty chart (or one of a single
step) would otherwise get a one-point axis, ticked "0.000000"."""


def _steps(frame: Any) -> list[float | None]:
    """The x-axis (decode steps) of a chart of `frame`'s `step` column: from 0 to its last step, at least
    `MIN_STEPS_SHOWN`."""
    return [0, float(max(frame["step"].max() if len(frame) else 0, MIN_STEPS_SHOWN))]


def _headroom(values: Any) -> float:
    """A tenth above the largest of `values` (a pandas Series; NaN ignored), or 1 when there is none: the top of
    a chart's y-axis. Gradio's native plots otherwise fit the axis to the data without a margin, so a line at the
    maximum is drawn on the frame, and an empty chart's one-point axis is ticked "0.000000"."""
    top = values.max()
    return 1.0 if pd.isna(top) or top <= 0 else float(top) * 1.1


def with_every_series(frame: Any, column: str, names: Iterable[str]) -> Any:
    """`frame` plus one invisible row (NaN in its float columns, 0 in its integer ones) for each of `names`
    missing from `column`. Gradio's plots fix their colour legend at the first data they get, so a series
    that appears later (a flush step, another backend) would never be drawn; these rows put every series in
    the legend from the start, and Vega does not draw points whose value is NaN."""
    present = set(frame[column].unique())
    missing = [name for name in names if name not in present]
    if not missing:
        return frame
    rows = []
    for name in missing:
        row: dict[str, object] = {}
        for col, dtype in frame.dtypes.items():
            if col == column:
                row[col] = name
            elif pd.api.types.is_float_dtype(dtype):
                row[col] = float("nan")
            elif pd.api.types.is_integer_dtype(dtype):
                row[col] = 0
            else:
                row[col] = ""
        rows.append(row)
    return pd.concat([frame, pd.DataFrame(rows).astype(frame.dtypes.to_dict())], ignore_index=True)


def table_spec(spec: CacheSpec) -> str:
    """A spec as the answers table names it: `CacheSpec.short_text` (nbits and the options off their defaults), or,
    for a quantized backend that takes no nbits, `full_text`, so that its precision shows
    (`ggml,type_k=q8_0,rotation=auto`, not a bare `ggml`)."""
    return spec.full_text if spec.info.quantized and "nbits" not in spec.info.options else spec.short_text


def answers_table(records: list[dict]) -> Any:
    """The Ask tab's answers table: `charts.answers_frame` with the figures rounded for reading."""
    return answers_frame(records).round({"question s": 2, "decode tokens/s": 1, "seconds": 2})


def memory_chart(events: list, spec: CacheSpec) -> dict[str, Any]:
    """The memory chart's update (a `gr.update` dict: building a `gr.LinePlot` per decode step cost ~5 ms): the
    series that exist for `spec`'s backend (`charts.memory_series`), each in the legend from the first update, on
    a y-axis from 0 to a tenth above the largest (`_headroom`)."""
    frame = memory_data(events, spec)
    title = MEMORY_TITLE if events else f"{MEMORY_TITLE}: ask a question to see it"
    return gr.update(value=frame, title=title, x_lim=_steps(frame), y_lim=[0, _headroom(frame["MiB"])])


RESIDUAL_SERIES = ("residual (first quantized layer)", "residual_length")
"""The residual chart's series: the fill of the first quantized layer's residual in tokens
(`charts.residual_layer`), and the `residual_length` at which it flushes (a level line)."""


def memory_data(events: list, spec: CacheSpec) -> Any:
    """The memory chart's data (`charts.memory_frame`): `spec`'s series, each in the legend."""
    series = memory_series(spec.info.quantized, spec.keeps_residual, bool(events) and events[0].memory.kept_bytes > 0)
    return with_every_series(memory_frame(events, series), "series", series)


def residual_data(events: list, spec: CacheSpec) -> Any:
    """The residual chart's data: the first quantized layer's fill (`charts.residual_frame`, as floats) and, for a
    backend with a residual, the `residual_length` level at every step (`RESIDUAL_SERIES`), each series in the
    legend."""
    fill = residual_frame(events if spec.keeps_residual else []).astype({"residual tokens": "float64"})
    frame = fill.assign(series=RESIDUAL_SERIES[0])
    if not spec.keeps_residual:
        return with_every_series(frame, "series", RESIDUAL_SERIES[:1])
    level = fill.assign(**{"residual tokens": float(spec.resolved()["residual_length"]), "series": RESIDUAL_SERIES[1]})
    return with_every_series(pd.concat([frame, level], ignore_index=True), "series", RESIDUAL_SERIES)


def residual_chart(events: list, spec: CacheSpec) -> dict[str, Any]:
    """The residual chart's update (a `gr.update` dict, as `memory_chart`) for `spec`: its fill (the first quantized
    layer) under the `residual_length` line, on a y-axis from 0, or, for a backend that keeps no residual, an empty
    chart whose title says so. Never `value=None`: Gradio then draws an empty box without the title."""
    frame = residual_data(events, spec)
    if not spec.keeps_residual:
        title = f"Residual fill: {spec.backend} keeps no residual (nothing to show)"
        return gr.update(value=frame, title=title, x_lim=_steps(frame), y_lim=[0, 1])
    limit = spec.resolved()["residual_length"]
    title = f"Residual fill (layer {residual_layer(events)}): flushes at residual_length={limit:,}"
    return gr.update(value=frame, title=title, x_lim=_steps(frame), y_lim=[0, limit * 1.1])


def speed_limit_line(limit: SpeedLimit, step_seconds: float | None) -> str:
    """The line under the step-time chart: the floor of a decode step on this machine (bytes read ÷ bandwidth,
    `kvdemo.cache.state.speedlimit`), the median measured step beside it, and the context above which the KV cache is
    read more than the weights (below it, no smaller KV cache can even halve the step)."""
    parts = [
        f"**Speed limit**: a decode step reads {limit.weight_bytes / 2**20:,.0f} MiB of weights + "
        f"{limit.kv_bytes / 2**20:,.1f} MiB of KV cache at {limit.bandwidth / 1e9:,.1f} GB/s (copy bandwidth): "
        f"floor **{limit.floor_seconds * 1000:,.1f} ms**"
    ]
    if limit.unread_bytes:
        parts[0] += (
            f" (its storage also holds {limit.unread_bytes / 2**20:,.1f} MiB beyond its {limit.kv_tokens:,} tokens: "
            "held, not read)"
        )
    if step_seconds is not None:
        parts.append(
            f"measured {step_seconds * 1000:,.1f} ms per step (median) = **{limit.ratio(step_seconds):.1f}×** the floor"
        )
    if limit.crossover_tokens is not None:
        parts.append(
            f"the KV read exceeds the weights' above {limit.crossover_tokens:,} tokens at this cache's "
            f"{limit.kv_bytes_per_token:,.0f} bytes/token (now {limit.kv_share:.0%} of the bytes read)"
        )
    if limit.full_precision_kv_bytes > limit.kv_bytes:
        parts.append(
            f"a full-precision cache of these tokens would read {limit.full_precision_kv_bytes / 2**20:,.1f} MiB: "
            f"floor {limit.full_precision_floor_seconds * 1000:,.1f} ms"
        )
    if limit.code_layers:
        parts.append(
            f"attention reads the stored codes in {limit.code_layers} layers, one tile at a time, with no "
            "de-quantized copy: the step follows its floor, so it passes full precision's where the KV cache is a "
            "large share of the bytes read (docs/benchmarks.md)"
        )
    if limit.dequantized_bytes:
        parts.append(
            f"not in the floor: each step also de-quantizes the stored values it reads whole or by block, "
            f"{limit.dequantized_bytes / 2**20:,.1f} MiB of full-precision keys and values over those layers "
            "(block by block, each read while still in the CPU's cache; no full-precision copy is kept between "
            "steps): why a quantized step is slower than `dynamic`'s, not faster"
        )
    if limit.rotation_side:
        what = {
            "query": "the new token's key, value, query and attention output rotated",
            "read": "the whole store rotated back at every read: this model's attention is not kvdemo's",
        }[limit.rotation_side]
        parts.append(f"the rotation adds {limit.rotation_flops / 1e6:,.1f} MFLOP per step, the same bytes ({what})")
    return " · ".join(parts)


def speed_limit_after(limit: SpeedLimit, events: list) -> str:
    """`speed_limit_line` beside the median decode step without a flush of the answer's `StepEvent`s."""
    return speed_limit_line(limit, flush_timing(events)[2])


def recommended_note(found: Recommendation, shown: CacheSpec | None = None) -> str:
    """The line under the options that says where the starting spec came from (`kvdemo.serve.recommended`), why
    the page's residual differs from the pick's where it does (`shown`: the spec the fields start at; None: the
    pick), and, for a pick no engine runs, the nearest settings llama.cpp and vLLM run
    (`Recommendation.nearest_deployed`) with their deploy lines (the command, without its comment)."""
    row = found.picked
    if row is None:
        return ""
    share = row.bytes_per_token[0] / found.rows[0].bytes_per_token[0]  # `dynamic`'s row comes first
    kl = "" if row.mean_kl is None else f"mean KL {row.mean_kl:.4f}, {row.same_top_p:.0f} % the same top token, "
    source = found.source or "a text"
    line = (
        f"ℹ Recommended for this model: `{found.pick}` ({kl}{share:.0%} of dynamic's bytes, on {source} of "
        f"{found.context_tokens:,} tokens; the **Recommend** tab measures yours)"
    )
    picked = CacheSpec.parse(found.pick)
    if shown is not None and shown.keeps_residual:
        page, measured = shown.resolved()["residual_length"], picked.resolved()["residual_length"]
        if page != measured:
            line += f", shown at `residual_length={page}` so that the first answer flushes (measured at {measured})"
    nearest = found.nearest_deployed()
    if not nearest:
        return line + "."
    named = ", ".join(
        f"`{deploy.split(': ', 1)[1].split('  #')[0]}` ({deploy.split(':')[0]}, "
        f"{r.bytes_per_token[0] / row.bytes_per_token[0]:.2f}× its bytes"
        + (f", mean KL {r.mean_kl:.4f})" if r.mean_kl is not None else ")")
        for r, deploy in nearest
    )
    unmeasured = any(r.mean_kl is None for r, _ in nearest)
    return (
        f"{line}. No engine stores it byte for byte (kvdemo only); the nearest settings engines run: {named}"
        + ("; not measured on that text" if unmeasured else "")
        + "."
    )
