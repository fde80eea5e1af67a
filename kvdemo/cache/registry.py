"""The one registry of KV cache backends: `BACKENDS`, one `Backend` entry each.

Each `Backend` entry carries its own rules, as transformers' cache-layer subclasses carry theirs: the options
and values it allows, its packing rule for `q_group_size`, its byte formula, how its cache is built and the text
that describes it (`kvdemo.cache.spec` validates a `CacheSpec` and builds its cache from them). The page, the
command line, the tests and the README's backend table read `BACKENDS` (and `kvdemo.cache.catalogue`'s specs);
nothing else switches on backend names. Adding a backend is one entry here (CONTRIBUTING.md, "Adding a backend").

The byte formulas and the packing rules for `q_group_size` live in `kvdemo.cache.layouts` (how each library lays
its store out).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdemo.cache.layer_plan import PLAN, parse_plan
from kvdemo.cache.layouts import (
    fp8_bytes,
    full_precision_bytes,
    group_bytes,
    hqq_group_problem,
    hqq_packed_bytes,
    quanto_group_problem,
    quanto_packed_bytes,
    turboquant_bytes,
    turboquant_combination_problem,
    turboquant_width_problem,
)
from kvdemo.cache.options import (
    OPTIMIZE_HELP,
    PROTECT_OPTION,
    SLIDING_OPTION,
    Option,
    SpecOptions,
    group_options,
)
from kvdemo.cache.policies import (
    FLUSH_POLICIES,
    FP8_SCALES,
    NORM_CORRECTION_CHOICES,
    OPTIMIZE_CHOICES,
    PROTECT_CHOICES,
    ROTATIONS,
    SLIDING_CHOICES,
    STORAGE_POLICIES,
)

# Reading the registry loads neither torch nor transformers (the command line's `--help` reads it): the modules
# that build a cache are imported by the functions that build one.
if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.geometry import KVGeometry

BytesFormula = Callable[[SpecOptions, "KVGeometry", int, int, int, bool, "Sequence[int] | None"], float]
"""`formula(options, geometry, tokens, residual_tokens, element_bytes, nominal_bits, blocks) -> bytes` (see
`estimate_kv_bytes`): `options` resolved, `residual_tokens` already capped at what the residual can hold, `blocks`
the store's blocks in tokens (None: one block; only a layout that pads per block reads them)."""
CacheMaker = Callable[[str, SpecOptions, "PreTrainedConfig"], "Cache"]
"""`make(backend_name, options, model_config) -> Cache`: options as a spec gives them (`CacheSpec.given()`)."""
WidthRule = Callable[[SpecOptions, str, int], "str | None"]
"""`rule(options, tensor, width) -> why it cannot run, or None` for one stored tensor (`keys` or `values`) of `width`
values per head and token, for a backend whose layout needs more of a width than a group size (TurboQuant's rotation
and dense packing)."""
GroupRule = Callable[[int, int, int, int, int], "str | None"]
"""`rule(nbits, q_group_size, axis, heads, width) -> why it cannot run, or None` for one stored tensor (keys or
values) of `heads` heads of `width` values per token (`KVGeometry.shapes`)."""


