"""The specs kvdemo offers, made from the registry alone: every backend at every nbits and option word
(`all_specs`: what the tests' matrix runs and the Compare tab lists) and the Compare tab's start
(`default_compare_specs`). No torch: the command line's `--help` lists them."""

from __future__ import annotations

from typing import Any, cast

from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec


def all_specs() -> list[CacheSpec]:
    """Every backend at every nbits it allows (at its default where `nbits` is not `in_matrix`), the other options
    unset (the backend's defaults), then each other choice of a text option (`storage=growing`, `flush=append`) at
    the default nbits, and the default nbits with
    the values one step lower (`quanto:4,nbits_value=2`, `hqq:4,nbits_value=3`): what the tests' matrix runs and
    the Compare tab offers. No per-layer `plan` (one is written for one model's layer count) and no option that acts
    on other layer kinds only (`sliding=quantize`: the model-family matrix runs it, `tests/families.py`) or that is
    not in the matrix (`protect`, `Option.in_matrix`).

    Example:
        >>> [s.text for s in all_specs()][:5]
        ['dynamic', 'dynamic,storage=growing', 'quanto:2', 'quanto:4', 'quanto:4,flush=append']
    """
    specs = []
    for name, info in BACKENDS.items():
        nbits = info.options.get("nbits")
        # nbits is an integer option: its choices and default are ints (`Option` types them for both kinds)
        nbits_choices = cast("tuple[int, ...]", nbits.choices) if nbits is not None else (None,)
        default_nbits = cast("int", nbits.default) if nbits else None
        if nbits is not None and not nbits.in_matrix:  # one layer class at every bits (mlx): its own tests
            nbits_choices = (cast("int", default_nbits),)
        specs += [CacheSpec(name, nbits=n) for n in nbits_choices]
        for option in info.options.values():
            if option.canonical is not None or option.acts_on or not option.in_matrix:
                continue  # a plan is made for one model's layers; `sliding` changes nothing on full attention;
                # `protect` keeps layers as `dynamic` does (its own tests)
            if option.is_text:
                assert option.choices is not None  # a text option lists its words
                specs += [
                    CacheSpec(name, nbits=default_nbits).replace(**{option.name: choice})
                    for choice in option.choices
                    if choice != option.default
                ]
            elif option.same_as is not None:  # nbits_value: the values one step below the keys' default bits
                lower = [c for c in cast("tuple[int, ...]", option.choices) if c < cast("int", option.default)]
                specs += [CacheSpec(name, nbits=default_nbits).replace(**{option.name: lower[-1]})] if lower else []
    return specs


def examples(purpose: str) -> tuple[str, ...]:
    """The spec texts the backends offer for `purpose` (`Backend.examples`), in the places they give: `baseline`
    (the full-precision spec every comparison measures against), `start` (the page's fixed first spec), `needle`
    (the needle grid's default specs), `plan_base` (the backend a plan keeps by default), `more` (the Compare
    tab's examples of further specs).

    Example:
        >>> examples("needle")  # the Needle tab starts with the first two: full precision, and 2 bits that lose it
        ('dynamic', 'hqq:2', 'hqq:4', 'quanto:4', 'fp8')
    """
    placed = [
        (place, text) for backend in BACKENDS.values() for text, place in backend.examples.get(purpose, {}).items()
    ]
    return tuple(text for _, text in sorted(placed, key=lambda pair: pair[0]))


def default_compare_specs() -> list[CacheSpec]:
    """The specs compared when none are chosen: each backend at each of its `compare_nbits`, its other options at
    their defaults (a rotated twin is one click away: `all_specs`). One spec per backend (six today; a format sets
    `compare_nbits=()` to stay out): a first comparison
    stays quick on every model offered, and the Compare tab adds the Ask tab's own start to them.

    Example:
        >>> [s.text for s in default_compare_specs()]
        ['dynamic', 'quanto:4', 'hqq:4', 'fp8', 'turboquant:4', 'ggml']
    """
    return [CacheSpec(name, nbits=n) for name, info in BACKENDS.items() for n in info.compare_nbits]


def defaults_for(model_config: Any) -> tuple[list[CacheSpec], list[str]]:
    """`default_compare_specs` on one model: the specs it serves, and a line for each it refuses (`CacheSpec.validate`:
    ggml's blocks of 32 on a head_dim of 80, a backend that cannot serve the model's layer kinds), to say beside the
    results; a refusal of the whole default set would leave a first comparison with nothing. An explicit choice is
    refused as it stands (`compare` validates every spec first)."""
    kept, left_out = [], []
    for spec in default_compare_specs():
        try:
            spec.validate(model_config)
            kept.append(spec)
        except ValueError as error:  # ImportError (a missing package) is the user's to fix: it is raised
            left_out.append(f"{spec.text} left out: {error}")
    return kept, left_out
