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

On every layer kind (`kvdemo.cache.model.layer_kinds`) the plan gives bits to the layers the spec quantizes and to no
other: full-attention layers, sliding-window ones with `sliding=quantize` (their attention is measured over their
window, with the window's mask), less those `protect` keeps. On a latent (MLA) model, whose attention sees the cached
latent only up-projected, a layer's error is the relative squared error of the latent and the rotary key part it stores
(e_K = ||K^ - K||^2 / ||K||^2 of the latent, e_V of the rotary part): the same units across its layers.

The budget is in bytes per context token at a stated context length (by default the context's own): the layers the
spec keeps at full precision (sliding windows, protected layers) count at that length, so that a window, whose
bytes stop growing, weighs less at a longer context.

The choice (`choose_plan`): the plan whose summed error over the layers is least among those whose bytes per token
(the registry's byte formula, layer by layer) fit the budget: a multiple-choice knapsack, solved exactly by
dynamic programming over the bytes reached. Pattern: sensitivity-aware layer-wise mixed precision of the KV cache
(KVTuner, Li et al. 2025, arXiv:2502.04420, which also measures each layer's attention-output error per
precision); the sum of per-layer errors as the objective is its (and HAWQ's) additivity assumption, checked here
by the measured fidelity of the result against the uniform spec of the same bytes (`benchmarks/plan.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from kvdemo.cache.layer_plan import LayerPrecision, plan_text
from kvdemo.cache.layers.attention import QueryRecord, recording_queries, uses_query_rotation
from kvdemo.cache.model.layer_kinds import is_latent, quantized_layers
from kvdemo.cache.spec import CacheSpec, build_cache
from kvdemo.evals.cache_error import ReferenceKV, layer_kv, reference_kv
from kvdemo.evals.plan_budget import (
    candidates,
    check_budget,
    checked_tokens,
    layer_bytes_per_token,
    plan_base,
    refuse_budget,
)
from kvdemo.qa.models import LoadedModel

QUERY_TOKENS = 64
"""Query positions per layer the error is measured over: the context's last ones (where a question's attention
starts from)."""


@dataclass(frozen=True)
class LayerErrors:
    """Per quantized layer, the relative error of each candidate precision of the keys and of the values.

    Attributes:
        base: the spec whose other options (q_group_size, axes, residual_length, flush, optimize, sliding, protect)
            every candidate keeps, without nbits, nbits_value, rotation or plan.
        layer_indices: the model's index of each planned layer (the layers `base` quantizes), in order.
        keys, values: per planned layer, dicts (bits, rotation) -> relative squared error of the attention output
            (of the stored latent on an MLA model; 0 exact).
        layer_bytes: per planned layer, (key bits, value bits) -> its bytes per context token at `context_tokens`
            (the registry's formula for that layer alone, the scales included).
        kept_bytes_per_token: the bytes per context token of the layers `base` keeps at full precision, at
            `context_tokens` (0 on a model whose every layer is quantized).
        context_tokens: the context length the bytes are stated at.
        tokens: the context's tokens; query_tokens: the query positions measured (0 on an MLA model).
        latent: the errors are the stored latent's (MLA), not attention outputs.
    """

    base: CacheSpec
    layer_indices: tuple[int, ...]
    keys: tuple[dict[tuple[int, str], float], ...]
    values: tuple[dict[tuple[int, str], float], ...]
    layer_bytes: tuple[dict[tuple[int, int], float], ...]
    kept_bytes_per_token: float
    context_tokens: int
    tokens: int
    query_tokens: int
    latent: bool = False

    @property
    def layers(self) -> int:
        """The planned (quantized) layers."""
        return len(self.keys)

    @property
    def bytes_per_token(self) -> dict[tuple[int, int], float]:
        """(key bits, value bits) -> bytes per context token of the uniform spec at those bits (every planned layer
        alike, the kept layers included), at `context_tokens`."""
        pairs = self.layer_bytes[0] if self.layer_bytes else {}
        return {pair: self.plan_bytes([LayerPrecision(*pair, "none")] * self.layers) for pair in pairs}

    def layer_error(self, layer: int, precision: LayerPrecision) -> float:
        """The error of one planned layer at `precision`: its keys' error plus its values'."""
        return (
            self.keys[layer][(precision.nbits, precision.rotation)]
            + self.values[layer][(precision.nbits_value, precision.rotation)]
        )

    def plan_error(self, plan: Sequence[LayerPrecision]) -> float:
        """The summed error of a plan (one precision per planned layer), the quantity `choose_plan` makes least."""
        return sum(self.layer_error(i, p) for i, p in enumerate(plan))

    def plan_bytes(self, plan: Sequence[LayerPrecision]) -> float:
        """Bytes per context token of a plan at `context_tokens`: the kept layers' and each planned layer's at its
        precision (the byte formula is a sum over layers, so this is the plan's own formula, scales included)."""
        return self.kept_bytes_per_token + sum(
            self.layer_bytes[i][(p.nbits, p.nbits_value)] for i, p in enumerate(plan)
        )


@dataclass(frozen=True)
class LayerPlan:
    """A chosen plan and what it was chosen from.

    Attributes:
        spec: the base spec with the plan (`quanto,plan=k4v2h*12+...`), ready for a session or a comparison.
        layers: one `LayerPrecision` per layer.
        budget_bytes_per_token: the budget asked for; bytes_per_token: the plan's (<= the budget), both per context
            token at `errors.context_tokens`, the kept layers included.
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
        measure = "latent error" if self.errors.latent else "attention error"
        return (
            f"{self.spec.text}: {self.bytes_per_token:,.0f} bytes per token at {self.errors.context_tokens:,} tokens "
            f"(budget {self.budget_bytes_per_token:,.0f}), summed {measure} {self.error:.4g}{uniform}"
        )


def _attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, tokens: int, window: int | None
) -> torch.Tensor:
    """Attention of the context's last query positions over the keys a layer holds, causal (and within the sliding
    window on a window layer): [batch, heads, queries, head_dim] in float64.

    query: [batch, heads, queries, head_dim] (the context's last positions); keys, values: [batch, kv_heads, held,
    head_dim], the context's last `held` tokens (all of them, or a window's; grouped-query heads shared as the model
    shares them); tokens: the context's tokens; window: the layer's `sliding_window`, None on a full layer."""
    queries, held = query.shape[-2], keys.shape[-2]
    query_at = torch.arange(tokens - queries, tokens).unsqueeze(-1)  # absolute positions
    key_at = torch.arange(tokens - held, tokens).unsqueeze(0)
    mask = key_at <= query_at  # [queries, held]
    if window is not None:
        mask &= key_at > query_at - window
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
    context_tokens: int | None = None,
    prefilled: tuple[ReferenceKV, QueryRecord] | None = None,
) -> LayerErrors:
    """Measure every quantized layer's error at every candidate precision of `base`'s backend on this context (see
    the module docstring).

    Work: one full-precision prefill, then per candidate (nbits x rotations) one quantization of the context by the
    library's layers and per layer two attentions of `query_tokens` queries (two norms on an MLA model).

    Args:
        loaded_model: a model that attends through kvdemo's attention function (every sdpa model `load_model`
            gives), whose queries are recorded; or a latent (MLA) model, whose latent is measured instead.
        token_ids: the context's ids as a prefill feeds them (`QASession.context_ids`).
        base: the backend and the options every candidate keeps (`plan_base`; its `sliding` and `protect` choose
            the layers planned).
        query_tokens: query positions per layer (the context's last ones).
        context_tokens: the context length the bytes per token are stated at; None: len(token_ids).
        prefilled: the full-precision keys and values of `token_ids` and the queries recorded while they were
            prefilled (`recording_queries(query_tokens)` around a `dynamic` prefill of the same ids: a
            recommendation's reference), instead of a prefill here; None: one prefill here.

    Returns:
        The `LayerErrors`.

    Raises:
        ValueError: `base` quantizes nothing here (`UnsupportedModelError`, saying what would), attention that is
            not kvdemo's (eager, flash), an empty context or one over the window, query_tokens or context_tokens < 1,
            a backend that takes no plan, or options that fit no bits on this model.
    """
    config = loaded_model.config
    latent = is_latent(config)
    if not latent and not uses_query_rotation(config):
        raise ValueError(
            "a per-layer plan measures attention with the model's own queries, through kvdemo's attention function; "
            f"this model attends with {getattr(config, '_attn_implementation', '?')}. Load it with "
            "attn_implementation='sdpa'"
        )
    at = len(token_ids) if context_tokens is None else checked_tokens(context_tokens)  # refused before any work
    base = plan_base(base).fit(config).validate(config)  # refuses a base that quantizes nothing here
    bits, rotations = candidates(base, config)
    if not bits:
        raise ValueError(f"no nbits of {base.backend} fits {base.short_text} on this model; change q_group_size")
    planned = _planned_layers(base, config)
    if prefilled is None:
        with recording_queries(query_tokens) as record:
            reference = reference_kv(loaded_model, token_ids)
    else:
        reference, record = prefilled
        if reference.tokens != len(token_ids) or record.last != query_tokens:
            raise ValueError(
                f"the prefilled keys hold {reference.tokens} tokens and {record.last} queries a layer, for "
                f"{len(token_ids)} ids and {query_tokens} queries; prefill these ids under recording_queries"
            )
    tokens = len(token_ids)
    windows, exact = _exact_outputs(reference, record, planned, tokens, config, latent)
    keys: list[dict[tuple[int, str], float]] = [{} for _ in planned]
    values: list[dict[tuple[int, str], float]] = [{} for _ in planned]
    for nbits in bits:
        for rotation in rotations:
            cache = build_cache(base.replace(nbits=nbits, rotation=rotation), config)
            for j, i in enumerate(planned):
                layer = cast("DynamicLayer", cache.layers[i])
                k, v = cast("tuple[torch.Tensor, torch.Tensor]", reference[i])
                with torch.no_grad():
                    layer.update(k, v)  # the prefill's update: the library quantizes the whole context
                k_hat, v_hat = layer_kv(layer)  # one layer de-quantized at a time: little memory held
                cache.layers[i] = DynamicLayer()  # its store freed
                if latent:
                    keys[j][(nbits, rotation)] = _relative(k_hat.double(), k.double())
                    values[j][(nbits, rotation)] = _relative(v_hat.double(), v.double())
                    continue
                q, scale, expected = record.queries[i], record.scaling[i], exact[j]
                assert expected is not None  # measured above for every layer of a model that is not latent
                keys[j][(nbits, rotation)] = _relative(_attention(q, k_hat, v, scale, tokens, windows[j]), expected)
                values[j][(nbits, rotation)] = _relative(_attention(q, k, v_hat, scale, tokens, windows[j]), expected)
    layer_bytes, kept = layer_bytes_per_token(base, bits, loaded_model, at)
    measured = (tuple(planned), tuple(keys), tuple(values), layer_bytes, kept, at, tokens)
    return LayerErrors(base, *measured, 0 if latent else record.last, latent)


def _exact_outputs(
    reference, record, planned: Sequence[int], tokens: int, config, latent: bool
) -> tuple[list[int | None], list[torch.Tensor | None]]:
    """Per planned layer, its sliding window where it holds one (None on a full layer), and the attention output of
    the recorded queries over its full-precision keys and values (None on a latent model, measured on the latent)."""
    window = getattr(config.get_text_config(decoder=True), "sliding_window", None)
    windows: list[int | None] = []
    exact: list[torch.Tensor | None] = []
    for i in planned:
        kv = reference[i]
        assert kv is not None  # a quantized layer holds keys and values
        windows.append(window if kv[0].shape[-2] < tokens else None)
        if latent:
            exact.append(None)
            continue
        exact.append(_attention(record.queries[i], kv[0], kv[1], record.scaling[i], tokens, windows[-1]))
    return windows, exact


def _planned_layers(base: CacheSpec, config) -> list[int]:
    """The model's indices of the layers `base` quantizes (its `sliding` and `protect`)."""
    opts = base.resolved()
    return quantized_layers(config, str(opts.get("sliding", "keep")), str(opts.get("protect", "0:0")))


def choose_plan(errors: LayerErrors, budget_bytes_per_token: float) -> LayerPlan:
    """The plan of least summed layer error whose bytes per quantized token fit the budget (exact: dynamic
    programming over the bytes reached, layer by layer, keeping the least error for each total).

    Args:
        errors: from `layer_errors`.
        budget_bytes_per_token: bytes per context token at `errors.context_tokens`, the kept layers included (the
            registry's formula, scales included: `quanto:4` is 7,200 on the embedded model, `quanto:2` 4,320).

    Returns:
        The `LayerPlan`, with the best uniform spec within the same budget beside it.

    Raises:
        ValueError: a budget that is not a positive number, or below the smallest cache (every layer at the fewest
            bits): the message gives that smallest figure.
    """
    smallest = errors.kept_bytes_per_token + sum(min(per.values()) for per in errors.layer_bytes)
    refuse_budget(budget_bytes_per_token, smallest, errors.base.backend, errors.context_tokens)
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
    # states: bytes reached (rounded, to merge equal sums) -> (error, choices); the kept layers' bytes first
    states: dict[float, tuple[float, tuple[LayerPrecision, ...]]] = {errors.kept_bytes_per_token: (0.0, ())}
    for layer, layer_options in enumerate(options):
        share = errors.layer_bytes[layer]
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
    context_tokens: int | None = None,
    prefilled: tuple[ReferenceKV, QueryRecord] | None = None,
) -> LayerPlan:
    """`choose_plan(layer_errors(...), budget)`: a per-layer plan for this model and context within the budget.

    Args:
        budget_bytes_per_token: bytes per context token at `context_tokens` (None: the context's own length), the
            layers the spec keeps at full precision included.
        prefilled: see `layer_errors`.

    Example:
        >>> ids = QASession(loaded).context_ids(case.context)
        >>> plan = plan_layers(loaded, ids, CacheSpec("quanto"), budget_bytes_per_token=5760)
        >>> plan.spec.short_text   # 'quanto,plan=k4v2h*...'
        >>> QASession(loaded, plan.spec).prefill(case.context)

    Raises:
        ValueError: see `layer_errors` and `choose_plan` (the base and the budget are checked first, against the
            backend's smallest cache on this model, before the prefill).
    """
    at = len(token_ids) if context_tokens is None else context_tokens
    base = check_budget(loaded_model, base, budget_bytes_per_token, at)  # before the prefill
    errors = layer_errors(loaded_model, token_ids, base, query_tokens, at, prefilled)
    return choose_plan(errors, budget_bytes_per_token)