@dataclass(frozen=True)
class Backend:
    """A KV cache backend as the registry knows it.

    Attributes:
        name: the name a spec uses (`dynamic`, `quanto`, `hqq`, `fp8`).
        summary: one line for the page, `--help` and the README: what stores the cache.
        behaviour: one line on its residual and flushes, for the page.
        quantized: True for the `QuantizedCache` backends; they quantize the layers `kvdemo.cache.layer_kinds` says
            they take (full attention; sliding with `sliding=quantize`) and keep the others at full precision.
        make_cache: `make_cache(name, options, model_config) -> Cache`, the empty cache of validated options (the
            backend's `name`, the options a spec sets: `CacheSpec.given()`), called by `Backend.empty_cache`.
        kv_bytes: its `BytesFormula`.
        options: the options it takes, by name (only `storage` for `dynamic`, only `sliding` for `fp8`).
        group_rule: its `GroupRule` for q_group_size, or None when it takes no q_group_size.
        compare_nbits: the nbits it is compared at by default (`(None,)`: the backend as it is; `()`: not at all),
            each at every `rotation` it takes (`kvdemo.cache.catalogue.default_compare_specs`).
        module: the Python module it needs, or None; pip: the command that installs it.
        width_rule: its `WidthRule`, or None where any width is stored.
        presets: named option sets a spec may give after the colon instead of nbits (`turboquant:k8v4`: vLLM's
            `kv_cache_dtype` presets), name -> {option: value}; `CacheSpec.parse` expands them.
        combination_rule: `rule(resolved options) -> why they cannot go together, or None`, for options that are
            each allowed but not together (turboquant's norm correction at nbits 8); None where any go together.
        in_transformers: transformers' own `QuantizedCache(backend=name)` stores it (`kvdemo.cache.deploy`).
    """

    name: str
    summary: str
    behaviour: str
    quantized: bool
    make_cache: CacheMaker
    kv_bytes: BytesFormula
    options: dict[str, Option] = field(default_factory=dict)
    group_rule: GroupRule | None = None
    compare_nbits: tuple[int | None, ...] = (None,)
    module: str | None = None
    pip: str | None = None
    width_rule: WidthRule | None = None
    presets: dict[str, dict[str, int | str]] = field(default_factory=dict)
    combination_rule: Callable[[SpecOptions], str | None] | None = None
    in_transformers: bool = False

    @property
    def has_residual(self) -> bool:
        """True where the cache keeps a full-precision residual that is flushed (quanto, hqq)."""
        return "residual_length" in self.options

    def empty_cache(self, options: SpecOptions, model_config: PreTrainedConfig) -> Cache:
        """The empty transformers cache of this backend with `options` (the ones a spec sets; transformers fills
        the rest with its defaults, the registry's `Option.default`), checked before by `CacheSpec.validate`."""
        return self.make_cache(self.name, options.copy(), model_config)

    def installed(self) -> bool:
        """Whether the module this backend needs can be imported (without importing it)."""
        if self.module is None:
            return True
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # the parent package (e.g. `optimum`) is missing
            return False

    def options_text(self) -> str:
        """Its options with allowed values and defaults, e.g. `nbits 2|4 (default 4), ...`; `none` without."""
        text = ", ".join(f"{n} {o.allowed_text()} (default {o.default_text})" for n, o in self.options.items())
        return text or "none"


def _dynamic_cache(name: str, options: SpecOptions, config: PreTrainedConfig) -> Cache:
    """transformers' `DynamicCache(config=config)`, or its `GrowingLayer` form with `storage=growing`."""
    from kvdemo.cache.layers.storage import dynamic_cache

    return dynamic_cache(config, str(options.get("storage", STORAGE_POLICIES[0])))


def _fp8_cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """transformers' `QuantizedCache("fp8", config)` built by layer kind (`kvdemo.cache.layers.flush.quantized_cache`),
    whose layers de-quantize by bit placement (`kvdemo.cache.layers.fp8.ExactFp8Layer`: the same bits, the same
    store)."""
    from kvdemo.cache.layers.flush import quantized_cache

    return quantized_cache(
        name,
        config,
        sliding=str(options.get("sliding", SLIDING_CHOICES[0])),
        protect=str(options.get("protect", PROTECT_CHOICES[0])),
        scale=str(options.get("scale", FP8_SCALES[0])),
    )


def _turboquant_cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """kvdemo's TurboQuant cache (`kvdemo.cache.layers.turboquant.turboquant_cache`) of the options a spec sets."""
    from kvdemo.cache.layers.turboquant import turboquant_cache

    return turboquant_cache(config, **options)


def _quanto_cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """`_residual_cache`, once optimum-quanto's extension is pointed at its one build per machine
    (`kvdemo.cache.quanto_build`: compiled by the first process, only loaded by the others)."""
    from kvdemo.cache.quanto_build import share_quanto_build

    share_quanto_build()
    return _residual_cache(name, options, config)


def _residual_cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """`QuantizedCache(name, config, **options)` whose layers flush by the `flush` option's policy and rotate by
    the `rotation` option, or take each its own precision from the `plan` (`kvdemo.cache.layers.flush.quantized_cache`:
    for `requantize` and `none`, transformers' own layers de-quantizing in place with the same bits,
    `kvdemo.cache.layers.dequantize`), read block-wise under kvdemo's attention (`kvdemo.cache.layers.blockwise`)."""
    from kvdemo.cache.layers.flush import quantized_cache

    options = dict(options)
    flush, rotation = str(options.pop("flush", FLUSH_POLICIES[0])), str(options.pop("rotation", ROTATIONS[0]))
    nbits_value = options.pop("nbits_value", None)
    optimize = str(options.pop("optimize", OPTIMIZE_CHOICES[0]))
    sliding = str(options.pop("sliding", SLIDING_CHOICES[0]))
    protect = str(options.pop("protect", PROTECT_CHOICES[0]))
    plan = parse_plan(str(options.pop(PLAN))) if options.get(PLAN) else None
    return quantized_cache(
        name,
        config,
        flush,
        rotation,
        nbits_value=nbits_value,
        optimize=optimize,
        plan=plan,
        sliding=sliding,
        protect=protect,
        **options,
    )


