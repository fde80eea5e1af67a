"""The Ask tab's option fields, from the registry (`kvdemo.cache.registry.BACKENDS`): what each field offers, its
first value, and the updates that follow a change of backend. Nothing here names a backend or an option.

At every change of the backend, however made, the fields the backend takes are shown with its choices
(`fields_shown`, values untouched). At the user's click on a backend the fields also take that backend's defaults,
or the values the user last set on it (`fields_for_backend`, `remember`). Where the page is set to a whole spec at
once (a reload, an opened session file), the setter writes the values itself."""

from __future__ import annotations

from typing import Any

import gradio as gr

from kvdemo.cache.options import Option
from kvdemo.cache.registry import BACKENDS, GROUP_OPTIONS

FIRST_FIELDS = ("type_k", "type_v", "nbits", "nbits_value", "residual_length", "flush", "rotation", "storage")
"""The option fields shown first, in one row with the backend, those a user of the field sets most (precision:
llama.cpp's `-ctk`/`-ctv` types or nbits; residual, flush, rotation; `dynamic`'s storage), without their help, which
the backend's note gives (a row of help texts four lines deep pushed the chat and Ask below a 900-px screen); the
others sit under "More options", each with its help (each still shown only for a backend that takes it)."""


def field_choices(option: Option) -> list[Any]:
    """What an option's Dropdown offers: its registry choices; for a `same_as` option (`nbits_value`) first
    `("same as nbits", "")`, the empty field, which leaves the option unset (`spec_from_inputs`), so that the page's
    `nbits` alone means what transformers' `nbits` means."""
    assert option.choices is not None  # a Dropdown's option lists its values
    if option.same_as is None:
        return list(option.choices)
    return [(f"same as {option.same_as}", ""), *((str(choice), choice) for choice in option.choices)]


def field_start(option: Option) -> int | str:
    """An option field's value when nothing else is there: the registry default, or the empty field ("") for a
    `same_as` option."""
    return "" if option.same_as is not None else option.default


def backend_option_updates(backend: str, *current: Any) -> tuple[Any, ...]:
    """Visibility, choices, values and help of the option fields (`GROUP_OPTIONS`) for a backend, from `BACKENDS`, and
    the backend's description. A field keeps its current value when the new backend allows it (so switching
    away and back restores what was there), else it takes the backend's default.

    Args:
        backend: the chosen backend.
        current: the fields' current values, in `GROUP_OPTIONS` order (may be omitted).
    """
    info = BACKENDS.get(backend) or next(iter(BACKENDS.values()))
    current = current + (None,) * (len(GROUP_OPTIONS) - len(current))
    updates = []
    for name, value in zip(GROUP_OPTIONS, current):
        option = info.options.get(name)
        if option is None:
            updates.append(gr.update(visible=False))
            continue
        if option.choices is not None:
            allowed = value in option.choices or (option.same_as is not None and value in ("", None))
        else:
            assert option.minimum is not None  # an option without choices has a minimum
            allowed = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= option.minimum
        keep = value if allowed else field_start(option)
        # each backend's own help (`rotation` is Hadamard for quanto and hqq, llama.cpp's rule for ggml); the first
        # row's in the note
        helped = {} if name in FIRST_FIELDS else {"info": option.help}
        if option.choices is not None:
            choices = field_choices(option)
            updates.append(gr.update(visible=True, choices=choices, value="" if keep is None else keep, **helped))
        else:
            updates.append(gr.update(visible=True, value=keep, **helped))
    helps = "".join(f"\n- **{name}**: {info.options[name].help}" for name in FIRST_FIELDS if name in info.options)
    note = f"{info.summary}. {info.behaviour}" + (f"\n\nThe fields above:{helps}" if helps else "")
    return (*updates, note)


def remember(backend: str, memory: dict | None, *current: Any) -> dict:
    """`memory` (backend -> its fields' values, in `GROUP_OPTIONS` order) with `current` recorded as `backend`'s: run
    at each change of a field, so that switching away and back brings the user's values back."""
    return {**(memory or {}), backend: list(current)}


def fields_for_backend(backend: str, memory: dict | None) -> tuple[Any, ...]:
    """The option fields and the note after the user picks `backend`: the values last set on it (`remember`), else
    its registry defaults, never another backend's values (quanto's `flush=requantize` would otherwise ride along to
    turboquant, whose default is `append`)."""
    saved = (memory or {}).get(backend)
    return backend_option_updates(backend, *saved) if isinstance(saved, list) else backend_option_updates(backend)


def fields_shown(backend: str) -> tuple[Any, ...]:
    """The option fields' visibility and choices for `backend` (no value: what the fields hold stays), and the
    backend's note: what every change of the backend runs, before the gate."""
    *updates, note = backend_option_updates(backend)
    return (*({key: value for key, value in u.items() if key != "value"} for u in updates), note)
