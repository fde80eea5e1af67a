"""What a per-layer plan may be and what it costs (`kvdemo.evals.planner` chooses one): the base every candidate
keeps (`plan_base`), the bits and rotations a layer may take (`candidates`), each planned layer's bytes per context
token and the kept layers' at a stated context length (`layer_bytes_per_token`: the registry's byte formula, layer by
layer), and the checks of a budget before any work (`check_budget`).

The budget is in bytes per context token at a stated context length: the layers the spec keeps at full precision
(sliding windows, protected layers) count at that length, so that a window, whose bytes stop growing, weighs less at a
longer context. No residual is counted: every token quantized, as a long context holds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from kvdemo.cache.layer_plan import PLAN
from kvdemo.cache.model.geometry import KVGeometry, element_size, split_geometry
from kvdemo.cache.options import PLANNED
from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.models import LoadedModel

MIN_PLAN_BITS = 2
"""The fewest bits a plan gives a layer's keys or values. hqq's 1-bit stores err by more than their own norm (hqq:1:
perplexity x 2,694 on the embedded model, docs/compare.md), beyond where one layer's attention error predicts the
model's: with 1-bit candidates, hqq's plan at 5,760 bytes per token put layer 0 at 1 bit and lost to the uniform
K2/V4 on the Normans example (mean KL 0.976 against 0.902); without them it wins (0.752; benchmarks/plan.py)."""


def plan_base(base: CacheSpec) -> CacheSpec:
    """`base` without the options a plan sets (nbits, nbits_value, rotation) or a plan: what every candidate and the
    chosen plan keep.

    Raises:
        ValueError: a backend that takes no plan (`dynamic`, `fp8`), or a spec the registry refuses."""
    base = base.validate()
    if PLAN not in base.info.options:
        takes = ", ".join(name for name, b in BACKENDS.items() if PLAN in b.options)
        raise ValueError(f"backend={base.backend} takes no per-layer plan; choose {takes}")
    return base.replace(**{name: None for name in (*PLANNED, PLAN)})


def candidates(base: CacheSpec, config) -> tuple[list[int], list[str]]:
    """The bits and rotations a plan of `base` may give a layer on this model: the backend's nbits from
    `MIN_PLAN_BITS` whose group rule fits `base`'s q_group_size and axes for keys and values alike, and its rotations
    (`none` alone where the head_dim takes no Hadamard matrix)."""
    options = base.info.options
    choices = [b for b in cast("tuple[int, ...]", options["nbits"].choices) if b >= MIN_PLAN_BITS]
    bits = [b for b in choices if _runs(base.replace(nbits=b), config)]
    rotations = [str(r) for r in cast("tuple[str, ...]", options["rotation"].choices)]
    rotations = [r for r in rotations if _runs(base.replace(nbits=bits[0] if bits else None, rotation=r), config)]
    return bits, rotations


def _runs(spec: CacheSpec, config) -> bool:
    try:
        spec.validate(config)
    except ValueError:
        return False
    return True


def checked_tokens(context_tokens: int) -> int:
    """`context_tokens`, once it is a whole number of tokens >= 1 (else ValueError saying so)."""
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context_tokens={context_tokens!r} must be a whole number of tokens, at least 1")
    return context_tokens


def layer_bytes_per_token(
    base: CacheSpec, bits: Sequence[int], loaded_model: LoadedModel, context_tokens: int
) -> tuple[tuple[dict[tuple[int, int], float], ...], float]:
    """Per planned layer, (key bits, value bits) -> its bytes per context token at `context_tokens` (the registry's
    formula on that layer's geometry alone, no residual: every token quantized); and the kept layers' bytes per
    context token at that length (full precision, a window's at most its window)."""
    config, element = loaded_model.config, element_size(loaded_model.dtype)
    opts = base.resolved()
    quantized, kept = split_geometry(config, str(opts.get("sliding", "keep")), str(opts.get("protect", "0:0")))
    per_layer: list[dict[tuple[int, int], float]] = [{} for _ in quantized.per_layer]
    for k in bits:
        for v in bits:
            resolved = base.replace(nbits=k, nbits_value=v).validate(config).resolved()
            for j, geometry in enumerate(quantized.per_layer):
                one = KVGeometry((geometry,))
                per_layer[j][(k, v)] = (
                    base.info.kv_bytes(resolved, one, context_tokens, 0, element, False, None) / context_tokens
                )
    return tuple(per_layer), element * kept.values_held(context_tokens) / context_tokens


def check_budget(
    loaded_model: LoadedModel, base: CacheSpec, budget_bytes_per_token: float, context_tokens: int
) -> CacheSpec:
    """Check a plan's request before any work: the base takes a plan (`plan_base`) and quantizes some layer of this
    model, and the budget is a number of bytes per context token (at `context_tokens`) at least the backend's
    smallest cache on this model at that length.

    Returns:
        `plan_base(base)`.

    Raises:
        ValueError: saying what to change (the smallest budget allowed, the backends that take a plan, the options
            that would quantize something: `UnsupportedModelError`).
    """
    base = plan_base(base)
    base.fit(loaded_model.config).validate(loaded_model.config)  # a base that quantizes nothing here is refused
    at = checked_tokens(context_tokens)
    refuse_budget(budget_bytes_per_token, _smallest_bytes(base, loaded_model, at), base.backend, at)
    return base


def _smallest_bytes(base: CacheSpec, loaded_model: LoadedModel, context_tokens: int) -> float:
    """Bytes per context token of `base`'s backend at `context_tokens` with every planned layer at its fewest bits,
    the kept layers included."""
    fitted = base.fit(loaded_model.config)
    bits, _ = candidates(fitted, loaded_model.config)
    if not bits:
        return 0.0
    layer_bytes, kept = layer_bytes_per_token(fitted, [min(bits)], loaded_model, context_tokens)
    return kept + sum(min(per.values()) for per in layer_bytes)


def refuse_budget(budget: float, smallest: float, backend: str, context_tokens: int) -> None:
    """Refuse a budget that is not a positive number of bytes per token, or below `smallest` (the backend's cache
    with every layer at its fewest bits), saying what to give."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget={budget!r} must be a number of bytes per token")
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"budget={budget} must be a positive number of bytes per token")
    if budget < smallest - 1e-6:
        raise ValueError(
            f"a budget of {budget:,.0f} bytes per token is below the smallest {backend} cache on this model at "
            f"{context_tokens:,} context tokens ({smallest:,.0f}: every layer at the fewest bits); give "
            f"{math.ceil(smallest):,} or more"
        )
