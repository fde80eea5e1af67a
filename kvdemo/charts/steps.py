"""Chart data and figures from telemetry records (`StepEvent`s and answer records), never from a live cache.

One function turns the records into each chart's data (a pandas DataFrame): the app feeds them to
Gradio's native plots while an answer streams (about a millisecond per update), and the notebooks draw
them with the matplotlib functions below. The step-time chart needs a log axis, which those plots lack: the page
draws it with `step_time_figure` through `gr.Plot`, once per answer. Figures are built with
`matplotlib.figure.Figure`, not pyplot, so nothing is registered globally and a figure is freed with its last
reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, StrMethodFormatter

from kvdemo.cache.state.telemetry import STEP_KINDS, StepEvent
from kvdemo.charts.frames import MIB, typed_frame

MEMORY_SERIES = ("quantized store", "KV cache", "held (cache + snapshot)", "full precision")
"""The memory chart's series (MiB): the quantized store; the whole cache (the store plus the full-precision
residual); everything held for it, the post-prefill state the snapshot keeps alive included (the figure that
never under-reports); and what a `DynamicCache` in the model's dtype would hold."""


KEPT_SERIES = "kept layers"
"""The memory chart's series (short, so the legend shows it whole) for what a quantized backend keeps at full
precision on a model of several layer kinds (sliding-window layers with `sliding=keep`, conv and recurrent states,
combined layers: `kvdemo.cache.model.layer_kinds`): flat once a sliding layer holds its window, while the quantized
layers grow with the context."""


def memory_series(has_quantized_store: bool, has_residual: bool, has_kept: bool = False) -> tuple[str, ...]:
    """The memory series that exist for a backend: a quantized store only for the quantized backends, and as
    a line apart from the cache only where a residual sits beside it; the kept layers where a quantized backend
    keeps some (`has_kept`: the first event's `MemoryReport.kept_bytes` is not 0)."""
    series = tuple(name for name in MEMORY_SERIES if name != MEMORY_SERIES[0] or (has_quantized_store and has_residual))
    return (*series, KEPT_SERIES) if has_kept and has_quantized_store else series


def memory_frame(events: Sequence[StepEvent], series: Sequence[str] = MEMORY_SERIES) -> pd.DataFrame:
    """KV memory over decode steps, long format for a line plot.

    Args:
        series: which of `MEMORY_SERIES` to include (see `memory_series`).

    Returns:
        Columns `step` (int), `series` (one of `series`), `MiB` (float: bytes / 2**20); one row per event and series.
    """
    values = {
        MEMORY_SERIES[0]: lambda e: e.memory.quantized_bytes,
        MEMORY_SERIES[1]: lambda e: e.memory.cache_bytes,
        MEMORY_SERIES[2]: lambda e: e.memory.total_bytes,
        MEMORY_SERIES[3]: lambda e: e.full_precision_bytes,
        KEPT_SERIES: lambda e: e.memory.kept_bytes,
    }
    rows = [(e.step, name, values[name](e) / MIB) for e in events for name in series]
    return typed_frame(rows, {"step": "int64", "series": "string", "MiB": "float64"})


def residual_layer(events: Sequence[StepEvent]) -> int:
    """The layer whose residual the charts follow: the first quantized one (`LayerMemory.kind`; Gemma 3's first
    full-attention layer is its 6th), 0 where none is."""
    layers = events[0].memory.layers if events else ()
    return next((index for index, layer in enumerate(layers) if layer.kind == "quantized"), 0)


def residual_frame(events: Sequence[StepEvent], layer: int | None = None) -> pd.DataFrame:
    """The residual's fill level over decode steps (a sawtooth for quanto and hqq; 0 for fp8).

    Args:
        layer: the layer to follow; None: `residual_layer(events)`, the first quantized one.

    Returns:
        Columns `step` (int) and `residual tokens` (int) of one layer (every quantized layer fills alike).
    """
    layer = residual_layer(events) if layer is None else layer
    return typed_frame(
        [(e.step, e.memory.layers[layer].residual_tokens) for e in events if e.memory.layers],
        {"step": "int64", "residual tokens": "int64"},
    )


def flush_frame(events: Sequence[StepEvent]) -> pd.DataFrame:
    """One row per flush: the decode step and the layer that re-quantized, with the step's seconds.

    Returns:
        Columns `step` (int), `layer` (int), `step seconds` (float: the whole decode step's wall time, which a
        flush of every layer dominates).
    """
    return typed_frame(
        [(e.step, layer, e.seconds) for e in events for layer in e.flushed_layers],
        {"step": "int64", "layer": "int64", "step seconds": "float64"},
    )


def step_time_frame(events: Sequence[StepEvent]) -> pd.DataFrame:
    """One row per decode step: its wall time, and whether layers flushed in it (time per flush, live).

    Returns:
        Columns `step` (int), `ms` (float: the step's wall time in milliseconds), `kind` (one of
        `STEP_KINDS`), `layers flushed` (int).
    """
    rows = []
    for e in events:
        rows.append((e.step, e.seconds * 1000, e.kind, len(e.flushed_layers)))
    return typed_frame(rows, {"step": "int64", "ms": "float64", "kind": "string", "layers flushed": "int64"})


STEP_COLOURS = ("#7f7f7f", "#1f77b4", "#d62728")
"""The colour of each of `STEP_KINDS` in the step-time chart."""
STEP_MARKERS = ("s", "o", "v")
"""The matplotlib marker of each of `STEP_KINDS` in the step-time chart."""


