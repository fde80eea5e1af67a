"""The needle grid's inputs checked and parsed: context lengths (tokens) and depths (%), as lists or as text
such as `"1024, 2048 4096"`; every error is a `ValueError` whose message says what to write instead. And the
grid's defaults (read by the command line's `--help` too: this module loads no torch)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any, Literal, SupportsInt, cast, overload

from kvdemo.cache.catalogue import examples
from kvdemo.checks import shown
from kvdemo.qa.limits import QUESTION_RESERVE_TOKENS

DEFAULT_SPECS = examples("needle")
DEFAULT_LENGTHS = (1024, 2048, 4096, 7936)
DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
DEFAULT_MAX_NEW_TOKENS = 32
"""Tokens an answer may take: the answer "The special magic number for Velora Quintash is 482913." is 18."""


# ---- input checks ----------------------------------------------------------------------------------------
def _number_list(text: str, what: str) -> list[str]:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what} is empty; give numbers separated by commas, e.g. {_EXAMPLES[what]}")
    return [part for part in re.split(r"[,\s]+", text.strip()) if part]


_EXAMPLES = {"lengths": "1024,2048,4096,7936", "depths": "0,25,50,75,100"}


def parse_lengths(text: str) -> list[int]:
    """Context lengths (tokens) from text such as `"1024, 2048 4096"` (commas or spaces).

    Raises:
        ValueError: empty, or an item that is not a whole number (checked further by `check_lengths`).
    """
    out = []
    for part in _number_list(text, "lengths"):
        if not re.fullmatch(r"[0-9]+", part.replace("_", "")):
            raise ValueError(f"lengths: {part!r} is not a whole number of tokens; write e.g. {_EXAMPLES['lengths']}")
        out.append(int(part.replace("_", "")))
    return check_lengths(out)


def parse_depths(text: str) -> list[float]:
    """Depths (%) from text such as `"0, 25, 50 75 100"` (commas or spaces).

    Raises:
        ValueError: empty, or an item that is not a number from 0 to 100.
    """
    out = []
    for part in _number_list(text, "depths"):
        try:
            out.append(float(part.rstrip("%")))
        except ValueError:
            raise ValueError(
                f"depths: {part!r} is not a number; write percentages like {_EXAMPLES['depths']}"
            ) from None
    return check_depths(out)


def check_lengths(lengths: Sequence[Any], most: int | None = None) -> list[int]:
    """The lengths as ints, sorted: each a whole number >= 1, none twice, none above `most` when given.

    Raises:
        ValueError: no length, a non-integer (a bool, a fraction, text), a length < 1 or > `most`, a repeat.
    """
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise ValueError(
            f"lengths={shown(lengths)}: give a list of context lengths in tokens, "
            f"e.g. [{_EXAMPLES['lengths'].replace(',', ', ')}]"
        )
    out = []
    for value in lengths:
        if (
            isinstance(value, numbers.Real)
            and not isinstance(value, (bool, numbers.Integral))
            and float(value).is_integer()
        ):
            value = int(cast(SupportsInt, value))  # typeshed's numbers.Real has no __int__; int() takes any Real
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"length {shown(value)} must be a whole number of tokens >= 1")
        if value in out:
            raise ValueError(f"length {value} is given twice; give each length once")
        if most is not None and value > most:
            raise ValueError(f"length {int(value):,} does not fit: {_window_text(most)}")
        out.append(int(value))
    return sorted(out)


def check_depths(depths: Sequence[Any]) -> list[float]:
    """The depths as floats, sorted: each a number from 0 to 100 (%), none twice.

    Raises:
        ValueError: no depth, a non-number, NaN, a depth outside 0-100, a repeat.
    """
    if isinstance(depths, (str, bytes)) or not isinstance(depths, Sequence) or not depths:
        raise ValueError(
            f"depths={shown(depths)}: give a list of depths in % from 0 to 100, "
            f"e.g. [{_EXAMPLES['depths'].replace(',', ', ')}]"
        )
    out = []
    for value in depths:
        # a Real compares with 0 and 100 as a float does (typeshed's numbers.Real has no __ge__)
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or math.isnan(value)
            or not 0 <= cast(float, value) <= 100
        ):
            raise ValueError(
                f"depth {shown(value)} must be a number from 0 to 100 (% of the haystack before the needle)"
            )
        if float(value) in out:
            raise ValueError(f"depth {value} is given twice; give each depth once")
        out.append(float(value))
    return sorted(out)


def _window_text(most: int) -> str:
    return (
        f"the longest context is {most:,} tokens (the model's window less {QUESTION_RESERVE_TOKENS} tokens "
        "for the question and max_new_tokens for the answer)"
    )


@overload
def check_count(value: Any, name: str, allow_none: Literal[False] = False) -> int: ...


@overload
def check_count(value: Any, name: str, allow_none: bool) -> int | None: ...


def check_count(value: Any, name: str, allow_none: bool = False) -> int | None:
    """`value` as a count (`name` in the message): a whole number >= 1, or None when `allow_none`.

    Raises:
        ValueError: a bool, a non-integer or a number < 1 (or None without `allow_none`).
    """
    if allow_none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={shown(value)} must be a whole number >= 1" + (" (or None)" if allow_none else ""))
    return int(value)
