"""Deploy lines: which engine stores a spec's cache the same way, and the line that asks it to (`Deployment`).

Each backend says its own engines (`Backend.deploy`, in its module under `kvdemo.cache.formats`);
`kvdemo.cache.spec.CacheSpec.deployments` asks it and adds kvdemo's own line last. A line is given only where the
engine's store is the one kvdemo measures, byte for byte: a close variant is not the same bytes, and its line would
promise figures kvdemo did not measure. The helpers here are the lines shared by several backends: each engine's
full-precision cache, and transformers' `QuantizedCache` (`cache_implementation="quantized"`, transformers 5's
`QuantizedCache.__init__`: full-attention models only, the options `nbits`, `axis_key`, `axis_value`,
`q_group_size`, `residual_length`, every other option at its default). No torch: the command line's parser reads
`ENGINES`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdemo.cache.model.layer_kinds import layer_actions, layer_types
from kvdemo.cache.policies import PROTECT_CHOICES, SLIDING_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from kvdemo.cache.options import Option, SpecOptions

ENGINES = ("llama.cpp", "vllm", "sglang", "tensorrt-llm", "transformers", "mlx-lm", "kvdemo")
"""The engines a deployment names, as `recommend --engine` takes them (`any`: every one)."""

SLIDING_KINDS = ("sliding_attention", "chunked_attention")
"""The layer kinds vLLM's `sliding_window` skip word names (kvdemo's `sliding` option acts on the same)."""

TRANSFORMERS_OPTIONS = ("nbits", "axis_key", "axis_value", "q_group_size", "residual_length")
"""The options transformers' `QuantizedCache` takes (its `__init__`); the others must be at kvdemo's defaults."""


@dataclass(frozen=True)
class Deployment:
    """One engine that stores the cache as kvdemo measured it: `engine` (one of `ENGINES`) and `line`, how to ask it
    (`llama.cpp: llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on`)."""

    engine: str
    line: str

    def to_dict(self) -> dict[str, str]:
        return {"engine": self.engine, "line": self.line}


def kvdemo_line(backend: str, given: SpecOptions, short_text: str) -> str:
    """kvdemo's own line for a spec: the `ask` command's flags and the Python spec, e.g.
    `kvdemo: python -m kvdemo ask --backend quanto --nbits 4 ...; in Python CacheSpec.parse("quanto:4")`."""
    flags = "".join(f" --{name.replace('_', '-')} {shlex.quote(str(value))}" for name, value in given.items())
    return f'kvdemo: python -m kvdemo ask --backend {backend}{flags} ...; in Python CacheSpec.parse("{short_text}")'


def at_defaults(
    options: dict[str, Option], given: SpecOptions, resolved: SpecOptions, but: tuple[str, ...] = ()
) -> bool:
    """Whether every option `given` but those in `but` is at its default among a backend's `options` (a `same_as`
    option at its source's value): what an engine that takes only some options needs of the others."""
    for name, option in options.items():
        if name in but or name not in given:
            continue
        default = resolved.get(option.same_as) if option.same_as else option.default  # type: ignore[misc]
        if resolved.get(name) != default:  # type: ignore[misc]
            return False
    return True


def transformers_lines(
    name: str, options: dict[str, Option], given: SpecOptions, resolved: SpecOptions, model_config: PreTrainedConfig
) -> tuple[Deployment, ...]:
    """transformers' `QuantizedCache(backend=name)` line for a spec of a backend that is that cache (its options
    `options`), or none where that cache stores something else or refuses the model (a layer that is not full
    attention)."""
    if set(layer_types(model_config)) != {"full_attention"}:
        return ()
    if not at_defaults(options, given, resolved, but=TRANSFORMERS_OPTIONS):
        return ()
    config: dict[str, Any] = {"backend": name, **{k: given[k] for k in TRANSFORMERS_OPTIONS if k in given}}  # type: ignore[literal-required]
    cache_config = ", ".join(f'"{k}": {v!r}'.replace("'", '"') for k, v in config.items())
    line = f'transformers: model.generate(..., cache_implementation="quantized", cache_config={{{cache_config}}})'
    return (Deployment("transformers", line),)


def transformers_rule(
    backend: Any, given: SpecOptions, resolved: SpecOptions, model_config: PreTrainedConfig
) -> tuple[Deployment, ...]:
    """The `DeployRule` of a backend that is one of transformers' `QuantizedCache` backends (quanto, hqq, fp8):
    `transformers_lines` of its name and options."""
    return transformers_lines(backend.name, backend.options, given, resolved, model_config)


def vllm_skip_layers(resolved: SpecOptions, model_config: PreTrainedConfig) -> str:
    """vLLM's `--kv-cache-dtype-skip-layers` for a spec's `sliding` and `protect` on this model: the layers vLLM then
    keeps in the model's dtype (`kv_cache_dtype="auto"`), as kvdemo keeps them: `sliding_window` for every
    sliding-window layer kept (`sliding=keep`), and the index of each layer `protect` keeps; "" where none is kept
    (every attention layer in the one dtype). vLLM's `CacheConfig.kv_cache_dtype_skip_layers` takes layer indices and
    `sliding_window` as words."""
    sliding = str(resolved.get("sliding", SLIDING_CHOICES[0]))
    protect = str(resolved.get("protect", PROTECT_CHOICES[0]))
    by_kind = layer_actions(model_config, True, sliding)  # what `sliding` alone keeps
    kept = layer_actions(model_config, True, sliding, protect)
    skipped = [str(i) for i, (a, b) in enumerate(zip(by_kind, kept)) if a != b]  # the layers `protect` keeps
    windows = sliding == SLIDING_CHOICES[0] and any(t in SLIDING_KINDS for t in layer_types(model_config))
    words = skipped + (["sliding_window"] if windows else [])
    return f" --kv-cache-dtype-skip-layers {' '.join(words)}" if words else ""
