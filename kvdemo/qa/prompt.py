"""The prompt layout: how a context and a question become the token ids the model reads, split at the context
so that the context's part is prefilled once and every question is fed on top of it (docs/DESIGN.md, invariant 5).

The model reads one user message, `context + separator + question` (the question stripped of surrounding
whitespace), rendered by the tokenizer's own chat template with the generation prompt: separator `"\\n\\n"`.
Without a chat template the layout is plain text: BOS, `context + "\\n" + question + "\\n"`. The reference
ids are the template's own: `tokenizer.apply_chat_template([{"role": "user", "content": ...}], tokenize=True,
add_generation_prompt=True, sanitize_control_tokens=True)`; the last option (transformers >= 5.23) encodes text
in the user's message that looks like a control token (`<|im_end|>`) as plain text, so the user's text can never
open or close a turn; for a message without such text it changes nothing.

The split. The prefilled prefix must be a prefix of the reference ids for *every* question, so it must end at a
token boundary that no question can move. The separator begins with whitespace, and a byte-level BPE
pre-tokenizer (GPT-2, Llama 3, Qwen, SmolLM2) keeps a run of whitespace in one piece: the context's trailing
whitespace joins the separator (context `"Hi.\\n"`: the template reads `. ĊĊ Ċ Who`, not `. Ċ ĊĊ Who`). So the
context's trailing whitespace always goes with the question (`PromptSplit.tail`), and the cut is then moved
back, a character at a time (at most `MAX_BACKTRACK`), until the prefix encoded alone is a prefix of the
reference ids, and prefix + question part equals them, for each of `PROBE_QUESTIONS` (one per kind of first
character a stripped question can have: letters, digits, punctuation, quotes, CJK, emoji, right-to-left text).
Some pre-tokenizers also join punctuation with the newlines after it (Llama 3's `?[^\\s\\p{L}\\p{N}]+[\\r\\n]*`);
the backtracking covers them. The separator ends in a newline and a question never starts with whitespace, so
with these pre-tokenizers nothing after the separator can reach back across it: what holds for the probes holds
for every question. A tokenizer without such a boundary (it merges across the split, or its template changes the
user's text) gets `PromptSplit.matches_template = False` and a note, which the prefill report carries.

Tokens are encoded in pieces as transformers' `encode_marked_chat` does for `sanitize_control_tokens`: the text is
cut at the user's control-token look-alikes, each look-alike is encoded as plain text on its own, the rest with
the template's control tokens parsed, and a piece that does not start the prompt is encoded after a newline that
is then removed (`_encode_chat_piece`: so that a SentencePiece tokenizer adds no prefix space mid-prompt).

The template's clock. Some templates write today's date before the user's text (Llama 3.1-3.3 and Granite:
`strftime_now("%d %b %Y")`). A split reads the clock once (`PromptLayout.clock`) and renders the whole split, its
probes and every question later fed on it at that moment (`PromptSplit.clock`, `template_clock`), so a session's
questions all read the date its prefill read, even after midnight; a fresh session on another day reads another date.
"""

from __future__ import annotations

import inspect
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from transformers.utils import chat_template_utils

CHAT_SEPARATOR = "\n\n"
"""Between the context and the question inside the one user message of a chat template."""
PLAIN_SEPARATOR = "\n"
"""Between the context and the question without a chat template; the question is followed by a newline too."""
MAX_BACKTRACK = 16
"""Characters the cut may move back from the end of the context's last non-whitespace character."""
PROBE_QUESTIONS = (
    "Who led them?",
    "what",
    "42 or 7?",
    "?",
    "'s",
    '"Why" (a)',
    "—and",
    "你好吗",
    "😀 here",
    "מי הוביל?",
)
"""Questions whose ids check the split: one per kind of first character a stripped question can have (a question
starting with one of the tokenizer's control tokens, as text, is added per tokenizer)."""

_MARK = "\ue000KVDEMO_CONTENT\ue000"


