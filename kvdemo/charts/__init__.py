"""Chart data and figures from records only, never from a live cache: a session's steps (`steps`), the
reports of a comparison (`reports`) and of a needle grid (`needle`), and what their data frames share (`frames`)."""

from kvdemo.charts.needle import needle_heatmap_figure
from kvdemo.charts.reports import (
    comparison_display_frame,
    drift_figure,
    kv_error_figure,
    kv_error_frame,
    speed_figure,
    tradeoff_figure,
)
from kvdemo.charts.steps import answers_frame, memory_frame

__all__ = [
    "answers_frame",
    "comparison_display_frame",
    "drift_figure",
    "kv_error_figure",
    "kv_error_frame",
    "memory_frame",
    "needle_heatmap_figure",
    "speed_figure",
    "tradeoff_figure",
]
