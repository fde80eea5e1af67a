"""The needle grid's contexts: invented needles (RULER's sentence with a name and a 6-digit value), the haystack
(the shipped SQuAD articles), and a context of an exact token length with each needle at its depth, moved back to
a sentence end. See `kvdemo.needle.grid` for the method; this module only tokenizes, it runs no model.

Example:
    >>> needles = make_needles([0, 50, 100], seed=0, avoid=haystack_text())
    >>> context = build_context(load_model(), 1024, needles)
    >>> [p.placed_depth for p in context.placements]
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from kvdemo.evals.cases import EXAMPLES_DIR, load_case
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import TOKENIZER_LOCK, PreparedContext

NEEDLE_TEMPLATE = "The special magic number for {name} is {value}."
QUESTION_TEMPLATE = "What is the special magic number for {name} mentioned in the text?"
ANSWER_PREFIX_TEMPLATE = "The special magic number for {name} is"
"""RULER's needle, question and answer prefix; the score is of the value after the answer prefix."""


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
        text: the context; prepared: it tokenized once (`QASession.prepare`), as every spec's prefill takes it.
        length: its tokens as prefilled (chat template's opening included).
        haystack_tokens: the haystack's tokens in it (length less the template's opening and the needles).
        placements: one per needle, by position.
    """

    text: str
    length: int
    haystack_tokens: int
    placements: tuple[Placement, ...]
    prepared: PreparedContext = field(repr=False, compare=False)


class TokenizedText:
    """A text's token offsets (characters) and sentence ends, for cutting it at token boundaries."""

    def __init__(self, loaded: LoadedModel, text: str):
        encoded = encode_with_offsets(loaded, text)
        self.text = text
        self.starts = [start for start, _ in encoded["offset_mapping"]]
        self.ends = [end for _, end in encoded["offset_mapping"]]
        self.sentence_ends = [m.end() for m in _SENTENCE_END.finditer(text)]

    def __len__(self) -> int:
        return len(self.starts)


def encode_with_offsets(loaded: LoadedModel, text: str) -> dict:
    """The model's tokenizer on `text` without special tokens, with `offset_mapping` (a (start, end) character
    span per token).

    Raises:
        ValueError: the tokenizer is not a fast one (only fast tokenizers give offsets).
    """
    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "the needle grid needs a fast tokenizer (it cuts the haystack at token offsets); "
            f"{type(tokenizer).__name__} gives none"
        )
    with TOKENIZER_LOCK:
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)


def _needle_tokens(loaded: LoadedModel, needle: Needle) -> int:
    return len(encode_with_offsets(loaded, " " + needle.text)["input_ids"])


def _assemble(hay: TokenizedText, kept: int, needles: Sequence[Needle]) -> tuple[str, list[tuple[Needle, int, int]]]:
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
    loaded: LoadedModel,
    length: int,
    needles: Sequence[Needle],
    haystack: str | None = None,
    _hay: TokenizedText | None = None,
) -> NeedleContext:
    """A context whose prefill is exactly `length` tokens, with `needles` hidden at their depths.

    Args:
        loaded: the model (its tokenizer and chat template decide the tokens).
        length: the tokens to prefill, chat template's opening included.
        needles: the needles, each at its `depth`.
        haystack: the text to hide them in (default `haystack_text()`); read again from its start when it
            is shorter than the context.

    Returns:
        The `NeedleContext`; `loaded.context_ids(result.text)` has exactly `length` ids.

    Raises:
        ValueError: `length` leaves fewer haystack tokens than the needles take (the message gives the
            least length), or the tokenizer is not a fast one.
        RuntimeError: no cut of the haystack tokenizes to exactly `length` tokens (not seen with the
            embedded model's tokenizer).
    """
    overhead = len(loaded.context_ids(""))
    needle_tokens = sum(_needle_tokens(loaded, n) for n in needles)
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
        hay = TokenizedText(loaded, text)
    while len(hay) < length:  # a window longer than the text: read it again
        hay = TokenizedText(loaded, hay.text + "\n\n" + hay.text)
    tried: dict[tuple[int, int], int] = {}
    for skipped in range(8):  # rarely no cut fits (see _exact_cut): start the haystack one sentence later
        if skipped:
            hay = TokenizedText(loaded, hay.text[hay.sentence_ends[0] :].lstrip())
        found = _exact_cut(loaded, hay, length, overhead, needles, length - overhead - needle_tokens, skipped, tried)
        if found is not None:
            return found
    raise RuntimeError(f"could not cut the haystack to exactly {length} tokens (tried {sorted(tried.items())})")


def _exact_cut(
    loaded: LoadedModel,
    hay: TokenizedText,
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
        prepared = loaded.prepare(text)
        tried[(skipped, cut)] = len(prepared.ids)
        return _placements(loaded, prepared, overhead, chars) if len(prepared.ids) == length else None

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
    loaded: LoadedModel, prepared: PreparedContext, overhead: int, chars: list[tuple[Needle, int, int]]
) -> NeedleContext:
    text, ids = prepared.text, prepared.ids
    offsets = encode_with_offsets(loaded, text)["offset_mapping"]
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
    return NeedleContext(text, len(ids), haystack_tokens, tuple(placements), prepared)
