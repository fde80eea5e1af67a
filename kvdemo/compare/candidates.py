"""The specs a recommendation measures (`candidate_specs`), derived from the registry alone for one model and engine:
no list of specs is written here, only which options are varied and why.

Each quantized, installed backend at every key precision from `MIN_PLAN_BITS` (the planner's floor: 1-bit stores err
by more than their own norm) and every value precision at most the keys' (the keys set which tokens a query attends
to and are the more sensitive half: KIVI, KVQuant; so a split gives the keys the bits), each at every choice of the
options in `VARIED` (`sliding` only for a backend that keeps sliding-window layers by default), every preset of a
backend (vLLM's TurboQuant presets as vLLM stores them, llama.cpp's cache types for keys and values), and the option
sets a backend lists as `candidates` (llama.cpp's keys at q8_0 or f16 with values of fewer bytes). Every
other option keeps its default: it changes when and how a store is written (the flush, the residual's length, the
axis, hqq's solver), not what a long context holds, and the Compare tab measures it. A spec the model refuses
(`CacheSpec.validate`: a group that does not fit its head_dim, a rotation on another width) is left out, and so is a
spec the engine does not store the same way (`kvdemo.cache.spec.CacheSpec.deployments`). `dynamic` comes first: the
reference and the answer when nothing quantized keeps the model within the target.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, cast

from kvdemo.cache.deploy import ENGINES
from kvdemo.cache.model.layer_kinds import layer_types
from kvdemo.cache.policies import SLIDING_CHOICES
from kvdemo.cache.registry import BACKENDS, BASELINE
from kvdemo.cache.spec import CacheSpec
from kvdemo.evals.plan_budget import MIN_PLAN_BITS

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from kvdemo.cache.backend import Backend

VARIED = ("rotation", "scale", "sliding")
"""The options whose every choice is a candidate: what each stored value is (`rotation`: the Hadamard basis that
spreads outlier channels; `scale`: fp8's per-tensor or per-token-head scale) and which layers are quantized
(`sliding`, only where the model has sliding-window layers: it changes nothing elsewhere)."""

ANY_ENGINE = "any"
"""`--engine any`: every candidate, whichever engine deploys it."""


def candidate_specs(model_config: PreTrainedConfig, engine: str = ANY_ENGINE, protect: str = "") -> list[CacheSpec]:
    """`dynamic`, then every candidate of every quantized installed backend that this model runs and `engine`
    deploys (see the module's docstring), validated, each once.

    Args:
        protect: also each candidate whose backend takes `protect` (and that does not set it) with these layers kept
            at full precision (`n:n`; `kvdemo.compare.weights`: the layers whose key bias is an outlier); "": none.

    Raises:
        ValueError: an engine not in `ENGINES` or `any` (the message lists them).
    """
    if engine != ANY_ENGINE and engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {', '.join((ANY_ENGINE, *ENGINES))}")
    grid = _grid(model_config)
    if protect:
        grid += [s.replace(protect=protect) for s in grid if "protect" in s.info.options and "protect" not in s.given()]
    found: dict[str, CacheSpec] = {}
    for spec in [CacheSpec(BASELINE), *grid]:
        try:
            spec = spec.validate(model_config)
        except (ValueError, ImportError):
            continue  # this model cannot store it (a group or a width): not a candidate here
        if engine == ANY_ENGINE or engine in [d.engine for d in spec.deployments(model_config)]:
            found.setdefault(spec.label, spec)
    return list(found.values())


def _grid(model_config: PreTrainedConfig) -> list[CacheSpec]:
    """Every quantized installed backend's bits, K/V splits, `VARIED` choices and presets (not yet validated)."""
    has_sliding = has_windows(model_config)
    specs = []
    for name, info in BACKENDS.items():
        if not info.quantized or not info.installed():
            continue
        varied = {
            option: [None, *(c for c in info.options[option].choices or () if c != info.options[option].default)]
            for option in VARIED
            if option in info.options and (option != "sliding" or (has_sliding and _keeps_sliding(info)))
        }
        for bits in _bit_pairs(name):
            for words in itertools.product(*varied.values()):
                specs.append(CacheSpec(name, **bits, **dict(zip(varied, words))))  # type: ignore[arg-type]
        for preset, options in info.presets.items():  # a preset that sets `sliding` (vLLM's) is taken as it is
            ways = [(None,) * len(varied)] if "sliding" in options else _sliding(varied)
            specs += [CacheSpec.parse(f"{name}:{preset}").replace(**_unset(varied, w, options)) for w in ways]
        for options in info.candidates:  # the backend's own further candidates (ggml's mixed key and value types)
            specs += [CacheSpec(name, **options).replace(**_unset(varied, w, options)) for w in _sliding(varied)]  # type: ignore[arg-type]
    return specs


def _unset(varied: dict[str, list], words: tuple, options: dict[str, int | str]) -> dict[str, int | str | None]:
    """The varied options' `words` for a preset or a backend's candidate, but those it sets itself (fp8's e5m2 sets
    `scale=one`: kept)."""
    return {option: word for option, word in zip(varied, words) if option not in options}


def has_windows(model_config: PreTrainedConfig) -> bool:
    """Whether the model has sliding-window (or chunked) attention layers, which `sliding` acts on."""
    return any("sliding" in kind or "chunked" in kind for kind in layer_types(model_config))


def _keeps_sliding(info: Backend) -> bool:
    """Whether a backend keeps sliding-window layers at full precision by default, so that quantizing them is a
    candidate of its own; where it quantizes them already (`ggml`, as llama.cpp does), keeping them is kvdemo's only
    and no engine's, and is not tried."""
    return info.options["sliding"].default == SLIDING_CHOICES[0]


def _sliding(varied: dict[str, list]) -> list[tuple]:
    """The presets' choices of the varied options: `sliding`'s both ways where varied; the others as the preset
    sets them (None)."""
    return [tuple(w if o == "sliding" else None for o, w in zip(varied, words)) for words in itertools.product(
        *[choices if o == "sliding" else [None] for o, choices in varied.items()])]  # fmt: skip


def _bit_pairs(name: str) -> list[dict[str, int | None]]:
    """Keys' and values' bits of backend `name`: nbits from `MIN_PLAN_BITS`, nbits_value at most nbits (unset where
    equal, so the spec reads as transformers' one precision); one empty pair for a backend without nbits (fp8)."""
    options = BACKENDS[name].options
    if "nbits" not in options:
        return [{}]
    bits = [b for b in cast("tuple[int, ...]", options["nbits"].choices) if b >= MIN_PLAN_BITS]
    values = cast("tuple[int, ...]", options["nbits_value"].choices) if "nbits_value" in options else ()
    pairs: list[dict[str, int | None]] = []
    for k in bits:
        pairs.append({"nbits": k})
        pairs += [{"nbits": k, "nbits_value": v} for v in values if MIN_PLAN_BITS <= v < k]
    return pairs
