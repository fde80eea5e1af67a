"""The page's input rules: pure parsing of what a user typed, ticked or uploaded, raising `ValueError` with a
message that says what to change; `user_errors`, the one place where such an error becomes a `gr.Error`
shown on the page (tests call the parsers directly); and `page_event`, the Ask tab's state inputs (Context box,
backend, options) as one named signature for Gradio."""

from __future__ import annotations

import functools
import inspect
import logging
import numbers
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import gradio as gr

from kvdemo import checks
from kvdemo.cache.layer_plan import PLAN
from kvdemo.cache.options import Option
from kvdemo.cache.registry import BACKENDS, GROUP_OPTIONS
from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.text import check_text
from kvdemo.serve.door import MAX_CONTEXT_BYTES

_log = logging.getLogger(__name__)

MAX_UPLOAD_BYTES = MAX_CONTEXT_BYTES  # what the Context box may hold, typed or uploaded
COMPARE_MAX_QUESTIONS = 20
COMPARE_MAX_NEW_TOKENS = 256
COMPARE_MAX_PERPLEXITY_TOKENS = 512
"""Limits of one comparison in the app (its reference keeps [tokens, vocab] float32 per question)."""
NEEDLE_MAX_NEW_TOKENS = 64
"""The most tokens a needle grid's answer may generate in the app (a needle is a short phrase)."""


