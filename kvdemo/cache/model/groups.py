"""`q_group_size` against a model's stored shapes: which tensors a spec's group rule checks (the keys and the values,
each with its own bits and axis, every bits a plan gives), and which group sizes fit every layer's stored heads and
widths (`kvdemo.cache.model.geometry.KVGeometry.shapes`: Gemma 4's layers differ; an MLA latent is 512 wide). Read by
`kvdemo.cache.spec` (its checks, `CacheSpec.fit`, `allowed_group_sizes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvdemo.cache.layer_plan import parse_plan
from kvdemo.cache.policies import PROTECT_CHOICES, SLIDING_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from kvdemo.cache.backend import Backend, GroupRule
    from kvdemo.cache.options import SpecOptions


class _Spec(Protocol):
    """What `allowed_group_sizes` reads of a `kvdemo.cache.spec.CacheSpec` (which imports this module)."""

    @property
    def info(self) -> Backend: ...

    def resolved(self) -> SpecOptions: ...


def tensors(opts: SpecOptions) -> list[tuple[str, int, str, int]]:
    """(axis option, axis, bits option, bits) of the keys, then of the values, from resolved options: each tensor's
    group rule is checked with its own axis and bits (`nbits`, `nbits_value`); with a plan, once for every bits the
    plan gives the keys, then the values."""
    if opts.get("plan"):
        layers = parse_plan(opts["plan"])
        return [("axis_key", opts["axis_key"], "nbits", b) for b in sorted({p.nbits for p in layers})] + [
            ("axis_value", opts["axis_value"], "nbits_value", b) for b in sorted({p.nbits_value for p in layers})
        ]
    return [
        ("axis_key", opts["axis_key"], "nbits", opts["nbits"]),
        ("axis_value", opts["axis_value"], "nbits_value", opts.get("nbits_value", opts["nbits"])),
    ]


def _shapes(model_config: PreTrainedConfig, axis_name: str, opts: SpecOptions) -> list[tuple[int, int]]:
    """The stored (heads, width) of the keys or the values over the layers the backend quantizes (a layer kept at
    full precision has no groups: `kvdemo.cache.model.geometry.split_geometry`)."""
    from kvdemo.cache.model.geometry import split_geometry

    quantized, _ = split_geometry(
        model_config, str(opts.get("sliding", SLIDING_CHOICES[0])), str(opts.get("protect", PROTECT_CHOICES[0]))
    )
    return quantized.shapes("keys" if axis_name == "axis_key" else "values")


def first_problem(
    rule: GroupRule | None, opts: SpecOptions, model_config: PreTrainedConfig
) -> tuple[str, int, str, int, str] | None:
    """The first stored tensor whose group rule refuses `opts["q_group_size"]` on any layer's shape: (axis option,
    axis, bits option, bits, why), or None (also for a backend without a group rule)."""
    if rule is None:
        return None
    for axis_name, axis, bits_name, bits in tensors(opts):
        for heads, width in _shapes(model_config, axis_name, opts):
            problem = rule(bits, opts["q_group_size"], axis, heads, width)
            if problem:
                return axis_name, axis, bits_name, bits, problem
    return None


def sizes_that_fit(rule: GroupRule | None, opts: SpecOptions, model_config: PreTrainedConfig) -> dict[str, list[int]]:
    """The q_group_size values the rule takes for the keys (`axis_key`) and the values (`axis_value`) with these
    options' bits and axes, on every layer's stored shape: ascending lists, empty without a group rule."""
    if rule is None:
        return {"axis_key": [], "axis_value": []}
    widest = max(h * w for name in ("axis_key", "axis_value") for h, w in _shapes(model_config, name, opts))
    fits: dict[str, list[int]] = {}
    for name, axis, _, bits in tensors(opts):  # a plan's several bits per tensor: the sizes that fit them all
        shapes = _shapes(model_config, name, opts)
        fits[name] = [
            g for g in fits.get(name, range(1, widest + 1)) if all(rule(bits, g, axis, h, w) is None for h, w in shapes)
        ]
    return fits


def allowed_group_sizes(spec: _Spec, model_config: PreTrainedConfig) -> dict[str, list[int]]:
    """The q_group_size values that run with `spec`'s backend, nbits and axes on this model, per axis option
    (`sizes_that_fit`): {"axis_key": [...], "axis_value": [...]}, ascending; empty lists for backends without
    q_group_size."""
    return sizes_that_fit(spec.info.group_rule, spec.resolved(), model_config)
