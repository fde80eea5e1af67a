"""The rotation's "why" as pictures (matplotlib, for the notebooks): a layer's per-channel maxima before and after
the Hadamard rotation, and the spans of its quantization groups per spec. The data come from
`kvdemo.evals.channel_spread`; these functions only draw."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from matplotlib.figure import Figure


def channel_max_figure(before: torch.Tensor, after: torch.Tensor, title: str = "Per-channel max |k|") -> Figure:
    """Two heatmaps on one colour scale, KV heads (rows) by head_dim channels (columns): the largest |x| over the
    tokens before the rotation (`before`) and after it (`after`), each [kv_heads, head_dim]
    (`kvdemo.evals.channel_spread.channel_max`), with a line per KV head below each.

    Raises:
        ValueError: the two shapes differ.
    """
    if before.shape != after.shape:
        raise ValueError(f"before {tuple(before.shape)} and after {tuple(after.shape)} differ")
    top = float(max(before.max(), after.max()))
    fig = Figure(figsize=(10, 5), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True, height_ratios=(1, 2))
    image = None
    for column, (matrix, name) in enumerate(((before, "as the model writes it"), (after, "rotated (x @ H)"))):
        image = axes[0][column].imshow(
            matrix.numpy(), aspect="auto", cmap="magma", vmin=0.0, vmax=top, interpolation="nearest"
        )
        axes[0][column].set(title=name, ylabel="KV head", yticks=range(matrix.shape[0]))
        for head, row in enumerate(matrix):
            axes[1][column].plot(row.numpy(), label=f"KV head {head}", linewidth=1)
        axes[1][column].set(xlabel="channel (head_dim)", ylabel="max |x| over the tokens", ylim=(0, top * 1.05))
        axes[1][column].legend(fontsize=7, loc="upper right")
    if image is not None:
        fig.colorbar(image, ax=[axes[0][0], axes[0][1]], label="max |x|", shrink=0.9)
    fig.suptitle(title)
    return fig


def group_span_figure(spans: Mapping[str, torch.Tensor], title: str = "Span of each quantization group") -> Figure:
    """Histograms of the group spans (`kvdemo.evals.channel_spread.group_spans`, [groups] each) of several specs,
    one panel per backend (the part of the label before the first `:` or `,`), overlaid within a panel, the median
    marked.

    Raises:
        ValueError: no spans given.
    """
    if not spans:
        raise ValueError("no spans to draw; give {spec label: group_spans(...)}")
    backends: dict[str, list[str]] = {}
    for label in spans:
        backends.setdefault(label.split(":")[0].split(",")[0], []).append(label)
    fig = Figure(figsize=(5 * len(backends), 3.6), layout="constrained")
    axes = fig.subplots(1, len(backends), squeeze=False)[0]
    top = float(max(s.max() for s in spans.values()))
    for ax, (backend, labels) in zip(axes, backends.items()):
        for label in labels:
            values = spans[label].numpy()
            line = ax.hist(values, bins=60, range=(0, top), histtype="step", linewidth=1.5, label=label)[2][0]
            ax.axvline(float(spans[label].median()), color=line.get_edgecolor(), linestyle="--", linewidth=1)
        ax.set(title=backend, xlabel="span of the group's grid: scale x (2**nbits - 1)", ylabel="groups")
        ax.legend(fontsize=7)
    fig.suptitle(title + " (dashed: the median)")
    return fig


def code_fit_figure(
    before: torch.Tensor,
    after: torch.Tensor,
    centroids: torch.Tensor,
    density: tuple[torch.Tensor, torch.Tensor],
    title: str = "One fixed code for every coordinate",
) -> Figure:
    """TurboQuant's "why" (`kvdemo.cache.formats.turboquant.layers`): the histogram of the coordinates of unit key
    vectors as the model writes them (`before`) and rotated by (x D) H (`after`), each a flat tensor of coordinates
    times sqrt(head_dim) so that N(0, 1) is the scale; the density the code was solved for (`density`: (x, f(x)) on that
    scale), and the code's centroids (`centroids`, the same scale) as vertical lines. Two panels, one per histogram;
    coordinates beyond the axis (the outliers) are drawn in its end bins, as the left panel's title says.

    Raises:
        ValueError: an empty histogram.
    """
    if before.numel() == 0 or after.numel() == 0:
        raise ValueError("no coordinates to draw; give the unit keys' coordinates before and after the rotation")
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    limit = max(4.0, float(centroids.abs().max()) * 1.3)
    panels = ((before, f"as the model writes them (beyond ±{limit:.0f}: at the ends)"), (after, "rotated: (k D) H"))
    for ax, (values, name) in zip(axes, panels):
        clipped = values.clamp(-limit, limit).numpy()
        ax.hist(clipped, bins=120, range=(-limit, limit), density=True, color="#8fb3d9", label="key coordinates")
        ax.plot(density[0].numpy(), density[1].numpy(), color="black", linewidth=1.2, label="what the code expects")
        for index, centroid in enumerate(centroids.tolist()):
            ax.axvline(centroid, color="#d95f02", linewidth=0.8, label="the code's centroids" if index == 0 else None)
        ax.set(title=name, xlabel="coordinate x sqrt(head_dim) of a unit key", xlim=(-limit, limit))
    axes[0].set(ylabel="density")
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title)
    return fig
