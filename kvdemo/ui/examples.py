"""The shipped examples (SQuAD 2.0 articles, CC BY-SA 4.0, in `kvdemo/data/cases/`): their contexts for the
Ask tab, and the questions suggested to the Compare tab."""

from __future__ import annotations

import functools

from kvdemo.evals.cases import example_path, load_case
from kvdemo.qa.session import Session

EXAMPLES = {"Normans": ("normans", "0-7"), "Southern California": ("southern_california", "0-5")}
"""Button name -> (case file stem, paragraphs)."""
EXAMPLE_QUESTIONS = 6


def example(name: str) -> tuple[str, list[str]]:
    """The context (chosen paragraphs) and the first answerable questions of a shipped example (read once per
    process: the page looks them up at every change of the Context box)."""
    context, questions = _example(name)
    return context, list(questions)


@functools.cache
def _example(name: str) -> tuple[str, tuple[str, ...]]:
    stem, paragraphs = EXAMPLES[name]
    case = load_case(example_path(stem)).select(paragraphs)
    return case.context, tuple(q.question for q in case.answerable(EXAMPLE_QUESTIONS))


def suggested_questions(qa: Session | None, context: str) -> list[str]:
    """The questions asked so far in this session (each once, in order); without any, the example
    questions when `context` is one of the shipped examples; else none."""
    asked = list(dict.fromkeys(a.question for a in qa.history)) if qa is not None else []
    if asked:
        return asked
    for name in EXAMPLES:
        text, questions = example(name)
        if isinstance(context, str) and context.strip() == text.strip():
            return questions
    return []
