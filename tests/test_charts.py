"""kvdemo.charts: the comparison's figures (the reader's table: MiB, rounding, groups, empty columns dropped; the
KV error heatmap and its frame, the drift lines) and the chart frames read by field, all from a real comparison on a
tiny model."""

from __future__ import annotations

import math

import pytest
from matplotlib.figure import Figure

from kvdemo import CacheSpec
from kvdemo.charts.reports import (
    DISPLAY_HELP,
    comparison_display_frame,
    display_groups,
    drift_figure,
    drift_frame,
    drift_runs,
    kv_error_figure,
    kv_error_frame,
    speed_figure,
    tradeoff_figure,
    tradeoff_frame,
)
from kvdemo.compare.run import compare

CONTEXT = "The Normans were the people who gave their name to Normandy. Rollo led them. " * 3
CONTINUATION = " Their descendants spread to England, Italy and the Near East over the next century. " * 2


@pytest.fixture(scope="module")
def report(tiny):
    specs = [CacheSpec("hqq", nbits=2, residual_length=2), CacheSpec("fp8")]
    return compare(
        tiny,
        CONTEXT,
        ["Who led them?"],
        specs,
        max_new_tokens=3,
        gold_answers=[["Rollo"]],
        perplexity_tokens=8,
        continuation=CONTINUATION,
    )


def test_display_frame_shows_mib_and_groups_memory_fidelity_speed(report):
    full = report.to_frame()
    display = comparison_display_frame(full)
    assert display["spec"].tolist() == ["dynamic", "hqq:2,residual_length=2", "fp8"]
    assert display["KV MiB"].tolist() == [round(b / 2**20, 2) for b in full["KV bytes"]]
    assert display["× dynamic"].tolist() == [round(r, 3) for r in full["ratio to dynamic"]]
    assert display["same top %"].tolist() == [round(r.kl.same_top_p, 1) for r in report.results]
    assert display["PPL ×"].iloc[0] == 1.0 and display["bytes/token"].dtype == "int64"
    groups = display_groups(display)
    assert list(groups) == ["memory", "fidelity", "speed"]
    assert groups["memory"][:3] == ["KV MiB", "bytes/token", "× dynamic"] and groups["speed"][0] == "tokens/s"
    # every header is explained, and the order is spec, then memory, fidelity, speed
    assert set(display.columns) <= set(DISPLAY_HELP)
    assert list(display.columns) == ["spec"] + groups["memory"] + groups["fidelity"] + groups["speed"] + ["deploy"]
    assert display["deploy"].tolist()[0] == "every engine's default cache"
    grouped = comparison_display_frame(full, grouped=True)
    assert grouped.columns.nlevels == 2 and grouped[("memory", "KV MiB")].tolist() == display["KV MiB"].tolist()
    assert len(grouped.columns) == len(display.columns)


def test_display_frame_drops_columns_without_values(report):
    full = report.to_frame()
    display = comparison_display_frame(full)
    assert {"contains gold", "F1", "PPL", "drift ×"} <= set(display.columns)  # gold, a perplexity run, hqq's flushes
    bare = full.assign(
        **{
            "contains gold": math.nan,
            "F1": math.nan,
            "PPL": math.nan,
            "PPL ratio to dynamic": math.nan,
            "drift (×)": math.nan,
        }
    )
    display = comparison_display_frame(bare)
    assert not {"contains gold", "F1", "PPL", "PPL ×", "drift ×"} & set(display.columns)
    assert "mean KLD" in display.columns and len(display) == 3
    empty = comparison_display_frame(full.iloc[:0])
    assert len(empty) == 0 and "spec" in empty.columns
    # kept layers: no column where no spec keeps any; where one does, the others keep 0 MiB, not NaN
    assert "kept MiB" not in display.columns
    kept = comparison_display_frame(full.assign(**{"kept bytes": [math.nan, 3 * 2**20, math.nan]}))
    assert kept["kept MiB"].tolist() == [0.0, 3.0, 0.0]


