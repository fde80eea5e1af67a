"""Text in and text out: the one check of the text a user gives (`check_text`), and the incremental decoding
of an answer's tokens into text that never ends in half a character (`TextStream`).

Python strings can hold code points that are not characters: unpaired UTF-16 surrogates (U+D800 to U+DFFF),
e.g. half an emoji in text copied from a PDF, a JSON escape such as `"\\ud83d"`, or an undecodable byte of a
command-line argument (Python turns it into U+DC80 to U+DCFF). Tokenizers refuse them with their own
`TypeError`; `check_text` refuses them first, with the position and what to do.

A token is not always a whole character: byte-level BPE splits an emoji or a CJK character into byte tokens,
and decoding a prefix of them gives U+FFFD. `TextStream` holds such a tail back until its last byte comes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers.decoders import DecodeStream
else:
    try:  # tokenizers >= 0.21
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - older tokenizers: the Python port below is used
        DecodeStream = None

_SURROGATE = re.compile("[\ud800-\udfff]")
_PAIR_OR_LONE = re.compile("([\ud800-\udbff][\udc00-\udfff])|[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def check_text(text: str, what: str) -> str:
    """The text, ready for a tokenizer: a valid UTF-16 surrogate pair written as two code points
    (`"\\ud83d\\ude00"`) is joined into its character (`"😀"`); anything else is returned unchanged.

    Args:
        text: the user's text (a context, a question, a file's contents).
        what: what the text is, starting the message (`"the context"`, `"the question"`, `"--question 2"`,
            `"normans.json, paragraph 3"`).

    Returns:
        `text`, with surrogate pairs joined (the same object when it holds none).

    Raises:
        ValueError: `text` is not a str, or it holds an unpaired surrogate; the message gives its position
            (0-based code point index, line and column), the code point and the text before it, and says to
            delete it or copy the text again.

    Example:
        >>> check_text("Caf\\u00e9 \\ud83d\\ude00", "the context")
        'Café 😀'
        >>> check_text("Caf\\udbc0", "the context")
        Traceback (most recent call last):
        ...
        ValueError: the context holds a broken character at position 3 (line 1, column 4, after 'Caf'): U+DBC0 ...
    """
    if not isinstance(text, str):
        raise ValueError(f"{what} must be text, not {type(text).__name__}")
    if _SURROGATE.search(text) is None:
        return text

    def join(match: re.Match) -> str:
        if match.group(1) is None:
            raise ValueError(_broken_message(text, match.start(), what))
        return match.group(1).encode("utf-16-le", "surrogatepass").decode("utf-16-le")

    return _PAIR_OR_LONE.sub(join, text)


def check_question(question: str, what: str = "the question") -> str:
    """A question, ready for a tokenizer: refused when empty or blank, then `check_text`. One check for the session
    (`QASession.question_ids`) and the command line, which runs it before the model loads.

    Args:
        question: the user's question.
        what: what the question is, starting the message (`"the question"`, `"--question number 2"`).

    Returns:
        `check_text(question, what)`.

    Raises:
        ValueError: `question` is not a str, or empty or blank ("<what> is empty; type a question about the
            context"), or holds an unpaired surrogate (`check_text`).
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{what} is empty; type a question about the context")
    return check_text(question, what)


def _broken_message(text: str, position: int, what: str) -> str:
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    before = _SURROGATE.sub(REPLACEMENT, text[max(0, position - 20) : position].split("\n")[-1])
    where = f"line {line}, column {column}" + (f", after {before!r}" if before else "")
    return (
        f"{what} holds a broken character at position {position:,} ({where}): U+{ord(text[position]):04X} is not a "
        "character but half of a UTF-16 surrogate pair (e.g. half an emoji, as text copied from a PDF can hold) or "
        "a byte that is not UTF-8. Delete it, or copy the text again from its source"
    )


class TextStream:
    """Decode an answer's token ids one at a time into text that never ends in half a character.

    The text only grows by whole characters: a token that ends inside a multi-byte character (the decoded
    text then ends in U+FFFD) is held back until the token holding its last byte comes; an answer cut there
    (max_new_tokens, Stop) ends before it. Decoding is incremental: each step decodes only the tokens since
    the last emitted chunk plus a few before them (for the decoder's spacing), never the whole answer.

    Pattern: the tokenizers library's own `tokenizers.decoders.DecodeStream` (tokenizers >= 0.21), used when
    the tokenizer has a `backend_tokenizer`; otherwise the same algorithm in Python, as text-generation-
    inference's `decode_token` (prefix and read offsets; a chunk is emitted only when the decoded text grew and
    does not end in U+FFFD). transformers' `TextStreamer` re-decodes all its cached tokens at every step and
    would print the U+FFFD; it is not used.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens: drop special tokens (EOS) from the text, as `tokenizer.decode(...)` does.

    Attributes:
        text: the text so far (whole characters only).
        held_tokens: tokens received whose bytes are not in `text` yet (0 when the text is complete).

    Example:
        >>> stream = TextStream(tokenizer)
        >>> for token_id in token_ids:
        ...     chunk = stream.push(token_id)   # "" while a character is incomplete
        >>> stream.text
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.held_tokens = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if DecodeStream is not None else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._ids: list[int] = []  # Python port: the window of ids still needed
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" when it ends inside a character or
        adds no text, e.g. a skipped special token), which `text` now ends with."""
        if self._stream is not None:
            assert self._backend is not None  # the stream is made only with a backend
            chunk = self._stream.step(self._backend, int(token_id)) or ""
        else:
            chunk = self._python_step(int(token_id))
        if chunk:
            self.text += chunk
            self.held_tokens = 0
        else:
            self.held_tokens += 1
        return chunk

    def _python_step(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        chunk = full[len(prefix) :]
        # keep only the window the next step needs: the tokens since the old read offset
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return chunk
