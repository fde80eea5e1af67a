"""The one registry of KV cache backends, the `CacheSpec` that names a backend and its options, and
`build_cache`, which turns a validated spec into the transformers cache.

This module is the only place that knows which backend takes which option. The UI, the command
line and the validation read `BACKENDS`; nothing else switches on backend names.

The packing rules in `_group_size_problem` were found by running every backend over every nbits,
q_group_size and axis on the embedded model's shapes (3 KV heads, head_dim 64) and on the test
model's, for prefill lengths 1, 5, 37, 64 and 130 followed by decode steps with flushes; the test
`tests/test_backends.py::test_validation_predicts_what_runs` repeats that sweep.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import numbers
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from transformers import DynamicCache, PreTrainedConfig, QuantizedCache
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

GROUP_OPTIONS = ("nbits", "q_group_size", "residual_length", "axis_key", "axis_value")
MAX_OPTION_VALUE = 1 << 20
"""No option means anything above this (1,048,576 tokens or values); larger numbers are refused."""


def _show(value: Any) -> str:
    """`repr(value)`, cut to 40 characters for messages."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Option:
    """One option of a backend.

    Attributes:
        name: the transformers keyword (`nbits`, `q_group_size`, `residual_length`, `axis_key`, `axis_value`).
        default: the value transformers uses when the option is left unset.
        choices: the allowed values, or None where any integer >= `minimum` is allowed (then
            model-dependent rules may narrow it, see `CacheSpec.validate`).
        minimum: the smallest allowed value when `choices` is None.
        help: one line for `--help` and the UI, with the unit.
    """

    name: str
    default: int
    choices: tuple[int, ...] | None = None
    minimum: int | None = None
    help: str = ""


@dataclass(frozen=True)
class Backend:
    """A KV cache backend as the registry knows it.

    Attributes:
        name: `dynamic`, `quanto`, `hqq` or `fp8`.
        summary: one line for the UI and `--help`.
        options: the options it takes, by name (empty for `dynamic` and `fp8`).
        module: the Python module it needs, or None.
        pip: the command that installs that module.
        bits_per_value: nominal bits of a stored value when the backend has no `nbits` option.
    """

    name: str
    summary: str
    options: dict[str, Option] = field(default_factory=dict)
    module: str | None = None
    pip: str | None = None
    bits_per_value: int | None = None

    @property
    def is_quantized(self) -> bool:
        """True for the `QuantizedCache` backends (everything but `dynamic`)."""
        return self.name != "dynamic"

    @property
    def has_residual(self) -> bool:
        """True where the cache keeps a full-precision residual that is flushed (quanto, hqq)."""
        return "residual_length" in self.options

    def installed(self) -> bool:
        """Whether the module this backend needs can be imported (without importing it)."""
        if self.module is None:
            return True
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # the parent package (e.g. `optimum`) is missing
            return False


def _group_options(nbits: tuple[int, ...], axes: tuple[int, ...]) -> dict[str, Option]:
    return {
        "nbits": Option("nbits", 4, choices=nbits, help="bits per quantized value"),
        "q_group_size": Option(
            "q_group_size", 64, minimum=1, help="values that share one scale and zero point (must fit head_dim)"
        ),
        "residual_length": Option(
            "residual_length", 128, minimum=1, help="tokens kept in full precision before a flush re-quantizes"
        ),
        "axis_key": Option("axis_key", 0, choices=axes, help="axis along which keys are grouped"),
        "axis_value": Option("axis_value", 0, choices=axes, help="axis along which values are grouped"),
    }


BACKENDS: dict[str, Backend] = {
    "dynamic": Backend(
        "dynamic",
        "DynamicCache: keys and values in the model's dtype, the full-precision baseline",
    ),
    "quanto": Backend(
        "quanto",
        "QuantizedCache(backend='quanto'): optimum-quanto int2/int4, group-wise, with a full-precision residual",
        options=_group_options(nbits=(2, 4), axes=(0, -1)),
        module="optimum.quanto",
        pip="pip install optimum-quanto==0.2.7",
    ),
    "hqq": Backend(
        "hqq",
        "QuantizedCache(backend='hqq'): HQQ 1-8 bit, group-wise, with a full-precision residual",
        options=_group_options(nbits=(1, 2, 3, 4, 8), axes=(0, 1)),
        module="hqq",
        pip="pip install hqq==0.2.8.post1",
    ),
    "fp8": Backend(
        "fp8",
        "QuantizedCache(backend='fp8'): float8_e4m3 per tensor, scale frozen at the first update, no residual",
        bits_per_value=8,
    ),
}

