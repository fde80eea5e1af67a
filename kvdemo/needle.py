"""Needle in a haystack: can the model still find one short fact in a long context under each KV cache?

A grid of context lengths x depths per `CacheSpec`. For each cell a short fact (the **needle**) is hidden at
a depth of a real text (the **haystack**), the context is prefilled into a cache of the spec's backend, and
a question that needs the fact is asked on top of it (`QASession`, the cache restored after every answer).

Method (after G. Kamradt's LLMTest_NeedleInAHaystack, 2023, and the single-needle tasks of RULER: Hsieh
et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"):

- **haystack**: the shipped SQuAD articles' paragraphs (`kvdemo/data/cases/*.json`, Wikipedia text, CC BY-SA
  4.0), in file order, joined with blank lines: about 9,800 tokens of running text with the embedded
  model's tokenizer, no sentence repeated below that (a longer window reads the text again from the start).
- **needle**: RULER's sentence `"The special magic number for {name} is {value}."`, with an invented name
  (two to three random syllables each for a first and a last name) and a 6-digit number drawn from `seed`,
  neither of which occurs in the haystack: runs are reproducible and the model cannot know the answer.
  Every needle of one length gets its own name and value; the same seed, length and depths give the same
  needles, whatever `needles_per_context` is.
- **depth** d %: the needle goes after d % of the haystack's tokens, moved back to the nearest sentence end
  before that point (Kamradt's rule), so it never splits a sentence; 100 % puts it at the very end of the
  context. `placed_depth` reports where it landed (the haystack tokens before it, in %).
- **length**: the tokens prefilled, chat template's opening included (`PrefillReport.context_tokens`), equal
  to the requested length exactly: the haystack is cut at a token boundary, and the cut is corrected until
  the tokenized context has that length. A length must leave `QUESTION_RESERVE_TOKENS + max_new_tokens`
  of the model's window free for the question and the answer.
- **hit**: the greedy answer (`max_new_tokens` at most) holds the value as a whole number (digits grouped
  with commas or spaces count: "482,913").
- **score** (graded): log P(value | context, question, answer prefix) in nats, the sum over the value's
  tokens of their log-probabilities teacher-forced after the question and the answer prefix
  `"The special magic number for {name} is"` (`QASession.score`, fed one decode step at a time as in
  generation). 0 is certainty; a guess among 10^6 numbers is about -13.8. It separates caches where the
  small model misses every needle.

Cost, and several needles in one context. A cell needs a context of its length with its needle at its
depth. With `needles_per_context=None` (the default) the needles of every depth of a length share one
context: one prefill per (spec, length) instead of one per cell, then per needle one answer and one
teacher-forced scoring, each followed by the restore. On a CPU a prefill of 7,936 tokens costs about as
much as all the decode steps of a few needles, so this divides a grid's time by up to the number of
depths. The price: the other needles are distractors of the same form (the model must pick the number of
the name asked: RULER's multi-key retrieval, a harder task than a lone needle), and they replace a little
haystack. `needles_per_context=1` is the classic grid (one needle, one prefill per cell); values in
between put that many needles per context, spread over the depths (depths i, i + n, i + 2n, ... of the
sorted list share a context). Every cell reports its context's prefill seconds, how many needles shared
that prefill, and its answer's and scoring's seconds.

Example:
    >>> grid = needle_grid(load_model(), ["dynamic", "hqq:2"], lengths=[1024, 4096], depths=[0, 50, 100])
    >>> grid.to_frame()[["spec text", "length", "depth", "hit", "score"]]
"""

from __future__ import annotations

import bisect
import gc
import json
import math
import numbers
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pandas as pd

from kvdemo import CacheSpec, QASession
from kvdemo.cases import EXAMPLES_DIR, load_case
from kvdemo.models import LoadedModel
from kvdemo.session import QUESTION_RESERVE_TOKENS, KVBudgetError

NEEDLE_TEMPLATE = "The special magic number for {name} is {value}."
QUESTION_TEMPLATE = "What is the special magic number for {name} mentioned in the text?"
ANSWER_PREFIX_TEMPLATE = "The special magic number for {name} is"
"""RULER's needle, question and answer prefix; the score is of the value after the answer prefix."""

