"""A spec against one model: `CacheSpec.validate`'s checks of the model's layer kinds, the plan's layer count and bits,
the widths a rotation or a backend's layout takes and the group rule of each stored tensor (`check_on_model`). Reads
the model's config only; torch is imported by the checks that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

from kvdemo.cache.layer_plan import parse_plan, plan_problem
from kvdemo.cache.policies import PROTECT_CHOICES, SLIDING_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from kvdemo.cache.backend import Backend
    from kvdemo.cache.options import SpecOptions


class _Spec(Protocol):
    """What `check_on_model` reads of a `kvdemo.cache.spec.CacheSpec` (which imports this module)."""

    @property
    def backend(self) -> str: ...

    @property
    def plan(self) -> str | None: ...

    @property
    def info(self) -> Backend: ...

    def resolved(self) -> SpecOptions: ...

    def replace(self, **changes: Any) -> Any: ...


def check_on_model(spec: _Spec, model_config: PreTrainedConfig) -> None:
    """`CacheSpec.validate`'s checks of `spec` (fitted to the model: `CacheSpec.fit`) against the model: its layer
    kinds and protected layers (`layer_kinds.serving_problem`), the plan's layer count and bits, a head_dim a rotation
    takes, the backend's width rule (`Backend.width_rule`) and the group rule of each stored tensor's bits and shape.

    Raises:
        UnsupportedModelError, ValueError: see `CacheSpec.validate`."""
    info = spec.info
    from kvdemo.cache.model.geometry import kv_geometry, rotation_problem
    from kvdemo.cache.model.groups import allowed_group_sizes, first_problem
    from kvdemo.cache.model.layer_kinds import UnsupportedModelError, quantized_layers, serving_problem

    sliding = str(spec.resolved().get("sliding", SLIDING_CHOICES[0]))
    protect = str(spec.resolved().get("protect", PROTECT_CHOICES[0]))
    problem = serving_problem(spec.backend, info.quantized, model_config, sliding, protect, "sliding" in info.options)
    if problem:
        raise UnsupportedModelError(problem)
    if spec.plan:
        problem = plan_problem(
            parse_plan(spec.plan),
            len(quantized_layers(model_config, sliding, protect)),
            cast("tuple[int, ...]", info.options["nbits"].choices),
        )
        if problem:
            raise ValueError(problem)
    if any(rotation != "none" for rotation in _rotations(spec)):
        geo = kv_geometry(model_config)
        for _, width in geo.shapes("keys") + geo.shapes("values"):
            problem = rotation_problem(width)
            if problem:
                raise ValueError(problem)
    if info.width_rule is not None:
        from kvdemo.cache.model.geometry import split_geometry

        quantized, _ = split_geometry(model_config, sliding, protect)
        for tensor in ("keys", "values"):
            for _, width in quantized.shapes(tensor):
                problem = info.width_rule(spec.resolved(), tensor, width)
                if problem:
                    raise ValueError(problem)
    if info.group_rule is not None:
        found = first_problem(info.group_rule, spec.resolved(), model_config)
        if found:
            axis_name, axis, bits_name, bits, problem = found
            fits = allowed_group_sizes(spec.replace(q_group_size=None), model_config)
            if not fits[axis_name]:  # no group size fits these bits on this axis: bits or axis must change
                raise ValueError(f"{bits_name}={bits} with {axis_name}={axis}: {problem}")
            both = sorted(set.intersection(*(set(sizes) for sizes in fits.values())))  # keys' and values' alike
            hint = f"; allowed here: {', '.join(map(str, both))}" if both else ""
            q_group_size = spec.resolved()["q_group_size"]
            raise ValueError(f"q_group_size={q_group_size} ({axis_name}={axis}): {problem}{hint}")


def _rotations(spec: _Spec) -> list[str]:
    """The rotations a spec's layers take: its `rotation` option, or each of its plan's layers' (none where the
    backend takes no rotation)."""
    if spec.plan:
        return [layer.rotation for layer in parse_plan(spec.plan)]
    return [str(spec.resolved().get("rotation", "none"))]