# Values per byte that hqq's bit packing needs along the packed axis (hqq.core.bitpack: 8x1bit, 4x2bit,
# 2x4bit in a uint8; 3-bit values go 10 to an int32 and 8-bit ones are stored as they are).
_HQQ_VALUES_PER_PACK = {1: 8, 2: 4, 3: 1, 4: 2, 8: 1}


def _group_size_problem(backend: str, nbits: int, group: int, axis: int, kv_heads: int, head_dim: int) -> str | None:
    """Why `group` cannot be used for one tensor (keys or values) of shape [1, kv_heads, tokens, head_dim]
    grouped along `axis`, or None when it runs for every token count."""
    width = kv_heads * head_dim
    if backend == "quanto":
        if axis == 0:
            if head_dim % group:
                return f"q_group_size={group} must divide head_dim={head_dim}"
        elif kv_heads % group:
            # axis -1 groups along batch x heads x tokens: one token must already fill whole groups
            return f"q_group_size={group} with axis -1 must divide num_key_value_heads={kv_heads}"
        return None
    # hqq
    pack = _HQQ_VALUES_PER_PACK[nbits]
    if axis == 0:
        if head_dim % group:
            return f"q_group_size={group} must divide head_dim={head_dim}"
        if group % pack:
            return f"hqq packs {pack} {nbits}-bit values together, so q_group_size must be a multiple of {pack}"
        return None
    if nbits == 3:
        return "hqq's 3-bit packing along axis 1 breaks on some token counts; use axis 0 for nbits=3"
    if width % group or (width // group) % pack:
        return (
            f"with axis 1, num_key_value_heads x head_dim / q_group_size = {width}/{group} must be a whole "
            f"multiple of {pack} (hqq packs {pack} {nbits}-bit values together)"
        )
    return None


@dataclass(frozen=True)
class CacheSpec:
    """A KV cache backend and its options; `None` means the backend's default (see `BACKENDS`).

    Attributes:
        backend: `dynamic`, `quanto`, `hqq` or `fp8`.
        nbits: bits per quantized value (quanto: 2, 4; hqq: 1, 2, 3, 4, 8).
        q_group_size: values per scale/zero-point group (quanto, hqq).
        residual_length: full-precision tokens held before a flush (quanto, hqq); >= 1.
        axis_key, axis_value: grouping axis (quanto: 0, -1; hqq: 0, 1).
    """

    backend: str = "dynamic"
    nbits: int | None = None
    q_group_size: int | None = None
    residual_length: int | None = None
    axis_key: int | None = None
    axis_value: int | None = None

    @property
    def info(self) -> Backend:
        """The registry entry of this spec's backend. Raises ValueError for an unknown backend."""
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"backend={_show(self.backend)} is not a backend; choose one of {', '.join(BACKENDS)}")
        return BACKENDS[self.backend]

    def given(self) -> dict[str, int]:
        """The options set on this spec (not None), by name."""
        return {name: getattr(self, name) for name in GROUP_OPTIONS if getattr(self, name) is not None}

    def resolved(self) -> dict[str, int]:
        """Every option the backend takes, with its default filled in where unset."""
        return {name: self.given().get(name, opt.default) for name, opt in self.info.options.items()}

    @property
    def label(self) -> str:
        """A short human name, e.g. `hqq nbits=4 q_group_size=64 residual_length=4`."""
        opts = " ".join(f"{k}={v}" for k, v in self.resolved().items() if not k.startswith("axis") or v != 0)
        return f"{self.backend} {opts}".strip()

    @property
    def text(self) -> str:
        """The spec in `CacheSpec.parse`'s syntax, only the options set: `hqq:4,residual_length=16`, `fp8`."""
        given = self.given()
        head = f"{self.backend}:{given.pop('nbits')}" if "nbits" in given else str(self.backend)
        return ",".join([head] + [f"{k}={v}" for k, v in given.items()])

    @classmethod
    def parse(cls, text: str) -> "CacheSpec":
        """A spec from `backend[:nbits][,option=value...]`, e.g. `dynamic`, `fp8`, `hqq:4`,
        `quanto:2,q_group_size=32,residual_length=16,axis_key=-1`. Options are `GROUP_OPTIONS`; unset ones
        take the backend's defaults. The result is checked against the registry (`validate`, no model).

        Raises:
            ValueError: malformed text, an unknown backend or option, a non-integer value, or a value the
                registry refuses (the message says which and what is allowed).
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError("an empty spec; write backend[:nbits][,option=value...], e.g. hqq:4 or dynamic")
        head, *pairs = [part.strip() for part in text.strip().split(",")]
        backend, _, nbits = head.partition(":")
        options: dict[str, Any] = {}
        if nbits.strip():
            options["nbits"] = nbits.strip()
        elif ":" in head:
            raise ValueError(f"spec {text!r}: give the nbits after the colon, e.g. hqq:4")
        for pair in pairs:
            name, sep, value = (p.strip() for p in pair.partition("="))
            if not sep or not name or not value:
                raise ValueError(f"spec {text!r}: {pair!r} is not option=value (options: {', '.join(GROUP_OPTIONS)})")
            name = name.replace("-", "_")
            if name not in GROUP_OPTIONS:
                raise ValueError(f"spec {text!r}: {name!r} is not an option; options: {', '.join(GROUP_OPTIONS)}")
            if name in options:
                raise ValueError(f"spec {text!r}: {name} is given twice")
            options[name] = value
        for name, value in options.items():
            if not re.fullmatch(r"-?[0-9]+", value):
                raise ValueError(f"spec {text!r}: {name}={value!r} must be an integer")
            options[name] = int(value)
        return cls(backend.strip().lower(), **options).validate()

    def replace(self, **changes: Any) -> "CacheSpec":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def validate(self, model_config: PreTrainedConfig | None = None) -> "CacheSpec":
        """Check this spec against the registry and, when given, the model's shapes.

        Args:
            model_config: the model's config; gives num_key_value_heads, head_dim and the layer types.

        Returns:
            self, so that `spec.validate(cfg)` can be chained.

        Raises:
            ValueError: naming the option, the value given and the values allowed: an unknown backend, an
                option the backend does not take (fp8 and dynamic take none), a value outside the registry's
                choices, a q_group_size that does not fit head_dim or the backend's bit packing, a
                residual_length < 1, or a quantized backend on a model whose layers are not all full attention.
            ImportError: the backend's package is not installed; the message gives the pip command.
        """
        info = self.info
        for name, value in self.given().items():
            if name not in info.options:
                takes = ", ".join(info.options) or "no options"
                raise ValueError(
                    f"{name}={value} is not an option of the {self.backend} backend (it takes {takes}); leave it unset"
                )
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name}={_show(value)} must be an integer")
            value = int(value)
            opt = info.options[name]
            if opt.choices is not None and value not in opt.choices:
                allowed = ", ".join(map(str, opt.choices))
                raise ValueError(f"{name}={value} is not allowed for {self.backend}; allowed: {allowed}")
            if opt.minimum is not None and value < opt.minimum:
                raise ValueError(f"{name}={value} is not allowed for {self.backend}; it must be >= {opt.minimum}")
            if value > MAX_OPTION_VALUE:
                raise ValueError(f"{name}={_show(value)} is not allowed; it must be <= {MAX_OPTION_VALUE:,}")
        if not info.installed():
            raise ImportError(f"the {self.backend} backend needs the {info.module} package: {info.pip}")
        if model_config is None:
            return self
        text_config = model_config.get_text_config(decoder=True)
        if info.is_quantized:
            layer_types, _ = get_layer_types_and_kwargs(text_config)
            others = sorted(set(layer_types) - {"full_attention"})
            if others:
                raise ValueError(
                    f"backend={self.backend} needs a model whose layers are all full attention; this model also has "
                    f"{', '.join(others)} layers. Use backend=dynamic with it"
                )
        if "q_group_size" in info.options:
            opts = self.resolved()
            kv_heads, head_dim = kv_shape(model_config)
            for axis_name in ("axis_key", "axis_value"):
                problem = _group_size_problem(
                    self.backend, opts["nbits"], opts["q_group_size"], opts[axis_name], kv_heads, head_dim
                )
                if problem:
                    allowed = allowed_group_sizes(self.replace(q_group_size=None), model_config)[axis_name]
                    hint = f"; allowed here: {', '.join(map(str, allowed))}" if allowed else ""
                    raise ValueError(f"q_group_size={opts['q_group_size']} ({axis_name}={opts[axis_name]}): {problem}{hint}")
        return self


def kv_shape(model_config: PreTrainedConfig) -> tuple[int, int]:
    """(num_key_value_heads, head_dim) of the model's decoder, as its attention layers cache them."""
    cfg = model_config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kv_heads, head_dim