DEFAULT_SPECS = ("dynamic", "hqq:2", "hqq:4", "quanto:4", "fp8")
DEFAULT_LENGTHS = (1024, 2048, 4096, 7936)
DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
DEFAULT_MAX_NEW_TOKENS = 32
"""Tokens an answer may take: the answer "The special magic number for Velora Quintash is 482913." is 18."""

ProgressCallback = Callable[[int, int, str], None]
"""`on_progress(done, total, what)`: units of work done so far (prefills, answers, scorings), the total,
and what runs next."""

_SYLLABLES = tuple(
    onset + vowel
    for onset in (
        "b",
        "br",
        "d",
        "dr",
        "f",
        "g",
        "gr",
        "k",
        "kl",
        "l",
        "m",
        "n",
        "p",
        "pr",
        "qu",
        "r",
        "s",
        "st",
        "t",
        "tr",
        "v",
        "z",
    )
    for vowel in ("a", "e", "i", "o", "u", "ai", "ea", "io")
)
_CODAS = ("", "", "n", "r", "s", "l", "sh", "th", "x")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)")


# ---- needles ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Needle:
    """One hidden fact and where it is asked to go.

    Attributes:
        name: an invented name, e.g. `Velora Quintash`.
        value: a 6-digit number as text, e.g. `482913`.
        depth: the requested depth (% of the haystack's tokens before the needle, 0 to 100).
    """

    name: str
    value: str
    depth: float

    @property
    def text(self) -> str:
        """The sentence hidden in the haystack (`NEEDLE_TEMPLATE`)."""
        return NEEDLE_TEMPLATE.format(name=self.name, value=self.value)

    @property
    def question(self) -> str:
        """The question asked for it (`QUESTION_TEMPLATE`)."""
        return QUESTION_TEMPLATE.format(name=self.name)

    @property
    def answer_prefix(self) -> str:
        """The start of the answer after which the value is scored (`ANSWER_PREFIX_TEMPLATE`)."""
        return ANSWER_PREFIX_TEMPLATE.format(name=self.name)


def _invented_word(rng: random.Random, syllables: int) -> str:
    word = "".join(rng.choice(_SYLLABLES) for _ in range(syllables)) + rng.choice(_CODAS)
    return word.capitalize()


def make_needles(depths: Sequence[float], seed: int | str, avoid: str = "") -> list[Needle]:
    """One needle per depth, with distinct invented names and distinct 6-digit values drawn from `seed`.

    Args:
        depths: the requested depths (%), one needle each, in this order.
        seed: any int or str; the same seed and depths give the same needles.
        avoid: text in which no name (case-insensitive) and no value may occur (the haystack), so that the
            needle is the only place the answer is.

    Returns:
        The needles, `depths[i]` for the i-th.

    Example:
        >>> make_needles([0, 50], seed=0)[0].text
        'The special magic number for ... is ....'
    """
    rng = random.Random(f"kvdemo-needle:{seed}")
    lowered = avoid.lower()
    names: set[str] = set()
    values: set[str] = set()
    needles = []
    for depth in depths:
        while True:
            name = f"{_invented_word(rng, rng.randint(2, 3))} {_invented_word(rng, rng.randint(2, 3))}"
            if name not in names and name.split()[0].lower() not in lowered and name.split()[1].lower() not in lowered:
                break
        while True:
            value = str(rng.randrange(100_000, 1_000_000))
            if value not in values and value not in avoid:
                break
        names.add(name)
        values.add(value)
        needles.append(Needle(name=name, value=value, depth=float(depth)))
    return needles


def hit(answer: str, value: str) -> bool:
    """True when `answer` holds `value` as a whole number: digits grouped with commas or spaces
    (`482,913`, `482 913`) count, a longer number that contains it (`4829130`) does not."""
    joined = re.sub(r"(?<=\d)[,\s](?=\d)", "", answer)
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", joined) is not None


# ---- the haystack and the contexts -----------------------------------------------------------------------
@lru_cache(maxsize=1)
def haystack_text() -> str:
    """The shipped SQuAD articles' paragraphs (`kvdemo/data/cases/*.json`, in file name order) joined with
    blank lines: the default haystack (Wikipedia text, CC BY-SA 4.0)."""
    return "\n\n".join(load_case(path).context for path in sorted(EXAMPLES_DIR.glob("*.json")))


