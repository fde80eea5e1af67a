"""Read the SQuAD 2.0 case files (`shared/cases/*.json`, CC BY-SA 4.0) and plain-text contexts.

A case file holds one whole Wikipedia article: `title`, `source`, `paragraphs` (joined with blank lines
they make one long context) and `questions` (`question`, `answers` = accepted gold spans,
`is_impossible`, `paragraph` = index of the paragraph holding the answer).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from kvdemo.qa.text import check_text


@dataclass(frozen=True)
class CaseQuestion:
    """One question of a case: its text, the accepted gold answers and whether the text answers it."""

    question: str
    answers: tuple[str, ...]
    is_impossible: bool
    paragraph: int | None = None


@dataclass(frozen=True)
class Case:
    """A context and, for case files, its title, source and questions."""

    title: str
    source: str
    paragraphs: tuple[str, ...]
    questions: tuple[CaseQuestion, ...] = field(default_factory=tuple)
    following: tuple[str, ...] = ()
    """After `select`: the article's paragraphs after the last one selected (the text that continues the context)."""

    @property
    def context(self) -> str:
        """The paragraphs joined with blank lines."""
        return "\n\n".join(self.paragraphs)

    @property
    def continuation(self) -> str | None:
        """The text that follows the context in the article: a blank line and the `following` paragraphs joined
        with blank lines, as `context` joins its own (None when the selection reaches the article's end, or
        before `select`). What `kvdemo.evals.fidelity.perplexity_inputs` feeds after the context."""
        return "\n\n" + "\n\n".join(self.following) if self.following else None

    def select(self, paragraphs: str | None) -> Case:
        """The case cut to some paragraphs (see `parse_ranges`); its questions are those about them, and `following`
        holds the paragraphs after the last one kept.

        Raises:
            ValueError: the range is malformed or out of bounds.
        """
        if paragraphs is None:
            return self
        keep = parse_ranges(paragraphs, len(self.paragraphs))
        kept = set(keep)
        return Case(
            title=self.title,
            source=self.source,
            paragraphs=tuple(self.paragraphs[i] for i in keep),
            questions=tuple(q for q in self.questions if q.paragraph is None or q.paragraph in kept),
            following=tuple(self.paragraphs[max(keep) + 1 :]) + self.following,
        )

    def answerable(self, n: int | None = None) -> list[CaseQuestion]:
        """The first `n` (all when None) questions the text answers."""
        found = [q for q in self.questions if not q.is_impossible]
        return found if n is None else found[:n]

    def unanswerable(self, n: int | None = None) -> list[CaseQuestion]:
        """The first `n` (all when None) questions the text does not answer (SQuAD 2.0 `is_impossible`)."""
        found = [q for q in self.questions if q.is_impossible]
        return found if n is None else found[:n]

    def gold_for(self, question: str) -> tuple[str, ...] | None:
        """The gold answers of a question of this case, or None when it is not one of them."""
        for q in self.questions:
            if q.question.strip() == question.strip():
                return q.answers
        return None


def parse_ranges(text: str, count: int) -> list[int]:
    """Indices from `"0-7"`, `"0,2,5-7"` or `"all"` (inclusive ranges, 0-based), checked against `count`.

    Raises:
        ValueError: malformed, empty, reversed or out of range [0, count - 1].
    """
    text = text.strip()
    if text.lower() == "all":
        return list(range(count))
    out: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", part)
        if match is None:
            raise ValueError(f"paragraphs={text!r}: write ranges like 0-7 or 0,2,5-7 (or all)")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if not 0 <= lo <= hi < count:
            raise ValueError(f"paragraphs={text!r}: this file has paragraphs 0 to {count - 1}")
        out.extend(i for i in range(lo, hi + 1) if i not in out)
    return out


STDIN = "-"
"""The path that reads standard input (a UTF-8 text, one context; or a case file's JSON), as Unix tools take `-`."""