def allowed_group_sizes(spec: CacheSpec, model_config: PreTrainedConfig) -> dict[str, list[int]]:
    """The q_group_size values that run with `spec`'s backend, nbits and axes on this model, per axis option.

    Returns:
        {"axis_key": [...], "axis_value": [...]}, ascending; empty lists for backends without q_group_size.
    """
    if "q_group_size" not in spec.info.options:
        return {"axis_key": [], "axis_value": []}
    opts = spec.resolved()
    kv_heads, head_dim = kv_shape(model_config)
    candidates = range(1, kv_heads * head_dim + 1)
    return {
        axis_name: [
            g
            for g in candidates
            if _group_size_problem(spec.backend, opts["nbits"], g, opts[axis_name], kv_heads, head_dim) is None
        ]
        for axis_name in ("axis_key", "axis_value")
    }


STORED_BITS = {("hqq", 3): 3.5}
"""Bits a stored value takes where the packing is not `nbits` exactly: hqq 0.2.8 packs 3-bit values ten to an
int32 with padding, measured at 5,040 bytes of packed data per 11,520 values (the embedded model's token)."""


def estimate_kv_bytes(
    spec: CacheSpec,
    model_config: PreTrainedConfig,
    tokens: int,
    dtype: torch.dtype,
    residual_tokens: int = 0,
    nominal_bits: bool = False,
) -> int:
    """The bytes a cache of `spec` holds with `tokens` tokens in it, from the model's shape, before anything
    runs (the out-of-memory guard of `QASession`, and the theoretical figure of `benchmarks/run_all.py`).

    With V = 2 * layers * kv_heads * head_dim values per token (keys and values) and e = the dtype's element
    size in bytes:
    - `dynamic`: V * e per token.
    - `fp8`: V * 1 byte per token (float8_e4m3), plus one scale per layer and tensor.
    - `quanto`, `hqq`: r = min(residual_tokens, residual_length, tokens) of the tokens sit in the full-precision
      residual, V * e bytes each; the others are quantized: V * nbits / 8 bytes each (`STORED_BITS` where the
      packing pads) plus a scale and a zero point of e bytes each per group of q_group_size values
      (V / q_group_size groups per token).
    Source: group-wise affine quantization, x ~ scale * (q - zero) with one scale and zero point per group
    (HQQ, Badri and Shaji 2023; optimum-quanto), with the full-precision residual of KIVI (Liu et al. 2024)
    that transformers' `QuantizedLayer` keeps. Checked against `telemetry.kv_memory` for every backend and
    nbits in `tests/test_budget.py`.

    Args:
        tokens: all tokens in the cache (the cache length).
        dtype: the model's dtype (the residual's and the scales' element type).
        residual_tokens: how many of them sit in the full-precision residual (quanto, hqq; ignored otherwise).
        nominal_bits: count nbits exactly, ignoring `STORED_BITS` (the textbook formula, without packing).

    Returns:
        Bytes (int).

    Raises:
        ValueError, ImportError: see `CacheSpec.validate`.
    """
    spec.validate(model_config)
    cfg = model_config.get_text_config(decoder=True)
    kv_heads, head_dim = kv_shape(model_config)
    values = 2 * cfg.num_hidden_layers * kv_heads * head_dim
    element = torch.empty((), dtype=dtype).element_size()
    if spec.backend == "dynamic":
        return values * element * tokens
    if spec.backend == "fp8":
        return values * tokens + 2 * cfg.num_hidden_layers * 4
    opts = spec.resolved()
    bits = opts["nbits"] if nominal_bits else STORED_BITS.get((spec.backend, opts["nbits"]), opts["nbits"])
    per_token = values * bits / 8 + 2 * element * values / opts["q_group_size"]
    residual = max(min(residual_tokens, opts["residual_length"], tokens), 0)
    return int(per_token * (tokens - residual) + values * element * residual)