def test_kv_error_frame_and_heatmap(report):
    hqq = report.results[1]
    frame = kv_error_frame(hqq.kv_error)
    assert len(frame) == 2 * 2 * 2  # tiny: 2 layers x 2 KV heads, keys and values
    keys = frame[frame["tensor"] == "keys"].pivot(index="layer", columns="KV head", values="relative error")
    assert keys.values.tolist() == [list(row) for row in hqq.kv_error.keys]
    # the dict of to_dict() gives the same frame
    assert kv_error_frame(report.to_dict()["results"][1]["kv_error"]).equals(frame)
    fig = kv_error_figure(hqq.kv_error, title="hqq 2-bit")
    assert isinstance(fig, Figure)
    heatmaps = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in heatmaps] == ["keys: ||K - K^|| / ||K||", "values: ||V - V^|| / ||V||"]
    assert heatmaps[0].images[0].get_array().tolist() == [list(row) for row in hqq.kv_error.keys]
    assert len(fig.axes) == 3  # and a colour bar


def test_drift_lines_from_the_comparison(report):
    runs = drift_runs(report.results)
    hqq = report.results[1]
    assert list(runs) == ["hqq:2,residual_length=2"]  # dynamic and fp8 never flush
    assert runs["hqq:2,residual_length=2"] == [hqq.kv_error.total, *hqq.perplexity.context_errors]
    frame = drift_frame(runs)
    assert frame["flush"].tolist() == list(range(1 + len(hqq.perplexity.context_errors)))
    fig = drift_figure(runs)
    line = fig.axes[0].lines[0]
    assert line.get_ydata().tolist() == runs["hqq:2,residual_length=2"]
    assert drift_frame({}).dtypes.tolist() == ["string", "int64", "float64"]


def test_chart_frames_read_fields_not_labels(report):
    full = report.to_frame()
    tradeoff = tradeoff_frame(full)
    assert tradeoff["backend"].tolist() == ["dynamic", "hqq", "fp8"]
    assert tradeoff["KL (nats)"].tolist() == [r.kl.mean_kld for r in report.results]
    labels = [t.get_text() for t in tradeoff_figure(full, fidelity="KL (nats)").axes[0].texts]
    assert labels == ["dynamic", "hqq:2,residual_length=2", "fp8"]
    bars = speed_figure(full).axes[0]
    assert [t.get_text() for t in bars.get_yticklabels()] == labels


def test_an_infinite_kl_is_reported_as_such(report):
    """A spec whose cache gives zero probability to a token `dynamic` does not has KL +inf (issue 23): the reader's
    table shows inf, the page's line names the spec and says the chart leaves it out, and the JSON download and
    `--json` carry "inf" in strict JSON; no NaN anywhere."""
    import dataclasses
    import json

    from kvdemo.ui import views

    fp8 = report.results[-1]
    inf = float("inf")
    broken = dataclasses.replace(fp8, kl=dataclasses.replace(fp8.kl, mean_kld=inf, max_kld=inf))
    infinite = dataclasses.replace(report, results=(*report.results[:-1], broken))
    note, table, tradeoff, _ = views.comparison_outputs(infinite, "Compared")
    assert "⚠ mean KL is infinite for fp8" in note and "leaves it out" in note
    assert "⚠" not in views.comparison_outputs(report, "Compared")[0]  # finite: no word about it
    assert table["mean KLD"].iloc[-1] == inf
    assert tradeoff["value"]["KL (nats)"].iloc[-1] == inf
    assert tradeoff["y_lim"][1] < inf  # the axis holds the points it can place
    text = infinite.to_json()
    results = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))["results"]
    assert results[-1]["kl"]["mean_kld"] == "inf" and results[-1]["kl"]["max_kld"] == "inf"
    assert results[0]["kl"]["mean_kld"] == report.results[0].kl.mean_kld  # finite figures stay numbers