class _TokenizerLock:
    """A re-entrant lock that a fork leaves usable: the forking thread takes it first (`os.register_at_fork`), so a
    worker is never forked while another thread is inside the tokenizer (a ZeroGPU worker is forked from the server's
    process while visitors' questions are tokenized there), and the child starts with a fresh, free lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        os.register_at_fork(before=self._take, after_in_parent=self._give, after_in_child=self._renew)

    def _take(self) -> None:
        self._lock.acquire()

    def _give(self) -> None:
        self._lock.release()

    def _renew(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> _TokenizerLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


TOKENIZER_LOCK = _TokenizerLock()
"""Held by every encode of kvdemo's. transformers' fast tokenizers set per call state on the shared Rust tokenizer
(`split_special_tokens` is written to `encode_special_tokens`, `tokenization_utils_tokenizers.py` 5.25,
`_batch_encode_plus`) and release the GIL while encoding, so two threads encoding at once (two visitors of the page,
one prefilling while the other asks) read each other's setting: a control token of the template came out as text, or
the user's look-alike as a control token, and the prompt split moved (`tests/test_prompt.py`, 4 threads: 127 of 600
splits differed before this lock)."""

_PINNED: ContextVar[datetime | None] = ContextVar("kvdemo_template_clock", default=None)


class _TemplateClock(datetime):
    """transformers' chat-template global `strftime_now(format)` is `datetime.now().strftime(format)` with the
    `datetime` of `transformers.utils.chat_template_utils` (5.24-5.25; a template cannot be handed a function: its
    arguments are made plain data). This class stands there: `now()` is the moment `template_clock` pins in this
    thread or task, else the real one."""

    @classmethod
    def now(cls, tz=None):  # type: ignore[override]
        pinned = _PINNED.get()
        return pinned if pinned is not None else datetime.now(tz)


chat_template_utils.datetime = _TemplateClock  # type: ignore[attr-defined,misc]


@contextmanager
def template_clock(moment: datetime | None) -> Iterator[None]:
    """Within it, in this thread or task, chat templates read `moment` as now (`strftime_now`); None: the real
    clock."""
    token = _PINNED.set(moment)
    try:
        yield
    finally:
        _PINNED.reset(token)


def reads_clock(template: Any) -> bool:
    """Whether a chat template (a string, or a dict of named templates) writes the time (`strftime_now`)."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("strftime_now" in str(text) for text in texts)


@dataclass(frozen=True)
class PromptSplit:
    """A context split for the prefill.

    Attributes:
        prefix: the ids prefilled once (template opening, or BOS, then `context[:cut]`).
        tail: `context[cut:]`: the context's end that is fed with each question (its trailing whitespace, and
            whatever else the tokenizer joins with the separator); usually "" or whitespace.
        matches_template: the prefix + question part equalled the reference ids for every probe question.
        note: why not, when `matches_template` is False (for the prefill report); None otherwise.
        clock: the moment the chat template read as now for this split and reads for every question on it; None
            where the template reads no clock.
    """

    prefix: tuple[int, ...]
    tail: str
    matches_template: bool
    note: str | None = None
    clock: datetime | None = None


