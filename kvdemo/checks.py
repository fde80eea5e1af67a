"""Argument checks shared by the library, the command line and the page, each written once.

Every check returns the value in its canonical type or raises `ValueError` with a message that says what to
change; the page turns that message into a `gr.Error` in one place (`kvdemo.ui.inputs.user_errors`).
"""

from __future__ import annotations

import numbers
from typing import Any, SupportsInt, cast


def shown(value: Any) -> str:
    """`repr(value)` cut to 40 characters (37 and `...`), for quoting what a user gave in a message.

    Example:
        >>> shown("x" * 100)
        "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..."
    """
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def max_new_tokens(value: Any, most: int | None = None, what: str = "an answer", name: str = "max_new_tokens") -> int:
    """`value` as the number of tokens an answer may generate: a whole number >= 1 (a float that is whole, as
    the page's number fields send, is accepted), and at most `most` when given (`what` names the job that has
    that limit in the message, e.g. "a comparison"; `name`, the argument the caller was given, e.g. `recommend`'s
    "answer_tokens").

    Example:
        >>> max_new_tokens(32.0)
        32

    Raises:
        ValueError: a bool, a non-number, a fraction, a value < 1 or > `most`.
    """
    number = value
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        # typeshed's numbers.Real has no __int__, but int() takes every Real, as it takes a float
        number = int(cast(SupportsInt, value)) if float(value).is_integer() else value
    if isinstance(number, bool) or not isinstance(number, numbers.Integral) or number < 1:
        raise ValueError(f"{name}={shown(value)} must be a whole number >= 1")
    if most is not None and number > most:
        raise ValueError(f"{name}={int(number)} is more than {what} runs here; use at most {most:,}")
    return int(number)


def prefill_fits(window: int, context_tokens: int, reserve_tokens: int) -> None:
    """Whether `context_tokens` plus `reserve_tokens` kept for a question and its answer fit a model's `window`
    (tokens).

    Raises:
        ValueError: the reserve alone fills the window, or the sum passes it (the longest context that fits).
    """
    if reserve_tokens >= window:
        raise ValueError(
            f"keeping {reserve_tokens:,} tokens for a question and its answer leaves no room for a context in "
            f"the model's {window:,}-token window; lower max_new_tokens"
        )
    if context_tokens + reserve_tokens > window:
        raise ValueError(
            f"the context is {context_tokens:,} tokens; with {reserve_tokens:,} tokens kept for a question and "
            f"its answer it exceeds the model's {window:,}-token window. Shorten the context to at most "
            f"{window - reserve_tokens:,} tokens"
        )


def answer_fits(window: int, context_tokens: int, question_tokens: int, max_new_tokens: int) -> None:
    """Whether a question of `question_tokens` and an answer of up to `max_new_tokens` fit a model's `window`
    after `context_tokens` (all in tokens).

    Raises:
        ValueError: the question leaves no room for an answer (shorten it: by how much), or max_new_tokens
            passes the room left (lower it: to what).
    """
    room = window - context_tokens - question_tokens
    if room < 1:
        raise ValueError(
            f"context {context_tokens:,} + question {question_tokens:,} tokens leave no room for an answer in "
            f"the model's {window:,}-token window; shorten the question to at most "
            f"{max(window - context_tokens - 1, 0):,} tokens, or prefill a shorter context"
        )
    if max_new_tokens > room:
        raise ValueError(
            f"context {context_tokens:,} + question {question_tokens:,} + max_new_tokens {max_new_tokens:,} "
            f"tokens exceeds the model's {window:,}-token window; lower max_new_tokens to at most {room:,} or "
            "shorten the question"
        )
