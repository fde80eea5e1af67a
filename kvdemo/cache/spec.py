"""`CacheSpec`, a backend and its options, checked against the registry (`kvdemo.cache.registry.BACKENDS`) and a
model's shapes; and what a spec gives: its empty cache (`build_cache`) and its bytes before anything runs
(`estimate_kv_bytes`). Every rule comes from the backend's registry entry; nothing here names a backend.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import Deployment, kvdemo_line
from kvdemo.cache.layer_plan import PLAN, canonical_plan
from kvdemo.cache.options import PLANNED, SpecOptions
from kvdemo.cache.policies import PROTECT_CHOICES, SLIDING_CHOICES
from kvdemo.cache.registry import BACKENDS, BASELINE, SPEC_OPTIONS
from kvdemo.checks import shown

# A spec is parsed, shown and checked against the registry without torch or transformers (the command line's
# `--help` lists the default specs): what meets a model imports them in the function that needs them.
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

MIN_FITTED_GROUP = 8
"""The smallest q_group_size `CacheSpec.fit` picks on its own: below it a group's scale and zero point outweigh its
values (a 2-value group at 2 bits holds more than full precision), so the spec is refused with the sizes allowed."""

PRESET_BITS = ("nbits", "nbits_value")
"""The options a preset is named by (`turboquant:k8v4`): a spec that gives a preset cannot give them too; its other
options (e.g. `protect`) may be changed beside it."""

MAX_OPTION_VALUE = 1 << 20
"""No option means anything above this (1,048,576 tokens or values); larger numbers are refused."""


@dataclass(frozen=True, init=False)
class CacheSpec:
    """A KV cache format (backend) and the options a spec sets; an option left unset takes the format's default.

    The options are the format's own, as its card declares them (`Backend.options`, in
    `kvdemo/cache/formats/<name>/__init__.py`): a spec holds only those it sets, so no format's option is a field of
    another's spec, and a format that adds an option needs no change here. Each is read by name as an attribute
    (`spec.nbits`, `spec.type_k`: None where unset) or with `given()` and `resolved()`; `validate` checks them against
    the card (an option the format does not take is refused there, with what it takes).

    Attributes:
        backend: a name in `BACKENDS`.
        options: the options set, (name, value) pairs in `kvdemo.cache.registry.SPEC_OPTIONS`' order; a `plan` kept in
            its one canonical text (`kvdemo.cache.layer_plan.canonical_plan`), so that two texts of one plan make one
            spec (a text that does not parse is kept as given, for `validate` to refuse).

    Example:
        >>> CacheSpec.parse("hqq:4,residual_length=16").label
        'hqq nbits=4 q_group_size=64 residual_length=16'
        >>> CacheSpec("hqq", nbits=4, residual_length=16) == CacheSpec.parse("hqq:4,residual_length=16")
        True

    """

    backend: str
    options: tuple[tuple[str, int | str], ...]

    def __init__(
        self, backend: str = BASELINE, *, options: tuple[tuple[str, int | str], ...] = (), **given: int | str | None
    ) -> None:
        """`CacheSpec(backend, **options)`: options by name, None for unset (`options=`: pairs, as
        `dataclasses.replace` hands them back). Raises TypeError: a name no format takes as an option."""
        values: dict[str, Any] = dict(options)
        values.update(given)
        unknown = [name for name in values if name not in SPEC_OPTIONS]
        if unknown:
            raise TypeError(f"CacheSpec() got an unexpected option {unknown[0]!r}; options: {', '.join(SPEC_OPTIONS)}")
        if isinstance(values.get(PLAN), str):
            try:
                values[PLAN] = canonical_plan(values[PLAN])
            except ValueError:
                pass
        pairs = tuple((name, values[name]) for name in SPEC_OPTIONS if values.get(name) is not None)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "options", pairs)

    def __getattr__(self, name: str) -> Any:
        """An option's value by name (`spec.nbits`), None where unset."""
        if name in SPEC_OPTIONS:
            return dict(self.__dict__.get("options", ())).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def info(self) -> Backend:
        """The registry entry of this spec's backend. Raises ValueError for an unknown backend."""
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"backend={shown(self.backend)} is not a backend; choose one of {', '.join(BACKENDS)}")
        return BACKENDS[self.backend]

    @property
    def keeps_residual(self) -> bool:
        """Whether this spec's cache keeps a full-precision residual that it flushes: the format takes
        `residual_length` and its `residual_rule`, where it has one, says these options keep one."""
        info = self.info
        return info.has_residual and (info.residual_rule is None or info.residual_rule(self.resolved()))

    def given(self) -> SpecOptions:
        """The options set on this spec (not None), by name."""
        return cast(SpecOptions, dict(self.options))

    def resolved(self) -> SpecOptions:
        """Every option the backend takes, with its default filled in where unset (an unset `same_as` option, such
        as `nbits_value`, takes its source option's resolved value); with a `plan`, not the options it sets per
        layer (`PLANNED`: nbits, nbits_value, rotation)."""
        given: dict[str, Any] = dict(self.given())
        resolved: dict[str, Any] = {}
        for name, opt in self.info.options.items():  # a source option comes before the options that follow it
            if (given.get(PLAN) and name in PLANNED) or (name == PLAN and not given.get(PLAN)):
                continue
            resolved[name] = given.get(name, resolved[opt.same_as] if opt.same_as else opt.default)
        return cast(SpecOptions, resolved)

    def _defaults(self) -> dict[str, Any]:
        """Each option's value when unset: its default, or its source option's resolved value (`same_as`)."""
        resolved: dict[str, Any] = dict(self.resolved())
        options = self.info.options
        return {n: resolved[str(options[n].same_as)] if options[n].same_as else options[n].default for n in resolved}

    @property
    def label(self) -> str:
        """A short human name, e.g. `hqq nbits=4 q_group_size=64 residual_length=4`,
        `quanto nbits=4 nbits_value=2 q_group_size=64 residual_length=128`."""
        defaults, options = self._defaults(), self.info.options
        # axes at 0, a text option at its default (flush=requantize) and nbits_value equal to nbits are left out
        opts = " ".join(
            f"{k}={v}"
            for k, v in self.resolved().items()
            if not (k.startswith("axis") and v == 0)
            and not ((isinstance(v, str) or options[k].same_as) and v == defaults[k])
        )
        return f"{self.backend} {opts}".strip()

    @property
    def text(self) -> str:
        """The spec in `CacheSpec.parse`'s syntax, only the options set: `hqq:4,residual_length=16`, `fp8`."""
        given = self.given()
        head = f"{self.backend}:{given.pop('nbits')}" if "nbits" in given else str(self.backend)
        return ",".join([head] + [f"{k}={v}" for k, v in given.items()])

    @property
    def short_text(self) -> str:
        """The spec in `CacheSpec.parse`'s syntax with nbits and only the options that differ from the backend's
        defaults, the same spec once parsed: `quanto:4,residual_length=16` for a page's every-option spec (a table
        cell a reader can take in; `full_text` says everything)."""
        defaults, resolved = self._defaults(), self.resolved()
        head = f"{self.backend}:{resolved.pop('nbits')}" if "nbits" in resolved else str(self.backend)
        return ",".join([head] + [f"{k}={v}" for k, v in resolved.items() if v != defaults[k]])

    @property
    def full_text(self) -> str:
        """The spec in `CacheSpec.parse`'s syntax with every option resolved, so that it means one thing
        wherever it is shown: `hqq:4,q_group_size=64,residual_length=16,axis_key=0,axis_value=0`, `fp8`
        (`nbits_value` only where it differs from nbits, `sliding` only where it is not `keep`: either default means
        what the text without it means)."""
        defaults, options, resolved = self._defaults(), self.info.options, self.resolved()
        head = f"{self.backend}:{resolved.pop('nbits')}" if "nbits" in resolved else str(self.backend)
        quiet = [k for k, v in resolved.items() if (options[k].same_as or options[k].quiet) and v == defaults[k]]
        shown = [f"{k}={v}" for k, v in resolved.items() if k not in quiet]
        return ",".join([head] + shown)

    @classmethod
    def parse(cls, text: str) -> CacheSpec:
        """A spec from `backend[:nbits][,option=value...]`, e.g. `dynamic`, `fp8`, `hqq:4`,
        `quanto:2,q_group_size=32,residual_length=16,axis_key=-1`, or `backend:preset[,option=value...]` for a
        backend with presets (`Backend.presets`: `turboquant:k8v4`, also written `turboquant:turboquant_k8v4` as vLLM
        names it), which sets the preset's options. Options are `GROUP_OPTIONS`; unset ones take the backend's
        defaults. The result is checked against the registry (`validate`, no model).

        Raises:
            ValueError: malformed text, an unknown backend or option, a non-integer value, an unknown preset or an
                option a preset sets given beside it, or a value the registry refuses (the message says which and
                what is allowed).
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError("an empty spec; write backend[:nbits][,option=value...], e.g. hqq:4 or dynamic")
        head, *pairs = [part.strip() for part in text.strip().split(",")]
        backend, _, nbits = head.partition(":")
        options: dict[str, Any] = {}
        preset = None
        if nbits.strip() and not re.fullmatch(r"-?[0-9]+", nbits.strip()):
            preset = cls._preset(text, backend.strip().lower(), nbits.strip())
        if preset is None and nbits.strip():
            options["nbits"] = nbits.strip()
        elif ":" in head and not nbits.strip():
            raise ValueError(f"spec {text!r}: give the nbits after the colon, e.g. hqq:4")
        for pair in pairs:
            name, sep, value = (p.strip() for p in pair.partition("="))
            if not sep or not name or not value:
                raise ValueError(f"spec {text!r}: {pair!r} is not option=value (options: {', '.join(SPEC_OPTIONS)})")
            name = name.replace("-", "_")
            if name not in SPEC_OPTIONS:
                raise ValueError(f"spec {text!r}: {name!r} is not an option; options: {', '.join(SPEC_OPTIONS)}")
            if name in options:
                raise ValueError(f"spec {text!r}: {name} is given twice")
            options[name] = value
        for name, value in options.items():
            if any(b.options[name].is_text for b in BACKENDS.values() if name in b.options):  # words
                options[name] = value.lower()
                continue
            if not re.fullmatch(r"-?[0-9]+", value):
                with_presets = [f"{b.name} ({', '.join(b.presets)})" for b in BACKENDS.values() if b.presets]
                hint = f"; only these backends take presets: {'; '.join(with_presets)}" if name == "nbits" else ""
                raise ValueError(f"spec {text!r}: {name}={value!r} must be an integer{hint}")
            options[name] = int(value)
        if preset is not None:  # the options given beside it change the preset's, but for the bits it is named by
            clash = [name for name in PRESET_BITS if name in options]
            if clash:
                sets = ", ".join(f"{name}={value}" for name, value in preset.items())
                raise ValueError(
                    f"spec {text!r}: the preset {nbits.strip()} sets {sets}; leave {', '.join(clash)} out, or give "
                    "nbits instead of the preset"
                )
            options = {**preset, **options}
        return cls(backend.strip().lower(), **options).validate()

    @staticmethod
    def _preset(text: str, backend: str, word: str) -> dict[str, int | str] | None:
        """The options of preset `word` of `backend` (a word after the colon), or None where the backend has no
        presets (then `word` is read as nbits). Raises ValueError: a word that is not one of its presets."""
        presets = BACKENDS[backend].presets if backend in BACKENDS else {}
        if not presets:
            return None
        name = word.lower()
        name = name if name in presets else name.removeprefix(f"{backend}_")  # vLLM's `turboquant_k8v4` too
        if name not in presets:
            nbits = f", or give nbits, e.g. {backend}:4" if "nbits" in BACKENDS[backend].options else ""
            raise ValueError(
                f"spec {text!r}: {word!r} is neither nbits nor a preset of {backend}; presets: {', '.join(presets)} "
                f"(e.g. {backend}:{next(iter(presets))}){nbits}"
            )
        return presets[name]

    def replace(self, **changes: Any) -> CacheSpec:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def validate(self, model_config: PreTrainedConfig | None = None) -> CacheSpec:
        """Check this spec against the registry and, when given, the model's layers and shapes.

        Args:
            model_config: the model's config; gives the layer kinds, each layer's num_key_value_heads and
                head_dim (or a latent's widths: `kvdemo.cache.model.geometry.kv_geometry`).

        Returns:
            The spec, so that `spec = spec.validate(cfg)` can be chained: with a model, the spec fitted to it
            (`fit`: a q_group_size left unset whose default does not fit the model's stored widths is set to one
            that does); without, self.

        Raises:
            UnsupportedModelError (a ValueError): the backend cannot serve the model's kind of layers
                (`kvdemo.cache.model.layer_kinds.serving_problem`: the message names them and what would work).
            ValueError: naming the option, the value given and the values allowed: an unknown backend, an
                option the backend does not take, a value outside the registry's
                choices, a q_group_size that does not fit head_dim or the backend's bit packing, a
                residual_length < 1, `rotation=hadamard` on a head_dim without a power-of-two block of 8 or more,
                or a `plan` that does not parse, is given with nbits, nbits_value or rotation, or does not give
                one of the backend's bits per layer.
            ImportError: the backend's package is not installed; the message gives the pip command."""
        info = self.info
        for name, value in self.given().items():
            if name not in info.options:
                takes = ", ".join(info.options) or "no options"
                raise ValueError(
                    f"{name}={value} is not an option of the {self.backend} backend (it takes {takes}); leave it unset"
                )
            opt = info.options[name]
            if opt.canonical is not None:  # a text in a syntax of its own (`plan`): its parser says what is wrong
                if not isinstance(value, str):
                    raise ValueError(f"{name}={shown(value)} must be text: {opt.syntax}")
                opt.canonical(value)
                continue
            if opt.is_text:
                assert opt.choices is not None  # a text option lists its words
                if value not in opt.choices:
                    allowed = ", ".join(map(str, opt.choices))
                    raise ValueError(f"{name}={shown(value)} is not allowed for {self.backend}; allowed: {allowed}")
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name}={shown(value)} must be an integer")
            value = int(value)
            if opt.choices is not None and value not in opt.choices:
                allowed = ", ".join(map(str, opt.choices))
                raise ValueError(f"{name}={value} is not allowed for {self.backend}; allowed: {allowed}")
            if opt.minimum is not None and value < opt.minimum:
                raise ValueError(f"{name}={value} is not allowed for {self.backend}; it must be >= {opt.minimum}")
            if value > MAX_OPTION_VALUE:
                raise ValueError(f"{name}={shown(value)} is not allowed; it must be <= {MAX_OPTION_VALUE:,}")
        planned = [name for name in PLANNED if name in self.given()]
        if self.plan and planned:
            raise ValueError(
                f"{', '.join(planned)} and plan are both given; the plan sets each layer's nbits, nbits_value and "
                "rotation, so leave them out (e.g. quanto,plan=k4v2h*30)"
            )
        problem = info.combination_rule(self.resolved()) if info.combination_rule else None
        if problem:
            raise ValueError(problem)
        if not info.installed():
            raise ImportError(f"the {self.backend} backend needs the {info.module} package: {info.pip}")
        if model_config is None:
            return self
        from kvdemo.cache.model.model_checks import check_on_model

        fitted = self.fit(model_config)
        check_on_model(fitted, model_config)
        return fitted

    def fit(self, model_config: PreTrainedConfig) -> CacheSpec:
        """This spec with its defaults fitted to the model: where `q_group_size` is unset and the backend's default
        (64, transformers') does not fit every stored width (head_dim 80, 96; an MLA latent), the largest power of
        two below the default that fits the keys and values of every layer (32 for head_dim 96, 16 for 80), else
        the largest size below the default that fits, else the smallest that fits (never below `MIN_FITTED_GROUP`);
        unchanged where the default fits, the option is given, the backend has no q_group_size, or nothing fits."""
        info = self.info
        if info.group_rule is None or self.q_group_size is not None or self.backend not in BACKENDS:
            return self
        try:
            if not self._group_problem(model_config):
                return self
            from kvdemo.cache.model.groups import allowed_group_sizes

            sizes = allowed_group_sizes(self, model_config)
        except (ValueError, LookupError):  # a spec that does not validate (bits no packing knows): `validate` says why
            return self
        # groups of a few values would hold more scale than data (quanto axis -1 on 2 heads: 2): refused instead
        both = sorted(size for size in set(sizes["axis_key"]) & set(sizes["axis_value"]) if size >= MIN_FITTED_GROUP)
        if not both:
            return self
        default = int(info.options["q_group_size"].default)
        below = [size for size in both if size <= default]
        powers = [size for size in below if size & (size - 1) == 0]  # 32 rather than 48 for head_dim 96
        return self.replace(q_group_size=(powers or below or both)[-1 if powers or below else 0])

    def deployments(self, model_config: PreTrainedConfig) -> tuple[Deployment, ...]:
        """The engines that store a cache of this spec the same way on this model, each with the line that asks it to
        (the backend's `Backend.deploy`), then kvdemo's own line.

        Raises:
            ValueError, ImportError: see `validate`.

        Example:
            >>> [d.line for d in CacheSpec.parse("ggml:q4_0").deployments(loaded.config)][0]
            'llama.cpp: llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on  # rotated: llama.cpp since 744c0c7 ...'
        """
        spec = self.validate(model_config)
        info, given, resolved = spec.info, spec.given(), spec.resolved()
        found = info.deploy(info, given, resolved, model_config) if info.deploy else ()
        return (*found, Deployment("kvdemo", kvdemo_line(spec.backend, given, spec.short_text)))

    def _group_problem(self, model_config: PreTrainedConfig) -> tuple[str, int, str, int, str] | None:
        """The first stored tensor whose group rule refuses this spec's q_group_size (`groups.first_problem`)."""
        from kvdemo.cache.model.groups import first_problem

        return first_problem(self.info.group_rule, self.resolved(), model_config)


