"""The one registry of KV cache backends: `BACKENDS`, one `Backend` entry each, listed from the backends' modules.

Each backend is one module under `kvdemo.cache.formats` that holds everything kvdemo knows of it (its options and
their words, presets, byte formula, layout rules, cache factory, deploy line and the spec texts it offers as
examples), as transformers' cache-layer subclasses carry their own rules; `kvdemo.cache.spec` validates a
`CacheSpec` and builds its cache from them. The page, the command line, the tests and the README's backend table read
`BACKENDS` (and `kvdemo.cache.catalogue`'s specs); nothing else names a backend. Adding a backend is one module and one
line here (CONTRIBUTING.md, "Adding a backend").
"""

from __future__ import annotations

from kvdemo.cache.backend import Backend
from kvdemo.cache.formats import dynamic, fp8, ggml, hqq, quanto, turboquant

BACKENDS: dict[str, Backend] = {
    module.BACKEND.name: module.BACKEND for module in (dynamic, quanto, hqq, fp8, turboquant, ggml)
}
"""Every backend by name, in the order the page, `--help` and the README list them; `dynamic` (the full-precision
baseline) first."""

BASELINE = dynamic.NAME
"""The full-precision backend every comparison measures against."""


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


def markdown_table() -> str:
    """The README's backend table (a test checks the README holds exactly this)."""
    rows = ["| backend | what stores the cache | options (allowed values, default) |", "|---|---|---|"]
    for b in BACKENDS.values():
        options = b.options_text().replace("|", "\\|")  # a bare | would end the table cell
        rows.append(f"| `{b.name}` | {b.summary} | {options} |")
    return "\n".join(rows)
