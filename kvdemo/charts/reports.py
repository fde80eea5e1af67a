"""Charts of the reports, from their records only: the comparison (memory against fidelity, decode speed, the
reader's table), where the KV error sits and its drift across flushes (the needle grid's heatmaps are in
`kvdemo.charts.needle`). The session's
own charts (memory, residual, flushes, step time while an answer streams) are in `kvdemo.charts.steps`, which re-exports
the figures the notebooks draw from here. Figures are `matplotlib.figure.Figure`s, never pyplot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

from kvdemo.charts.frames import MIB, typed_frame


def tradeoff_figure(
    frame: pd.DataFrame, fidelity: str = "contains gold", title: str = "Memory against fidelity"
) -> Figure:
    """Bytes per context token against a fidelity column, one point per spec labelled with its `spec text`.

    Args:
        frame: `ComparisonReport.to_frame()` (columns `spec text`, `bytes/token` and `fidelity`).
    """
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.scatter(frame["bytes/token"], frame[fidelity])
    for _, row in frame.iterrows():
        ax.annotate(
            row["spec text"],
            (row["bytes/token"], row[fidelity]),
            fontsize="x-small",
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set(xlabel="KV bytes per context token", ylabel=fidelity, title=title)
    return fig


def speed_figure(frame: pd.DataFrame, title: str = "Decode speed") -> Figure:
    """Decode tokens/s per spec, a horizontal bar each labelled with its `spec text` (from
    `ComparisonReport.to_frame()`)."""
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.add_subplot()
    labels = list(frame["spec text"])
    ax.barh(labels, frame["tokens/s"])
    ax.invert_yaxis()
    ax.set(xlabel="tokens/s", title=title)
    return fig


def tradeoff_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The app's memory-against-fidelity chart data, one row per spec, from `ComparisonReport.to_frame()`.

    Columns: `spec` (the frame's `spec text`: backend:nbits and the options set), `backend`, `bytes per token`
    (KV bytes per context token),
    `KL (nats)` (mean KL per answer token against `dynamic`, llama.cpp's "Mean KLD"), `identical` (share of answers
    identical to `dynamic`'s), `contains gold` (NaN without gold answers).
    """
    return pd.DataFrame(
        {
            "spec": frame["spec text"].astype("string"),
            "backend": frame["backend"].astype("string"),
            "bytes per token": frame["bytes/token"].astype("float64"),
            "KL (nats)": frame["KL (nats)"].astype("float64"),
            "identical": frame["identical to dynamic"].astype("float64"),
            "contains gold": frame["contains gold"].astype("float64"),
        }
    )


def speed_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The app's decode-speed chart data: `spec` (the `spec text`), `tokens/s` (median over the answers) and
    `flush s` (seconds spent in decode steps that flushed), from `ComparisonReport.to_frame()`."""
    return pd.DataFrame(
        {
            "spec": frame["spec text"].astype("string"),
            "tokens/s": frame["tokens/s"].astype("float64"),
            "flush s": frame["flush s"].astype("float64"),
        }
    )


# ---- the comparison as a reader sees it -------------------------------------------------------------------------
DISPLAY_COLUMNS: tuple[tuple[str, str, str, int], ...] = (
    ("", "spec", "spec text", -1),
    ("memory", "KV MiB", "KV bytes", 2),
    ("memory", "kept MiB", "kept bytes", 2),
    ("memory", "bytes/token", "bytes/token", 0),
    ("memory", "× dynamic", "ratio to dynamic", 3),
    ("memory", "restored", "restored", -1),
    ("fidelity", "same top %", "same top p (%)", 1),
    ("fidelity", "mean KLD", "KL (nats)", 4),
    ("fidelity", "99% KLD", "99.0% KLD", 4),
    ("fidelity", "99.9% KLD", "99.9% KLD", 4),
    ("fidelity", "max KLD", "max KLD", 3),
    ("fidelity", "RMS Δp %", "RMS Δp (%)", 2),
    ("fidelity", "99% |Δlog p|", "99.0% |Δ log p|", 3),
    ("fidelity", "identical", "identical to dynamic", 2),
    ("fidelity", "PPL", "PPL", 2),
    ("fidelity", "PPL ×", "PPL ratio to dynamic", 3),
    ("fidelity", "K error", "K error", 3),
    ("fidelity", "V error", "V error", 3),
    ("fidelity", "drift ×", "drift (×)", 3),
    ("fidelity", "contains gold", "contains gold", 2),
    ("fidelity", "F1", "F1", 2),
    ("speed", "tokens/s", "tokens/s", 1),
    ("speed", "prefill s", "prefill s", 2),
    ("speed", "flush s", "flush s", 2),
    ("", "deploy", "deploy", -1),
)
"""The reader's table: (group, header, column of `ComparisonReport.to_frame()`, decimals; -1: as it is)."""