TURBOQUANT_PRESETS: dict[str, dict[str, int | str]] = {
    "k8v4": {"nbits": 8, "nbits_value": 4, "protect": "2:2"},
    "4bit_nc": {"nbits": 4, "nbits_value": 4, "norm_correction": "true", "protect": "2:2"},
    "k3v4_nc": {"nbits": 3, "nbits_value": 4, "norm_correction": "true", "protect": "2:2"},
    "3bit_nc": {"nbits": 3, "nbits_value": 3, "norm_correction": "true", "protect": "2:2"},
}
"""vLLM's TurboQuant `kv_cache_dtype` presets (`turboquant_<name>`, vLLM's `TQ_PRESETS`), as turboquant options:
`k8v4` fp8 keys and 4-bit values (vLLM: 2.6x smaller, perplexity +1.17 %); `4bit_nc` 4-bit keys and values with norm
correction (3.8x, +2.71 %); `k3v4_nc` 3-bit keys, 4-bit values (~3.5x, +10.63 %); `3bit_nc` 3-bit keys and values
(4.9x, +20.59 %). Each keeps the first 2 and last 2 quantized layers at full precision, as vLLM does on dense models
(its figures are vLLM's on its models; kvdemo measures its own, docs/turboquant.md)."""


def _turboquant_options() -> dict[str, Option]:
    """The turboquant backend's options: bits of keys and values, the residual and its flush, the norm correction, and
    the layer options of every quantized backend."""
    bits = (2, 3, 4, 8)
    group = group_options(nbits=bits, axes=(0,))
    flush = group["flush"]
    return {
        "nbits": Option(
            "nbits",
            4,
            choices=bits,
            help="the keys' bits per coordinate: a Lloyd-Max code of the rotated key (8: float8 keys with a scale per "
            "token and head, not rotated)",
        ),
        "nbits_value": Option(
            "nbits_value",
            4,
            choices=bits,
            help="the values' bits: uniform codes with a float16 scale and zero per token and head; unset: nbits",
            same_as="nbits",
        ),
        "residual_length": group["residual_length"],
        "flush": Option("flush", FLUSH_POLICIES[1], choices=FLUSH_POLICIES, help=flush.help),
        "norm_correction": Option(
            "norm_correction",
            NORM_CORRECTION_CHOICES[0],
            choices=NORM_CORRECTION_CHOICES,
            help="true: store each key's norm over its code's, so a de-quantized key keeps its norm (vLLM's _nc)",
            quiet=True,
        ),
        "sliding": SLIDING_OPTION,
        "protect": PROTECT_OPTION,
    }


