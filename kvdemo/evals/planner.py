"""A per-layer plan chosen for a byte budget from the error measured on the user's own text: which layers' keys and
values get more bits, and which are rotated (`kvdemo.cache.layer_plan` writes the result as a spec's `plan`).

The measure (`layer_errors`): one full-precision prefill of the context through the model, which also records the
last `query_tokens` queries of every layer (`kvdemo.cache.layers.attention.recording_queries`). Then, for every
candidate precision the backend takes (each nbits, each rotation), the context's keys and values are quantized by
the library's own layers (the cache a spec of that precision builds: its prefill update, as a real prefill does)
and read back in the model's basis (`cache_error.layer_kv`), one layer at a time. A layer's error for a candidate
is the relative squared error of its attention output over those queries, with the keys quantized (values exact)
or the values quantized (keys exact):

    e_K = ||A(q, K^, V) - A(q, K, V)||^2 / ||A(q, K, V)||^2,   A(q, K, V) = softmax(s q K^T + causal mask) V

so the keys' and the values' errors are in the same units, what attention hands on, which the raw relative KV
error is not (a key error moves every score through the softmax; KIVI, Liu et al. 2024). A layer's error at
(key bits, value bits, rotation) is its key error plus its value error.

The choice (`choose_plan`): the plan whose summed error over the layers is least among those whose bytes per token
(the registry's byte formula, `estimate_kv_bytes`) fit the budget: a multiple-choice knapsack, solved exactly by
dynamic programming over the bytes reached. Pattern: sensitivity-aware layer-wise mixed precision of the KV cache
(KVTuner, Li et al. 2025, arXiv:2502.04420, which also measures each layer's attention-output error per
precision); the sum of per-layer errors as the objective is its (and HAWQ's) additivity assumption, checked here
by the measured fidelity of the result against the uniform spec of the same bytes (`benchmarks/plan.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from kvdemo.cache.geometry import kv_geometry
from kvdemo.cache.layer_kinds import UnsupportedModelError, planning_problem
from kvdemo.cache.layer_plan import PLAN, LayerPrecision, plan_text
from kvdemo.cache.layers.attention import recording_queries, uses_query_rotation
from kvdemo.cache.options import PLANNED
from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec, build_cache, estimate_kv_bytes
from kvdemo.evals.cache_error import layer_kv, reference_kv
from kvdemo.qa.models import LoadedModel

MIN_PLAN_BITS = 2
"""The fewest bits a plan gives a layer's keys or values. hqq's 1-bit stores err by more than their own norm (hqq:1:
perplexity x 2,694 on the embedded model, docs/compare.md), beyond where one layer's attention error predicts the
model's: with 1-bit candidates, hqq's plan at 5,760 bytes per token put layer 0 at 1 bit and lost to the uniform
K2/V4 on the Normans example (mean KL 0.976 against 0.902); without them it wins (0.752; benchmarks/plan.py)."""

QUERY_TOKENS = 64
"""Query positions per layer the error is measured over: the context's last ones (where a question's attention
starts from)."""


@dataclass(frozen=True)
class LayerErrors:
    """Per layer, the relative attention-output error of each candidate precision of the keys and of the values.

    Attributes:
        base: the spec whose other options (q_group_size, axes, residual_length, flush, optimize) every candidate
            keeps, without nbits, nbits_value, rotation or plan.
        keys, values: [layers] dicts (bits, rotation) -> relative squared error of the attention output (0 exact).
        bytes_per_token: (key bits, value bits) -> bytes per quantized token of a uniform spec at those bits (the
            registry's formula, the scales included).
        tokens: the context's tokens; query_tokens: the query positions measured.
    """

    base: CacheSpec
    keys: tuple[dict[tuple[int, str], float], ...]
    values: tuple[dict[tuple[int, str], float], ...]
    bytes_per_token: dict[tuple[int, int], float]
    tokens: int
    query_tokens: int

    @property
    def layers(self) -> int:
        return len(self.keys)

    def layer_error(self, layer: int, precision: LayerPrecision) -> float:
        """The error of one layer at `precision`: its keys' error plus its values'."""
        return (
            self.keys[layer][(precision.nbits, precision.rotation)]
            + self.values[layer][(precision.nbits_value, precision.rotation)]
        )

    def plan_error(self, plan: Sequence[LayerPrecision]) -> float:
        """The summed error of a plan (one precision per layer), the quantity `choose_plan` makes least."""
        return sum(self.layer_error(i, p) for i, p in enumerate(plan))

    def plan_bytes(self, plan: Sequence[LayerPrecision]) -> float:
        """Bytes per quantized token of a plan: each layer's share of its precision's uniform bytes (the byte
        formula is a sum over layers, so this is the plan's own formula, scales included)."""
        return sum(self.bytes_per_token[(p.nbits, p.nbits_value)] for p in plan) / len(plan)


@dataclass(frozen=True)
class LayerPlan:
    """A chosen plan and what it was chosen from.

    Attributes:
        spec: the base spec with the plan (`quanto,plan=k4v2h*12+...`), ready for a session or a comparison.
        layers: one `LayerPrecision` per layer.
        budget_bytes_per_token: the budget asked for; bytes_per_token: the plan's (<= the budget).
        error: the plan's summed layer error; uniform_error: that of the best uniform precision (every layer alike,
            the best rotation) within the same budget, None where none fits.
        uniform: that uniform spec (`quanto:4,nbits_value=2,rotation=hadamard`), None where none fits.
        errors: the measure it was chosen from.
    """

    spec: CacheSpec
    layers: tuple[LayerPrecision, ...]
    budget_bytes_per_token: float
    bytes_per_token: float
    error: float
    uniform_error: float | None
    uniform: CacheSpec | None
    errors: LayerErrors

    def summary(self) -> str:
        """One line: the plan, its bytes against the budget, its error against the uniform spec's."""
        uniform = (
            f"; the best uniform spec within it, {self.uniform.text}: {self.uniform_error:.4g}"
            if self.uniform is not None and self.uniform_error is not None
            else ""
        )
        return (
            f"{self.spec.text}: {self.bytes_per_token:,.0f} bytes per token (budget "
            f"{self.budget_bytes_per_token:,.0f}), summed attention error {self.error:.4g}{uniform}"
        )


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


def _candidates(base: CacheSpec, config) -> tuple[list[int], list[str]]:
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


def _attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of the last query positions over every key, causal: [batch, heads, queries, head_dim] in float64.

    query: [batch, heads, queries, head_dim] (the context's last positions); keys, values: [batch, kv_heads,
    tokens, head_dim] (grouped-query heads shared as the model shares them)."""
    queries, tokens = query.shape[-2], keys.shape[-2]
    positions = torch.arange(tokens - queries, tokens).unsqueeze(-1)
    mask = torch.arange(tokens).unsqueeze(0) <= positions  # [queries, tokens]
    groups = query.shape[1] // keys.shape[1]
    keys, values = (t.double().repeat_interleave(groups, dim=1) for t in (keys, values))
    return F.scaled_dot_product_attention(query.double(), keys, values, attn_mask=mask, scale=scaling)


def _relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).pow(2).sum() / exact.pow(2).sum().clamp_min(1e-300))


def layer_errors(
    loaded_model: LoadedModel,
    token_ids: Sequence[int],
    base: CacheSpec,
    query_tokens: int = QUERY_TOKENS,
) -> LayerErrors:
    """Measure every layer's attention-output error at every candidate precision of `base`'s backend on this
    context (see the module docstring).

    Work: one full-precision prefill of `token_ids`, then per candidate (nbits x rotations: quanto 4, hqq 8) one
    quantization of the whole context's keys and values by the library's layers, and per layer and candidate two
    attentions of `query_tokens` queries over the context.

    Args:
        loaded_model: a model that attends through kvdemo's attention function (every sdpa model `load_model`
            gives), whose queries are recorded.
        token_ids: the context's ids as a prefill feeds them (`QASession.context_ids`).
        base: the backend and the options every candidate keeps (`plan_base`).
        query_tokens: query positions per layer (the context's last ones).

    Returns:
        The `LayerErrors`.

    Raises:
        UnsupportedModelError (a ValueError): a latent (MLA) model, or one with layers a quantized backend does not
            quantize (sliding-window, recurrent, KV-shared: `kvdemo.cache.layer_kinds`).
        ValueError: a model whose attention is not kvdemo's (eager, flash: its queries cannot be recorded), an empty
            context or one over the window, query_tokens < 1, a backend that takes no plan, or a base whose
            options fit no bits on this model.
    """
    if not uses_query_rotation(loaded_model.config):
        raise ValueError(
            "a per-layer plan measures attention with the model's own queries, through kvdemo's attention function; "
            f"this model attends with {getattr(loaded_model.config, '_attn_implementation', '?')}. Load it with "
            "attn_implementation='sdpa'"
        )
    config = loaded_model.config
    problem = planning_problem(config)
    if problem:
        raise UnsupportedModelError(problem)
    base = plan_base(base).fit(config)
    bits, rotations = _candidates(base, config)
    if not bits:
        raise ValueError(f"no nbits of {base.backend} fits {base.short_text} on this model; change q_group_size")
    with recording_queries(query_tokens) as record:
        reference = reference_kv(loaded_model, token_ids)
    layers = kv_geometry(config).layers
    exact = [_attention(record.queries[i], k, v, record.scaling[i]) for i, (k, v) in enumerate(reference)]
    keys: list[dict[tuple[int, str], float]] = [{} for _ in range(layers)]
    values: list[dict[tuple[int, str], float]] = [{} for _ in range(layers)]
    for nbits in bits:
        for rotation in rotations:
            cache = build_cache(base.replace(nbits=nbits, rotation=rotation), config)
            for i, (layer, (k, v)) in enumerate(zip(cast("list[DynamicLayer]", cache.layers), reference)):
                with torch.no_grad():
                    layer.update(k, v)  # the prefill's update: the library quantizes the whole context
                k_hat, v_hat = layer_kv(layer)  # one layer de-quantized at a time: little memory held
                cache.layers[i] = DynamicLayer()  # its store freed
                q, scale = record.queries[i], record.scaling[i]
                keys[i][(nbits, rotation)] = _relative(_attention(q, k_hat, v, scale), exact[i])
                values[i][(nbits, rotation)] = _relative(_attention(q, k, v_hat, scale), exact[i])
    dtype = loaded_model.dtype
    per_token = {
        (k, v): estimate_kv_bytes(base.replace(nbits=k, nbits_value=v), config, 1 << 16, dtype) / (1 << 16)
        for k in bits
        for v in bits
    }
    return LayerErrors(base, tuple(keys), tuple(values), per_token, len(token_ids), record.last)


def choose_plan(errors: LayerErrors, budget_bytes_per_token: float) -> LayerPlan:
    """The plan of least summed layer error whose bytes per quantized token fit the budget (exact: dynamic
    programming over the bytes reached, layer by layer, keeping the least error for each total).

    Args:
        errors: from `layer_errors`.
        budget_bytes_per_token: bytes per quantized token (the registry's formula, scales included: `quanto:4` is
            7,200 on the embedded model, `quanto:2` 4,320).

    Returns:
        The `LayerPlan`, with the best uniform spec within the same budget beside it.

    Raises:
        ValueError: a budget that is not a positive number, or below the smallest cache (every layer at the fewest
            bits): the message gives that smallest figure.
    """
    _check_budget(budget_bytes_per_token, min(errors.bytes_per_token.values()), errors.base.backend)
    # per layer, each (key bits, value bits) at its better rotation (a rotation costs no byte)
    options = []
    for layer in range(errors.layers):
        best: dict[tuple[int, int], tuple[float, LayerPrecision]] = {}
        for nbits, rotation in errors.keys[layer]:
            for nbits_value, rotation_v in errors.values[layer]:
                if rotation_v != rotation:
                    continue
                candidate = LayerPrecision(nbits, nbits_value, rotation)
                error = errors.layer_error(layer, candidate)
                if (nbits, nbits_value) not in best or error < best[(nbits, nbits_value)][0]:
                    best[(nbits, nbits_value)] = (error, candidate)
        options.append(list(best.values()))
    share = {key: value / errors.layers for key, value in errors.bytes_per_token.items()}
    # states: bytes reached (rounded, to merge equal sums) -> (error, choices)
    states: dict[float, tuple[float, tuple[LayerPrecision, ...]]] = {0.0: (0.0, ())}
    for layer_options in options:
        nxt: dict[float, tuple[float, tuple[LayerPrecision, ...]]] = {}
        for spent, (error, chosen) in states.items():
            for option_error, precision in layer_options:
                cost = round(spent + share[(precision.nbits, precision.nbits_value)], 6)
                if cost > budget_bytes_per_token + 1e-6:
                    continue
                total = error + option_error
                if cost not in nxt or total < nxt[cost][0]:
                    nxt[cost] = (total, (*chosen, precision))
        states = nxt
    error, chosen = min(states.values(), key=lambda state: state[0])
    spec = errors.base.replace(plan=plan_text(chosen)).validate()
    uniform, uniform_error = _best_uniform(errors, budget_bytes_per_token)
    return LayerPlan(
        spec, chosen, budget_bytes_per_token, errors.plan_bytes(chosen), error, uniform_error, uniform, errors
    )


def _best_uniform(errors: LayerErrors, budget: float) -> tuple[CacheSpec | None, float | None]:
    """The uniform spec (every layer at one precision and one rotation) of least summed error within `budget`."""
    best: tuple[float, LayerPrecision] | None = None
    rotations = sorted({rotation for _, rotation in errors.keys[0]})
    for (nbits, nbits_value), per_token in errors.bytes_per_token.items():
        if per_token > budget + 1e-6:
            continue
        for rotation in rotations:
            precision = LayerPrecision(nbits, nbits_value, rotation)
            error = errors.plan_error([precision] * errors.layers)
            if best is None or error < best[0]:
                best = (error, precision)
    if best is None:
        return None, None
    error, p = best
    value_bits = p.nbits_value if p.nbits_value != p.nbits else None  # unset: nbits, as transformers
    rotated = p.rotation if p.rotation != "none" else None
    return errors.base.replace(nbits=p.nbits, nbits_value=value_bits, rotation=rotated), error


def plan_layers(
    loaded_model: LoadedModel,
    token_ids: Sequence[int],
    base: CacheSpec,
    budget_bytes_per_token: float,
    query_tokens: int = QUERY_TOKENS,
) -> LayerPlan:
    """`choose_plan(layer_errors(...), budget)`: a per-layer plan for this model and context within the budget.

    Example:
        >>> ids = QASession(loaded).context_ids(case.context)
        >>> plan = plan_layers(loaded, ids, CacheSpec("quanto"), budget_bytes_per_token=5760)
        >>> plan.spec.short_text   # 'quanto,plan=k4v2h*...'
        >>> QASession(loaded, plan.spec).prefill(case.context)

    Raises:
        ValueError: see `layer_errors` and `choose_plan` (the budget is checked first, against the backend's
            smallest cache on this model, before the prefill).
    """
    base = check_budget(loaded_model, base, budget_bytes_per_token)  # before the prefill
    return choose_plan(layer_errors(loaded_model, token_ids, base, query_tokens), budget_bytes_per_token)


def check_budget(loaded_model: LoadedModel, base: CacheSpec, budget_bytes_per_token: float) -> CacheSpec:
    """Check a plan's request before any work: the base takes a plan (`plan_base`) and the budget is a number of
    bytes per token at least the backend's smallest cache on this model.

    Returns:
        `plan_base(base)`.

    Raises:
        ValueError: saying what to change (the smallest budget allowed, the backends that take a plan).
    """
    base = plan_base(base)
    _check_budget(budget_bytes_per_token, _smallest_bytes(base, loaded_model), base.backend)
    return base


def _smallest_bytes(base: CacheSpec, loaded_model: LoadedModel) -> float:
    """Bytes per quantized token of `base`'s backend with every layer at its fewest bits."""
    bits, _ = _candidates(base, loaded_model.config)
    if not bits:
        return 0.0
    fewest = base.replace(nbits=min(bits))
    return estimate_kv_bytes(fewest, loaded_model.config, 1 << 16, loaded_model.dtype) / (1 << 16)


def _check_budget(budget: float, smallest: float, backend: str) -> None:
    """Refuse a budget that is not a positive number of bytes per token, or below `smallest` (the backend's cache
    with every layer at its fewest bits), saying what to give."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget={budget!r} must be a number of bytes per token")
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"budget={budget} must be a positive number of bytes per token")
    if budget < smallest - 1e-6:
        raise ValueError(
            f"a budget of {budget:,.0f} bytes per token is below the smallest {backend} cache on this model "
            f"({smallest:,.0f}: every layer at the fewest bits); give {math.ceil(smallest):,} or more"
        )
