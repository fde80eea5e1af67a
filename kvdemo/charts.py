"""Chart data and figures from telemetry records (`StepEvent`s and answer records), never from a live cache.

One function turns the records into each chart's data (a pandas DataFrame): the app feeds them to
Gradio's native plots while an answer streams (about a millisecond per update), and the notebooks draw
them with the matplotlib functions below. Figures are built with `matplotlib.figure.Figure`, not pyplot,
so nothing is registered globally and a figure is freed with its last reference.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import pandas as pd
from matplotlib.figure import Figure

from kvdemo.telemetry import StepEvent

MIB = 1024 * 1024


def _typed(rows: list[tuple], dtypes: dict[str, str]) -> pd.DataFrame:
    """A DataFrame with fixed column dtypes, also when empty (Gradio's plots take each axis's type,
    quantitative or nominal, from the dtype, and an empty frame would otherwise be `object`: nominal)."""
    return pd.DataFrame(rows, columns=list(dtypes)).astype(dtypes)
MEMORY_SERIES = ("quantized", "quantized + residual", "full precision")
"""The memory chart's series (MiB): the quantized store, the whole cache (the gap between the two lines
is the residual, stacked on the quantized bytes), and what a `DynamicCache` in the model's dtype holds."""


def memory_frame(events: Sequence[StepEvent]) -> pd.DataFrame:
    """KV memory over decode steps, long format for a line plot.

    Returns:
        Columns `step` (int), `series` (one of `MEMORY_SERIES`), `MiB` (float: bytes / 2**20); 3 rows per event.
    """
    rows = []
    for e in events:
        rows.append((e.step, MEMORY_SERIES[0], e.memory.quantized_bytes / MIB))
        rows.append((e.step, MEMORY_SERIES[1], e.memory.total_bytes / MIB))
        rows.append((e.step, MEMORY_SERIES[2], e.full_precision_bytes / MIB))
    return _typed(rows, {"step": "int64", "series": "string", "MiB": "float64"})


def residual_frame(events: Sequence[StepEvent], layer: int = 0) -> pd.DataFrame:
    """The residual's fill level over decode steps (a sawtooth for quanto and hqq; 0 for fp8).

    Returns:
        Columns `step` (int) and `residual tokens` (int) of one layer (every layer fills alike).
    """
    return _typed(
        [(e.step, e.memory.layers[layer].residual_tokens) for e in events if e.memory.layers],
        {"step": "int64", "residual tokens": "int64"},
    )


def flush_frame(events: Sequence[StepEvent]) -> pd.DataFrame:
    """One row per flush: the decode step and the layer that re-quantized, with the step's seconds.

    Returns:
        Columns `step` (int), `layer` (int), `step seconds` (float: the whole decode step's wall time, which a
        flush of every layer dominates).
    """
    return _typed(
        [(e.step, layer, e.seconds) for e in events for layer in e.flushed_layers],
        {"step": "int64", "layer": "int64", "step seconds": "float64"},
    )


STEP_KINDS = ("question pass", "decode step", "flush step")
"""The step-time chart's series: the question's own forward pass (step 0), decode steps without a flush,
and decode steps during which at least one layer flushed."""


def step_time_frame(events: Sequence[StepEvent]) -> pd.DataFrame:
    """One row per decode step: its wall time, and whether layers flushed in it (time per flush, live).

    Returns:
        Columns `step` (int), `ms` (float: the step's wall time in milliseconds), `kind` (one of
        `STEP_KINDS`), `layers flushed` (int).
    """
    rows = []
    for e in events:
        kind = STEP_KINDS[0] if e.step == 0 else STEP_KINDS[2] if e.flushed_layers else STEP_KINDS[1]
        rows.append((e.step, e.seconds * 1000, kind, len(e.flushed_layers)))
    return _typed(rows, {"step": "int64", "ms": "float64", "kind": "string", "layers flushed": "int64"})


def flush_timing(events: Sequence[StepEvent]) -> tuple[int, float | None, float | None]:
    """(flush steps, median seconds of a flush step, median seconds of another decode step), over the decode
    steps after the question pass; a median is None when there is no such step."""
    flush = [e.seconds for e in events if e.step > 0 and e.flushed_layers]
    other = [e.seconds for e in events if e.step > 0 and not e.flushed_layers]
    median = lambda xs: float(pd.Series(xs).median()) if xs else None  # noqa: E731
    return len(flush), median(flush), median(other)


ANSWER_COLUMNS = ["answer", "question", "tokens", "flushes", "tokens/s", "seconds", "cache length after", "finish"]