@dataclass(frozen=True)
class Placement:
    """Where a needle landed in a context.

    Attributes:
        needle: the needle.
        position: index of the needle's first token in the prefilled ids (`QASession.context_ids`), chat
            template's opening included.
        tokens: the needle's tokens; `context_ids[position:position + tokens]` decode to `needle.text`.
        placed_depth: haystack tokens before the needle over all haystack tokens of the context (%).
    """

    needle: Needle
    position: int
    tokens: int
    placed_depth: float


@dataclass(frozen=True)
class NeedleContext:
    """A context of an exact token length with needles hidden in it.

    Attributes:
        text: the context as given to `QASession.prefill`.
        length: its tokens as prefilled (chat template's opening included).
        haystack_tokens: the haystack's tokens in it (length less the template's opening and the needles).
        placements: one per needle, by position.
    """

    text: str
    length: int
    haystack_tokens: int
    placements: tuple[Placement, ...]


class _Tokenized:
    """A text's token offsets (characters) and sentence ends, for cutting it at token boundaries."""

    def __init__(self, session: QASession, text: str):
        encoded = _encode_with_offsets(session, text)
        self.text = text
        self.starts = [start for start, _ in encoded["offset_mapping"]]
        self.ends = [end for _, end in encoded["offset_mapping"]]
        self.sentence_ends = [m.end() for m in _SENTENCE_END.finditer(text)]

    def __len__(self) -> int:
        return len(self.starts)


def _encode_with_offsets(session: QASession, text: str) -> dict:
    tokenizer = session.loaded.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "the needle grid needs a fast tokenizer (it cuts the haystack at token offsets); "
            f"{type(tokenizer).__name__} gives none"
        )
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)


def _needle_tokens(session: QASession, needle: Needle) -> int:
    return len(_encode_with_offsets(session, " " + needle.text)["input_ids"])


def _assemble(hay: _Tokenized, kept: int, needles: Sequence[Needle]) -> tuple[str, list[tuple[Needle, int]]]:
    """The first `kept` haystack tokens with the needles inserted at sentence ends: the text, and per needle
    (needle, first character, end character), the first being the space before it (byte-level tokens hold it)."""
    filler = hay.text[: hay.ends[kept - 1]] if kept > 0 else ""
    points = []
    for order, needle in enumerate(needles):
        if needle.depth >= 100:
            point = len(filler)
        else:
            token = min(round(needle.depth / 100 * kept), kept - 1)
            target = hay.starts[token]
            i = bisect.bisect_right(hay.sentence_ends, target) - 1
            point = hay.sentence_ends[i] if i >= 0 and hay.sentence_ends[i] <= len(filler) else 0
        points.append((point, order, needle))
    points.sort(key=lambda p: (p[0], p[1]))
    parts, chars, at = [], [], 0
    length = 0
    for point, _, needle in points:
        parts.append(filler[at:point])
        length += point - at
        piece = needle.text + " " if point == 0 and filler else " " + needle.text
        start = length + (0 if piece.startswith(needle.text) else 1)
        parts.append(piece)
        length += len(piece)
        text_so_far = "".join(parts)
        first = start - 1 if start > 0 and text_so_far[start - 1] == " " else start  # byte-level: " The" is a token
        chars.append((needle, first, start + len(needle.text)))
        at = point
    parts.append(filler[at:])
    return "".join(parts), chars