def page_event(handler: Callable[..., Any], progress: bool = True) -> Callable[..., Any]:
    """`handler(context, backend, options, request[, progress])` as the Gradio event function of the Ask tab's
    state inputs: its parameters are `context`, `backend`, one per option of `GROUP_OPTIONS` (default None: the
    backend's default), then `request: gr.Request` and, when `progress`, `progress=gr.Progress()`. Gradio reads
    that signature to insert the request and the progress by position and to name the API's parameters
    (`client.predict(context=..., backend="hqq", nbits=4, api_name="/prefill")`); the options reach the handler
    as one dict, so an option added to the registry needs no change here.

    Source of the mechanism: `inspect.Signature` (PEP 362), which `gradio.helpers.special_args` and
    `gradio.utils.get_function_params` read through `inspect.signature`.
    """
    P = inspect.Parameter
    names = ("context", "backend")
    parameters = [P(name, P.POSITIONAL_OR_KEYWORD) for name in names]
    parameters += [P(name, P.POSITIONAL_OR_KEYWORD, default=None) for name in GROUP_OPTIONS]
    parameters.append(P("request", P.POSITIONAL_OR_KEYWORD, default=None, annotation=gr.Request))
    if progress:
        parameters.append(P("progress", P.POSITIONAL_OR_KEYWORD, default=gr.Progress()))
    signature = inspect.Signature(parameters)

    def event(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        values = given.arguments
        options = {name: values[name] for name in GROUP_OPTIONS}
        extra = (values["progress"],) if progress else ()
        return handler(values["context"], values["backend"], options, values["request"], *extra)

    event.__name__ = event.__qualname__ = handler.__name__
    event.__doc__ = handler.__doc__
    cast(Any, event).__signature__ = signature  # read by inspect.signature; typeshed's functions do not declare it
    event.__annotations__ = {"request": gr.Request}
    return event


def spec_from_inputs(backend: str, given: Mapping[str, Any]) -> CacheSpec:
    """A `CacheSpec` from the Ask tab's option fields, `given` keyed by the names of `GROUP_OPTIONS` (missing
    ones empty); options the backend does not take are ignored (they are hidden on the page), empty fields mean
    the backend's default. A text option (`flush`, `storage`) is kept as its word; the others must be whole
    numbers. An option that acts on other layer kinds only (`sliding`) at its default is left unset, as on the
    command line. A `q_group_size` at the registry's default (the field's starting value) is left unset, so that the
    session fits it to the model (`CacheSpec.fit`: 32 on a head_dim of 96, where 64 would be refused) and its
    status line says the size that ran.

    Example:
        >>> spec = spec_from_inputs("quanto", {"nbits": 2.0, "q_group_size": None, "storage": "growing"})
        >>> spec == CacheSpec("quanto", nbits=2)  # storage is dynamic's option: hidden on the page, ignored
        True

    Raises:
        ValueError: an unknown backend, a name that is not an option, a value that is not a whole number, or one
            the registry refuses (`CacheSpec.validate` without a model: choices, minimum, maximum).
        ImportError: the backend's package is not installed (`CacheSpec.validate`).
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={str(backend)[:40]!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    given = given or {}
    unknown = [str(name) for name in given if name not in GROUP_OPTIONS]
    if unknown:
        raise ValueError(f"{', '.join(unknown)} is not an option; the options are {', '.join(GROUP_OPTIONS)}")
    options: dict[str, Any] = {}  # keywords of CacheSpec, integers but for the text options
    for name, option in BACKENDS[backend].options.items():
        value = given.get(name)
        if value is None or value == "":
            continue
        if option.is_text:
            word = str(value).strip().lower()  # as `CacheSpec.parse` reads it
            if not (option.quiet and word == option.default):  # `sliding=keep` unless asked: the spec as before
                options[name] = word
            continue
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            options[name] = int(value)  # exact, also past a float's 53 bits
            continue
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not number.is_integer():
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{name}={checks.shown(value)} must be a whole number") from None
        options[name] = int(number)
    if options.get("q_group_size") == BACKENDS[backend].options.get("q_group_size", Option("", -1)).default:
        del options["q_group_size"]  # the default: fitted to the model when the session is built
    return CacheSpec(backend, **options).validate()


def read_upload(path: str | None) -> str:
    """The text of an uploaded .txt / .md file.

    Raises:
        ValueError: no file, another suffix, a file over `MAX_UPLOAD_BYTES`, not UTF-8, binary (NUL bytes) or
            empty.
    """
    if not path:
        raise ValueError("No file was uploaded; choose a .txt or .md file")
    file = Path(path)
    if file.suffix.lower() not in (".txt", ".md"):
        raise ValueError(f"{file.name} is not a .txt or .md file; upload plain text")
    size = file.stat().st_size
    if size > MAX_UPLOAD_BYTES:
        raise ValueError(f"{file.name} is {size / 2**20:.1f} MiB; the limit is {MAX_UPLOAD_BYTES / 2**20:.0f} MiB")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{file.name} is not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    if "\x00" in text:
        raise ValueError(f"{file.name} looks binary (it holds NUL bytes); upload a text file")
    if not text.strip():
        raise ValueError(f"{file.name} is empty")
    return check_text(text, file.name)


def compare_specs(chosen: list[str] | None, more: str | None) -> list[CacheSpec]:
    """The specs of the Compare tab: the ticked ones, then one per non-empty line of `more` (the
    `CacheSpec.parse` syntax, e.g. `hqq:4,residual_length=16`).

    Raises:
        ValueError: a line that does not parse (its message, with the line number), or no spec at all.
    """
    specs = [CacheSpec.parse(text) for text in chosen or []]
    for number, line in enumerate((more or "").splitlines(), 1):
        if line.strip():
            try:
                specs.append(CacheSpec.parse(line))
            except ValueError as error:
                raise ValueError(f"more specs, line {number}: {error}") from None
    if not specs:
        raise ValueError("Tick at least one spec to compare (dynamic is always included as the baseline)")
    return specs


def compare_questions(text: str | None) -> list[str]:
    """The questions of the Compare tab: one per non-empty line.

    Raises:
        ValueError: there is none, or more than `COMPARE_MAX_QUESTIONS`.
    """
    questions = [
        check_text(line.strip(), f"question line {n}")
        for n, line in enumerate((text or "").splitlines(), 1)
        if line.strip()
    ]
    if not questions:
        raise ValueError("Give at least one question, one per line (or press 'Fill in questions')")
    if len(questions) > COMPARE_MAX_QUESTIONS:
        raise ValueError(
            f"{len(questions)} questions is more than a comparison runs here; give at most {COMPARE_MAX_QUESTIONS}"
        )
    return questions


def compare_inputs(
    chosen: list[str] | None, more: str | None, questions_text: str | None, max_new_tokens: Any
) -> tuple[list[CacheSpec], list[str], int]:
    """The Compare tab's inputs checked, for the click and for the run: `compare_specs`, `compare_questions`,
    and `checks.max_new_tokens` with at most `COMPARE_MAX_NEW_TOKENS`.

    Raises:
        ValueError: see those three.
    """
    specs = compare_specs(chosen, more)
    questions = compare_questions(questions_text)
    return specs, questions, checks.max_new_tokens(max_new_tokens, COMPARE_MAX_NEW_TOKENS, what="a comparison")


def refusal(error: Exception, what: str) -> str:
    """The message shown beside the button that was refused (it stays until the next action there), after one
    line in the server log (no traceback: a refusal is not a fault)."""
    message = error.message if isinstance(error, gr.Error) else str(error)
    _log.info("refused %s: %s", what, message)
    return f"⚠ {message}"


PLAN_BACKENDS = tuple(name for name, info in BACKENDS.items() if PLAN in info.options)
"""The backends that take a per-layer plan (`plan` in their registry options), the Compare tab's plan choices."""

MAX_PLAN_BUDGET = 1 << 20
"""No KV cache here needs more bytes per token than this (the embedded model's full precision is 46,080)."""


def plan_request(base: Any, budget: Any) -> list[tuple[CacheSpec, float]]:
    """The Compare tab's per-layer plan fields: a base spec (`quanto`, or with options, `hqq,q_group_size=32`) and a
    budget in bytes per quantized token; a budget of 0 or empty asks for no plan.

    Returns:
        [] or [(base, budget)], for `compare(..., plans=...)`, which checks the budget against the backend's
        smallest cache on the model.

    Raises:
        ValueError: a budget that is not a number from 0 to `MAX_PLAN_BUDGET`, or a base that does not parse or
            takes no plan (saying which backends do).
    """
    if budget is None or budget == "" or budget == 0:
        return []
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= MAX_PLAN_BUDGET:
        raise ValueError(
            f"plan budget={checks.shown(budget)} must be a number of bytes per token from 1 to {MAX_PLAN_BUDGET:,} "
            "(0: no plan)"
        )
    spec = CacheSpec.parse(base if isinstance(base, str) and base.strip() else PLAN_BACKENDS[0])
    if PLAN not in spec.info.options:
        raise ValueError(f"plan backend={spec.backend} takes no per-layer plan; choose {', '.join(PLAN_BACKENDS)}")
    return [(spec, float(budget))]


def perplexity_tokens(value: Any) -> int:
    """The Compare tab's perplexity field: a whole number of tokens, 0 (no perplexity) to
    `COMPARE_MAX_PERPLEXITY_TOKENS`; empty means 0.

    Raises:
        ValueError: anything else.
    """
    if value is None or value == "":
        return 0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != int(value)
        or not (0 <= value <= COMPARE_MAX_PERPLEXITY_TOKENS)
    ):
        raise ValueError(
            f"perplexity tokens={str(value)[:40]!r} must be a whole number from 0 (none) to "
            f"{COMPARE_MAX_PERPLEXITY_TOKENS}"
        )
    return int(value)


def user_errors(fn: Callable) -> Callable:
    """`fn` (a handler, plain or a generator) with `ValueError` and `ImportError`, the library's errors meant for
    the user, raised as `gr.Error` carrying the same message, so the page shows it. The signature is kept
    (`functools.wraps`), so Gradio still finds `gr.Request` and `gr.Progress` parameters."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except gr.Error:  # already a message for the page (gr.Error is a ValueError)
                raise
            except (ValueError, ImportError) as error:
                raise gr.Error(str(error)) from None

        return stream

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except (ValueError, ImportError) as error:
            raise gr.Error(str(error)) from None

    return call
