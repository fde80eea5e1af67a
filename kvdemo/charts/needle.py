"""The needle grid's heatmaps, from its table only (`NeedleGrid.to_frame()`): one panel per spec, depth by
length, coloured by the graded score or by the hit, each cell labelled. Figures are `matplotlib.figure.Figure`s,
never pyplot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

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
    return _pivot(table, spec, value)


def _pivot(table: pd.DataFrame, spec: str, column: str) -> pd.DataFrame:
    """The spec's `column` (as float64) by depth (rows, sorted) and length (columns), the mean should a cell
    appear twice; empty when the spec has no cell."""
    rows = table[table["spec text"] == spec].astype({column: "float64"})
    if rows.empty:
        return pd.DataFrame(dtype="float64")
    return rows.pivot_table(index="depth", columns="length", values=column, aggfunc="mean").sort_index()


def needle_heatmap_figure(
    table: pd.DataFrame, specs: Sequence[str] | None = None, value: str = "score", title: str | None = None
) -> Figure:
    """Needle-in-a-haystack heatmaps, one panel per spec side by side, on one colour scale.

    `score` colours the graded score (log P of the value in nats, from the table's lowest score, or -15 when
    lower: worse than a guess among 10^6 numbers, -13.8, to 0); `hit` colours hits green and misses red. Every
    cell is labelled with a tick (hit), a cross (miss) or `cut` (a miss that max_new_tokens ended, the table's
    `cut` column) and its score.

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
    scale: dict[str, Any] = (  # keywords of imshow
        {"cmap": "viridis", "vmin": floor, "vmax": 0.0}
        if value == "score"
        else {"cmap": "RdYlGn", "vmin": 0.0, "vmax": 1.0}
    )
    image = None
    for ax, spec in zip(axes, specs):
        shown = needle_heatmap_frame(table, spec, value).reindex(index=depths, columns=lengths)
        scores = needle_heatmap_frame(table, spec, "score").reindex(index=depths, columns=lengths)
        hits = needle_heatmap_frame(table, spec, "hit").reindex(index=depths, columns=lengths)
        # 1.0 where a miss was ended by max_new_tokens (`NeedleCell.cut`); a table without the column has none
        cuts = _pivot(table, spec, "cut").reindex(index=depths, columns=lengths) if "cut" in table else None
        image = ax.imshow(shown.to_numpy(), aspect="auto", **scale)
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if pd.isna(scores.iat[i, j]):
                    continue
                cut = cuts is not None and cuts.iat[i, j] >= 0.5
                mark = "\u2713" if hits.iat[i, j] >= 0.5 else "cut " if cut else "\u2717"
                ax.text(
                    j,
                    i,
                    f"{mark}{scores.iat[i, j]:.1f}",
                    ha="center",
                    va="center",
                    fontsize="x-small",
                    color="black" if value == "hit" or scores.iat[i, j] > scale["vmin"] / 2 else "white",
                )
        ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], fontsize="small", rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:g} %" for d in depths], fontsize="small")
        ax.set_title(spec, fontsize="medium")
        ax.set_xlabel("context tokens", fontsize="small")
    axes[0].set_ylabel("needle depth")
    if image is not None:
        label = "log P(value), nats" if value == "score" else "hit"
        fig.colorbar(
            image,
            ax=list(axes),
            label=label,
            shrink=0.9,
            extend="min" if value == "score" and low < floor else "neither",
        )
    fig.suptitle(
        title
        or (
            "Needle in a haystack: graded score (\u2713 hit, \u2717 miss)"
            if value == "score"
            else "Needle in a haystack: hits (labels: log P(value), nats)"
        ),
        fontsize="medium",
    )
    return fig