BACKENDS: dict[str, Backend] = {
    "dynamic": Backend(
        "dynamic",
        "DynamicCache: keys and values in the model's dtype, the full-precision baseline",
        "No quantization and no residual: it never flushes. storage=concat (transformers') copies the whole cache "
        "into a new tensor at every decode step; storage=growing writes only the new token into spare capacity.",
        quantized=False,
        make_cache=_dynamic_cache,
        kv_bytes=full_precision_bytes,
        options={
            "storage": Option(
                "storage",
                STORAGE_POLICIES[0],
                choices=STORAGE_POLICIES,
                help="concat: the whole cache copied each step (transformers); growing: in place, spare room counted",
            )
        },
    ),
    "quanto": Backend(
        "quanto",
        "QuantizedCache(backend='quanto'): optimum-quanto int2/int4, group-wise, with a full-precision residual",
        "New tokens wait in the full-precision residual; at residual_length the whole layer is re-quantized "
        "(flush=requantize, transformers') or only the residual block is quantized and appended (flush=append).",
        quantized=True,
        make_cache=_quanto_cache,
        kv_bytes=group_bytes(quanto_packed_bytes),
        options=group_options(nbits=(2, 4), axes=(0, -1)),
        group_rule=quanto_group_problem,
        compare_nbits=(4,),  # the Compare tab starts with seven specs: one per backend, and the rotated twins
        module="optimum.quanto",
        in_transformers=True,
        pip="pip install optimum-quanto==0.2.7",
    ),
    "hqq": Backend(
        "hqq",
        "QuantizedCache(backend='hqq'): HQQ 1-8 bit, group-wise, with a full-precision residual",
        "New tokens wait in the full-precision residual; at residual_length the whole layer is re-quantized "
        "(flush=requantize, transformers') or only the residual block is quantized and appended (flush=append).",
        quantized=True,
        make_cache=_residual_cache,
        kv_bytes=group_bytes(hqq_packed_bytes),
        options={
            **group_options(nbits=(1, 2, 3, 4, 8), axes=(0, 1)),
            "optimize": Option("optimize", OPTIMIZE_CHOICES[0], choices=OPTIMIZE_CHOICES, help=OPTIMIZE_HELP),
        },
        group_rule=hqq_group_problem,
        compare_nbits=(4,),
        module="hqq",
        in_transformers=True,
        pip="pip install hqq==0.2.8.post1",
    ),
    "fp8": Backend(
        "fp8",
        "QuantizedCache(backend='fp8'): float8_e4m3, one scale per tensor frozen at the first update (or one per "
        "token and head), no residual",
        "It appends every new token, with the scale frozen at the prefill (scale=per_tensor) or its own scales "
        "(scale=per_token_head): no residual, never flushes.",
        quantized=True,
        make_cache=_fp8_cache,
        kv_bytes=fp8_bytes,
        in_transformers=True,
        options={
            "sliding": SLIDING_OPTION,
            "protect": PROTECT_OPTION,
            "scale": Option(
                "scale",
                FP8_SCALES[0],
                choices=FP8_SCALES,
                help="per_tensor: one scale per layer and tensor, frozen at the first update (transformers'); "
                "per_token_head: one float32 scale per token and KV head (vLLM's dynamic per-token-head scales)",
                quiet=True,
            ),
        },
    ),
    "turboquant": Backend(
        "turboquant",
        "kvdemo's TurboQuant (arXiv:2504.19874, as vLLM serves it): keys randomly rotated, Lloyd-Max codes and a norm; "
        "values uniform per token and head; a full-precision residual",
        "Why one fixed code fits: the random rotation spreads a key's outlier channels over all its coordinates, so "
        "every coordinate of every key follows one known distribution, and the code is the optimal one for it. New "
        "tokens wait in the full-precision residual; at residual_length the residual block is coded and appended "
        "(flush=append, vLLM's) or the whole layer is coded again (flush=requantize).",
        quantized=True,
        make_cache=_turboquant_cache,
        kv_bytes=turboquant_bytes,
        options=_turboquant_options(),
        compare_nbits=(4,),
        width_rule=turboquant_width_problem,
        presets=TURBOQUANT_PRESETS,
        combination_rule=turboquant_combination_problem,
    ),
}


def option_choices_text(option: str) -> str:
    """Per backend, the values `option` allows, e.g. `quanto 2|4, hqq 1|2|3|4|8` (for `--help`)."""
    return ", ".join(
        f"{name} {info.options[option].allowed_text()}" for name, info in BACKENDS.items() if option in info.options
    )


def presets_help() -> str:
    """The presets' line of the command line's spec syntax: `--spec turboquant:k8v4 (a preset, vLLM's names: ...)`;
    empty where no backend has presets."""
    named = [(name, list(backend.presets)) for name, backend in BACKENDS.items() if backend.presets]
    if not named:
        return ""
    examples = " ".join(f"--spec {name}:{presets[0]}" for name, presets in named)
    listed = "; ".join(f"{name}: {', '.join(presets)}" for name, presets in named)
    return f"{examples} (a preset, vLLM's names: {listed})"


def backends_help() -> str:
    """Every backend's summary and options, for `--help`."""
    return "\n".join(
        f"  {b.name}: {b.summary}" + (f"\n      options: {b.options_text()}" if b.options else "")
        for b in BACKENDS.values()
    )


def markdown_table() -> str:
    """The README's backend table (a test checks the README holds exactly this)."""
    rows = ["| backend | what stores the cache | options (allowed values, default) |", "|---|---|---|"]
    for b in BACKENDS.values():
        options = b.options_text().replace("|", "\\|")  # a bare | would end the table cell
        rows.append(f"| `{b.name}` | {b.summary} | {options} |")
    return "\n".join(rows)
