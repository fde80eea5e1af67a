"""kvdemo.qa.text: the one check of user text (unpaired surrogates refused with their position, pairs joined), and
the incremental decoding that never shows half a character, against `tokenizer.decode` of every prefix."""

from __future__ import annotations

import pytest

from kvdemo.qa.text import REPLACEMENT, TextStream, check_text

SYMBOLS = "Favourite symbols: 😀 🚀 ❤️ 🍕. 你好, שלום, naïve — done."


def test_text_without_surrogates_is_returned_as_is():
    text = "Café 😀 你好 שלום \r\n\t\u200b"
    assert check_text(text, "the context") is text


def test_surrogate_pairs_are_joined_into_their_character():
    assert check_text("A \ud83d\ude00 B", "the context") == "A 😀 B"
    assert check_text("\ud83c\udf55\ud83c\udf55", "the question") == "🍕🍕"


@pytest.mark.parametrize(
    "text, position, where, code",
    [
        ("Caf\udbc0", 3, "line 1, column 4, after 'Caf'", "U+DBC0"),
        ("\ud83d", 0, "line 1, column 1", "U+D83D"),  # half an emoji: its high surrogate
        ("ok \ude00 then", 3, "line 1, column 4, after 'ok '", "U+DE00"),  # a low surrogate alone
        ("line one\nab\udcff", 11, "line 2, column 3, after 'ab'", "U+DCFF"),  # an undecodable byte from argv
        ("\ud83d\ud83d\ude00", 0, "line 1, column 1", "U+D83D"),  # two highs: the first is unpaired
        ("\ude00\ud83d", 0, "line 1, column 1", "U+DE00"),  # a pair in the wrong order
    ],
)
def test_unpaired_surrogates_are_refused_with_their_position(text, position, where, code):
    with pytest.raises(ValueError) as error:
        check_text(text, "the context")
    assert str(error.value) == (
        f"the context holds a broken character at position {position} ({where}): {code} is not a character but half "
        "of a UTF-16 surrogate pair (e.g. half an emoji, as text copied from a PDF can hold) or a byte that is not "
        "UTF-8. Delete it, or copy the text again from its source"
    )


def test_text_that_is_not_a_string_is_refused():
    with pytest.raises(ValueError, match="the question must be text, not bytes"):
        check_text(b"Who?", "the question")


def _complete_prefixes(tokenizer, ids):
    """By hand: after n tokens, the text is the longest decoded prefix of ids[:n] that does not end in U+FFFD."""
    out, shown = [], ""
    for n in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if not decoded.endswith(REPLACEMENT):
            shown = decoded
        out.append(shown)
    return out


class _DecodeOnly:
    """A tokenizer without `backend_tokenizer`: TextStream's Python port of the algorithm runs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("backend", ["DecodeStream", "python"])
def test_stream_holds_back_half_characters_and_matches_decode(embedded, backend):
    tokenizer = embedded.tokenizer
    ids = tokenizer.encode(SYMBOLS, add_special_tokens=False) + [tokenizer.eos_token_id]
    partial = [tokenizer.decode(ids[:n]) for n in range(1, len(ids))]
    assert sum(t.endswith(REPLACEMENT) for t in partial) >= 6  # the input does cut characters
    decoder = tokenizer if backend == "DecodeStream" else _DecodeOnly(tokenizer)
    stream = TextStream(decoder)
    assert (stream._stream is not None) == (backend == "DecodeStream")
    texts, chunks = [], []
    for token in ids:
        chunks.append(stream.push(token))
        texts.append(stream.text)
    assert texts == _complete_prefixes(tokenizer, ids)
    assert not any(REPLACEMENT in t for t in texts)
    assert "".join(chunks) == stream.text == SYMBOLS  # the EOS is skipped
    assert stream.held_tokens == 1  # the EOS added no text
    if backend == "python":  # incremental: the tokens decoded per step do not grow with the answer
        longer = _DecodeOnly(tokenizer)
        stream = TextStream(longer)
        for token in tokenizer.encode(SYMBOLS * 4, add_special_tokens=False):
            stream.push(token)
        assert stream.text == SYMBOLS * 4
        assert max(longer.decoded_lengths) == max(decoder.decoded_lengths) < len(ids) / 4


def test_an_answer_cut_inside_a_character_ends_before_it(embedded):
    tokenizer = embedded.tokenizer
    ids = tokenizer.encode("Pizza 🍕", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    stream = TextStream(tokenizer)
    for token in ids[:cut]:
        stream.push(token)
    assert stream.text == "Pizza" and stream.held_tokens == 1  # the space comes with the emoji's token
    assert tokenizer.decode(ids[:cut]) == "Pizza " + REPLACEMENT  # what decoding the whole prefix would show
