"""The Ask tab's Context box on the wire: what the server sees of it at each change (its text, or when it is large its
`page_state.fingerprint`, computed in the browser), the note under the box, what the browser keeps, and the box's
events (`wire`).

Why, as measured in Chromium on Gradio 6.31 (tests/e2e/test_context_box.py): the box may hold 2 MiB. Wired plainly,
each change sends the whole text with every listener's request (the gate, the browser's copy, the example questions)
and again as the change event's own data, and the browser's copy comes back down. Gradio re-dispatches a whole event,
every listener of it, when one deferred listener (`trigger_mode="always_last"`) ends, so two listeners with a
request each on one change re-triggered each other for as long as anyone typed: about eleven requests a second of
each, tens of seconds after five characters, at any size. And every request's inputs are copied (Svelte's
`$state.snapshot`, a `structuredClone`) several times in the browser: 16 copies of a 2 MB text per keystroke.

So each change of the box runs one listener in the browser (`fn=None`, `sync_js`) that reads the box once and writes
three small components: `context_sent` (hidden: the text, or the fingerprint of a large one), the note under the
box, and the browser's copy (`page_state.remember_js`); then one request chain reads `context_sent`, not the box:
the gate, then the example questions. A prefill and an answer still send the whole text, once per click."""

from __future__ import annotations

import functools
from typing import Any

import gradio as gr

from kvdemo.ui import page_state
from kvdemo.ui.page_state import FINGERPRINT_PREFIX

FINGERPRINT_JS = f"""(text) => {{
    const table = window.kvdemoCrcTable || (window.kvdemoCrcTable = Int32Array.from({{length: 256}}, (_, n) => {{
        for (let k = 0; k < 8; k++) n = n & 1 ? 0xedb88320 ^ (n >>> 1) : n >>> 1;
        return n;
    }}));
    let crc = -1, a = 1, b = 0;
    for (let start = 0; start < text.length; start += 2776) {{  // zlib's NMAX: 5,552 bytes between two modulos
        const end = Math.min(start + 2776, text.length);
        for (let i = start; i < end; i++) {{
            const unit = text.charCodeAt(i), lo = unit & 255, hi = unit >>> 8;
            crc = table[(crc ^ lo) & 255] ^ (crc >>> 8);
            crc = table[(crc ^ hi) & 255] ^ (crc >>> 8);
            a += lo; b += a; a += hi; b += a;
        }}
        a %= 65521; b %= 65521;
    }}
    const hex = (x) => (x >>> 0).toString(16).padStart(8, "0");
    return `{FINGERPRINT_PREFIX}${{text.length}}:${{hex(~crc)}}:${{hex(b * 65536 + a)}}`;
}}"""
"""`page_state.fingerprint` in JavaScript: the length in UTF-16 code units, then zlib's CRC-32 and Adler-32 over the
UTF-16-LE bytes (the table-driven CRC of RFC 1952, section 8; Adler-32 of RFC 1950, section 9, its modulo taken every
5,552 bytes as zlib does). About 15 ms for 2 MB in Chromium."""


def note_js(limit: int) -> str:
    """The note under the Context box, in JavaScript: empty, or for a context over `limit` characters that a reload
    will not keep it (`page_state.remember_js`)."""
    return f"""(context) => {{
    if (typeof context !== "string" || context.length <= {limit}) return "";
    return `ℹ ${{context.length.toLocaleString("en-US")}} characters: a reload of the page will not keep a context `
        + `this large (over {limit:,} characters); the backend and options are kept.`;
}}"""


def sync_js(limit: int) -> str:
    """The `js=` run in the browser at each change of the Context box (`fn=None`), from the page's state inputs (the
    box, the backend, the options): (`context_sent`: the text, or its fingerprint when over `limit` characters; the
    note; the browser's copy)."""
    return f"""(context, backend, ...options) => {{
    const fingerprint = {FINGERPRINT_JS};
    const note = {note_js(limit)};
    const remember = {page_state.remember_js(limit)};
    const large = typeof context === "string" && context.length > {limit};
    return [large ? fingerprint(context) : context, note(context), remember(context, backend, ...options)];
}}"""


def wire(tab: Any, demo: gr.Blocks, state_inputs: list[Any], gate: dict[str, Any]) -> Any:
    """The Context box's events. `tab`: the `AskTab` (its widgets `w` and the handlers `example_questions`, `upload`,
    `load_example`); `state_inputs`: the box, the backend and the option fields; `gate`: the keywords of the Ask
    tab's gate event (`AskTab.gate`, its first input `w["context_sent"]`). A change of the box runs `sync_js` in the
    browser, then one request chain: the gate, then the example questions. A change of the backend or an option
    writes the browser's copy in the browser (its gate is `AskTab.wire`'s). The page's load reads the copy back
    (`page_state.restore`); a keystroke clears the upload field in the browser; an upload or an example button
    fills the box. Returns the page load's event (`Dependency`), which later steps of a load follow (`.then`)."""
    w = tab.w
    private: dict[str, Any] = {"api_visibility": "private", "queue": False}
    box, sent, limit = w["context"], w["context_sent"], page_state.LARGE_CONTEXT_CHARS
    # `then` defaults to "once", which would drop the requests of the last text while earlier ones run
    last: dict[str, Any] = {"trigger_mode": "always_last"}
    box.change(
        None, inputs=state_inputs, outputs=[sent, w["context_note"], w["saved"]], js=sync_js(limit), **private
    ).then(**gate, **last).then(tab.example_questions, inputs=sent, outputs=w["example_questions"], **last, **private)
    for field in state_inputs[1:]:
        field.change(None, inputs=state_inputs, outputs=w["saved"], js=page_state.remember_js(limit), **private)
    # the events that write the box show their progress beside it: Gradio copies every component that ever showed a
    # progress (its whole value) at each status change of every request after, a 2 MB text several times a keystroke
    beside: dict[str, Any] = {"show_progress_on": w["context_note"], "show_progress": "hidden"}
    restored = demo.load(
        page_state.restore, inputs=w["saved"], outputs=[*state_inputs, w["context_note"]], **beside, **private
    )
    w["upload"].upload(
        tab.upload, inputs=w["upload"], outputs=[box, w["notice"]], api_name="read_upload", show_progress_on=w["notice"]
    )
    for name, button in w["examples"].items():
        button.click(functools.partial(tab.load_example, name), outputs=box, **beside, **private)
    # typing or pasting into the box makes it no longer the uploaded file's text: the file name goes
    box.input(None, outputs=w["upload"], js="() => null", **private)
    return restored
