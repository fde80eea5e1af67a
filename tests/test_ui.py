"""The page's handlers called directly (prefill, ask, stop, backend switch, bad input), on a tiny model.

Cost: 41 s for 66 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import gradio as gr
import pytest

from kvdemo import CacheSpec, QASession
from kvdemo.cache.layers.storage import GrowingLayer
from kvdemo.cache.registry import GROUP_OPTIONS
from kvdemo.cache.spec import estimate_kv_bytes
from kvdemo.charts.steps import MEMORY_SERIES
from kvdemo.compare.run import compare
from kvdemo.serve.server import App
from kvdemo.serve.store import SessionStore
from kvdemo.ui import build_demo, times, views
from kvdemo.ui.examples import EXAMPLES, example
from kvdemo.ui.inputs import MAX_UPLOAD_BYTES, read_upload, spec_from_inputs
from kvdemo.ui.option_fields import backend_option_updates
from kvdemo.ui.tab_view import tab_view
from tests.helpers import named_handlers, plot_title, plotted, refused

CONTEXT = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them."
HQQ = ("hqq", 4, 64, 4, 0, 0)


@pytest.fixture()
def handlers(tiny):
    app = App(loader=lambda source=None: tiny)
    app.start_loading()
    demo = build_demo(app)
    fns = named_handlers(demo)
    return app, fns


def _request(name="tab-1"):
    return gr.Request(session_hash=name)


def _ask(fns, question, max_new_tokens=6, request=None):
    return list(fns["ask"](question, max_new_tokens, request or _request()))


def test_prefill_then_ask_streams_and_restores(handlers, tiny):
    app, fns = handlers
    assert fns["model_status"]().startswith("**tiny-llama-2x2x64** · 7 M parameters · 2 layers · 2 KV heads")
    summary, chat, *_, ask_button, floor, beside = fns["prefill"](CONTEXT, *HQQ, _request())
    assert beside == ""  # no full-precision answer of an earlier cache left
    assert "Prefilled **" in summary and "hqq nbits=4 q_group_size=64 residual_length=4" in summary
    assert chat == [] and ask_button["interactive"] is True
    assert floor.startswith("**Speed limit**: a decode step reads ") and "measured" not in floor  # no step yet
    updates = _ask(fns, "Who led the Normans?", 6)
    assert len(updates) == 8  # at once "reading the question", one per decode step, then the final one
    assert updates[0].stats.startswith("reading the question (") and updates[0].chat[-1]["content"] == "…"
    assert updates[1].chat[-1]["content"] != "…"  # each update carries its own chat
    chat, stats, memory_plot, residual, flushes_plot, table, speed = updates[-1]
    memory, flushes = plotted(memory_plot), plotted(flushes_plot)
    assert memory_plot["title"] == "KV cache memory"
    assert plot_title(flushes_plot) == "Time per decode step (flush steps marked)"
    # the memory y-axis from 0 to a tenth above its largest value: no point clipped at the top; step times on a log
    # axis that Vega fits to them, so that a flush step does not crush the plain ones
    assert memory_plot["y_lim"] == [0, pytest.approx(memory["MiB"].max() * 1.1)]
    axes = flushes_plot.axes[0]
    assert axes.get_yscale() == "log" and axes.get_ylim()[1] > flushes["ms"].max()  # matplotlib fits the log axis
    # 6 steps on an axis of at least 8 (no "0.000000")
    assert memory_plot["x_lim"] == [0, 8.0] and axes.get_xlim() == (-0.5, 8.5)
    assert speed.startswith("**Speed limit**: a decode step reads ") and "×** the floor" in speed
    qa = app.sessions.get("tab-1").qa
    context_tokens = qa.prefill_report.context_tokens
    assert f"cache length after restore = {context_tokens:,} (context)" in stats
    assert chat[-1] == {"role": "assistant", "content": qa.history[-1].text}
    assert list(memory["step"].unique()) == [0, 1, 2, 3, 4, 5] and len(memory) == 24  # 4 series for hqq
    events = tab_view(app.sessions.get("tab-1")).events
    held = memory[memory["series"] == "held (cache + snapshot)"]["MiB"].tolist()
    assert held == pytest.approx([e.memory.total_bytes / 2**20 for e in events])  # the snapshot counted
    assert residual["title"] == "Residual fill (layer 0): flushes at residual_length=4" and residual["y_lim"][0] == 0
    fill = plotted(residual)
    assert fill[fill["series"] == "residual (first quantized layer)"]["residual tokens"].tolist() == [
        e.memory.layers[0].residual_tokens for e in events
    ]
    assert fill[fill["series"] == "residual_length"]["residual tokens"].tolist() == [4.0] * len(events)
    flushes = flushes.sort_values("step")
    assert flushes["step"].tolist() == list(range(6)) and flushes["kind"].iloc[0] == "question pass"
    assert flushes["kind"].tolist() == [e.kind for e in events] and "flush step" in set(flushes["kind"])
    assert flushes["ms"].tolist() == pytest.approx(
        [e.seconds * 1000 for e in tab_view(app.sessions.get("tab-1")).events]
    )
    if (flushes["kind"] == "flush step").any():
        assert " flush step(s), " in stats and " ms each (median) vs " in stats
    assert table["tokens"].tolist() == [6] and table["cache length after"].tolist() == [context_tokens]
    # the same answer as a fresh single-question session
    fresh = QASession(tiny, CacheSpec("hqq", nbits=4, q_group_size=64, residual_length=4, axis_key=0, axis_value=0))
    fresh.prefill(CONTEXT)
    assert qa.history[-1].token_ids == fresh.ask("Who led the Normans?", 6).token_ids
    # a second question: the table grows, the chat keeps both turns
    chat, *_, table, _ = _ask(fns, "Where is Normandy?", 4)[-1]
    assert len(chat) == 4 and table["question"].tolist() == ["Who led the Normans?", "Where is Normandy?"]
    assert table["answer"].tolist() == [a.text for a in qa.history]


def test_the_full_precision_answer_beside_a_quantized_one(handlers, tiny):
    """After an answer, the page's next event (`reference`) puts `dynamic`'s answer beside it: the same tokens a
    fresh `dynamic` session answers, where the two first differ, made once per question (a second ask keeps it),
    its cache released from the server's KV account; nothing for a refused answer, nor for a `dynamic` cache."""
    app, fns = handlers
    spec = CacheSpec("quanto", nbits=2, q_group_size=32, residual_length=1, axis_key=0, axis_value=0)  # departs
    fns["prefill"](CONTEXT, "quanto", 2, 32, 1, 0, 0, _request())
    assert app.sessions.get("tab-1").qa.spec.text == spec.text
    _ask(fns, "Who led the Normans?", 8)
    waiting, shown = list(fns["reference"](_request()))
    assert waiting.startswith("Making the full-precision answer: a `dynamic` cache of the same ")
    full = QASession(tiny, CacheSpec())
    full.prefill(CONTEXT)
    expected = full.ask("Who led the Normans?", 8)
    assert shown.startswith("**Full precision** (`dynamic`, ") and f"«{expected.text.strip()}»" in shown
    mine = app.sessions.get("tab-1").qa.history[-1].token_ids
    common = next((i for i, (a, b) in enumerate(zip(mine, expected.token_ids)) if a != b), None)
    if common is None:
        assert "the same tokens" in shown
    else:
        assert f"first differs at token {common + 1}:" in shown
    assert not any(holder.startswith("reference:") for holder in app.kv.holders())  # released
    assert list(fns["reference"](_request())) == [views.KEEP]  # once per answer: no new answer, no new line
    _ask(fns, "Who led the Normans?", 8)  # the same question again: the reference is kept, not made again
    assert "kept from an earlier ask" in list(fns["reference"](_request()))[-1]
    fns["prefill"](CONTEXT, "dynamic", _request())
    _ask(fns, "Who led the Normans?", 8)
    assert list(fns["reference"](_request())) == [
        "This cache is full precision (`dynamic`): its answer is the reference."
    ]