DISPLAY_HELP: dict[str, str] = {
    "spec": "the backend and the options set (backend[:nbits][,option=value])",
    "deploy": "the engines that store this cache the same way, each with the flag that asks it to (kvdemo only: none "
    "does)",
    "KV MiB": "the KV cache after the prefill (MiB, measured from the tensors held)",
    "kept MiB": "of it, the layers a quantized backend keeps at full precision (sliding windows, recurrent states)",
    "bytes/token": "KV bytes per context token",
    "× dynamic": "KV bytes / dynamic's (the full-precision cache)",
    "restored": "after every answer the cache was back at the context's length",
    "same top %": "positions of dynamic's answers where this cache's most likely token is dynamic's "
    "(llama.cpp: Same top p)",
    "mean KLD": "mean KL(P_dynamic || P_spec) per answer token, nats, teacher-forced on dynamic's answers "
    "(llama.cpp: Mean KLD)",
    "99% KLD": "99th percentile of the KL over those positions (llama.cpp: 99.0% KLD)",
    "99.9% KLD": "99.9th percentile of the KL over those positions (llama.cpp: 99.9% KLD)",
    "max KLD": "largest KL at one position (llama.cpp: Maximum KLD)",
    "RMS Δp %": "root mean square of p_spec - p_dynamic of dynamic's token, in percent (llama.cpp: RMS Δp)",
    "99% |Δlog p|": "99th percentile of |log p_dynamic - log p_spec| of dynamic's token (nats)",
    "identical": "share of answers whose tokens equal dynamic's",
    "PPL": "perplexity of the text after the context, fed one decode step per token through this cache",
    "PPL ×": "PPL / dynamic's PPL on the same tokens (llama.cpp: PPL(Q)/PPL(base))",
    "K error": "||K - K^|| / ||K|| of the de-quantized keys after the prefill, all layers and heads",
    "V error": "the same for the values",
    "drift ×": "the context's KV error after the last of several flushes / after the prefill (1: no drift)",
    "contains gold": "share of answers containing a gold answer (SQuAD normalisation)",
    "F1": "SQuAD token F1 against the gold answers",
    "tokens/s": "decode tokens per second (median over the answers)",
    "prefill s": "prefill wall time (seconds)",
    "flush s": "seconds of the decode steps that flushed",
}
"""One line per header of `comparison_display_frame`, for a legend under the table."""


def comparison_display_frame(frame: pd.DataFrame, grouped: bool = False) -> pd.DataFrame:
    """The table a reader sees, from the full one: short headers, MiB instead of bytes, rounded figures, the
    columns grouped memory · fidelity · speed (`DISPLAY_COLUMNS`), and the columns with no value in any row
    dropped (the gold columns without gold answers, perplexity without a perplexity run, drift without
    flushes). Values stay numbers (a table can sort them).

    Args:
        frame: `ComparisonReport.to_frame()`.
        grouped: True: two header levels (group, header), for a notebook or a terminal; False: one level
            (`DISPLAY_HELP` explains each header; `display_groups` gives the groups), for Gradio's table.

    Returns:
        One row per spec.

    Example:
        >>> comparison_display_frame(report.to_frame(), grouped=True)
    """
    columns: dict[tuple[str, str], pd.Series] = {}
    for group, header, source, digits in DISPLAY_COLUMNS:
        if source not in frame:
            continue
        values = frame[source] / MIB if source in ("KV bytes", "kept bytes") else frame[source]
        if values.isna().all() and len(values):
            continue
        if source == "kept bytes":  # kept layers on this model: a spec that keeps none (dynamic) keeps 0, not NaN
            values = values.fillna(0.0)
        if digits >= 0:
            values = values.astype("float64").round(digits)
            if digits == 0:
                values = values.astype("int64") if not values.isna().any() else values
        columns[(group, header)] = values.reset_index(drop=True)
    out = pd.DataFrame(columns)
    if not grouped:
        out.columns = [header for _, header in columns]
    elif len(columns):
        out.columns = pd.MultiIndex.from_tuples(list(columns), names=["", ""])
    return out


