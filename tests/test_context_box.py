"""A large Context box travels as a fingerprint (`kvdemo.ui.page_state.fingerprint`, `kvdemo.ui.context_box`): the
fingerprint's rule, the gate's comparison of it with the prefilled text (on the tiny model), and what the browser
keeps and reads back. The browser's side (the same fingerprint in JavaScript, the bytes per keystroke) is
tests/e2e/test_context_box.py."""

from __future__ import annotations

import zlib

import gradio as gr

from kvdemo.cache.registry import GROUP_OPTIONS
from kvdemo.serve.server import App
from kvdemo.ui import build_demo, context_box, page_state, views
from kvdemo.ui.page_state import FINGERPRINT_PREFIX, LARGE_CONTEXT_CHARS, fingerprint, restore, same_context
from tests.helpers import named_handlers, refused

CONTEXT = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them."
HQQ = ("hqq", 4, 64, 4, 0, 0)


def test_the_fingerprint_counts_utf16_code_units_as_the_browser_does():
    for text in ("", "abc", "a\U0001f600b\r\nc", "\ud800 a lone surrogate", "é" * 70_000):
        data = text.encode("utf-16-le", "surrogatepass")
        length, crc, adler = fingerprint(text).removeprefix(FINGERPRINT_PREFIX).split(":")
        assert int(length) == len(data) // 2  # JavaScript's String.length: an emoji is 2
        assert (int(crc, 16), int(adler, 16)) == (zlib.crc32(data), zlib.adler32(data))
    assert fingerprint("a\U0001f600").startswith(f"{FINGERPRINT_PREFIX}3:")
    large = "x" * (LARGE_CONTEXT_CHARS + 1)
    edits = {large, large[:-1] + "y", "y" + large[1:], large + "x", large[:1000] + "yx" + large[1002:]}
    assert len({fingerprint(text) for text in edits}) == len(edits)  # one character anywhere changes it
    assert len(fingerprint(large)) < 60


def test_same_context_takes_the_text_or_its_fingerprint():
    assert same_context(CONTEXT, CONTEXT) and same_context(fingerprint(CONTEXT), CONTEXT)
    assert not same_context(fingerprint(CONTEXT + "!"), CONTEXT)
    assert not same_context(CONTEXT + "!", CONTEXT) and not same_context(None, CONTEXT)
    # a text that looks like a fingerprint is compared as one, so it matches only the text it stands for
    assert not same_context(f"{FINGERPRINT_PREFIX}3:00000000:00000000", "abc")


def test_the_gate_compares_a_fingerprint_with_the_prefilled_text(tiny):
    """What the page sends of a large Context box (its fingerprint) passes the gate exactly when it is the prefilled
    text's; an answer still compares the whole text the page sends at the click."""
    app = App(loader=lambda source=None: tiny)
    app.start_loading()
    fns = named_handlers(build_demo(app))
    gate, request = fns["gate"], gr.Request(session_hash="tab-1")
    fns["prefill"](CONTEXT, *HQQ, request)
    line, _, ask, _ = gate(fingerprint(CONTEXT), *HQQ, request)
    assert line.startswith("Prefilled") and ask["interactive"] is True
    line, _, ask, _ = gate(fingerprint(CONTEXT + " Edited."), *HQQ, request)
    assert "⚠ The Context box changed since the prefill" in line and ask["interactive"] is False
    # Enter in the question box while the page shows another text is refused, whatever text the click sends
    assert "The Context box changed since the prefill" in refused(fns["ask"]("Who led them?", 2, request, CONTEXT))
    line, _, _, _ = gate(fingerprint(CONTEXT), "fp8", request)
    assert "⚠ The options changed since the prefill" in line  # the fingerprint matched: only the options differ
    gate(fingerprint(CONTEXT), *HQQ, request)
    assert len(list(fns["ask"]("Who led them?", 2, request, CONTEXT))) > 1
    assert "has changed since the prefill" in refused(fns["ask"]("Who led them?", 2, request, CONTEXT + " Edited."))
    # the example questions follow a fingerprint as they follow the text: the questions asked on it
    questions = {getattr(f.fn, "__name__", ""): f.fn for f in build_demo(app).fns.values()}["example_questions"]
    assert questions(fingerprint(CONTEXT), request).constructor_args["samples"] == [["Who led them?"]]
    assert questions(fingerprint(CONTEXT + " Edited."), request).constructor_args["visible"] is False


def test_what_the_browser_kept_comes_back_and_a_large_context_says_it_was_not_kept():
    options = [4, 64, 48]
    back = restore({"context": CONTEXT, "backend": "hqq", "options": options})
    assert len(back) == 3 + len(GROUP_OPTIONS)  # the box, the backend, the options, the note
    assert back[:5] == [CONTEXT, "hqq", *options] and back[5:] == [views.KEEP] * (len(back) - 5)
    back = restore({"context": "", "context_chars": 2_000_005, "backend": "hqq", "options": options})
    assert back[0] is views.KEEP and back[1:5] == ["hqq", *options]  # the box as it is (empty after a reload)
    assert back[-1] == page_state.not_kept_note(2_000_005)
    assert back[-1].startswith("ℹ The last context (2,000,005 characters) was not kept across the reload")
    assert f"at most {LARGE_CONTEXT_CHARS:,} characters" in back[-1]
    assert restore(None) == restore({"backend": "no-such-backend"}) == [views.KEEP] * len(back)


def test_the_browser_code_names_the_limit_and_the_prefix():
    """The JavaScript is built from the Python constants (its behaviour is checked in Chromium)."""
    sync = context_box.sync_js(LARGE_CONTEXT_CHARS)
    assert f"context.length > {LARGE_CONTEXT_CHARS}" in sync and FINGERPRINT_PREFIX in sync
    assert f"options.slice(0, {len(GROUP_OPTIONS)})" in page_state.remember_js(LARGE_CONTEXT_CHARS)
    assert "over 65,536 characters" in context_box.note_js(LARGE_CONTEXT_CHARS)