def test_stop_ends_the_answer_and_restores(handlers):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    stream = fns["ask"]("Who led the Normans?", 50, _request())
    next(stream), next(stream), next(stream)  # reading the question, then two decode steps
    assert fns["stop"](_request()) is None
    final = list(stream)[-1]
    qa = app.sessions.get("tab-1").qa
    assert qa.history[-1].finish_reason == "stopped" and qa.history[-1].steps == 2
    assert "stopped" in final[1] and f"cache length after restore = {qa.prefill_report.context_tokens:,}" in final[1]
    assert final.chat[-1]["content"] == f"{qa.history[-1].text} [stopped]"  # marked in the chat too
    assert fns["stop"](_request("other-tab")) is None  # nothing streams there: nothing happens


def test_stop_pressed_while_the_answer_waits_in_the_queue_stops_it_after_one_step(handlers):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    ask, stop, chat, beside = fns["before_answer"]("Who led the Normans?", _request())  # the click
    assert beside == ""  # the last answer's full-precision line emptied
    assert ask["interactive"] is False and stop["interactive"] is True  # Ask disabled, Stop enabled and applies
    assert chat[-2:] == [
        {"role": "user", "content": "Who led the Normans?"},
        {"role": "assistant", "content": "… waiting for the model"},
    ]
    fns["stop"](_request())  # pressed while the answer waits in the queue
    final = _ask(fns, "Who led the Normans?", 50)[-1]
    answer = app.sessions.get("tab-1").qa.history[-1]
    assert (answer.finish_reason, answer.steps) == ("stopped", 1) and "stopped" in final.stats
    # a Stop pressed when nothing runs does not stop the next answer, from a click or from an API call
    for click in (True, False):
        fns["stop"](_request())
        if click:
            fns["before_answer"]("Who led the Normans?", _request())
        _ask(fns, "Who led the Normans?", 5)
        assert app.sessions.get("tab-1").qa.history[-1].finish_reason == "max_new_tokens"


@pytest.mark.parametrize("door", ["ask", "ask_question"])
def test_stop_pressed_before_the_stream_began_stops_it(handlers, monkeypatch, door):
    """A Stop that lands while the handler reserves the answer's KV (before `qa.stream` has cleared the session's
    stop flag) still applies: the Ask tab's answer and the `ask_question` tool's, for the same browser session."""
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    reserve = app.door.reserve_answer

    def reserve_then_stop(*args):
        prepared = reserve(*args)
        fns["stop"](_request())  # the Stop button of the same session, pressed meanwhile
        return prepared

    monkeypatch.setattr(app.door, "reserve_answer", reserve_then_stop)
    if door == "ask":
        _ask(fns, "Who led the Normans?", 50)
    else:
        assert json.loads(fns["ask_question"]("Who led the Normans?", 50, "", _request()))["finish_reason"] == "stopped"
    answer = app.sessions.get("tab-1").qa.history[-1]
    assert (answer.finish_reason, answer.steps) == ("stopped", 1)


@pytest.mark.parametrize(
    "inputs, message",
    [
        (("", *HQQ), "the context is empty"),
        (("  \n", *HQQ), "the context is empty"),
        ((CONTEXT, "quanto", 3, 64, 4, 0, 0), "nbits=3 is not allowed for quanto; allowed: 2, 4"),
        ((CONTEXT, "hqq", 1, 4, 4, 0, 0), "hqq packs 8 1-bit values together"),
        ((CONTEXT, "hqq", 4, 64, 0, 0, 0), "residual_length=0 is not allowed for hqq; it must be >= 1"),
        ((CONTEXT, "hqq", 4, 64.5, 4, 0, 0), "q_group_size=64.5 must be a whole number"),
        ((CONTEXT, "hqq", 4, 64, True, 0, 0), "residual_length=True must be a whole number"),
        ((CONTEXT, "hqq", 4, 64, 10**40, 0, 0), "it must be <= 1,048,576"),
        ((CONTEXT, ["hqq"], 4, 64, 4, 0, 0), "is not a backend"),
        ((CONTEXT, "int3", 4, 64, 4, 0, 0), "backend='int3' is not a backend"),
        (("word " * 600, *HQQ), "exceeds the model's 512-token window"),
    ],
)
def test_bad_prefill_input_says_what_to_change_and_keeps_the_session(handlers, inputs, message):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    before = app.sessions.get("tab-1").qa
    view = fns["prefill"](*inputs, _request())
    assert re.search(message, refused(view)) and "The cache still holds the previous context" in view.notice
    assert view.chat is view.memory_plot  # every other output skipped: the page keeps what it showed
    assert app.sessions.get("tab-1").qa is before
    named_handlers(build_demo(app))["gate"](CONTEXT, *HQQ, _request())  # the page set back as the cache holds it
    assert "cache length after restore" in _ask(fns, "Who led the Normans?", 3)[-1][1]


@pytest.mark.parametrize(
    "question, max_new_tokens, message",
    [
        ("", 5, "the question is empty"),
        ("Who?", 0, "max_new_tokens=0 must be a whole number >= 1"),
        ("Who?", None, "max_new_tokens=None must be a whole number"),
        ("Who?", 4000, "lower max_new_tokens"),
    ],
)
def test_bad_questions_say_what_to_change(handlers, question, max_new_tokens, message):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    assert re.search(message, refused(_ask(fns, question, max_new_tokens)))
    assert len(_ask(fns, "Who led the Normans?", 3)) == 5


def test_ask_before_prefill_and_after_a_model_change(handlers, tiny, embedded):
    app, fns = handlers
    assert "Prefill a context first" in refused(_ask(fns, "Who?"))
    fns["prefill"](CONTEXT, *HQQ, _request())
    app.loaded = embedded  # another user loaded another model
    assert "The model changed since your prefill; press Prefill" in refused(_ask(fns, "Who?"))


def test_failed_model_load_keeps_the_previous_model(handlers, tiny):
    app, fns = handlers
    app.wait_for_model()

    def failing_loader(source=None):
        raise OSError(f"could not load {source!r} from the Hugging Face Hub")

    app.loader = failing_loader
    line = fns["load_model"]("org/missing")
    assert "could not load 'org/missing' from the Hugging Face Hub. Keeping tiny-llama" in refused(line)
    assert line.startswith("**tiny-llama")  # the status line still shows the model in use
    assert app.loaded is tiny


def test_two_tabs_never_see_each_other(handlers):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request("tab-a"))
    fns["prefill"]("Southern California is a megaregion.", "fp8", None, None, None, None, None, _request("tab-b"))
    chat_a = _ask(fns, "Who led the Normans?", 3, _request("tab-a"))[-1][0]
    chat_b = _ask(fns, "What is it?", 3, _request("tab-b"))[-1][0]
    assert [m["content"] for m in chat_a if m["role"] == "user"] == ["Who led the Normans?"]
    assert [m["content"] for m in chat_b if m["role"] == "user"] == ["What is it?"]
    assert app.sessions.get("tab-a").qa.context == CONTEXT
    assert app.sessions.get("tab-b").qa.spec.backend == "fp8"