def load_case(path: str | Path) -> Case:
    """Read a SQuAD case file (JSON with `paragraphs`) or a UTF-8 text file (one context, no questions); `-`
    (`STDIN`) reads standard input, a case file where it parses as JSON with `paragraphs`, else a text.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not UTF-8 text, an empty file, JSON without `paragraphs`, or a broken character: an unpaired
            surrogate, e.g. a JSON escape `"\\ud83d"` (`kvdemo.qa.text.check_text`; the message names the file, the
            paragraph or question, and the position).
    """
    if str(path) == STDIN:
        import sys  # noqa: PLC0415

        raw, path = sys.stdin.buffer.read(), Path("standard input")
        if raw.lstrip().startswith(b"{"):
            path = Path("standard input.json")  # read as a case file below
    else:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    if "\x00" in text:
        raise ValueError(f"{path} looks binary (it holds NUL bytes); give a text file")
    if not text.strip():
        raise ValueError(f"{path} is empty; give a file with the context text")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error})") from None
        paragraphs = data.get("paragraphs") if isinstance(data, dict) else None
        if not isinstance(paragraphs, list) or not paragraphs or not all(isinstance(p, str) for p in paragraphs):
            raise ValueError(f"{path} is JSON but not a case file: it needs a non-empty 'paragraphs' list of strings")
        questions = data.get("questions", [])
        if not isinstance(questions, list) or not all(
            isinstance(q, dict) and isinstance(q.get("question"), str) and isinstance(q.get("answers", []), list)
            for q in questions
        ):
            raise ValueError(
                f'{path}: \'questions\' must be a list of {{"question": str, "answers": [str], ...}} objects'
            )
        return Case(
            title=check_text(str(data.get("title", path.stem)), f"{path}, title"),
            source=check_text(str(data.get("source", path.name)), f"{path}, source"),
            paragraphs=tuple(check_text(p, f"{path}, paragraph {i}") for i, p in enumerate(paragraphs)),
            questions=tuple(
                CaseQuestion(
                    question=check_text(q["question"], f"{path}, question {i}"),
                    answers=tuple(
                        check_text(str(a), f"{path}, question {i}, answer {j}")
                        for j, a in enumerate(q.get("answers", ()))
                    ),
                    is_impossible=bool(q.get("is_impossible", False)),
                    paragraph=q.get("paragraph"),
                )
                for i, q in enumerate(questions)
            ),
        )
    return Case(title=path.stem, source=path.name, paragraphs=(check_text(text, str(path)),))


EXAMPLES_DIR = Path(__file__).parents[1] / "data" / "cases"
"""The case files shipped with kvdemo (copies of `shared/cases`, SQuAD 2.0, CC BY-SA 4.0; see its README.md)."""


def example_path(name: str) -> Path:
    """The path of a shipped case file: `normans` or `southern_california`.

    Raises:
        FileNotFoundError: no such example; the message lists the ones there are.
    """
    path = EXAMPLES_DIR / f"{name}.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in EXAMPLES_DIR.glob("*.json")))
        raise FileNotFoundError(f"no example named {name!r}; there are: {names}")
    return path


def gold_answers_for(context: str, questions: list[str]) -> list[tuple[str, ...]] | None:
    """The gold answers of `questions` when `context` is made of paragraphs of one shipped example and every
    question is one of that example's about those paragraphs (then an empty tuple marks a question the text
    does not answer); else None. Lets the app score the example questions against gold."""
    paragraphs = [p.strip() for p in context.split("\n\n") if p.strip()] if isinstance(context, str) else []
    if not paragraphs or not questions:
        return None
    for path in sorted(EXAMPLES_DIR.glob("*.json")):
        case = load_case(path)
        index = {p.strip(): i for i, p in enumerate(case.paragraphs)}
        if all(p in index for p in paragraphs):
            # only the questions about the paragraphs in the context (`Case.select`)
            chosen = case.select(",".join(str(index[p]) for p in paragraphs))
            golds = [chosen.gold_for(q) for q in questions]
            return None if any(g is None for g in golds) else cast("list[tuple[str, ...]]", golds)
    return None


def continuation_for(context: str) -> str | None:
    """The text that follows `context` in its article when `context` is made of paragraphs of one shipped example
    (`Case.continuation` after the last of them: the next paragraphs, joined as the context joins its own), else
    None. Lets the app measure perplexity on the article's next paragraphs (`kvdemo.evals.fidelity.perplexity_inputs`);
    with None the tail of the user's own text is used."""
    paragraphs = [p.strip() for p in context.split("\n\n") if p.strip()] if isinstance(context, str) else []
    if not paragraphs:
        return None
    for path in sorted(EXAMPLES_DIR.glob("*.json")):
        case = load_case(path)
        index = {p.strip(): i for i, p in enumerate(case.paragraphs)}
        if all(p in index for p in paragraphs):
            return case.select(",".join(str(index[p]) for p in paragraphs)).continuation
    return None