def build_context(
    session: QASession,
    length: int,
    needles: Sequence[Needle],
    haystack: str | None = None,
    _hay: _Tokenized | None = None,
) -> NeedleContext:
    """A context whose prefill is exactly `length` tokens, with `needles` hidden at their depths.

    Args:
        session: any `QASession` of the model (its tokenizer and chat template decide the tokens).
        length: the tokens to prefill, chat template's opening included.
        needles: the needles, each at its `depth`.
        haystack: the text to hide them in (default `haystack_text()`); read again from its start when it
            is shorter than the context.

    Returns:
        The `NeedleContext`; `session.context_ids(result.text)` has exactly `length` ids.

    Raises:
        ValueError: `length` leaves fewer haystack tokens than the needles take (the message gives the
            least length), or the tokenizer is not a fast one.
        RuntimeError: no cut of the haystack tokenizes to exactly `length` tokens (not seen with the
            embedded model's tokenizer).
    """
    overhead = len(session.context_ids(""))
    needle_tokens = sum(_needle_tokens(session, n) for n in needles)
    least = overhead + 2 * needle_tokens
    if length < least:
        raise ValueError(
            f"length {length} is too short for {len(needles)} needle(s): the chat template's opening takes "
            f"{overhead} tokens and the needles {needle_tokens}, and the haystack must be at least as long as the "
            f"needles; give lengths of at least {least} tokens (or fewer needles per context)"
        )
    hay = _hay
    if hay is None:
        text = haystack if haystack is not None else haystack_text()
        hay = _Tokenized(session, text)
    while len(hay) < length:  # a window longer than the text: read it again
        hay = _Tokenized(session, hay.text + "\n\n" + hay.text)
    tried: dict[tuple[int, int], int] = {}
    for skipped in range(8):  # rarely no cut fits (see _exact_cut): start the haystack one sentence later
        if skipped:
            hay = _Tokenized(session, hay.text[hay.sentence_ends[0] :].lstrip())
        found = _exact_cut(session, hay, length, overhead, needles, length - overhead - needle_tokens, skipped, tried)
        if found is not None:
            return found
    raise RuntimeError(f"could not cut the haystack to exactly {length} tokens (tried {sorted(tried.items())})")


def _exact_cut(
    session: QASession,
    hay: _Tokenized,
    length: int,
    overhead: int,
    needles: Sequence[Needle],
    kept: int,
    skipped: int,
    tried: dict[tuple[int, int], int],
) -> NeedleContext | None:
    """The context of `length` tokens made of the first `kept` haystack tokens (corrected) and the needles, or
    None when no cut gives exactly `length`: where the cut falls in a blank line, one more haystack token
    adds two context tokens (`"\\n\\n"` is one token at the end of a text, two before a word)."""

    def attempt(cut: int) -> NeedleContext | None:
        text, chars = _assemble(hay, cut, needles)
        ids = session.context_ids(text)
        tried[(skipped, cut)] = len(ids)
        return _placements(session, text, ids, overhead, chars) if len(ids) == length else None

    for _ in range(8):  # tokens merge across a cut now and then: correct the cut by the difference
        if (found := attempt(kept)) is not None:
            return found
        nxt = kept + length - tried[(skipped, kept)]
        if (skipped, nxt) in tried or not 0 < nxt <= len(hay):
            break
        kept = nxt
    for delta in sorted(range(-4, 5), key=abs):  # the cut's neighbours
        if (skipped, kept + delta) not in tried and 0 < kept + delta <= len(hay):
            if (found := attempt(kept + delta)) is not None:
                return found
    return None


def _placements(
    session: QASession, text: str, ids: list[int], overhead: int, chars: list[tuple[Needle, int, int]]
) -> NeedleContext:
    offsets = _encode_with_offsets(session, text)["offset_mapping"]
    starts = [start for start, _ in offsets]
    ends = [end for _, end in offsets]
    found = []
    for needle, char, end in chars:
        first = bisect.bisect_left(starts, char)
        last = bisect.bisect_left(ends, end)
        if first >= len(starts) or starts[first] != char or last >= len(ends) or ends[last] != end:
            raise RuntimeError(f"the needle {needle.text!r} does not start and end on token boundaries")
        found.append((needle, overhead + first, last - first + 1))
    total_needle_tokens = sum(n for _, _, n in found)
    haystack_tokens = len(ids) - overhead - total_needle_tokens
    placements = []
    for needle, position, n in sorted(found, key=lambda f: f[1]):
        before = position - overhead - sum(m for _, p, m in found if p < position)
        placements.append(Placement(needle, position, n, round(100 * before / haystack_tokens, 2)))
    return NeedleContext(text=text, length=len(ids), haystack_tokens=haystack_tokens, placements=tuple(placements))


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
            f"lengths={_shown(lengths)}: give a list of context lengths in tokens, "
            f"e.g. [{_EXAMPLES['lengths'].replace(',', ', ')}]"
        )
    out = []
    for value in lengths:
        if (
            isinstance(value, numbers.Real)
            and not isinstance(value, (bool, numbers.Integral))
            and float(value).is_integer()
        ):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"length {_shown(value)} must be a whole number of tokens >= 1")
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
            f"depths={_shown(depths)}: give a list of depths in % from 0 to 100, "
            f"e.g. [{_EXAMPLES['depths'].replace(',', ', ')}]"
        )
    out = []
    for value in depths:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or not 0 <= value <= 100:
            raise ValueError(
                f"depth {_shown(value)} must be a number from 0 to 100 (% of the haystack before the needle)"
            )
        if float(value) in out:
            raise ValueError(f"depth {value} is given twice; give each depth once")
        out.append(float(value))
    return sorted(out)