def test_session_store_is_bounded_and_frees_the_least_recently_used():
    store = SessionStore(max_sessions=2)
    a, b = store.get("a"), store.get("b")
    store.get("a")  # a is now the most recent
    store.get("c")
    assert len(store) == 2 and store.get("a") is a and store.get("b") is not b
    store.free("a")
    assert len(store) == 1 and store.get("a") is not a


def test_backend_options_shown_from_the_registry():
    *hqq, note = backend_option_updates("hqq")
    # all but dynamic's storage, fp8's scale and turboquant's norm correction
    assert [u["visible"] for u in hqq] == [True] * 6 + [False, True, True, True, True, True, False, False] + [False] * 9
    assert hqq[0]["choices"] == [1, 2, 3, 4, 8] and hqq[3]["choices"] == [0, 1]
    *quanto, _ = backend_option_updates("quanto")
    assert quanto[0]["choices"] == [2, 4] and quanto[4]["choices"] == [0, -1]
    *fp8, note = backend_option_updates("fp8")
    assert [u["visible"] for u in fp8] == [False] * 10 + [True] * 3 + [False] * 4 + [True] + [
        False
    ] * 5 and "never flushes" in note
    assert fp8[10]["choices"] == ["keep", "quantize"] and fp8[10]["value"] == "keep"
    assert fp8[11]["choices"] == ["0:0", "1:1", "2:2", "3:3", "4:4", "vllm"] and fp8[12]["value"] == "per_tensor"
    *turbo, note = backend_option_updates("turboquant")
    assert [u["visible"] for u in turbo] == [True, False, True, False, False, True, False, False, True] + [
        False,
        True,
        True,
        False,
        True,
        False,
        False,
        True,
    ] + [False] * 6 and "coded and appended" in note
    assert turbo[16]["choices"] == ["kvdemo", "vllm"] and turbo[16]["value"] == "kvdemo"  # layout
    *ggml, note = backend_option_updates("ggml")
    assert [i for i, u in enumerate(ggml) if u["visible"]] == [7, 10, 14, 15] and "no residual" in note
    assert ggml[14]["value"] == "q8_0" and ggml[7]["choices"] == ["auto", "none"] and ggml[10]["value"] == "quantize"
    assert turbo[0]["choices"] == [2, 3, 4, 8] and turbo[5]["value"] == "append" and turbo[13]["value"] == "false"
    *dynamic, note = backend_option_updates("dynamic")
    assert [u["visible"] for u in dynamic] == [False] * 6 + [True] + [False] * 16 and "storage=growing" in note
    assert dynamic[6]["choices"] == ["concat", "growing"] and dynamic[6]["value"] == "concat"
    assert hqq[7]["choices"] == ["none", "hadamard"] and hqq[7]["value"] == "none"  # rotation
    # nbits_value: first the empty field, "same as nbits" (the option unset), then the values' own bits
    assert quanto[8]["choices"] == [("same as nbits", ""), ("2", 2), ("4", 4)] and quanto[8]["value"] == ""
    # optimize: hqq's alone
    assert hqq[9]["choices"] == ["true", "false"] and hqq[9]["value"] == "true" and not quanto[9]["visible"]
    *nvfp4, note = backend_option_updates("nvfp4")
    assert [i for i, u in enumerate(nvfp4) if u["visible"]] == [10, 11, 18, 19, 20] and "never flushes" in note
    assert [nvfp4[i]["value"] for i in (10, 18, 19, 20)] == ["quantize", "nvfp4", "max6", "one"]
    assert fp8[17]["choices"] == ["e4m3", "e5m2"] and fp8[12]["choices"][2:] == ["one", "calculated"]
    *mlx, note = backend_option_updates("mlx")
    assert [i for i, u in enumerate(mlx) if u["visible"]] == [0, 21, 22] and "quantized_kv_start" in note
    assert mlx[0]["choices"] == [2, 3, 4, 5, 6, 8] and mlx[21]["value"] == 64 and mlx[22]["value"] == 0


def test_switching_backend_keeps_the_values_the_new_backend_allows():
    *hqq, _ = backend_option_updates("hqq", 3, 32, 16, 1, 0)
    assert [u.get("value") for u in hqq] == [3, 32, 16, 1, 0, "requantize", None, "none", "", "true", "keep", "0:0"] + [
        None,
        None,
    ] + [None] * 9
    *quanto, _ = backend_option_updates("quanto", 3, 32, 16, 1, 0)
    assert [u.get("value") for u in quanto] == [
        4,
        32,
        16,
        0,
        0,
        "requantize",
        None,
        "none",
        "",
        None,
        "keep",
        "0:0",
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    ]  # nbits 3 and axis 1 are not quanto's: defaults; storage and optimize are hidden (not quanto's)
    *hqq, _ = backend_option_updates("hqq", None, None, 0, None, None)
    assert [u.get("value") for u in hqq] == [4, 64, 128, 0, 0, "requantize", None, "none", "", "true", "keep"] + [
        "0:0",
        None,
        None,
    ] + [None] * 9
    *dynamic, _ = backend_option_updates("dynamic", 4, 64, 128, 0, 0, "append", "growing")
    assert dynamic[6]["value"] == "growing" and not any(u["visible"] for i, u in enumerate(dynamic) if i != 6)
    # the values' bits kept where the backend takes them, hqq's 8 is not quanto's: back to "same as nbits"
    *hqq, _ = backend_option_updates("hqq", 4, 64, 128, 0, 0, "append", None, "none", 8)
    assert hqq[8]["value"] == 8 and backend_option_updates("quanto", *[u.get("value") for u in hqq])[8]["value"] == ""


def test_spec_from_inputs_ignores_hidden_options():
    assert spec_from_inputs("fp8", dict(nbits=4, q_group_size=64, residual_length=16)) == CacheSpec("fp8")
    assert spec_from_inputs(
        "quanto", dict(nbits=2.0, q_group_size=None, residual_length="", axis_key=0, axis_value=-1)
    ) == CacheSpec("quanto", nbits=2, axis_key=0, axis_value=-1)
    with pytest.raises(ValueError, match="bits is not an option; the options are nbits, q_group_size, "):
        spec_from_inputs("quanto", {"bits": 2})
    with pytest.raises(ValueError, match="nbits='two' must be a whole number"):
        spec_from_inputs("quanto", {"nbits": "two"})
    # checked against the registry, as `CacheSpec.parse` checks a spec's text (found by a tester: these passed)
    assert spec_from_inputs("dynamic", {"storage": " Growing "}) == CacheSpec("dynamic", storage="growing")
    assert spec_from_inputs("hqq", None) == CacheSpec("hqq")
    for options, message in (
        ({"storage": "3"}, "storage='3' is not allowed for dynamic; allowed: concat, growing"),
        ({"nbits": -1}, "nbits=-1 is not allowed for quanto; allowed: 2, 4"),
        ({"residual_length": 0}, "residual_length=0 is not allowed for quanto; it must be >= 1"),
        ({"residual_length": 10**30}, "residual_length=1000000000000000000000000000000 is not allowed; it must be <="),
        ({"flush": "sideways"}, "flush='sideways' is not allowed for quanto; allowed: requantize, append"),
    ):
        backend = "dynamic" if "storage" in options else "quanto"
        with pytest.raises(ValueError) as error:
            spec_from_inputs(backend, options)
        assert str(error.value).startswith(message), error.value