def display_groups(display: pd.DataFrame) -> dict[str, list[str]]:
    """The groups of a flat `comparison_display_frame` present in it: {"memory": [...], "fidelity": [...],
    "speed": [...]} (headers in order)."""
    groups: dict[str, list[str]] = {}
    for group, header, _, _ in DISPLAY_COLUMNS:
        if group and header in display.columns:
            groups.setdefault(group, []).append(header)
    return groups


# ---- where the error sits, and its drift ------------------------------------------------------------------------
def _field(error: Any, name: str, default: Any = ()) -> Any:
    return error.get(name, default) if isinstance(error, Mapping) else getattr(error, name, default)


def _matrix(error: Any, which: str) -> list[list[float]]:
    """[layers][kv_heads] of one tensor's error; a layer left out (an empty row) is a row of NaN."""
    rows = [list(map(float, row)) for row in _field(error, which)]
    heads = max((len(row) for row in rows), default=0)
    return [row if row else [float("nan")] * heads for row in rows]


def layer_labels(error: Any) -> list[str]:
    """Per layer, what the KV error map shows of it: `quantized`, `kept` (full precision, as `dynamic` holds it),
    `window` beside either for a sliding-window layer, `latent` on an MLA model, or why it is left out (`state`: conv
    or recurrent states; `nothing`: a KV-shared or MLP-only layer; `window moved`)."""
    reads, quantized = list(_field(error, "reads")), list(_field(error, "quantized"))
    layers = len(_field(error, "keys"))
    reads += ["all tokens"] * (layers - len(reads))  # a record without them: every layer compared whole
    quantized += [True] * (layers - len(quantized))
    latent = bool(_field(error, "latent", False))
    labels = []
    for read, stored in zip(reads, quantized):
        if read not in ("all tokens", "window"):
            labels.append(read)
            continue
        what = "quantized" if stored else "kept"
        labels.append(f"{what} window" if read == "window" else f"{what} latent" if latent else what)
    return labels


def kv_error_frame(error: Any) -> pd.DataFrame:
    """The per-layer, per-KV-head relative error of a cache, long format (for a table or a Gradio heatmap).

    Args:
        error: a `cache_error.KVError` (e.g. `SpecResult.kv_error`) or its dict (`ComparisonReport.to_dict()`).

    Returns:
        Columns `layer` (int), `KV head` (int), `tensor` (`keys` or `values`), `relative error` (float: ||X - X^|| /
        ||X|| over the tokens and head_dim), `layer holds` (`layer_labels`); compared layers x kv_heads x 2 rows (a
        layer left out has none).
    """
    labels = layer_labels(error)
    rows: list[tuple[int, int, str, float, str]] = []
    for which in ("keys", "values"):
        for layer, row in enumerate(_field(error, which)):
            rows.extend((layer, head, which, float(value), labels[layer]) for head, value in enumerate(row))
    return typed_frame(
        rows,
        {
            "layer": "int64",
            "KV head": "int64",
            "tensor": "string",
            "relative error": "float64",
            "layer holds": "string",
        },
    )