def build_cache(spec: CacheSpec, model_config: PreTrainedConfig) -> Cache:
    """Validate `spec` and build its empty transformers cache for a model.

    Returns:
        `DynamicCache(config=...)` for `dynamic`, else `QuantizedCache(backend, config, **options)` with
        only the options the spec sets (transformers fills the rest with its defaults, listed in `BACKENDS`).

    Raises:
        ValueError, ImportError: see `CacheSpec.validate`.
    """
    spec.validate(model_config)
    if not spec.info.is_quantized:
        return DynamicCache(config=model_config)
    return QuantizedCache(spec.backend, model_config, **spec.given())


def warm_up(backends: tuple[str, ...] | None = None) -> dict[str, float]:
    """Run one prefill-sized update and one decode-step update through each installed quantized backend's
    own cache layer, on random tensors of shape [1, 1, 8, 64], so that one-time work happens now: optimum-quanto
    compiles its C++ extension on its first de-quantize in a fresh install (23-35 s on 2 cores, written into
    site-packages, needs g++ and ninja). `make` runs this once after installing.

    Returns:
        Seconds spent per backend.
    """
    import time

    import torch
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=64,
    )
    seconds = {}
    for name in backends or tuple(BACKENDS):
        spec = CacheSpec(name) if name == "fp8" else CacheSpec(name, residual_length=1)
        if not spec.info.is_quantized or not spec.info.installed():
            continue
        start = time.perf_counter()
        layer = build_cache(spec, config).layers[0]
        states = torch.randn(1, 1, 8, 64)
        layer.update(states, states)
        layer.update(states[:, :, :1], states[:, :, :1])
        seconds[name] = time.perf_counter() - start
    return seconds