def test_changing_options_or_the_context_after_a_prefill_asks_for_a_new_one(handlers):
    app, fns = handlers
    gate = named_handlers(build_demo(app))["gate"]
    line, notice, button, _ = gate(CONTEXT, *HQQ, _request())
    assert "nothing prefilled in this tab yet" in line and button["interactive"] is False
    fns["prefill"](CONTEXT, *HQQ, _request())
    message, _, button, _ = gate(CONTEXT, "hqq", 2, 64, 4, 0, 0, _request())
    assert "⚠ The options changed since the prefill" in message and button["interactive"] is False
    assert (
        "Now: **spec** `hqq:2,q_group_size=64,residual_length=4,axis_key=0,axis_value=0,flush=requantize,rotation=none,"
        "optimize=true`" in message
    )
    message, _, button, _ = gate(CONTEXT + " Edited.", *HQQ, _request())
    assert "⚠ The Context box changed since the prefill" in message and button["interactive"] is False
    message, notice, button, _ = gate(CONTEXT, *HQQ, _request())
    assert message.startswith("Prefilled") and notice == "" and button["interactive"] is True
    # the API path cannot answer over a context the page no longer shows
    updates = list(fns["ask"]("Who led the Normans?", 3, _request(), "Another text entirely."))
    assert "The Context box has changed since the prefill" in refused(updates) and len(updates) == 1
    assert len(list(fns["ask"]("Who led the Normans?", 3, _request(), CONTEXT))) == 5


