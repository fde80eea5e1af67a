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