@dataclass(frozen=True)
class PreparedContext:
    """A context tokenized once and handed down to every session that prefills it (each spec of a comparison,
    the server's reservation before it): `QASession.prepare` makes it, `QASession.prefill` takes it.

    Attributes:
        text: the checked context (`kvdemo.qa.text.check_text`).
        split: its `PromptSplit` (the prefilled ids, `split.prefix`, and the tail fed with each question).
        tokenizer: the tokenizer that made it; a session of another tokenizer refuses it.
    """

    text: str
    split: PromptSplit
    tokenizer: Any = field(repr=False, compare=False)

    @property
    def ids(self) -> tuple[int, ...]:
        """The token ids a prefill of this context feeds (length = its context tokens)."""
        return self.split.prefix

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled without its tokenizer (a job sent to a device worker: ids and text, a few kB); `bound` gives it
        the worker's model's."""
        return PreparedContext, (self.text, self.split, None)

    def bound(self, tokenizer: Any) -> PreparedContext:
        """This context for a model of `tokenizer`: itself, or (one that was pickled, `tokenizer` None) a copy
        that `tokenizer` owns. The worker serves the one model the server prepared it with (`kvdemo.serve.device`
        checks the model's name before any job)."""
        return self if self.tokenizer is not None else PreparedContext(self.text, self.split, tokenizer)


@dataclass(frozen=True)
class PreparedQuestion:
    """A question tokenized and checked once, from a server's reservation to the decode loop:
    `QASession.prepare_question` makes it for the session's current prefill, `QASession.stream` takes it.

    Attributes:
        text: the question as given; ids: its token ids fed on top of the prefilled context (`question_ids`).
        max_new_tokens: the checked answer length (tokens); split: the prefill it was made for.
    """

    text: str
    ids: tuple[int, ...]
    max_new_tokens: int
    split: PromptSplit = field(repr=False, compare=False)


class PromptLayout:
    """The prompt of one tokenizer: its chat template (or the plain layout), and the split of a context.

    Args:
        tokenizer: a transformers tokenizer; its `chat_template` decides the layout.
        clock: the time source a split reads once where the template writes the time (tests pass a fake one).

    Example:
        >>> layout = PromptLayout(tokenizer)
        >>> split = layout.split("Hi.\\n")
        >>> list(split.prefix) + layout.question_ids(split, "Who?") == layout.reference_ids("Hi.\\n", "Who?")
        True
    """

    def __init__(self, tokenizer: Any, clock: Callable[[], datetime] = datetime.now):
        self.tokenizer = tokenizer
        self.clock = clock
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.reads_clock = self.chat and reads_clock(tokenizer.chat_template)
        self.bos: tuple[int, ...]
        self._frames: dict[datetime | None, tuple[str, str]] = {}
        if self.chat:
            self.separator, self.bos = CHAT_SEPARATOR, ()
        else:
            self._frames[None] = ("", PLAIN_SEPARATOR)
            self.separator = PLAIN_SEPARATOR
            bos = getattr(tokenizer, "bos_token_id", None)
            self.bos = (bos,) if bos is not None else ()
        self._sanitize = (
            self.chat and "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters
        )
        controls = sorted(self._control_tokens(), key=len, reverse=True)
        self._controls = re.compile("|".join(map(re.escape, controls))) if controls else None
        eos = getattr(tokenizer, "eos_token", None)
        self._control_probe = ((eos if eos in controls else controls[-1]) + " x",) if controls else ()
        with TOKENIZER_LOCK:
            self._newline_ids = tokenizer.encode("\n", add_special_tokens=False)

    # ---- the text ---------------------------------------------------------------------------------
    def content(self, context: str, question: str) -> str:
        """The user's message: `context + separator + question.strip()`."""
        return context + self.separator + question.strip()

    def _render(self, content: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    def frame(self, moment: datetime | None = None) -> tuple[str, str]:
        """The template's text before and after the user's message (`before`, `after`), rendered with the clock at
        `moment` (None: the template reads no clock; the plain layout: "" and its newline)."""
        moment = moment if self.reads_clock else None
        if moment not in self._frames:
            with template_clock(moment):
                before, after = self._render(_MARK).split(_MARK)
            self._frames = {**dict(list(self._frames.items())[-3:]), moment: (before, after)}  # a few dates at most
        return self._frames[moment]

    def _control_tokens(self) -> list[str]:
        """Added tokens that user text must not produce: the special ones, and the added tokens the chat
        template writes (transformers' `_get_control_tokens` rule)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return [
            t.content
            for t in decoder.values()
            if t.content and (t.special or (t.content in template and not t.content.isspace()))
        ]

    # ---- ids ---------------------------------------------------------------------------------------
    def reference_ids(self, context: str, question: str, moment: datetime | None = None) -> list[int]:
        """The ids the model should read for `question` on `context`: the chat template's own
        (`apply_chat_template(..., tokenize=True, add_generation_prompt=True, sanitize_control_tokens=True)`), its
        clock at `moment` (None: the real clock), or BOS + the plain layout's text without a template."""
        if not self.chat:
            return list(self.bos) + self._encode([(self.content(context, question) + self.frame()[1], True)])
        kwargs = {"sanitize_control_tokens": True} if self._sanitize else {}
        with template_clock(moment), TOKENIZER_LOCK:
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": self.content(context, question)}],
                    tokenize=True,
                    add_generation_prompt=True,
                    return_dict=False,
                    **kwargs,
                )
            )

    def prefix_ids(self, head: str, moment: datetime | None = None) -> list[int]:
        """The ids of the template's opening at `moment` (or BOS) followed by `head`, the context's part before the
        cut."""
        return list(self.bos) + self._encode([(self.frame(moment)[0], False), (head, True)])

    def question_ids(self, split: PromptSplit, question: str) -> list[int]:
        """The ids fed for `question` on top of a prefill of `split`: `split.tail + separator + question.strip()`
        and the rest of the template (the end of the user turn, the assistant turn's opening), its clock at the
        split's (`split.clock`)."""
        return self._encode(
            [(split.tail + self.separator + question.strip(), True), (self.frame(split.clock)[1], False)],
            starts_prompt=False,
        )

    def _encode(self, parts: list[tuple[str, bool]], starts_prompt: bool = True) -> list[int]:
        """Encode text parts (text, is the user's) in pieces: the user's control-token look-alikes are cut out
        and encoded as plain text; the rest is joined and encoded with control tokens parsed (those are the
        template's own)."""
        pieces: list[tuple[str, bool]] = [("", False)]
        for text, user in parts:
            start = 0
            for match in self._controls.finditer(text) if (user and self._controls) else ():
                pieces[-1] = (pieces[-1][0] + text[start : match.start()], False)
                pieces += [(match.group(), True), ("", False)]
                start = match.end()
            pieces[-1] = (pieces[-1][0] + text[start:], False)
        ids: list[int] = []
        for index, (piece, as_text) in enumerate(pieces):
            if piece:
                ids += self._encode_piece(piece, as_text, first=starts_prompt and index == 0)
        return ids

    def _encode_piece(self, piece: str, as_text: bool, first: bool) -> list[int]:
        """One piece, as transformers' `_encode_chat_piece`: after a removed newline unless it starts the prompt."""

        def encode(text: str) -> list[int]:
            with TOKENIZER_LOCK:
                return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=as_text)

        if not first:
            ids = encode("\n" + piece)
            if ids[: len(self._newline_ids)] == self._newline_ids:
                return ids[len(self._newline_ids) :]
        return encode(piece)

    # ---- the split ---------------------------------------------------------------------------------
    def split(self, context: str, max_prefix_tokens: int | None = None) -> PromptSplit:
        """Split `context` for the prefill (see the module docstring).

        Args:
            context: the context (checked text, not blank).
            max_prefix_tokens: when the first cut's prefix is longer than this, it is returned unchecked
                (`matches_template` False): the caller refuses the context anyway, and the probes would only
                tokenize a text too long for the model several times.

        Returns:
            A `PromptSplit`; with `matches_template` True its prefix + `question_ids(split, q)` equals
            `reference_ids(context, q)` for every probe question.
        """
        end = len(context.rstrip())
        moment = self.clock() if self.reads_clock else None  # read once: the split and its questions at one date
        first = self.prefix_ids(context[:end], moment)
        if max_prefix_tokens is not None and len(first) > max_prefix_tokens:
            return PromptSplit(tuple(first), context[end:], False, "not checked: the context is too long", moment)
        probes = PROBE_QUESTIONS + self._control_probe
        references = [(q, self.reference_ids(context, q, moment)) for q in probes]
        for cut in range(end, max(end - MAX_BACKTRACK, 0) - 1, -1):
            prefix = first if cut == end else self.prefix_ids(context[:cut], moment)
            candidate = PromptSplit(tuple(prefix), context[cut:], True, clock=moment)
            if all(
                ref[: len(prefix)] == prefix and prefix + self.question_ids(candidate, q) == ref
                for q, ref in references
            ):
                return candidate
        note = (
            "the tokenizer joins the end of this context with the question (no token boundary in its last "
            f"{MAX_BACKTRACK} characters that every question keeps), or the chat template changes the user's text: "
            "for some questions the ids the model reads differ from the chat template's"
        )
        return PromptSplit(tuple(first), context[end:], False, note, moment)
