"""Argument checks shared by the library, the command line and the page, each written once.

Every check returns the value in its canonical type or raises `ValueError` with a message that says what to
change; the page turns that message into a `gr.Error` in one place (`kvdemo.ui.inputs.user_errors`).
"""

from __future__ import annotations

import numbers
from typing import Any


def shown(value: Any) -> str:
    """`repr(value)` cut to 40 characters (37 and `...`), for quoting what a user gave in a message.

    Example:
        >>> shown("x" * 100)
        "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..."
    """
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def max_new_tokens(value: Any, most: int | None = None, what: str = "an answer") -> int:
    """`value` as the number of tokens an answer may generate: a whole number >= 1 (a float that is whole, as
    the page's number fields send, is accepted), and at most `most` when given (`what` names the job that has
    that limit in the message, e.g. "a comparison").

    Example:
        >>> max_new_tokens(32.0)
        32

    Raises:
        ValueError: a bool, a non-number, a fraction, a value < 1 or > `most`.
    """
    number = value
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        number = int(value) if float(value).is_integer() else value
    if isinstance(number, bool) or not isinstance(number, numbers.Integral) or number < 1:
        raise ValueError(f"max_new_tokens={shown(value)} must be a whole number >= 1")
    if most is not None and number > most:
        raise ValueError(f"max_new_tokens={int(number)} is more than {what} runs here; use at most {most:,}")
    return int(number)