def kv_error_figure(error: Any, title: str = "Relative KV error after the prefill") -> Figure:
    """Heatmaps of the relative error per layer (rows) and KV head (columns), keys and values side by side on one
    colour scale, each cell labelled when there are few enough; each row named by what the layer holds
    (`layer_labels`). A layer kept at full precision is drawn grey and written `kept`, not as an error of 0; a layer
    left out (states, nothing, a moved window) is drawn blank with the reason.

    Args:
        error: a `cache_error.KVError` or its dict.
    """
    labels = layer_labels(error)
    keys, values = _matrix(error, "keys"), _matrix(error, "values")
    layers = len(keys)
    fig = Figure(figsize=(7.6, max(3.0, 0.2 * layers + 1.2)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    shown = [v for matrix in (keys, values) for label, row in zip(labels, matrix) for v in row if "quantized" in label]
    top = max([v for v in shown if v == v] + [1e-12])
    image = None
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
    for ax, matrix, name in zip(axes, (keys, values), ("keys: ||K - K^|| / ||K||", "values: ||V - V^|| / ||V||")):
        masked = [row if "quantized" in label else [float("nan")] * len(row) for label, row in zip(labels, matrix)]
        image = ax.imshow(masked, aspect="auto", cmap=cmap, vmin=0.0, vmax=top, interpolation="nearest")
        heads = len(matrix[0]) if matrix else 0
        ax.set(title=name, xlabel="KV head", xticks=range(heads))
        if layers * heads <= 200:
            for layer, row in enumerate(masked):
                for head, value in enumerate(row):
                    quantized = "quantized" in labels[layer]
                    ax.text(
                        head,
                        layer,
                        f"{value:.2f}" if quantized else labels[layer].replace(" window", "").replace(" latent", ""),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="black" if not quantized or value >= 0.6 * top else "white",
                    )
    axes[0].set_ylabel("layer")
    if layers <= 64:
        axes[0].set_yticks(range(layers), [f"{i} {label}" for i, label in enumerate(labels)], fontsize=6)
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="relative error", shrink=0.8)
    fig.suptitle(title)
    return fig


def drift_runs(results: Sequence[Any]) -> dict[str, list[float]]:
    """The context's error through its flushes, per spec, from `SpecResult`s: the error after the prefill, then
    after each flush of the longest run of flushes (the perplexity feed's, or a scored answer's). Specs without a
    flush (`dynamic`, `fp8`, or a residual never filled) are left out.

    Returns:
        {`spec text`: [error after the prefill, after flush 1, after flush 2, ...]}.
    """
    out = {}
    for r in results:
        runs = [q.context_errors for q in r.questions]
        if r.perplexity is not None:
            runs.append(r.perplexity.context_errors)
        longest = max(runs, key=len, default=())
        if longest:
            out[r.spec_text] = [r.kv_error.context_total, *longest]
    return out


def drift_frame(runs: Mapping[str, Sequence[float]]) -> pd.DataFrame:
    """Long format of `drift_runs` (or any {label: [error after the prefill, after flush 1, ...]}).

    Returns:
        Columns `spec` (string), `flush` (int: 0 = after the prefill), `context error` (float, relative).
    """
    rows = [(label, i, value) for label, errors in runs.items() for i, value in enumerate(errors)]
    return typed_frame(rows, {"spec": "string", "flush": "int64", "context error": "float64"})


def drift_figure(runs: Mapping[str, Sequence[float]], title: str = "The context's KV error across flushes") -> Figure:
    """One line per spec: the context's relative KV error after the prefill (flush 0) and after each flush, which
    de-quantizes the whole store and quantizes it again. A flat line: re-quantizing keeps the error; a rising one:
    it accumulates."""
    fig = Figure(figsize=(7, 3.4), layout="constrained")
    ax = fig.add_subplot()
    frame = drift_frame(runs)
    for label, part in frame.groupby("spec", sort=False):
        ax.plot(part["flush"], part["context error"], marker="o", markersize=3, label=label)
    ax.set(xlabel="flush (0: after the prefill)", ylabel="relative error of the context's K and V", title=title)
    ax.set_ylim(bottom=0)
    if runs:
        ax.legend(fontsize="small")
    return fig
