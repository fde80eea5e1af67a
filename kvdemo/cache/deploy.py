"""Which engine stores a spec's cache the same way, and the line that asks it to (`deployments`).

A line is given only where the engine's store is the one kvdemo measures: transformers' `QuantizedCache` is the
library kvdemo's quanto, hqq and fp8 layers are (`cache_implementation="quantized"`, transformers 5's
`QuantizedCache.__init__`: full-attention models only, the options `nbits`, `axis_key`, `axis_value`,
`q_group_size`, `residual_length`, every other option at its default); the full-precision baseline is every engine's
default cache. kvdemo's own options (a rotation, a K/V split, `flush=append`, a plan, protected or quantized sliding
layers, TurboQuant) are deployed by kvdemo only. llama.cpp's cache types, vLLM's exact TurboQuant layouts and mlx-lm's
quantized cache are not stored by kvdemo yet, so no quantized spec names them: a close variant is not the same bytes,
and its line would promise figures kvdemo did not measure. No torch: the command line's parser reads `ENGINES`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdemo.cache.layer_kinds import layer_types

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from kvdemo.cache.spec import CacheSpec

ENGINES = ("llama.cpp", "vllm", "transformers", "mlx", "kvdemo")
"""The engines a deployment names, as `recommend --engine` takes them (`any`: every one)."""

DEFAULT_LINES = {
    "llama.cpp": "llama.cpp: the default f16 cache (no -ctk/-ctv)",
    "vllm": "vLLM: --kv-cache-dtype auto (the default)",
    "transformers": "transformers: the default DynamicCache",
    "mlx": "mlx-lm: the default cache (no --kv-bits)",
}
"""Each engine's full-precision cache, the `dynamic` baseline (in the engine's own dtype)."""

TRANSFORMERS_OPTIONS = ("nbits", "axis_key", "axis_value", "q_group_size", "residual_length")
"""The options transformers' `QuantizedCache` takes (its `__init__`); the others must be at kvdemo's defaults."""


@dataclass(frozen=True)
class Deployment:
    """One engine that stores the cache as kvdemo measured it: `engine` (one of `ENGINES`) and `line`, how to ask it
    (`transformers: model.generate(..., cache_implementation="quantized", cache_config={...})`)."""

    engine: str
    line: str

    def to_dict(self) -> dict[str, str]:
        return {"engine": self.engine, "line": self.line}


def deployments(spec: CacheSpec, model_config: PreTrainedConfig) -> tuple[Deployment, ...]:
    """The engines that store a cache of `spec` the same way on this model, each with its line; kvdemo's last.

    Raises:
        ValueError, ImportError: see `CacheSpec.validate`.

    Example:
        >>> [d.line for d in deployments(CacheSpec.parse("quanto:4"), loaded.config)][0]
        'transformers: model.generate(..., cache_implementation="quantized", cache_config={"backend": "quanto", ...})'
    """
    spec = spec.validate(model_config)
    found = []
    if not spec.info.quantized:
        if spec.resolved().get("storage", "concat") == "concat":
            found = [Deployment(engine, line) for engine, line in DEFAULT_LINES.items()]
    elif (config := _transformers_config(spec, model_config)) is not None:
        cache_config = ", ".join(f'"{k}": {v!r}'.replace("'", '"') for k, v in config.items())
        line = f'transformers: model.generate(..., cache_implementation="quantized", cache_config={{{cache_config}}})'
        found = [Deployment("transformers", line)]
    return (*found, Deployment("kvdemo", kvdemo_line(spec)))


def kvdemo_line(spec: CacheSpec) -> str:
    """kvdemo's own line for `spec`: the `ask` command's flags and the Python spec, e.g.
    `kvdemo: python -m kvdemo ask --backend quanto --nbits 4 ...; in Python CacheSpec.parse("quanto:4")`."""
    flags = "".join(f" --{name.replace('_', '-')} {shlex.quote(str(value))}" for name, value in spec.given().items())
    python = f'CacheSpec.parse("{spec.short_text}")'
    return f"kvdemo: python -m kvdemo ask --backend {spec.backend}{flags} ...; in Python {python}"


def _transformers_config(spec: CacheSpec, model_config: PreTrainedConfig) -> dict[str, Any] | None:
    """transformers' `cache_config` for `spec`, or None where its `QuantizedCache` stores something else or refuses
    the model (a layer that is not full attention)."""
    if not spec.info.in_transformers or set(layer_types(model_config)) != {"full_attention"}:
        return None
    resolved, given = spec.resolved(), spec.given()
    for name, option in spec.info.options.items():
        if name in TRANSFORMERS_OPTIONS:
            continue
        default = resolved.get(option.same_as) if option.same_as else option.default  # nbits_value: nbits's
        if name in given and resolved.get(name) != default:  # type: ignore[misc]
            return None
    return {"backend": spec.backend, **{k: given[k] for k in TRANSFORMERS_OPTIONS if k in given}}  # type: ignore[literal-required]