def test_uploads(tmp_path):
    good = tmp_path / "context.md"
    good.write_text("# Normans\nRollo led them.", encoding="utf-8")
    assert read_upload(str(good)) == "# Normans\nRollo led them."
    cases = {
        "binary.txt": (b"\x00\x01\x02binary", "looks binary"),
        "latin1.txt": ("café".encode("latin-1"), "is not UTF-8 text"),
        "empty.txt": (b"  \n", "is empty"),
        "big.txt": (b"a" * (MAX_UPLOAD_BYTES + 1), "the limit is 2 MiB"),
        "data.pdf": (b"%PDF", "is not a .txt or .md file"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):  # the parser's error; the page shows it (user_errors)
            read_upload(str(path))
    with pytest.raises(ValueError, match="No file was uploaded"):
        read_upload(None)


def test_examples_load_real_articles():
    for name in EXAMPLES:
        context, questions = example(name)
        assert len(context) > 2000 and len(questions) == 6 and all(q.endswith("?") for q in questions)


def test_ask_while_an_answer_runs_in_the_same_session_is_refused(handlers):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    first = fns["ask"]("Who led the Normans?", 30, _request())
    next(first)
    assert "already running in this session" in refused(_ask(fns, "Where?"))
    first.close()
    assert app.sessions.get("tab-1").qa.cache_length == app.sessions.get("tab-1").qa.prefill_report.context_tokens


# ---- the Compare backends tab -------------------------------------------------------------------------


def test_compare_tab_runs_and_leaves_the_session_cache_untouched(handlers, tiny):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    before = _ask(fns, "Who led the Normans?", 5)[-1][0][-1]["content"]
    qa = app.sessions.get("tab-1").qa
    cache, snapshot_length = qa.cache, qa.cache_length
    assert fns["compare_questions"](CONTEXT, _request()) == "Who led the Normans?"  # asked so far
    view = fns["compare"](
        CONTEXT, ["dynamic", "fp8"], "hqq:2,residual_length=2\n\n", "Who led the Normans?\nWhere?", 3.0, _request()
    )
    status, table, tradeoff, speed = view[:4]
    assert status.startswith("Compared 3 specs on 2 questions (no gold answers for this text).")
    assert table["spec"].tolist() == ["dynamic", "fp8", "hqq:2,residual_length=2"]
    assert table["mean KLD"].iloc[0] == 0.0 and table["mean KLD"].iloc[2] > 0 and table["restored"].all()
    assert "contains gold" not in table and "PPL" not in table  # columns with no value are not shown
    # one point per spec, named in the legend, but dynamic: the reference, named in the title, would squeeze them
    points = tradeoff["value"]
    assert points["bytes per token"].round(0).tolist() == table["bytes/token"].tolist()[1:]
    assert points["spec"].tolist() == table["spec"].tolist()[1:]
    assert "(dynamic, the reference: " in tradeoff["title"] and "off the chart" in tradeoff["title"]
    assert tradeoff["x_lim"] == [0, pytest.approx(points["bytes per token"].max() * 1.1)]  # no point clipped
    assert tradeoff["y_lim"] == [0, pytest.approx(points["KL (nats)"].max() * 1.15)]
    # the same figures as kvdemo.compare.run called directly
    direct = compare(
        tiny,
        CONTEXT,
        ["Who led the Normans?", "Where?"],
        [CacheSpec("fp8"), CacheSpec("hqq", nbits=2, residual_length=2)],
        3,
    ).to_frame()
    assert table["KV MiB"].tolist() == (direct["KV bytes"] / 2**20).round(2).tolist()
    assert table["mean KLD"].tolist() == pytest.approx(direct["KL (nats)"].tolist(), abs=5e-4)  # rounded to show
    # the full report to download, and where the error sits for the smallest quantized cache
    csv_path, json_path = view.files
    assert open(csv_path, encoding="utf-8").read() == view.report.to_csv()
    assert open(json_path, encoding="utf-8").read() == view.report.to_json()  # what the CLI prints with --json
    assert view.heatmap_spec["value"] == "hqq:2,residual_length=2" and view.heatmap_plot is not None
    # this session's own cache: the same object, the same length, the same answer
    assert qa.cache is cache and qa.cache_length == snapshot_length and app.sessions.get("tab-1").qa is qa
    assert _ask(fns, "Who led the Normans?", 5)[-1][0][-1]["content"] == before


def test_compare_tab_suggests_the_example_questions_and_scores_gold(handlers):
    app, fns = handlers
    context, questions = example("Normans")
    assert fns["compare_questions"](context, _request("fresh")).splitlines() == questions
    assert fns["compare_questions"]("Some other text.", _request("fresh")) == ""


def test_compare_tab_cancel_returns_the_finished_specs(handlers, monkeypatch):
    from kvdemo.compare import run

    app, fns = handlers
    real = run.compare

    def compare_then_press_cancel(*args, on_progress, **kwargs):
        def progress(done, total, what):
            on_progress(done, total, what)
            if what.startswith("fp8: answered"):
                fns["cancel_compare"](_request())  # the Cancel button, as pressed mid-run

        return real(*args, on_progress=progress, **kwargs)

    monkeypatch.setattr(run, "compare", compare_then_press_cancel)  # the door runs it
    status, table, *_ = fns["compare"](CONTEXT, ["dynamic", "fp8", "hqq:4"], "", "Who?\nWhere?", 3, _request())
    assert status.startswith("Cancelled after 1 spec(s).") and table["spec"].tolist() == ["dynamic"]
    # the next run starts afresh (the cancel flag is cleared)
    monkeypatch.undo()
    status, table, *_ = fns["compare"](CONTEXT, ["fp8"], "", "Who?", 2, _request())
    assert status.startswith("Compared 2 specs") and len(table) == 2


@pytest.mark.parametrize(
    "context, chosen, more, questions, max_new_tokens, message",
    [
        (CONTEXT, [], "", "Who?", 3, "Tick at least one spec"),
        (CONTEXT, ["fp8"], "hqq:4\nhqq:9", "Who?", 3, "more specs, line 2: nbits=9 is not allowed for hqq"),
        (CONTEXT, ["fp8"], "hqq:4,group=2", "Who?", 3, "'group' is not an option"),
        (CONTEXT, ["fp8"], "", " \n ", 3, "Give at least one question, one per line"),
        ("   ", ["fp8"], "", "Who?", 3, "the context is empty"),
        (CONTEXT, ["fp8"], "", "Who?", 0, "max_new_tokens=0 must be a whole number >= 1"),
        (CONTEXT, ["fp8"], "", "Who?", 2.5, "max_new_tokens=2.5 must be a whole number >= 1"),
        (CONTEXT, ["hqq:4"], "hqq:4,q_group_size=48", "Who?", 3, "q_group_size=48"),
    ],
)
def test_compare_tab_bad_input_says_what_to_change(handlers, context, chosen, more, questions, max_new_tokens, message):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    assert message in refused(fns["compare"](context, chosen, more, questions, max_new_tokens, _request()))
    assert len(_ask(fns, "Who?", 2)) == 4  # the session still answers


def test_compare_tab_plans_per_layer_within_a_budget(handlers, tiny):
    app, fns = handlers
    budget = estimate_kv_bytes(CacheSpec.parse("quanto:4,nbits_value=2"), tiny.config, 1, tiny.dtype)
    status, table, *_ = fns["compare"](CONTEXT, ["fp8"], "", "Who?", 2, _request(), 0, "quanto", budget)
    planned = [text for text in table["spec"] if ",plan=" in text]
    assert len(planned) == 1 and planned[0].startswith("quanto,plan=k") and len(table) == 4  # and its uniform twin
    tokens = len(QASession(tiny).context_ids(CONTEXT))  # the budget is per token at the context's length
    assert (
        f"Per-layer plan: `{planned[0]}: {budget:,.0f} bytes per token at {tokens} tokens (budget {budget:,.0f})"
        in (status)
    )
    assert table["bytes/token"].iloc[2] <= budget + 1


@pytest.mark.parametrize(
    "base, budget, message",
    [
        ("quanto", -1, "plan budget=-1 must be a number of bytes per token from 1 to 1,048,576 (0: no plan)"),
        ("quanto", "lots", "plan budget='lots' must be a number of bytes per token"),
        ("fp8", 5000, "plan backend=fp8 takes no per-layer plan; choose quanto, hqq"),
        ("hqq:4,group=2", 5000, "'group' is not an option"),
        ("quanto", 10, "a budget of 10 bytes per token is below the smallest quanto cache on this model"),
    ],
)
def test_compare_tab_bad_plan_says_what_to_change(handlers, base, budget, message):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    assert message in refused(fns["compare"](CONTEXT, ["fp8"], "", "Who?", 2, _request(), 0, base, budget))
    assert len(_ask(fns, "Who?", 2)) == 4  # the session still answers


def test_load_with_an_empty_field_reloads_the_start_up_model(tiny):
    asked = []

    def loader(source=None):
        asked.append(source)
        return tiny

    app = App(model_source="/srv/models/start-up", loader=loader, allow_local_paths=False)
    app.start_loading()
    app.wait_for_model()
    fns = named_handlers(build_demo(app))
    assert fns["load_model"]("  ").startswith("**tiny-llama")  # the operator's own path, even on a public server
    assert asked == ["/srv/models/start-up", "/srv/models/start-up"]
    assert "is not a Hugging Face Hub id" in refused(fns["load_model"]("/srv/models/other"))
    assert (
        fns["load_model"]("HuggingFaceTB/SmolLM2-135M-Instruct") and asked[-1] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def test_every_series_is_in_the_chart_data_from_the_first_update(handlers):
    from kvdemo.ui.views import with_every_series

    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    first = list(fns["ask"]("Who led the Normans?", 3, _request()))[1]  # the first step's update
    memory = plotted(first[2])
    assert sorted(memory["series"]) == sorted(MEMORY_SERIES)  # one real row per series: nothing invisible to add
    frame = with_every_series(memory, "series", MEMORY_SERIES)
    assert len(frame) == 4  # nothing missing: unchanged
    # the step-time chart (matplotlib) puts every kind in its legend: every kind, from one real row; it is
    # emptied when the answer begins and drawn once, at its end (no redraw per step: see `views.step_times`)
    updates = _ask(fns, "Who led the Normans?", 3)
    assert plot_title(updates[0].step_plot).endswith(": drawn when the answer ends")
    assert plotted(updates[0].step_plot).empty and all(u.step_plot is views.KEEP for u in updates[1:-1])
    legend = [t.get_text() for t in updates[-1].step_plot.legends[0].get_texts()]
    assert legend == ["question pass", "decode step", "flush step"]  # every kind, whichever ran
    assert plotted(updates[-1].step_plot).sort_values("step")["kind"].iloc[0] == "question pass"


@pytest.mark.parametrize(
    "backend, series, residual_title",
    [
        ("dynamic", ["KV cache", "held (cache + snapshot)", "full precision"], "dynamic keeps no residual"),
        ("fp8", ["KV cache", "held (cache + snapshot)", "full precision"], "fp8 keeps no residual"),
        ("hqq", ["quantized store", "KV cache", "held (cache + snapshot)", "full precision"], "flushes at"),
    ],
)
def test_each_chart_shows_what_exists_for_the_backend(handlers, backend, series, residual_title):
    app, fns = handlers
    options = HQQ[1:] if backend == "hqq" else (None,) * 5
    view = fns["prefill"](CONTEXT, backend, *options, _request())
    assert residual_title in view.residual_plot["title"]
    # the empty charts of a new cache: titled, every series of the backend in the legend, no point drawn
    empty = plotted(view.memory_plot)
    assert view.memory_plot["title"] == "KV cache memory: ask a question to see it"
    assert sorted(empty["series"]) == sorted(series) and empty["MiB"].isna().all()
    assert plot_title(view.step_plot).endswith(": ask a question to see it") and plotted(view.step_plot).empty
    chat, stats, memory, residual, *_ = _ask(fns, "Who led the Normans?", 3)[-1]
    assert sorted(set(plotted(memory)["series"])) == sorted(series) and residual_title in residual["title"]
    if backend != "hqq":  # no sawtooth of a residual that does not exist (the title says so)
        assert plotted(residual)["residual tokens"].isna().all()


def test_a_spec_that_codes_every_token_charts_no_residual():
    """vLLM's TurboQuant presets code each token as it comes (`CacheSpec.keeps_residual` False): the residual chart
    says so and the memory chart has no quantized-store-beside-a-residual series; the same format with a residual
    keeps them."""
    preset, residual = CacheSpec.parse("turboquant:4bit_nc"), CacheSpec.parse("turboquant:4bit_nc,residual_length=16")
    assert not preset.keeps_residual and residual.keeps_residual
    assert "keeps no residual" in views.residual_chart([], preset)["title"]
    assert "flushes at residual_length=16" in views.residual_chart([], residual)["title"]
    assert "quantized store" not in set(views.memory_data([], preset)["series"])
    assert "quantized store" in set(views.memory_data([], residual)["series"])


def test_prefill_shows_real_progress_and_stop_ends_it(handlers):
    app, fns = handlers
    long_context = " ".join(f"Council {i} met at Rouen." for i in range(40))  # ~300 tokens: 2 chunks
    calls = []
    view = fns["prefill"](
        long_context, *HQQ, _request(), progress=lambda value, desc=None, unit=None: calls.append((value, desc, unit))
    )
    tokens = app.sessions.get("tab-1").qa.prefill_report.context_tokens
    # the chunks, then the quantizer's stage: the whole context into each of the 2 layers
    assert [c[0] for c in calls] == [(256, tokens), (tokens, tokens), (0, 2), (1, 2), (2, 2)] and tokens > 256
    assert calls[1][1:] == (f"Prefilling: {tokens:,} of {tokens:,} tokens", "tokens")
    assert calls[-1][1:] == ("Quantizing the cache (hqq): 2 of 2 layers", "layers")
    assert view.prefill_info.startswith("Prefilled")

    def stop_while_quantizing(value, desc=None, unit=None):
        if unit == "layers" and value == (1, 2):
            fns["stop"](_request())  # the Stop button during the quantizer's stage: it stops before the next layer

    stopped = fns["prefill"](long_context, *HQQ, _request(), progress=stop_while_quantizing)
    assert stopped.prefill_info.startswith("⚠ Stopped: the prefill was stopped while quantizing layer 2 of 2")
    assert app.sessions.get("tab-1").qa.cache_length == tokens  # the previous cache stays

    def stop_after_the_first_chunk(value, desc=None, unit=None):
        fns["stop"](_request())  # the Stop button while the prefill runs

    view = fns["prefill"](long_context, *HQQ, _request(), progress=stop_after_the_first_chunk)
    assert view.prefill_info.startswith("⚠ Stopped: the prefill was stopped after 256 of")
    qa = app.sessions.get("tab-1").qa  # the previous cache stays: a prefill replaces it only when it ends
    # the kept cache's own summary, not replaced by the stop
    assert f"The cache still holds the previous context: Prefilled **{tokens:,} tokens**" in view.prefill_info
    assert qa is not None and qa.cache_length == tokens and view.ask_button["interactive"] is True
    assert len(_ask(fns, "Where did they meet?", 2)) == 4
    fns["prefill"](long_context, *HQQ, _request())  # and it prefills again
    assert len(_ask(fns, "Where did they meet?", 2)) == 4


# ---- the Needle tab ------------------------------------------------------------------------------------


def test_needle_tab_runs_a_grid_cancels_and_refuses_bad_input(handlers, tiny):
    from kvdemo.needle.grid import answer_tokens_needed, needle_grid

    app, fns = handlers
    needed = answer_tokens_needed(tiny, [128, 192], [0.0, 100.0], seed=3)
    assert 18 <= needed <= 30  # the needle's own sentence, in the embedded tokenizer's tokens
    view = fns["needle"](["dynamic", "fp8"], "128,192", "0,100", 3, needed, _request())
    assert view.needle_status.startswith("8 cells in ")  # 2 specs x 2 lengths x 2 depths
    direct = needle_grid(
        tiny, ["dynamic", "fp8"], [128, 192], [0.0, 100.0], seed=3, max_new_tokens=needed, needles_per_context=1
    )  # the tab's default: one needle per prefill
    assert view.needle_table.drop(columns=[c for c in view.needle_table if "s" == c[-1:]]).equals(
        direct.summary_frame().drop(columns=[c for c in direct.summary_frame() if "s" == c[-1:]])
    )
    cut = sum(c.cut for c in direct.cells)  # the random tiny model misses; its answers run to max_new_tokens
    assert cut > 0 and f"⚠ {cut} miss(es) (dynamic, fp8) ended at max_new_tokens={needed} (marked `cut`)" in (
        view.needle_status
    )
    assert view.score_plot is not None and view.hit_plot is not None and len(view.needle_files) == 2
    together = fns["needle"](["dynamic"], "128", "0,100", 3, needed, _request(), False)  # one prefill per length
    assert together.needle_status.startswith("2 cells in ")
    assert "lengths" in refused(fns["needle"](["dynamic"], "12x", "0", 0, needed, _request()))
    assert "depth 150.0 must be a number from 0 to 100" in refused(
        fns["needle"](["dynamic"], "128", "150", 0, needed, _request())
    )
    short = answer_tokens_needed(tiny, [128], [0.0], seed=0)
    for tokens, message in (
        (0, "must be a whole number >= 1"),
        (65, "is more than a needle grid runs here"),
        (short - 1, f"max_new_tokens={short - 1} cannot hold the answer: the needle's own sentence takes {short}"),
    ):
        assert message in refused(fns["needle"](["dynamic"], "128", "0", 0, tokens, _request()))
    # Cancel while it runs: the cells finished so far are shown
    app.sessions.get("tab-1").compare_pending = True
    app.sessions.get("tab-1").compare_cancel.set()
    cancelled = fns["needle"](["dynamic"], "128", "0", 0, needed, _request())
    assert cancelled.needle_status.startswith("Cancelled after 0 cells")


def test_the_prefill_event_names_every_option_for_the_api(handlers, tiny):
    from gradio.utils import get_function_params

    app, _ = handlers
    events = {f.api_name: f.fn for f in build_demo(app).fns.values() if f.api_name}
    names = [name for name, *_ in get_function_params(events["prefill"])]
    assert names[: 2 + len(GROUP_OPTIONS)] == ["context", "backend", *GROUP_OPTIONS] and "request" not in names
    # by keyword, as `client.predict(context=..., storage="growing")` sends it: the options reach the spec
    view = events["prefill"](context=CONTEXT, backend="dynamic", storage="growing", request=_request())
    assert "dynamic storage=growing" in view.prefill_info
    assert isinstance(app.sessions.get("tab-1").qa.cache.layers[0], GrowingLayer)


def test_a_new_prefill_replaces_the_speed_limit_line(handlers):
    """Seen in a browser: after an answer on `dynamic,storage=growing`, a quanto prefill cleared the charts but
    kept the old answer's speed-limit line (its floor, measured step and spare room). The prefill now shows the
    new cache's floor; a refused prefill keeps the line of the cache that stays."""
    from kvdemo.cache.state.speedlimit import speed_limit

    app, fns = handlers
    fns["prefill"](CONTEXT, "dynamic", None, None, None, None, None, None, "growing", _request())
    old = _ask(fns, "Who led the Normans?", 4)[-1].speed_limit
    assert "held, not read" in old and "measured" in old
    view = fns["prefill"](CONTEXT, *HQQ, _request())
    qa = app.sessions.get("tab-1").qa
    assert view.speed_limit == views.speed_limit_line(speed_limit(qa.loaded.model, qa.cache), None)
    assert "held, not read" not in view.speed_limit and "measured" not in view.speed_limit
    updates = _ask(fns, "Who led them?", 4)
    assert updates[0].speed_limit == view.speed_limit  # while it streams: the floor, not the last answer's step
    assert "measured" in updates[-1].speed_limit
    a = qa.history[-1]
    assert f"{a.flush_count - a.question_flushes:,} flushes in decode steps, {a.flush_count:,} in all" in (
        updates[-1].stats
    )
    refused_view = fns["prefill"](" ", *HQQ, _request())
    assert refused(refused_view) and refused_view.speed_limit == gr.skip()  # the line stays


def test_an_answer_of_one_token_has_no_decode_speed(handlers):
    """One token comes from the question's own pass: no decode step ran, so no decode speed is shown (it read
    'decode 0.0 tokens/s')."""
    _, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    stats = _ask(fns, "Who led the Normans?", 1)[-1].stats
    assert stats.startswith("1 token · question pass ") and "· no decode step ·" in stats
    assert "tokens/s" not in stats
    assert "tokens/s" in _ask(fns, "Who led the Normans?", 3)[-1].stats


def test_enter_in_the_question_box_cannot_pass_the_gate(handlers, tiny):
    """Found by a tester: after an option change the gate disables Ask, but Enter in the question box reached the
    server and was answered from the old cache. The gate (and a prefill, at its click) now records what the page
    shows in the session, and `ask` refuses while it is not the cache's; setting the options back (or a new
    prefill) lets the cache answer again."""
    app, fns = handlers
    gate = named_handlers(build_demo(app))["gate"]
    fns["prefill"](CONTEXT, *HQQ, _request())
    qa = app.sessions.get("tab-1").qa
    gate(CONTEXT, "fp8", _request())  # the user picks fp8: the button is disabled, Enter still sends the question
    message = refused(fns["ask"]("Who led them?", 4, _request(), CONTEXT))
    assert message == (
        "⚠ The options changed since the prefill: the cache holds hqq:4,q_group_size=64,residual_length=4,"
        "axis_key=0,axis_value=0,flush=requantize,rotation=none,optimize=true, the page shows fp8; press Prefill to "
        "rebuild it, or "
        "set the "
        "options back"
    )
    gate(CONTEXT, "quanto", 3, _request())
    assert "the page's options are not valid" in refused(fns["ask"]("Who led them?", 4, _request(), CONTEXT))
    assert qa.history == []  # nothing was answered
    gate(CONTEXT, *HQQ, _request())  # set back: the same cache answers, as a fresh run
    updates = list(fns["ask"]("Who led them?", 4, _request(), CONTEXT))
    fresh = QASession(tiny, CacheSpec.parse("hqq:4,residual_length=4,axis_key=0,axis_value=0"))
    fresh.prefill(CONTEXT)
    assert updates[-1].chat[-1]["content"] == fresh.ask("Who led them?", 4).text
    gate(CONTEXT, "fp8", _request())
    fns["prefill"](CONTEXT, "fp8", _request())  # a prefill of what the page shows clears it
    assert len(list(fns["ask"]("Who led them?", 2, _request(), CONTEXT))) > 1
    # options changed while a prefill runs (the gate runs outside the queue): the new cache is not what the page
    # shows, so Ask stays disabled and Enter is refused
    user = app.sessions.get("tab-1")
    real_prefill = app.door.prefill_reserved

    def prefill_while_the_user_picks_fp8(*args, **kwargs):
        report = real_prefill(*args, **kwargs)
        gate(CONTEXT, "fp8", _request())
        return report

    app.door.prefill_reserved = prefill_while_the_user_picks_fp8
    view = fns["prefill"](CONTEXT, *HQQ, _request())
    assert view.ask_button["interactive"] is False and user.qa.spec.backend == "hqq"
    assert "the page shows fp8" in refused(fns["ask"]("Who led them?", 2, _request(), CONTEXT))
    assert all(isinstance(v, (str, CacheSpec)) for v in user.page_shows)


def test_the_page_fields_leave_bad_numbers_to_the_project_checks(handlers):
    """Found by a tester: Gradio's own bounds refused max_new_tokens=0 or residual_length=0 with a bare "Error"
    over the chat and charts (Ask stayed disabled), its precision=0 ran 2.5 as 2, and the API could not send
    quanto's axis -1 (the dropdown kept hqq's choices). The fields now pass what was typed; the project's checks
    refuse it beside the button, saying what to change, and the session keeps answering."""
    app, fns = handlers
    demo = build_demo(app)
    numbers = [b for b in demo.blocks.values() if isinstance(b, gr.Number) and not b.label.startswith("seed")]
    assert len(numbers) >= 6  # Ask: max_new_tokens, q_group_size, residual_length; Compare: 2; Needle: 1
    for field_ in numbers:
        assert field_.preprocess(-3) == -3 and field_.preprocess(2.5) == 2.5, field_.label
    options = [b for b in demo.blocks.values() if isinstance(b, gr.Dropdown) and b.label in GROUP_OPTIONS]
    assert {b.label for b in options} == {
        "nbits",
        "axis_key",
        "axis_value",
        "flush",
        "storage",
        "rotation",
        "nbits_value",
        "optimize",
        "sliding",
        "protect",
        "scale",
        "norm_correction",
        "type_k",
        "type_v",
        "layout",
        "float8",
        "keys",
        "block_rule",
        "tensor_scale",
        "kv_group_size",
    }  # quantized_kv_start: a number
    for field_ in options:
        assert field_.preprocess(-1) == -1 and field_.preprocess("Growing") == "Growing", field_.label
    fns["prefill"](CONTEXT, *HQQ, _request())
    for value, message in ((0, "max_new_tokens=0 must be a whole number >= 1"), (2.5, "max_new_tokens=2.5 must be")):
        assert message in refused(fns["ask"]("Who led them?", value, _request(), CONTEXT))
    view = fns["prefill"](CONTEXT, "hqq", 4, 64, 0, 0, 0, _request())
    assert "residual_length=0 is not allowed for hqq; it must be >= 1" in refused(view)
    assert "q_group_size=2.5 must be a whole number" in refused(fns["prefill"](CONTEXT, "hqq", 4, 2.5, _request()))
    view = fns["prefill"](CONTEXT, "quanto", 4, 2, 16, -1, -1, _request())  # groups along the 2 KV heads
    assert "quanto nbits=4 q_group_size=2 residual_length=16 axis_key=-1 axis_value=-1" in view.prefill_info
    assert len(_ask(fns, "Who led them?", 3)) > 1


def test_a_refusal_beside_ask_gives_way_to_the_last_answer_once_the_page_matches_again(handlers):
    app, fns = handlers
    fns["prefill"](CONTEXT, *HQQ, _request())
    last_line = _ask(fns, "Who led the Normans?", 3)[-1].stats
    assert "cache length after restore" in last_line
    changed = ("hqq", 4, 64, 8, 0, 0)  # residual_length 8 on the page, 4 in the cache
    line, _, ask, beside_ask = fns["gate"](CONTEXT, *changed, _request())
    assert ask["interactive"] is False and beside_ask is views.KEEP and "residual_length=8" in line
    fns["before_answer"]("Where?", _request())  # Enter in the question box, the button being disabled
    stale = refused(_ask(fns, "Where?", 3))
    assert not app.sessions.get("tab-1").answer_pending  # nothing waits once refused
    assert "the page shows hqq:4,q_group_size=64,residual_length=8" in stale
    line, _, ask, beside_ask = fns["gate"](CONTEXT, *HQQ, _request())  # the option set back
    assert ask["interactive"] is True and line.startswith("Prefilled") and beside_ask == last_line


def test_the_click_echoes_the_question_and_a_refusal_takes_it_back(handlers):
    app, fns = handlers
    assert fns["before_answer"]("Who?", _request())[2] is views.KEEP  # nothing prefilled: nothing to echo
    fns["prefill"](CONTEXT, *HQQ, _request())
    _ask(fns, "Who led the Normans?", 3)
    before = list(tab_view(app.sessions.get("tab-1")).chat)
    assert len(before) == 2
    _, _, echoed, _ = fns["before_answer"]("  Where?  ", _request())
    assert echoed[:2] == before and echoed[2] == {"role": "user", "content": "Where?"}
    assert fns["before_answer"]("   ", _request())[2] is views.KEEP
    refused_view = list(fns["ask"]("Where?", 3, _request(), "another text"))[-1]  # the Context box changed
    assert "Context box has changed" in refused_view.stats and refused_view.chat == before


def test_stop_is_enabled_only_while_something_runs(handlers):
    app, fns = handlers
    demo_fns = {getattr(f.fn, "__name__", ""): f.fn for f in build_demo(app).fns.values()}
    stop_state = demo_fns["stop_state"]
    assert stop_state(_request())["interactive"] is False  # no session yet
    fns["prefill"](CONTEXT, *HQQ, _request())
    assert stop_state(_request())["interactive"] is False  # prefilled, idle
    stream = fns["ask"]("Who led the Normans?", 20, _request())
    next(stream)
    assert stop_state(_request())["interactive"] is True  # an answer streams
    stream.close()
    assert stop_state(_request())["interactive"] is False
    # Enter during a prefill: the answer is refused while the prefill holds the lock; once the prefill ends,
    # nothing runs or waits, so Stop is disabled again (the queued answer ended with its refusal)
    user = app.sessions.get("tab-1")
    user.lock.acquire()  # what a running prefill holds
    try:
        fns["before_answer"]("Where?", _request())
        assert "already running" in refused(_ask(fns, "Where?", 3))
        assert stop_state(_request())["interactive"] is True  # the prefill still runs
    finally:
        user.lock.release()
    assert not user.answer_pending and stop_state(_request())["interactive"] is False
    # two clicks queued, one answer running: the mark stays until both have ended
    fns["before_answer"]("Where?", _request())
    fns["before_answer"]("Where?", _request())
    running = fns["ask"]("Who led the Normans?", 20, _request())
    next(running)
    assert "already running" in refused(list(fns["ask"]("Where?", 3, _request())))
    assert user.answer_pending and stop_state(_request())["interactive"] is True
    running.close()
    assert not user.answer_pending and stop_state(_request())["interactive"] is False


def test_example_questions_follow_the_context_box(handlers):
    app, fns = handlers
    demo_fns = {getattr(f.fn, "__name__", ""): f.fn for f in build_demo(app).fns.values()}
    questions_for = demo_fns["example_questions"]
    normans, questions = example("Normans")
    offered = questions_for(normans, _request()).constructor_args  # the update the page gets
    assert offered["samples"] == [[q] for q in questions] and offered["visible"] is True
    other = questions_for("A text about something else entirely.", _request()).constructor_args
    assert other["samples"] == [] and other["visible"] is False  # never Normans' questions about another text
    fns["prefill"](CONTEXT, *HQQ, _request())
    _ask(fns, "Who led the Normans?", 2)
    asked = questions_for(CONTEXT, _request()).constructor_args
    assert asked["samples"] == [["Who led the Normans?"]]  # asked on this text
    assert questions_for("A text about something else entirely.", _request()).constructor_args["visible"] is False


def test_cancel_is_enabled_only_while_a_long_job_runs_or_waits(handlers):
    app, fns = handlers
    demo = build_demo(app)
    cancels = [b for b in demo.blocks.values() if isinstance(b, gr.Button) and b.value == "Cancel"]
    assert len(cancels) == 3 and all(b.interactive is False for b in cancels)  # Compare's, Needle's, Recommend's
    states = [f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "cancel_state"]
    assert len(states) == 6  # after each tab's click and after its run
    assert all(state(_request())["interactive"] is False for state in states)  # no session yet
    fns["prefill"](CONTEXT, *HQQ, _request())
    user = app.sessions.get("tab-1")
    app.sessions.queue_long_job(user)  # a click queued a comparison
    assert all(state(_request())["interactive"] is True for state in states)
    with app.sessions.long_job(user, "busy"):  # it runs
        assert all(state(_request())["interactive"] is True for state in states)
    assert all(state(_request())["interactive"] is False for state in states)  # it ended


def test_live_charts_redraw_four_times_a_second_and_at_every_flush():
    """The memory and residual charts are rebuilt from every step so far at each redraw: at most one per
    `CHART_INTERVAL_SECONDS` (0.25 s), but always at the first step and at a flush, so no flush waits."""
    from types import SimpleNamespace

    from kvdemo.ui.views import CHART_INTERVAL_SECONDS, charts_due

    assert CHART_INTERVAL_SECONDS == 0.25
    steps = [(0.0, ()), (0.08, ()), (0.16, ()), (0.24, ()), (0.26, ()), (0.34, (0, 1)), (0.42, ()), (0.6, ())]
    drawn_at, drawn = None, []
    for elapsed, flushed in steps:
        if charts_due(SimpleNamespace(elapsed=elapsed, flushed_layers=flushed), drawn_at):
            drawn_at = elapsed
            drawn.append(elapsed)
    assert drawn == [0.0, 0.26, 0.34, 0.6]


def test_the_answers_table_names_each_spec_with_its_precision():
    """A backend without nbits is named with its types (ggml's `-ctk`/`-ctv`), not by its bare name."""
    assert views.table_spec(CacheSpec.parse("ggml")) == "ggml,type_k=q8_0,rotation=auto"
    assert views.table_spec(CacheSpec.parse("quanto:4,residual_length=16")) == "quanto:4,residual_length=16"
    assert views.table_spec(CacheSpec.parse("dynamic")) == "dynamic"


def test_long_jobs_say_the_time_left_at_their_own_pace():
    """The bar of Compare, Needle and Recommend: no promise before a unit is done, then the seconds per unit so far ×
    the units left, revised at every update."""
    shown, now = [], [100.0]
    paced = times.Paced(lambda value, desc, unit: shown.append((value, desc)), clock=lambda: now[0])
    paced(0, 10, "dynamic: prefilling")
    now[0] = 130.0
    paced(3, 10, "dynamic: answering 1/2")
    now[0] = 400.0
    paced(5, 10, "fp8: prefilling")
    assert shown == [
        ((0, 10), "dynamic: prefilling"),
        ((3, 10), "dynamic: answering 1/2 · about 70 s left at this run's pace"),
        ((5, 10), "fp8: prefilling · about 5 min 00 s left at this run's pace"),  # a busier machine: revised
    ]


def test_compare_estimates_its_time_from_the_tabs_own_measurements(handlers):
    app, fns = handlers
    assert times.compare_estimate(6, 1, 32, None, []) == ""  # nothing measured here yet: no promise
    fns["prefill"](CONTEXT, *HQQ, _request())
    user = app.sessions.get("tab-1")
    assert times.compare_estimate(6, 1, 32, user.qa, tab_view(user).events) == ""  # a prefill, no decode step yet
    _ask(fns, "Who led the Normans?", 6)
    step = sorted(e.seconds for e in tab_view(user).events if e.kind == "decode step")
    text = times.compare_estimate(6, 2, 32, user.qa, tab_view(user).events)
    assert text.startswith(" (about ") and "6 prefills of " in text and "768 decode steps of " in text
    seconds = 6 * (user.qa.prefill_report.seconds + 2 * 2 * 32 * views.flush_timing(tab_view(user).events)[2])
    assert f"about {times.duration(seconds)}:" in text and step


def test_compare_says_when_its_speeds_were_measured_on_a_busy_machine(tiny):
    """A load average above the core count at the run's start or end: the speed chart and the line say so; an idle
    machine: nothing is said."""
    import os

    report = compare(tiny, CONTEXT, ["Who led the Normans?"], [CacheSpec("fp8")], 2)
    cores = os.cpu_count() or 1
    note, _, _, speed = views.comparison_outputs(report, "Compared", (0.2, cores + 3.0))
    assert speed["title"] == "Decode speed ⚠ on a busy machine" and f"{cores + 3.0:.1f} on {cores} cores" in note
    note, _, _, speed = views.comparison_outputs(report, "Compared", (0.2, 0.4))
    assert speed["title"] == "Decode speed" and "busy" not in note


def test_recommend_estimates_its_time_from_the_page_default_measured_here():
    """Before its first unit, Recommend scales the page default's measured seconds to the text's tokens (never below
    them: a shorter text still reads the same candidates); nothing without one for this model."""
    found = SimpleNamespace(model="m", seconds=40.0, context_tokens=500)
    assert times.recommend_estimate(found, "m", 1500) == (
        " (about 2 min 00 s at most: the page's default took 40 s on 500 tokens here, and this text has 1,500)"
    )
    assert times.recommend_estimate(found, "m", 100).startswith(" (about 40 s at most")
    assert times.recommend_estimate(found, "another model", 1500) == ""
    assert times.recommend_estimate(None, "m", 1500) == ""
