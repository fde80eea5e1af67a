"""The `ask` command: prefill a context (or open a saved session, `--session`), answer the questions in turn, and
optionally save the session (`--save-session`); and the questions of a case file, which `compare` reads too.
Nothing here loads torch until a command runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvdemo import checks
from kvdemo.cache.registry import BASELINE, SPEC_OPTIONS
from kvdemo.cache.spec import CacheSpec


def case_questions(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """The case (cut to --paragraphs) and the questions from --question and --questions-from-case (and, for
    compare, --unanswerable-from-case). Raises ValueError for a missing or bad choice, or a question that is blank or
    has a broken character (an argument that is not UTF-8 reaches Python as an unpaired surrogate: `check_question`),
    before any model loads."""
    from kvdemo.evals.cases import load_case
    from kvdemo.qa.text import check_question

    questions = [check_question(q, f"--question number {i}") for i, q in enumerate(args.question, 1)]
    case = load_case(args.context_file).select(args.paragraphs)
    for flag, count, picked in (
        ("--questions-from-case", args.questions_from_case, lambda n: case.answerable(n)),
        ("--unanswerable-from-case", getattr(args, "unanswerable_from_case", None), lambda n: case.unanswerable(n)),
    ):
        if count is None:
            continue
        if count < 1:
            raise ValueError(f"{flag} must be >= 1")
        if not case.questions:
            raise ValueError(f"{args.context_file} has no questions; {flag} needs a case file")
        questions += [q.question for q in picked(count)]
    if not questions:
        raise ValueError("no question: give --question (repeatable) or --questions-from-case N")
    return case, questions


def asked_spec(args: argparse.Namespace) -> CacheSpec | None:
    """The spec of --backend, --preset and the option flags, validated against the registry; None when none is given
    with --session (the file's spec is taken). Raises ValueError for a bad option."""
    given = ",".join(f"{name}={getattr(args, name)}" for name in SPEC_OPTIONS if getattr(args, name) is not None)
    if args.session and args.backend is None and not args.preset and not given:
        return None
    backend = args.backend or BASELINE
    if args.preset:  # written as a spec, so that the preset is read as `compare --spec` reads it
        spec = CacheSpec.parse(",".join(filter(None, [f"{backend}:{args.preset}", given])))
    else:
        spec = CacheSpec(backend, **{name: getattr(args, name) for name in SPEC_OPTIONS})
    return spec.validate()  # options against the registry before the model loads


def _questions(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """The case (None with --session) and the questions; checked before any model loads."""
    if args.session and args.context_file:
        raise ValueError("give --context-file to prefill, or --session to open a saved session, not both")
    if not args.session and not args.context_file:
        raise ValueError("give --context-file (the text to prefill) or --session (a saved session file)")
    if args.context_file:
        return case_questions(args)
    from kvdemo.qa.text import check_question

    if args.questions_from_case is not None or args.paragraphs:
        raise ValueError("--questions-from-case and --paragraphs read a case file: give --question with --session")
    questions = [check_question(q, f"--question number {i}") for i, q in enumerate(args.question, 1)]
    if not questions:
        raise ValueError("no question: give --question (repeatable)")
    return None, questions


def run_ask(args: argparse.Namespace) -> dict[str, Any]:
    """Run the `ask` command and return its JSON-ready result.

    Raises:
        ValueError, ImportError, OSError: bad input (a session file that cannot be opened here included:
            `kvdemo.qa.session_file.SessionFileError`); the message says what to change.
    """
    spec = asked_spec(args)
    checks.max_new_tokens(args.max_new_tokens)
    case, questions = _questions(args)  # bad input refused before torch is imported (seconds on a cold start)
    from kvdemo.qa.models import load_model
    from kvdemo.qa.session_file import read_manifest
    from kvdemo.serve.server import App
    from kvdemo.serve.store import API_KEY

    if args.session:
        model = args.model if args.model is not None else (read_manifest(args.session).get("model") or {}).get("source")
        door = App.serving(load_model(model, device=args.device)).door
        session = door.open_file(API_KEY, args.session, spec)
    else:
        door = App.serving(load_model(args.model, device=args.device)).door
        session = door.prefill(API_KEY, spec or CacheSpec(), case.context, max_new_tokens=args.max_new_tokens).session
    loaded, report, spec = session.loaded, session.prefill_report, session.spec
    assert report is not None  # prefilled or opened above
    saved = door.save_file(API_KEY, Path(args.save_session))[1] if args.save_session else None
    answers = []
    for question in questions:
        with door.answer(API_KEY, question, args.max_new_tokens) as run:
            for _ in run:
                pass
        answers.append(run.answer.to_dict())
    for question, answer in zip(questions, answers):
        if case is not None and case.gold_for(question) is not None:
            answer["gold_answers"] = list(case.gold_for(question))
    return {
        "model": loaded.name,
        "backend": spec.backend,
        "options": spec.resolved(),
        "context_tokens": report.context_tokens,
        "prefill_seconds": round(report.prefill_seconds or report.seconds, 4),
        "session_opened": report.opened_from and {"file": args.session, "load_seconds": round(report.seconds, 4)},
        "session_saved": saved and {"file": str(saved.path), "bytes": saved.bytes, "seconds": round(saved.seconds, 4)},
        "kv_bytes": report.kv_bytes,
        "full_precision_bytes": report.full_precision_bytes,
        "bytes_per_token": round(report.bytes_per_token, 2),
        "ratio_to_full_precision": round(report.ratio_to_full_precision, 4),
        "bytes_by_kind": report.memory.bytes_by_kind(),
        "prompt_matches_template": report.prompt_matches_template,
        "prompt_note": report.prompt_note,
        "template_clock": report.template_clock and report.template_clock.isoformat(timespec="seconds"),
        "deploy": list(report.deploy),
        "decode_read": report.decode_read,
        "answers": answers,
    }