def estimate_kv_bytes(
    spec: CacheSpec,
    model_config: PreTrainedConfig,
    tokens: int,
    dtype: torch.dtype,
    residual_tokens: int = 0,
    *,
    nominal_bits: bool = False,
    blocks: Sequence[int] | None = None,
) -> int:
    """The bytes a cache of `spec` holds with `tokens` tokens in it, from the model's shape, before anything
    runs (the out-of-memory guard of `QASession`, and the theoretical figure of `benchmarks/run_all.py`).

    The formula is the backend's own (`Backend.kv_bytes`, `kvdemo.cache.layouts`: each gives its sources); the
    layers a quantized backend keeps (`kvdemo.cache.model.layer_kinds`) count as `dynamic`'s. Equal to the bytes of
    `telemetry.kv_memory` for every backend and option, block by block (`tests/test_budget.py`).

    Args:
        tokens: all tokens in the cache (the cache length).
        dtype: the model's dtype (the residual's and the scales' element type).
        residual_tokens: how many of them sit in the full-precision residual (ignored without a residual).
        nominal_bits: count nbits exactly, ignoring the packing's padding (the textbook formula).
        blocks: the tokens of each block of the store, summing to `tokens` less the residual (`layouts.store_blocks`);
            None: one block, as after a prefill or with `flush=requantize`. Read where the packing pads per block.

    Returns:
        Bytes (int).

    Raises:
        ValueError, ImportError: see `CacheSpec.validate`; ValueError: `blocks` do not sum to the stored tokens.
    """
    from kvdemo.cache.model.geometry import KVGeometry, element_size, kv_geometry, split_geometry

    spec = spec.validate(model_config)
    opts = spec.resolved()
    residual = max(min(residual_tokens, opts["residual_length"], tokens), 0) if "residual_length" in opts else 0
    if blocks is not None and sum(blocks) != tokens - residual:
        raise ValueError(f"blocks {list(blocks)} must sum to the {tokens - residual} tokens outside the residual")
    element, geo, kept = element_size(dtype), kv_geometry(model_config), KVGeometry(())
    if spec.info.quantized:  # the layers it keeps at full precision count as `dynamic`'s
        geo, kept = split_geometry(
            model_config, str(opts.get("sliding", SLIDING_CHOICES[0])), str(opts.get("protect", PROTECT_CHOICES[0]))
        )
    kept_bytes = element * kept.values_held(tokens)
    return int(spec.info.kv_bytes(opts, geo, tokens, residual, element, nominal_bits, blocks) + kept_bytes)


def build_cache(spec: CacheSpec, model_config: PreTrainedConfig) -> Cache:
    """Validate `spec` and build its empty transformers cache for a model (the backend's `Backend.empty_cache`).

    Example:
        >>> cache = build_cache(CacheSpec.parse("hqq:4"), model.config)

    Raises:
        ValueError, ImportError: see `CacheSpec.validate`.
    """
    spec = spec.validate(model_config)
    return spec.info.empty_cache(spec.given(), model_config)