def _shown(value: Any) -> str:
    """`repr(value)`, cut to 40 characters, for messages."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _window_text(most: int) -> str:
    return (
        f"the longest context is {most:,} tokens (the model's window less {QUESTION_RESERVE_TOKENS} tokens "
        "for the question and max_new_tokens for the answer)"
    )


def longest_length(loaded_model: LoadedModel, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    """The longest context (tokens) a grid can prefill: `max_context_tokens - QUESTION_RESERVE_TOKENS -
    max_new_tokens`, e.g. 8,192 - 64 - 32 = 8,096 for the embedded model with 32 new tokens."""
    return loaded_model.max_context_tokens - QUESTION_RESERVE_TOKENS - max_new_tokens


def _check_count(value: Any, name: str, allow_none: bool = False) -> int | None:
    if allow_none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={_shown(value)} must be a whole number >= 1" + (" (or None)" if allow_none else ""))
    return int(value)


# ---- the grid --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NeedleCell:
    """One (spec, length, depth) cell: the needle, the answer, the hit and the score, and the seconds.

    Attributes:
        spec: `CacheSpec.label`; spec_text: `CacheSpec.text` (e.g. `hqq:4`).
        length: tokens prefilled (the requested length, exactly).
        depth: the requested depth (%); placed_depth: where the needle landed (% of the haystack before it).
        position: the needle's first token's index in the prefill; needle_tokens: its tokens.
        name, value: the needle's; question, answer: as asked and as answered (greedy).
        hit: the answer holds the value (`hit`).
        score: log P(value | context, question, answer prefix), nats, summed over value_tokens tokens (<= 0).
        finish_reason: the answer's (`eos`, `max_new_tokens`, ...).
        context: the index of the cell's context in the grid's plan (`plan_contexts`): cells of one spec with
            the same index shared one prefill.
        needles_in_context: needles sharing this cell's context (and its prefill).
        prefill_seconds: the wall time of that context's prefill (shared by needles_in_context cells).
        answer_seconds, score_seconds: this needle's answer and teacher-forced scoring (seconds).
        cache_length_after: the cache's length after the restore (equals length).
        kv_bytes: the cache's bytes after the prefill.
    """

    spec: str
    spec_text: str
    length: int
    depth: float
    placed_depth: float
    position: int
    needle_tokens: int
    name: str
    value: str
    question: str
    answer: str
    hit: bool
    score: float
    value_tokens: int
    finish_reason: str
    context: int
    needles_in_context: int
    prefill_seconds: float
    answer_seconds: float
    score_seconds: float
    cache_length_after: int
    kv_bytes: int

    @property
    def seconds(self) -> float:
        """This cell's share of the work: prefill_seconds / needles_in_context + answer + scoring seconds."""
        return self.prefill_seconds / self.needles_in_context + self.answer_seconds + self.score_seconds