def answers_frame(records: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per answer of a session, from `Answer.to_dict()` records.

    Returns:
        Columns `ANSWER_COLUMNS`; `answer` counts from 1.
    """
    rows = [
        (
            i,
            r["question"],
            len(r["token_ids"]),
            r["flushes"],
            r["tokens_per_second"],
            r["seconds"],
            r["cache_length_after"],
            r["finish_reason"],
        )
        for i, r in enumerate(records, 1)
    ]
    return pd.DataFrame(rows, columns=ANSWER_COLUMNS)


def memory_figure(events: Sequence[StepEvent], title: str = "KV cache memory") -> Figure:
    """Quantized and residual bytes stacked over decode steps, with the full-precision equivalent as a line."""
    frame = memory_frame(events).pivot(index="step", columns="series", values="MiB")
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    if not frame.empty:
        quantized = frame[MEMORY_SERIES[0]]
        residual = frame[MEMORY_SERIES[1]] - quantized
        ax.stackplot(frame.index, quantized, residual, labels=["quantized", "residual"], alpha=0.8)
        ax.plot(frame.index, frame[MEMORY_SERIES[2]], color="black", linestyle="--", label="full precision")
        ax.legend(loc="upper left", fontsize="small")
    ax.set(xlabel="decode step", ylabel="MiB", title=title)
    ax.set_ylim(bottom=0)
    return fig


def flush_figure(events: Sequence[StepEvent], title: str = "Residual fill and flushes") -> Figure:
    """The residual's fill level (layer 0) over decode steps, with a mark at every step where layers flushed."""
    fill = residual_frame(events)
    flushes = flush_frame(events)
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.step(fill["step"], fill["residual tokens"], where="post", label="residual tokens (layer 0)")
    if not flushes.empty:
        steps = sorted(set(flushes["step"]))
        ax.scatter(steps, [0] * len(steps), marker="v", color="red", zorder=3, label="flush (all layers)")
    ax.set(xlabel="decode step", ylabel="tokens", title=title)
    ax.legend(loc="upper right", fontsize="small")
    return fig


def residual_comparison_figure(runs: Mapping[str, Sequence[StepEvent]], title: str = "Residual fill by residual_length") -> Figure:
    """The residual's fill (layer 0) over decode steps for several runs, one line each (the sawtooths side by side).

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


def step_time_figure(events: Sequence[StepEvent], title: str = "Time per decode step") -> Figure:
    """Each decode step's wall time (ms), the steps where layers flushed marked apart: a flush re-quantizes
    the whole layer, so those steps stand out."""
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    plain = [(e.step, e.seconds * 1000) for e in events if not e.flushed_layers]
    flushed = [(e.step, e.seconds * 1000) for e in events if e.flushed_layers]
    for points, label, style in ((plain, "no flush", "o"), (flushed, "flush", "v")):
        if points:
            ax.scatter(*zip(*points), marker=style, label=label)
    ax.set(xlabel="decode step", ylabel="ms", title=title)
    ax.legend(fontsize="small")
    return fig


def tradeoff_figure(frame: pd.DataFrame, fidelity: str = "contains gold", title: str = "Memory against fidelity") -> Figure:
    """Bytes per context token against a fidelity column, one labelled point per spec.

    Args:
        frame: `ComparisonReport.to_frame()` (columns `spec`, `bytes/token` and `fidelity`).
    """
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.scatter(frame["bytes/token"], frame[fidelity])
    for _, row in frame.iterrows():
        ax.annotate(row["spec"].split(" q_group_size")[0], (row["bytes/token"], row[fidelity]), fontsize="x-small",
                    xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="KV bytes per context token", ylabel=fidelity, title=title)
    return fig


def speed_figure(frame: pd.DataFrame, title: str = "Decode speed") -> Figure:
    """Decode tokens/s per spec, a horizontal bar each (from `ComparisonReport.to_frame()`)."""
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.add_subplot()
    labels = [s.split(" q_group_size")[0] for s in frame["spec"]]
    ax.barh(labels, frame["tokens/s"])
    ax.invert_yaxis()
    ax.set(xlabel="tokens/s", title=title)
    return fig


def tradeoff_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The app's memory-against-fidelity chart data, one row per spec, from `ComparisonReport.to_frame()`.

    Columns: `spec`, `backend` (the spec's first word), `bytes per token` (KV bytes per context token), `KL (nats)` (mean per answer token,
    against `dynamic`), `identical` (share of answers identical to `dynamic`'s), `contains gold` (NaN without
    gold answers).
    """
    return pd.DataFrame(
        {
            "spec": frame["spec"].astype("string"),
            "backend": frame["spec"].str.split().str[0].astype("string"),
            "bytes per token": frame["bytes/token"].astype("float64"),
            "KL (nats)": frame["KL (nats)"].astype("float64"),
            "identical": frame["identical to dynamic"].astype("float64"),
            "contains gold": frame["contains gold"].astype("float64"),
        }
    )


def speed_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The app's decode-speed chart data: `spec`, `tokens/s` (median over the answers) and `flush s` (seconds
    spent in decode steps that flushed), from `ComparisonReport.to_frame()`."""
    return pd.DataFrame(
        {
            "spec": frame["spec"].astype("string"),
            "tokens/s": frame["tokens/s"].astype("float64"),
            "flush s": frame["flush s"].astype("float64"),
        }
    )


NEEDLE_VALUES = ("score", "hit")
"""What a needle heatmap colours: `score` (log P of the value, nats) or `hit` (the answer holds the value)."""


SCORE_FLOOR = -15.0
"""The lowest graded score (nats) a needle heatmap tells apart by colour; lower scores take its colour."""


def needle_heatmap_frame(table: pd.DataFrame, spec: str, value: str = "score") -> pd.DataFrame:
    """One spec's needle grid as a matrix: depth (%) rows from 0 down, context length (tokens) columns.

    Args:
        table: `NeedleGrid.to_frame()` (columns `spec text`, `length`, `depth`, `hit`, `score`).
        spec: a `spec text` of the table, e.g. `hqq:4`.
        value: one of `NEEDLE_VALUES`; `hit` gives 1.0 or 0.0 (the mean, should a cell appear twice).

    Returns:
        float64 values indexed by `depth`, columns `length`; empty when the spec has no cell.

    Raises:
        ValueError: `value` is not one of `NEEDLE_VALUES`.
    """
    if value not in NEEDLE_VALUES:
        raise ValueError(f"value={value!r}: choose one of {', '.join(NEEDLE_VALUES)}")
    rows = table[table["spec text"] == spec].astype({value: "float64"})
    if rows.empty:
        return pd.DataFrame(dtype="float64")
    return rows.pivot_table(index="depth", columns="length", values=value, aggfunc="mean").sort_index()


def needle_heatmap_figure(table: pd.DataFrame, specs: Sequence[str] | None = None, value: str = "score",
                          title: str | None = None) -> Figure:
    """Needle-in-a-haystack heatmaps, one panel per spec side by side, on one colour scale.

    `score` colours the graded score (log P of the value in nats, from the table's lowest score, or -15 when
    lower: worse than a guess among 10^6 numbers, -13.8, to 0); `hit` colours hits green and misses red. Every
    cell is labelled with a tick (hit) or a cross (miss) and its score.

    Args:
        table: `NeedleGrid.to_frame()`.
        specs: `spec text`s to draw, in order (default: the table's, in order of appearance).
        value: one of `NEEDLE_VALUES`.

    Raises:
        ValueError: `value` is not one of `NEEDLE_VALUES`.
    """
    if value not in NEEDLE_VALUES:
        raise ValueError(f"value={value!r}: choose one of {', '.join(NEEDLE_VALUES)}")
    specs = list(dict.fromkeys(table["spec text"])) if specs is None else list(specs)
    lengths = sorted(set(table["length"])) or [0]
    depths = sorted(set(table["depth"])) or [0]
    width = 1.0 + 0.62 * len(lengths)
    fig = Figure(figsize=(min(1.2 + width * max(len(specs), 1), 18), 1.5 + 0.36 * len(depths)), layout="constrained")
    axes = fig.subplots(1, max(len(specs), 1), squeeze=False)[0]
    low = float(table["score"].min()) if len(table) else -1.0
    floor = min(max(low, SCORE_FLOOR), -1e-3)
    scale = {"cmap": "viridis", "vmin": floor, "vmax": 0.0} if value == "score" else \
        {"cmap": "RdYlGn", "vmin": 0.0, "vmax": 1.0}
    image = None
    for ax, spec in zip(axes, specs):
        shown = needle_heatmap_frame(table, spec, value).reindex(index=depths, columns=lengths)
        scores = needle_heatmap_frame(table, spec, "score").reindex(index=depths, columns=lengths)
        hits = needle_heatmap_frame(table, spec, "hit").reindex(index=depths, columns=lengths)
        image = ax.imshow(shown.to_numpy(), aspect="auto", **scale)
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if pd.isna(scores.iat[i, j]):
                    continue
                mark = "\u2713" if hits.iat[i, j] >= 0.5 else "\u2717"
                ax.text(j, i, f"{mark}{scores.iat[i, j]:.1f}", ha="center", va="center", fontsize="x-small",
                        color="black" if value == "hit" or scores.iat[i, j] > scale["vmin"] / 2 else "white")
        ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], fontsize="small", rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:g} %" for d in depths], fontsize="small")
        ax.set_title(spec, fontsize="medium")
        ax.set_xlabel("context tokens", fontsize="small")
    axes[0].set_ylabel("needle depth")
    if image is not None:
        label = "log P(value), nats" if value == "score" else "hit"
        fig.colorbar(image, ax=list(axes), label=label, shrink=0.9,
                     extend="min" if value == "score" and low < floor else "neither")
    fig.suptitle(title or ("Needle in a haystack: graded score (\u2713 hit, \u2717 miss)" if value == "score"
                           else "Needle in a haystack: hits (labels: log P(value), nats)"), fontsize="medium")
    return fig
