"""The one registry of KV cache formats (backends): `BACKENDS`, one `Backend` card each, read from the formats'
folders.

Each format is one folder, `kvdemo/cache/formats/<name>/`, that holds everything kvdemo knows of it: its card in
`__init__.py` (its options and their words, presets, byte formula, layout rules, cache factory, deploy rule, store
types and the spec texts it offers as examples) and its layers, blocks and codes beside it, as transformers'
cache-layer subclasses carry their own rules; `kvdemo.cache.spec` validates a `CacheSpec` and builds its cache from
the card. The page, the command line, the tests and the README's backend table read `BACKENDS` (and
`kvdemo.cache.catalogue`'s specs); nothing else names a format. Adding a format is one folder and one name in `FORMATS`
(CONTRIBUTING.md, "Adding a format").
"""

from __future__ import annotations

import importlib

from kvdemo.cache.backend import Backend
from kvdemo.cache.layer_plan import PLAN
from kvdemo.cache.options import SHOWN_ORDER

FORMATS = ("dynamic", "quanto", "hqq", "fp8", "turboquant", "ggml", "nvfp4", "mlx", "int8")
"""The formats' folders under `kvdemo.cache.formats`, in the order the page, `--help` and the README list them;
`dynamic` (the full-precision baseline) first. A folder's name is its format's name in a spec."""

BACKENDS: dict[str, Backend] = {
    card.name: card for card in (importlib.import_module(f"kvdemo.cache.formats.{name}").BACKEND for name in FORMATS)
}
"""Every format's card by name, in `FORMATS`' order."""

BASELINE = FORMATS[0]
"""The full-precision backend every comparison measures against."""

_DECLARED = [name for card in BACKENDS.values() for name in card.options]
SPEC_OPTIONS: tuple[str, ...] = (
    *[name for name in SHOWN_ORDER if name in _DECLARED],
    *dict.fromkeys(name for name in _DECLARED if name not in SHOWN_ORDER),
)
"""Every option some format takes, by name: a spec sets some of them (`kvdemo.cache.spec.CacheSpec`), the page, the
command line and the tables show them in this order (`kvdemo.cache.options.SHOWN_ORDER`, then any a format added later,
in `FORMATS`' order)."""

GROUP_OPTIONS: tuple[str, ...] = tuple(name for name in SPEC_OPTIONS if name != PLAN)
"""`SPEC_OPTIONS` but the per-layer `plan` (`kvdemo.cache.layer_plan`): the Ask tab's option fields, in order (a plan is
made for one model and one text, in the Compare tab, the command line or Python)."""


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
    return f"{examples} (a preset: {listed})"


def backends_help() -> str:
    """Every backend's summary and options, for `--help`."""
    return "\n".join(
        f"  {b.name}: {b.summary}" + (f"\n      options: {b.options_text()}" if b.options else "")
        for b in BACKENDS.values()
    )


FORMATS_PAGE = "docs/formats.md"
"""The docs page holding each format's options table (`options_markdown`), one section per format named after it."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | would end the table cell


def markdown_table() -> str:
    """The README's backend table: each format linked to its section of `FORMATS_PAGE`, what stores its cache, the
    names of its options (their values, defaults and meaning: `options_markdown`). A test checks the README holds
    exactly this."""
    rows = ["| format | what stores the cache | options |", "|---|---|---|"]
    for b in BACKENDS.values():
        names = ", ".join(f"`{name}`" for name in b.options) or "none"
        rows.append(f"| [`{b.name}`]({FORMATS_PAGE}#{b.name}) | {b.summary} | {names} |")
    return "\n".join(rows)


def options_markdown(name: str) -> str:
    """Format `name`'s options as a table for its section of `FORMATS_PAGE`: each option's allowed values, default and
    help line, from its card (a test checks the page holds exactly this)."""
    rows = ["| option | values | default | what it sets |", "|---|---|---|---|"]
    for option in BACKENDS[name].options.values():
        rows.append(f"| `{option.name}` | {_cell(option.allowed_text())} | {_cell(option.default_text)} | "
                    f"{_cell(option.help)} |")  # fmt: skip
    return "\n".join(rows)