def flush_timing(events: Sequence[StepEvent]) -> tuple[int, float | None, float | None]:
    """(flush steps, median seconds of a flush step, median seconds of another decode step), over the decode
    steps after the question pass; a median is None when there is no such step."""
    flush = [e.seconds for e in events if e.is_flush_step]
    other = [e.seconds for e in events if e.kind == STEP_KINDS[1]]
    median = lambda xs: float(pd.Series(xs).median()) if xs else None  # noqa: E731
    return len(flush), median(flush), median(other)


ANSWER_COLUMNS = [
    "question",
    "answer",
    "spec",
    "tokens",
    "question s",
    "decode tokens/s",
    "flushes",
    "seconds",
    "cache length after",
    "finish",
]


def answers_frame(records: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per answer of a session, from `Answer.to_dict()` records (with a `spec` key: the cache it was
    answered on, `CacheSpec.short_text`; the page keeps answers across prefills).

    Returns:
        Columns `ANSWER_COLUMNS`, the question and the answer's text first (what a reader looks for); `question s`
        is the question's own pass, apart from the decode speed.
    """
    rows = [
        (
            r["question"],
            r["answer"],
            r.get("spec", ""),
            len(r["token_ids"]),
            r["question_seconds"],
            r["decode_tokens_per_second"],
            r["flushes"],
            r["seconds"],
            r["cache_length_after"],
            r["finish_reason"],
        )
        for r in records
    ]
    return pd.DataFrame(rows, columns=ANSWER_COLUMNS)


def memory_figure(events: Sequence[StepEvent], title: str = "KV cache memory") -> Figure:
    """Quantized store, residual, kept layers (full-precision layers of other kinds beside the quantized ones:
    sliding windows, states) and snapshot bytes stacked over decode steps, with the full-precision equivalent as a
    line."""
    frame = memory_frame(events, (*MEMORY_SERIES, KEPT_SERIES)).pivot(index="step", columns="series", values="MiB")
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    if not frame.empty:
        quantized, kept = frame[MEMORY_SERIES[0]], frame[KEPT_SERIES]
        residual = frame[MEMORY_SERIES[1]] - quantized - kept
        snapshot = frame[MEMORY_SERIES[2]] - frame[MEMORY_SERIES[1]]
        parts, labels = [quantized, residual, kept, snapshot], ["quantized", "residual", KEPT_SERIES, "snapshot"]
        shown = [i for i, part in enumerate(parts) if i != 2 or part.any()]  # the kept layers where there are some
        ax.stackplot(frame.index, *[parts[i] for i in shown], labels=[labels[i] for i in shown], alpha=0.8)
        ax.plot(frame.index, frame[MEMORY_SERIES[3]], color="black", linestyle="--", label="full precision")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")  # outside: it hides no line
    ax.set(xlabel="decode step", ylabel="MiB", title=title)
    ax.set_ylim(bottom=0)
    return fig


def flush_figure(events: Sequence[StepEvent], title: str = "Residual fill and flushes") -> Figure:
    """The residual's fill level (the first quantized layer) over decode steps, with a mark at every step where
    layers flushed."""
    fill = residual_frame(events)
    flushes = flush_frame(events)
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.step(
        fill["step"], fill["residual tokens"], where="post", label=f"residual tokens (layer {residual_layer(events)})"
    )
    if not flushes.empty:
        steps = sorted(set(flushes["step"]))
        ax.scatter(steps, [0] * len(steps), marker="v", color="red", zorder=3, label="flush (all layers)")
    ax.set(xlabel="decode step", ylabel="tokens", title=title)
    ax.legend(loc="upper right", fontsize="small")
    return fig


def residual_comparison_figure(
    runs: Mapping[str, Sequence[StepEvent]], title: str = "Residual fill by residual_length"
) -> Figure:
    """The residual's fill (the first quantized layer) over decode steps for several runs, one line each (the
    sawtooths side by side).

    Args:
        runs: label (e.g. `residual_length=8`) -> the run's step events.
    """
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    for label, events in runs.items():
        fill = residual_frame(events)
        ax.step(fill["step"], fill["residual tokens"], where="post", label=label)
    ax.set(xlabel="decode step", ylabel="residual tokens", title=title)
    ax.legend(fontsize="small")
    return fig


def step_time_figure(
    events: Sequence[StepEvent], title: str = "Time per decode step", min_steps: int = 0, size=(7, 3.2)
) -> Figure:
    """Each decode step's wall time (ms) on a log axis, its kind (`STEP_KINDS`) marked apart: a flush re-quantizes
    the whole layer, so a flush step can take 40x a plain one, and the log axis keeps both readable. The page's
    step-time chart (through `gr.Plot`) and the notebooks' figure.

    Args:
        events: the answer's `StepEvent`s (empty: the axes and the legend only).
        title: the figure's title.
        min_steps: the x-axis spans at least this many decode steps.
        size: the figure's size in inches.
    """
    fig = Figure(figsize=size, layout="constrained")
    ax = fig.add_subplot()
    for kind, marker, colour in zip(STEP_KINDS, STEP_MARKERS, STEP_COLOURS):
        steps = [e.step for e in events if e.kind == kind]
        ms = [e.seconds * 1000 for e in events if e.kind == kind]
        ax.scatter(steps, ms, marker=marker, label=kind, color=colour, s=18)
    ax.set(xlabel="decode step", ylabel="ms (log scale)", title=title, yscale="log")
    last = max((e.step for e in events), default=0)
    ax.set_xlim(-0.5, max(last, min_steps) + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole steps
    if events:
        ax.margins(y=0.12)  # no point on the frame (the question's pass is often the slowest)
    else:
        ax.set_ylim(10, 1000)  # a log axis needs a positive range before any step
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 100, 200, 500, 1,000 ms: read as numbers
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(fontsize="small", loc="outside lower center", ncols=3, frameon=False)  # below: no point hidden
    return fig