@dataclass(frozen=True)
class NeedleGrid:
    """A needle grid's cells (spec by spec, then by length and depth) and how it was made.

    Attributes:
        model: the model's name; device: where it ran.
        specs: the specs run, as `CacheSpec.text`, in order; lengths (tokens) and depths (%), sorted.
        needles_per_context: needles per prefill (None: every depth of a length in one context).
        seed, max_new_tokens: as given.
        cells: one `NeedleCell` per finished cell.
        seconds: the grid's wall time (seconds).
        complete: False when it was cancelled (then `cells` holds the cells finished before).
    """

    model: str
    device: str
    specs: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    needles_per_context: int | None
    seed: int | str
    max_new_tokens: int
    cells: tuple[NeedleCell, ...]
    seconds: float
    complete: bool = True

    COLUMNS = (
        "spec text",
        "length",
        "depth",
        "placed depth",
        "hit",
        "score",
        "value",
        "answer",
        "needles in context",
        "prefill s",
        "answer s",
        "score s",
        "cell s",
        "name",
        "position",
        "spec",
    )

    def to_frame(self) -> pd.DataFrame:
        """One row per cell (`COLUMNS`, also when there is none): spec text, length (tokens), depth (%),
        placed depth (%), hit (bool), score (nats), value, answer, needles in context, prefill s (the shared
        prefill's), answer s, score s, cell s (`NeedleCell.seconds`), name, position (token), spec (label)."""
        rows = [
            {
                "spec text": c.spec_text,
                "length": c.length,
                "depth": c.depth,
                "placed depth": c.placed_depth,
                "hit": c.hit,
                "score": round(c.score, 4),
                "value": c.value,
                "answer": c.answer,
                "needles in context": c.needles_in_context,
                "prefill s": round(c.prefill_seconds, 3),
                "answer s": round(c.answer_seconds, 3),
                "score s": round(c.score_seconds, 3),
                "cell s": round(c.seconds, 3),
                "name": c.name,
                "position": c.position,
                "spec": c.spec,
            }
            for c in self.cells
        ]
        return pd.DataFrame(rows, columns=list(self.COLUMNS)).astype(
            {"length": "int64", "depth": "float64", "placed depth": "float64", "hit": "bool", "score": "float64"}
        )

    def summary_frame(self) -> pd.DataFrame:
        """One row per spec: `spec text`, `cells`, `hits`, `hit rate`, `mean score` (nats), `prefill s` (summed
        over its prefills), `decode s` (answers and scorings summed), `seconds` (the two together)."""
        rows = []
        for spec in self.specs:
            cells = [c for c in self.cells if c.spec_text == spec]
            if not cells:
                continue
            prefill = sum({c.context: c.prefill_seconds for c in cells}.values())
            decode = sum(c.answer_seconds + c.score_seconds for c in cells)
            rows.append(
                {
                    "spec text": spec,
                    "cells": len(cells),
                    "hits": sum(c.hit for c in cells),
                    "hit rate": sum(c.hit for c in cells) / len(cells),
                    "mean score": sum(c.score for c in cells) / len(cells),
                    "prefill s": round(prefill, 2),
                    "decode s": round(decode, 2),
                    "seconds": round(prefill + decode, 2),
                }
            )
        return pd.DataFrame(
            rows, columns=["spec text", "cells", "hits", "hit rate", "mean score", "prefill s", "decode s", "seconds"]
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field and every cell (`asdict`)."""
        out = asdict(self)
        out["cells"] = [asdict(c) | {"seconds": c.seconds} for c in self.cells]
        return out

    def to_json(self) -> str:
        """`to_dict()` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def to_csv(self) -> str:
        """`to_frame()` as CSV text (a header line, one line per cell)."""
        return self.to_frame().to_csv(index=False)

    def write(self, folder: str | Path, stem: str = "needle_grid") -> tuple[Path, Path]:
        """Write `<stem>.csv` and `<stem>.json` into `folder` (created if missing); returns their paths."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        csv_path, json_path = folder / f"{stem}.csv", folder / f"{stem}.json"
        csv_path.write_text(self.to_csv(), encoding="utf-8")
        json_path.write_text(self.to_json(), encoding="utf-8")
        return csv_path, json_path


class NeedleCancelled(Exception):
    """Raised by `needle_grid` when its `cancel` event is set; `grid` holds the cells finished before
    (`complete=False`)."""

    def __init__(self, grid: NeedleGrid):
        super().__init__(f"needle grid cancelled after {len(grid.cells)} cell(s)")
        self.grid = grid


class _Cancelled(Exception):
    pass


@dataclass(frozen=True)
class _Plan:
    length: int
    context: NeedleContext


def plan_contexts(
    loaded_model: LoadedModel,
    lengths: Sequence[int],
    depths: Sequence[float],
    needles_per_context: int | None = None,
    seed: int | str = 0,
    haystack: str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> list[NeedleContext]:
    """The contexts `needle_grid` prefills (for every spec alike), length by length: tokenization only.

    Needles: per length, `make_needles(depths, seed=f"{seed}:{length}")`, so a cell's needle does not depend on
    `needles_per_context`. With n contexts per length (`ceil(len(depths) / needles_per_context)`), context i
    holds the needles of the sorted depths i, i + n, i + 2n, ...

    Raises:
        ValueError: bad lengths, depths or counts (see `check_lengths`, `check_depths`), a length too long for
            the window with `max_new_tokens` or too short for its needles (the messages give the bounds).
    """
    max_new_tokens = _check_count(max_new_tokens, "max_new_tokens")
    if isinstance(seed, bool) or not isinstance(seed, (numbers.Integral, str)):
        raise ValueError(f"seed={_shown(seed)} must be a whole number or a text")
    most = longest_length(loaded_model, max_new_tokens)
    lengths = check_lengths(lengths, most)
    depths = check_depths(depths)
    per = _check_count(needles_per_context, "needles_per_context", allow_none=True) or len(depths)
    groups = math.ceil(len(depths) / per)
    session = QASession(loaded_model)  # tokenization only: no cache is built before a prefill
    text = haystack if haystack is not None else haystack_text()
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the haystack is empty; give a text to hide the needles in (or None for the SQuAD articles)")
    hay = _Tokenized(session, text)
    contexts = []
    for length in lengths:
        needles = make_needles(depths, seed=f"{seed}:{length}", avoid=text)
        for g in range(groups):
            contexts.append(build_context(session, length, needles[g::groups], _hay=hay))
    return contexts


def _score_ids(session: QASession, needle: Needle) -> tuple[list[int], int]:
    """The answer ids teacher-forced for the score (answer prefix, a space, the value) and the index of the
    value's first token in them."""
    text = f"{needle.answer_prefix} {needle.value}"
    encoded = _encode_with_offsets(session, text)
    start = len(text) - len(needle.value)
    first = next(i for i, (s, e) in enumerate(encoded["offset_mapping"]) if e > start and s >= start)
    return list(encoded["input_ids"]), first


def needle_grid(
    loaded_model: LoadedModel,
    specs: Sequence[CacheSpec | str] = DEFAULT_SPECS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    needles_per_context: int | None = None,
    seed: int | str = 0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    haystack: str | None = None,
    cancel: threading.Event | None = None,
    on_progress: ProgressCallback | None = None,
    kv_budget_bytes: int | None = None,
) -> NeedleGrid:
    """Run the needle grid: for every spec, length and depth, hide a needle, prefill, ask, score.

    Per spec one `QASession` (freed before the next spec); per context one prefill; per needle one greedy
    answer and one teacher-forced scoring, each followed by the restore. The contexts are the same for every
    spec. See the module docstring for the method and the cost.

    Args:
        loaded_model: from `kvdemo.load_model`.
        specs: `CacheSpec`s or their text (`"hqq:4"`); each validated against the model before anything runs;
            a repeated spec runs once.
        lengths: context lengths (tokens prefilled), each at most `longest_length(loaded_model, max_new_tokens)`.
        depths: needle depths (%), 0 to 100.
        needles_per_context: needles per prefill; None: every depth of a length in one context.
        seed: draws the needles (names and values).
        max_new_tokens: per answer (tokens).
        haystack: the text to hide the needles in; None: `haystack_text()`.
        cancel: set it (from another thread) to stop at the next decode step of an answer, or before the next
            prefill or scoring; the cache is restored as after any answer.
        on_progress: `ProgressCallback`, called before each prefill and after each prefill, answer and scoring.
        kv_budget_bytes: each session's out-of-memory guard (`QASession`); checked for the longest length of
            every spec before anything runs. None: no limit.

    Returns:
        The `NeedleGrid`.

    Raises:
        ValueError: no spec, a spec the model cannot run, bad lengths, depths, counts or haystack (nothing
            has run then; the message says what to change).
        KVBudgetError (a ValueError): a spec's cache at the longest length would exceed `kv_budget_bytes`.
        ImportError: a spec's backend package is missing.
        NeedleCancelled: `cancel` was set; its `grid` holds the cells finished before.
    """
    start = time.perf_counter()
    if isinstance(specs, (str, CacheSpec)) or not isinstance(specs, Sequence) or not specs:
        raise ValueError("give a list of specs, e.g. ['dynamic', 'hqq:4']")
    ordered: list[CacheSpec] = []
    for spec in specs:
        spec = (CacheSpec.parse(spec) if isinstance(spec, str) else spec).validate(loaded_model.config)
        if spec.label not in [s.label for s in ordered]:
            ordered.append(spec)
    contexts = plan_contexts(loaded_model, lengths, depths, needles_per_context, seed, haystack, max_new_tokens)
    lengths, depths = check_lengths(lengths), check_depths(depths)
    reserve = QUESTION_RESERVE_TOKENS + max_new_tokens
    if kv_budget_bytes is not None:
        for spec in ordered:
            probe = QASession(loaded_model, spec, kv_budget_bytes=kv_budget_bytes)
            estimate = probe.estimate_kv_bytes(max(lengths), reserve)
            if estimate > kv_budget_bytes:
                raise KVBudgetError(
                    f"a {spec.text} KV cache for the longest context ({max(lengths):,} tokens + {reserve} for a "
                    f"question and its answer) would hold about {estimate / 2**20:,.1f} MiB; the KV budget is "
                    f"{kv_budget_bytes / 2**20:,.1f} MiB. Drop the longest lengths or this spec",
                    estimate,
                    kv_budget_bytes,
                )
    total = len(ordered) * sum(1 + 2 * len(c.placements) for c in contexts)
    done = 0
    cells: list[NeedleCell] = []

    def progress(what: str, finished: bool = True) -> None:
        nonlocal done
        done += finished
        if on_progress is not None:
            on_progress(done, total, what)

    def check_cancel() -> None:
        if cancel is not None and cancel.is_set():
            raise _Cancelled

    def grid(complete: bool) -> NeedleGrid:
        return NeedleGrid(
            model=loaded_model.name,
            device=str(loaded_model.device),
            specs=tuple(s.text for s in ordered),
            lengths=tuple(lengths),
            depths=tuple(depths),
            needles_per_context=needles_per_context,
            seed=seed,
            max_new_tokens=max_new_tokens,
            seconds=time.perf_counter() - start,
            complete=complete,
            cells=tuple(sorted(cells, key=lambda c: (rank[c.spec_text], c.length, c.depth))),
        )

    rank = {s.text: i for i, s in enumerate(ordered)}
    score_ids: dict[str, tuple[list[int], int]] = {}
    try:
        for spec in ordered:
            session = QASession(loaded_model, spec, kv_budget_bytes=kv_budget_bytes)
            for index, context in enumerate(contexts):
                check_cancel()
                progress(f"{spec.text}: prefilling {context.length:,} tokens", finished=False)
                report = session.prefill(context.text, reserve_tokens=reserve)
                if report.context_tokens != context.length:  # the session tokenizes as context_ids does
                    raise RuntimeError(f"prefilled {report.context_tokens} tokens for a {context.length}-token context")
                progress(f"{spec.text}: prefilled {context.length:,} tokens")
                for placement in context.placements:
                    needle = placement.needle
                    stream = session.stream(needle.question, max_new_tokens)
                    try:
                        for _ in stream:
                            check_cancel()
                    finally:
                        stream.close()
                    answer = session.history[-1]
                    progress(f"{spec.text} {context.length:,} tokens: answered the needle at {needle.depth:g} %")
                    check_cancel()
                    if needle.name not in score_ids:
                        score_ids[needle.name] = _score_ids(session, needle)
                    ids, first = score_ids[needle.name]
                    scored_at = time.perf_counter()
                    logprobs = session.score(needle.question, ids)
                    score_seconds = time.perf_counter() - scored_at
                    score = float(sum(logprobs[i, ids[i]] for i in range(first, len(ids))))
                    del logprobs
                    cells.append(
                        NeedleCell(
                            spec=spec.label,
                            spec_text=spec.text,
                            length=context.length,
                            depth=needle.depth,
                            placed_depth=placement.placed_depth,
                            position=placement.position,
                            needle_tokens=placement.tokens,
                            name=needle.name,
                            value=needle.value,
                            question=needle.question,
                            answer=answer.text,
                            hit=hit(answer.text, needle.value),
                            score=score,
                            value_tokens=len(ids) - first,
                            finish_reason=answer.finish_reason,
                            context=index,
                            needles_in_context=len(context.placements),
                            prefill_seconds=report.seconds,
                            answer_seconds=answer.seconds,
                            score_seconds=score_seconds,
                            cache_length_after=answer.cache_length_after,
                            kv_bytes=report.kv_bytes,
                        )
                    )
                    progress(f"{spec.text} {context.length:,} tokens: scored the needle at {needle.depth:g} %")
            del session
            gc.collect()
    except _Cancelled:
        raise NeedleCancelled(grid(complete=False)) from None
    return grid(complete=True)
