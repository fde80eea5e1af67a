"""A per-layer plan: the keys' bits, the values' bits and the rotation of every layer of a quantized cache, written
as the `plan` option of a spec (`quanto,plan=k4v2h*12+k2v2h*18`).

Why: layers do not suffer alike from a quantized KV cache, so one precision for every layer spends bits where
they buy little. A plan gives each layer its own `nbits` (keys), `nbits_value` (values) and `rotation`, each taken
by the library's own layer for that layer (`kvdemo.cache.layers.flush.quantized_cache`); `kvdemo.evals.planner` chooses
one from the error measured on the user's own text under a byte budget. Pattern: per-layer mixed KV precision
(KVTuner, Li et al. 2025, arXiv:2502.04420; llama.cpp's `--cache-type-k`/`--cache-type-v` taken per tensor).

The syntax, one entry per run of equal layers, in layer order, joined by `+`:

    k<nbits>v<nbits_value>[h][*<layers>]      k4v2h*12 = 12 layers: keys at 4 bits, values at 2, rotated

`h` is `rotation=hadamard` for that layer's keys and values (no `h`: `none`); `*<layers>` repeats the entry (1 when
left out). The runs must cover exactly the model's layers. Letters are read in either case; `plan_text` writes the
canonical form (lower case, equal neighbours merged). No torch here: the command line's parser reads it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from kvdemo.cache.policies import ROTATIONS

PLAN = "plan"
"""The spec option a plan is written in (`kvdemo.cache.registry.SPEC_OPTIONS`)."""

MAX_PLAN_LAYERS = 1024
"""No model here has more layers; a plan that counts more is refused."""

_ENTRY = re.compile(r"k(\d+)v(\d+)(h?)(?:\*(\d+))?")
SYNTAX = "k<nbits>v<nbits_value>[h][*<layers>]+..."
"""The plan's syntax in one line, for messages, `--help` and the README's backend table."""

EXAMPLE = "k4v2h*12+k2v2h*18"
"""A plan for a 30-layer model, for messages."""


class LayerPrecision(NamedTuple):
    """One layer's precision in a plan: `nbits` bits per key value, `nbits_value` per value value, and its
    `rotation` (one of `kvdemo.cache.policies.ROTATIONS`)."""

    nbits: int
    nbits_value: int
    rotation: str = ROTATIONS[0]

    @property
    def text(self) -> str:
        """`k4v2h` (rotated) or `k4v2`."""
        return f"k{self.nbits}v{self.nbits_value}{'h' if self.rotation != ROTATIONS[0] else ''}"


def parse_plan(text: str) -> tuple[LayerPrecision, ...]:
    """The layers of a plan written in `SYNTAX`, one `LayerPrecision` per layer.

    Raises:
        ValueError: empty text, an entry that is not `k<bits>v<bits>[h][*<layers>]` (the message quotes it and
            gives the syntax), a count of 0, or more than `MAX_PLAN_LAYERS` layers.

    Example:
        >>> parse_plan("k4v2h*2+k2v2")
        (LayerPrecision(nbits=4, nbits_value=2, rotation='hadamard'), LayerPrecision(nbits=4, nbits_value=2,
        rotation='hadamard'), LayerPrecision(nbits=2, nbits_value=2, rotation='none'))
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"plan is empty; write {SYNTAX}, e.g. {EXAMPLE}")
    layers: list[LayerPrecision] = []
    for entry in text.strip().lower().split("+"):
        match = _ENTRY.fullmatch(entry.strip())
        if match is None:
            raise ValueError(
                f"plan entry {entry.strip()[:40]!r} is not k<nbits>v<nbits_value>[h][*<layers>]; write {SYNTAX}, "
                f"e.g. {EXAMPLE}"
            )
        key_bits, value_bits, rotated, count = match.groups()
        repeat = int(count) if count is not None else 1
        if repeat < 1:
            raise ValueError(f"plan entry {entry.strip()!r} repeats {repeat} times; give *1 or more (or leave it out)")
        if len(layers) + repeat > MAX_PLAN_LAYERS:
            raise ValueError(f"the plan names more than {MAX_PLAN_LAYERS} layers; give one entry per model layer")
        rotation = ROTATIONS[1] if rotated else ROTATIONS[0]
        layers += [LayerPrecision(int(key_bits), int(value_bits), rotation)] * repeat
    return tuple(layers)


def plan_text(layers: Sequence[LayerPrecision]) -> str:
    """The canonical text of a plan: equal neighbours merged into one `*<layers>` run, lower case.

    Raises:
        ValueError: no layer.

    Example:
        >>> plan_text([LayerPrecision(4, 2, "hadamard")] * 2 + [LayerPrecision(2, 2)])
        'k4v2h*2+k2v2'
    """
    if not layers:
        raise ValueError("a plan needs at least one layer")
    runs: list[list] = []
    for layer in layers:
        if runs and runs[-1][0] == layer:
            runs[-1][1] += 1
        else:
            runs.append([layer, 1])
    return "+".join(f"{layer.text}*{count}" if count > 1 else layer.text for layer, count in runs)


def canonical_plan(text: str) -> str:
    """`plan_text(parse_plan(text))`: the one way a plan is written (so that two texts of one plan are one spec).

    Raises:
        ValueError: see `parse_plan`.
    """
    return plan_text(parse_plan(text))


def plan_problem(layers: Sequence[LayerPrecision], model_layers: int, allowed_bits: Sequence[int]) -> str | None:
    """Why a plan cannot run on a model with `model_layers` quantized layers (`kvdemo.cache.model.layer_kinds
    .quantized_layers`: a plan gives bits only to the layers that take them) and a backend taking `allowed_bits`,
    or None.

    The message says what to change: the layer count the model has, or the bits the backend takes."""
    if len(layers) != model_layers:
        return (
            f"the plan gives {len(layers)} layers and this model has {model_layers} layers that are quantized; give "
            "one entry per quantized layer (full_attention layers, and sliding_attention ones with sliding=quantize)"
        )
    for index, layer in enumerate(layers):
        for name, bits in (("nbits", layer.nbits), ("nbits_value", layer.nbits_value)):
            if bits not in allowed_bits:
                allowed = ", ".join(map(str, allowed_bits))
                return f"the plan's layer {index} ({layer.text}) asks {name}={bits}; this backend takes {allowed}"
    return None


def mean_bits(layers: Sequence[LayerPrecision]) -> tuple[float, float]:
    """(keys, values): the mean bits per value over the layers (every layer holds as many values)."""
    count = len(layers)
    return sum(layer.nbits for layer in layers) / count, sum(layer.nbits_value for layer in layers) / count
