"""The server-wide KV budget (`kvdemo.serve.accounting.KVAccount`, the door's `prefill`, `reserve_answer` and long
jobs: `kvdemo.serve.door.Door`) and the MCP tools' handlers (`kvdemo.ui.mcp_tools.McpTools`) called directly on a
tiny model: what a session may hold against what it really holds, refusals with the figures before anything runs,
reservations released when a session is freed or replaced, and the MCP sessions kept apart.

Cost: 17 s in a pytest-xdist worker on 2 cores (the clean-clone CI of 2026-12-04): prefills and answers on a tiny
model through the App and the MCP handlers."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import gradio as gr
import pytest

from kvdemo import CacheSpec, QASession
from kvdemo.cache.spec import estimate_kv_bytes
from kvdemo.cache.state.telemetry import _bytes
from kvdemo.qa.limits import QUESTION_RESERVE_TOKENS
from kvdemo.serve.accounting import KVAccount, ServerKVBudgetError, prefill_tokens, session_kv_bytes
from kvdemo.serve.server import App
from kvdemo.ui.ask_widgets import START_SPEC
from kvdemo.ui.mcp_tools import McpTools

MIB = 2**20


def _request(session_hash: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=session_hash)


def _app(tiny, limit_bytes: int | None) -> App:
    app = App(loader=lambda source: tiny, server_kv_budget_bytes=limit_bytes)
    app.start_loading()
    app.wait_for_model()
    return app


# ---- what a session may hold ----------------------------------------------------------------------------
def test_a_dynamic_session_holds_its_tokens_in_full_precision_and_nothing_more(tiny):
    # tiny: 2 layers x 2 KV heads x head_dim 64, keys and values, float32: 2 * 2 * 2 * 64 * 4 = 2,048 bytes/token
    assert session_kv_bytes(CacheSpec("dynamic"), tiny, 300, 128) == 2048 * 428


def _held_with_snapshot(qa: QASession) -> int:
    """Bytes of every tensor storage the cache and its snapshot hold, each counted once (as `kv_memory` counts)."""
    names = ("_quantized_keys", "_quantized_values", "_answer_keys", "_answer_values", "keys", "values")
    seen, total = set(), 0
    for layer, saved in zip(qa.cache.layers, qa._snapshot.layers):
        total += _bytes(tuple(getattr(layer, name, None) for name in names), seen)
        if saved.attributes is not None:
            total += _bytes(tuple(saved.attributes.get(name) for name in names), seen)
    return total


@pytest.mark.parametrize(
    "text, flushes",
    [
        ("dynamic", False),
        ("fp8", True),
        ("hqq:4,residual_length=8", True),
        ("quanto:2,residual_length=8", True),
        ("hqq:2,residual_length=128", False),
    ],
)
def test_what_a_session_may_hold_bounds_its_cache_and_snapshot_during_an_answer(tiny, normans, text, flushes):
    spec = CacheSpec.parse(text)
    qa = QASession(tiny, spec)
    context = normans.select("0").context
    assert prefill_tokens(tiny, context) == qa.prefill(context).context_tokens
    question = "Tell me about the Normans."
    decoded = len(qa.question_ids(question)) + 40
    limit = session_kv_bytes(qa.spec, tiny, qa.prefill_report.context_tokens, decoded)
    peak = max(_held_with_snapshot(qa) for _ in qa.stream(question, 40))
    assert len(qa.history[-1].token_ids) == 40  # the answer used the whole reserve (no EOS)
    assert peak <= limit
    # once the answer has flushed, the snapshot keeps the post-prefill store alive (fp8 appends: from the first
    # step); before, it shares the cache's store; dynamic's restore slices back and keeps nothing
    # the estimate (kvdemo.cache.state.budget.held_bytes_estimate) counts the snapshot's store only where a flush frees
    # the cache from it, so it is tight for every kind
    assert peak == pytest.approx(limit, rel=0.03)
    store = estimate_kv_bytes(qa.spec, tiny.config, qa.prefill_report.context_tokens, tiny.dtype)
    assert qa.estimate_kv_bytes(qa.prefill_report.context_tokens, decoded) == limit
    assert (qa.history[-1].flush_count > 0) == (flushes and spec.keeps_residual) or not spec.keeps_residual
    assert store > 0


def test_prefill_tokens_of_what_is_not_text_is_zero(tiny):
    assert prefill_tokens(tiny, "") == prefill_tokens(tiny, "   ") == prefill_tokens(tiny, None) == 0


# ---- the account ----------------------------------------------------------------------------------------
def test_the_account_refuses_what_would_pass_its_limit_with_the_figures():
    account = KVAccount(100 * MIB)
    account.reserve("cache:a", 60 * MIB, "a cache")
    account.reserve("cache:a", 70 * MIB, "a bigger cache")  # replaces its own reservation
    assert account.held_bytes == 70 * MIB
    with pytest.raises(ServerKVBudgetError) as refused:
        account.reserve("compare:b", 40 * MIB, "a comparison of 2 spec(s) on 300 context tokens")
    assert str(refused.value) == (
        "The server's KV budget is full: a comparison of 2 spec(s) on 300 context tokens needs about 40.0 MiB, and "
        "70.0 MiB of its 100.0 MiB are held by 1 other cache and comparisons (30.0 MiB free). Try again when other "
        "users finish, or ask for less: a shorter context, fewer max_new_tokens, or a backend with fewer bits (e.g. "
        "hqq with nbits 2)"
    )
    assert (refused.value.request_bytes, refused.value.held_bytes, refused.value.limit_bytes) == (
        40 * MIB,
        70 * MIB,
        100 * MIB,
    )
    assert account.holders() == {"cache:a": 70 * MIB}  # nothing reserved by the refusal
    account.reserve("cache:a", 10 * MIB, "an answer", grow_only=True)  # never shrinks
    account.reserve("prefill:b", 30 * MIB, "a prefill")
    account.transfer("prefill:b", "cache:b")
    assert account.holders() == {"cache:a": 70 * MIB, "cache:b": 30 * MIB}
    assert account.release("cache:a") == 70 * MIB and account.release("cache:a") == 0
    assert KVAccount(None).reserve("x", 10**15, "anything") is None  # no limit: counted, never refused
    with pytest.raises(ValueError, match="limit_bytes=0 must be >= 1"):
        KVAccount(0)


# ---- the app --------------------------------------------------------------------------------------------
def _one_session_bytes(tiny, context: str, spec: CacheSpec) -> int:
    return session_kv_bytes(
        spec.validate(tiny.config), tiny, prefill_tokens(tiny, context), QUESTION_RESERVE_TOKENS + 64
    )


def test_a_prefill_over_the_server_budget_is_refused_before_it_runs_and_a_freed_session_makes_room(tiny, normans):
    context = normans.select("0").context
    spec = CacheSpec("hqq", nbits=4, residual_length=8)
    one = _one_session_bytes(tiny, context, spec)
    app = _app(tiny, int(1.5 * one))
    a = app.door.prefill("a", spec, context).session
    assert app.kv.holders() == {"cache:a": one} and app.sessions.peek("a").qa is a
    refused = r"needs about 0\.\d MiB, and 0\.\d MiB of its 0\.\d MiB are held by 1 other cache and comparisons"
    with pytest.raises(ServerKVBudgetError, match=refused):
        app.door.prefill("b", spec, context)
    assert app.sessions.peek("b").qa is None and app.kv.holders() == {"cache:a": one}  # nothing ran or reserved
    # a new prefill in session a counts its old cache too: it is alive until the new one replaces it
    with pytest.raises(ServerKVBudgetError):
        app.door.prefill("a", spec, context)
    assert app.sessions.peek("a").qa is a
    assert a.ask("Who were the Normans?", 4).cache_length_after == a.prefill_report.context_tokens
    app.sessions.free("a")
    assert app.kv.holders() == {}
    b = app.door.prefill("b", spec, context).session
    assert app.kv.holders() == {"cache:b": one}
    alone = QASession(tiny, spec)
    alone.prefill(context)
    assert b.ask("Who were the Normans?", 6).text == alone.ask("Who were the Normans?", 6).text


def test_a_refused_or_failed_prefill_keeps_the_old_reservation_and_a_closed_tab_releases_the_new_one(tiny, normans):
    context = normans.select("0").context
    app = _app(tiny, None)
    dynamic = CacheSpec("dynamic")
    app.door.prefill("a", dynamic, context)
    old = app.kv.holders()
    with pytest.raises(ValueError, match="the context is empty"):
        app.door.prefill("a", dynamic, " ")
    with pytest.raises(ValueError, match="exceeds the model's 512-token window"):
        app.door.prefill("a", dynamic, normans.select("0-7").context)
    assert app.kv.holders() == old
    app.sessions.free("a")  # the tab closes while another prefill of it runs: nothing keeps that cache
    app.door.prefill_reserved("a", QASession(tiny, dynamic), context)
    assert app.kv.holders() == {}


def test_an_answer_longer_than_the_prefill_reserved_grows_the_reservation_or_is_refused(tiny, normans):
    context = normans.select("0").context
    spec = CacheSpec("dynamic")
    one = _one_session_bytes(tiny, context, spec)
    app = _app(tiny, one + 2048 * 100)  # room for 100 more tokens (dynamic: 2,048 bytes per token)
    qa = app.door.prefill("a", spec, context).session
    tokens = qa.prefill_report.context_tokens
    question = "Who were the Normans?"
    q = len(qa.question_ids(question))
    app.door.reserve_answer("a", qa, question, 8)  # inside the prefill's reserve: unchanged
    assert app.kv.holders() == {"cache:a": one}
    app.door.reserve_answer("a", qa, question, 128 + 90 - q)
    assert app.kv.holders() == {"cache:a": 2048 * (tokens + 128 + 90)}
    with pytest.raises(ServerKVBudgetError, match="an answer of up to 300 tokens on your"):
        app.door.reserve_answer("a", qa, question, 300)
    with pytest.raises(ValueError, match="the question is empty"):
        app.door.reserve_answer("a", qa, "  ", 8)


def test_a_comparison_holds_its_largest_spec_while_it_runs(tiny, normans):
    context = normans.select("0").context
    specs = [CacheSpec.parse("hqq:4"), CacheSpec.parse("fp8")]
    dynamic = session_kv_bytes(CacheSpec("dynamic"), tiny, prefill_tokens(tiny, context), QUESTION_RESERVE_TOKENS + 4)
    app = _app(tiny, dynamic + 1000)
    seen, refused = [], []

    def during(done: int, total: int, what: str) -> None:  # while a's comparison runs: what it holds, b refused
        seen.append(dict(app.kv.holders()))
        if not refused:
            with pytest.raises(ServerKVBudgetError, match="a comparison of 2 spec") as error:
                with app.door.long_job("b", "busy") as other:
                    other.compare(context, ["Who?"], specs, 4)
            refused.append(error.value)

    with app.door.long_job("a", "busy") as job:
        report = job.compare(context, ["Who were the Normans?"], specs, 4, on_progress=during)
    assert refused and seen and all(held == {"compare:a": dynamic} for held in seen)
    # no spec's session held more than the reservation (measured after its prefill)
    assert max(r.kv_bytes for r in report.results) <= dynamic
    assert app.kv.holders() == {}
    with pytest.raises(ValueError, match="nbits=3 is not allowed for quanto"):
        with app.door.long_job("a", "busy") as job:
            job.compare(context, ["Who?"], [CacheSpec("quanto", nbits=3)], 4)


# ---- the MCP tools' handlers ------------------------------------------------------------------------------
def test_mcp_sessions_are_named_and_kept_apart_from_each_other_and_from_the_tabs(tiny, normans):
    app = _app(tiny, None)
    tools = McpTools(app)
    assert tools.key_of("alice", _request("h")) == "mcp:alice" and tools.key_of("", _request("h")) == "h"
    contexts = {"alice": normans.select("0").context, "bob": normans.select("2").context}
    for name, context in contexts.items():
        json.loads(tools.prefill_context(context, "quanto:4,residual_length=4", name, _request("loopback")))
    question = "Who were the Normans?"
    for name, context in contexts.items():
        answer = json.loads(tools.ask_question(question, 5, name, _request("loopback")))
        alone = QASession(tiny, CacheSpec.parse("quanto:4,residual_length=4"))
        tokens = alone.prefill(context).context_tokens
        assert (answer["answer"], answer["cache_length_after"]) == (alone.ask(question, 5).text, tokens)
    assert set(app.kv.holders()) == {"cache:mcp:alice", "cache:mcp:bob"}
    with pytest.raises(gr.Error, match="Nothing is prefilled in this session"):
        tools.ask_question(question, 5, "", _request("a-browser-tab"))


def test_mcp_tools_obey_the_server_budget_and_refuse_bad_input(tiny, normans):
    context = normans.select("0").context
    one = _one_session_bytes(tiny, context, START_SPEC)  # the tool's default spec
    app = _app(tiny, int(1.5 * one))
    tools = McpTools(app)
    tools.prefill_context(context, session="a", request=None)
    with pytest.raises(gr.Error, match=f"The server's KV budget is full: a {START_SPEC.backend} .* KV cache for .* "):
        tools.prefill_context(context, session="b", request=None)
    cases = [
        (lambda: tools.prefill_context(context, "hqq:4,nbits=2", "a"), "nbits is given twice"),
        (lambda: tools.prefill_context(context, 4, "a"), "spec must be a text like hqq:4,residual_length=16"),
        (lambda: tools.prefill_context(context, "dynamic", "../etc"), "session='../etc' must be 1-64 letters"),
        (lambda: tools.prefill_context(context, "mlx:4,kv_group_size=48", "a"), "kv_group_size=48 is not allowed"),
        (lambda: tools.prefill_context(context, "nvfp4:nvfp4_4over5", "a"), "presets: nvfp4, nvfp4_4over6"),
        (lambda: tools.ask_question("Who?", 0, "a"), "max_new_tokens=0 must be a whole number >= 1"),
        (lambda: tools.ask_question("", 4, "a"), "the question is empty"),
        (lambda: tools.compare_backends(["Who?"], ["hqq:9"], 4, "", "a"), "nbits=9 is not allowed for hqq"),
        (lambda: tools.compare_backends(["Who?", " "], None, 4, "", "a"), "a question is empty"),
        (
            lambda: tools.compare_backends(["Who?"], None, 1000, "", "a"),
            "max_new_tokens=1000 is more than a comparison runs here; use at most 256",
        ),
        (lambda: tools.compare_backends(["Who?"], None, 4, "", "nobody"), "Nothing is prefilled in this session"),
        (lambda: tools.compare_backends("Who?", None, 4, "", "a"), "questions must be a list of 1-20"),
    ]
    for call, message in cases:
        with pytest.raises(gr.Error, match=message):
            call()
    # the session still answers as alone after every refusal
    alone = QASession(tiny, START_SPEC)  # the tool's default spec
    alone.prefill(context)
    assert json.loads(tools.ask_question("Who?", 4, "a"))["answer"] == alone.ask("Who?", 4).text


def test_mcp_compare_uses_the_sessions_context_and_one_comparison_at_a_time(tiny, normans):
    app = _app(tiny, None)
    tools = McpTools(app)
    context = normans.select("1").context
    tools.prefill_context(context, "dynamic", "a")
    report = json.loads(tools.compare_backends(["Who ruled the duchy?"], ["hqq:2"], 3, "", "a"))
    assert report["context_tokens"] == app.sessions.peek("mcp:a").qa.prefill_report.context_tokens
    assert [row["backend"] for row in report["results"]] == ["dynamic", "hqq"] and app.kv.holders() == {
        "cache:mcp:a": app.kv.holders()["cache:mcp:a"]
    }
    user = app.sessions.peek("mcp:a")
    started = threading.Event()
    with user.compare_lock:  # a comparison already running in this session
        started.set()
        with pytest.raises(gr.Error, match="A comparison is already running in this session"):
            tools.compare_backends(["Who?"], ["hqq:2"], 3, "", "a")


def test_what_no_wait_can_fit_is_told_so_not_that_the_server_is_full(tiny, monkeypatch):
    """Found by a tester: a context far past the model's window, or an answer of 10**9 tokens, was refused with
    "the server's KV budget is full ... try again when other users finish", after ~50 s of tokenizing the
    whole text again for each of the prompt split's probes; a question that fills the window was told to lower
    max_new_tokens "to at most -340". The window and the session's budget are checked before the shared
    reservation, a too-long context is counted once, and a reservation larger than the whole budget says so."""
    app = _app(tiny, 4 * MIB)
    key, window, dynamic = "tab-1", tiny.max_context_tokens, CacheSpec("dynamic")
    probes = []
    monkeypatch.setattr(type(tiny.layout), "reference_ids", lambda self, *a: probes.append(a) or [])
    long_text = "word " * (3 * window)
    assert prefill_tokens(tiny, long_text) > window and probes == []  # counted once, no probe
    with pytest.raises(ValueError, match=f"exceeds the model's {window:,}-token window. Shorten the context"):
        app.door.prefill(key, dynamic, long_text)
    monkeypatch.undo()
    assert app.kv.holders() == {}  # nothing reserved
    with pytest.raises(ValueError, match=r"^the context is 2\.4 MiB of text; the limit is 2 MiB, and the model's "):
        app.door.prefill(key, dynamic, "word " * 500_000)  # refused before tokenizing
    with pytest.raises(ServerKVBudgetError) as error:  # 2,048 bytes/token: 4 MiB hold 2,048 tokens
        app.kv.reserve("prefill:x", 5 * MIB, "a dynamic KV cache for 2,432 context tokens")
    assert str(error.value).startswith(
        "The server's KV budget is too small for this: a dynamic KV cache for 2,432 context tokens needs about "
        "5.0 MiB, more than the whole 4.0 MiB this server gives all users together. Ask for less"
    )
    qa = app.door.prefill(key, dynamic, "The Normans gave their name to Normandy. " * 10).session
    context_tokens, held = qa.prefill_report.context_tokens, app.kv.holders()
    with pytest.raises(ValueError, match="lower max_new_tokens to at most "):
        app.door.reserve_answer(key, qa, "Who?", 10**9)
    question = "Why? " * window
    with pytest.raises(ValueError) as error:
        app.door.reserve_answer(key, qa, question, 8)
    assert f"context {context_tokens:,} + question " in str(error.value)
    assert (
        f"leave no room for an answer in the model's {window:,}-token window; shorten the question to at most "
        f"{window - context_tokens - 1:,} tokens" in str(error.value)
    )
    assert app.kv.holders() == held  # the refusals reserved nothing


def test_one_long_job_protocol_for_comparisons_and_grids(tiny):
    """`SessionStore.long_job`: one long job per session (the second refused with the caller's message, nothing
    run), Cancel armed for an API call, the lock and the pending flag freed however the job ends; a click
    (`queue_long_job`) arms Cancel before the job starts, and `cancel_long_job` reaches it while it waits."""
    app = _app(tiny, None)
    user = app.sessions.get("k")
    user.compare_cancel.set()  # left over from an earlier job
    with app.sessions.long_job(user, "busy here") as cancel:
        assert cancel is user.compare_cancel and not cancel.is_set() and user.compare_pending
        with pytest.raises(ValueError, match="^busy here$"):
            with app.sessions.long_job(user, "busy here"):
                raise AssertionError("a second job ran")
    assert not user.compare_pending and not user.compare_lock.locked()
    with pytest.raises(RuntimeError, match="a fault"):
        with app.sessions.long_job(user, "busy"):
            raise RuntimeError("a fault")
    assert not user.compare_lock.locked() and not user.busy
    app.sessions.queue_long_job(user)  # the click, while the job waits in the queue
    app.sessions.cancel_long_job(user)
    with app.sessions.long_job(user, "busy") as cancel:
        assert cancel.is_set()  # the Cancel pressed while it waited applies
    app.sessions.cancel_long_job(user)  # nothing runs or waits: nothing armed
    assert not user.compare_pending and cancel.is_set()


def test_a_needle_grid_reserves_its_largest_spec_at_its_longest_length(tiny):
    app = _app(tiny, None)
    specs = [CacheSpec("dynamic"), CacheSpec.parse("hqq:4")]
    held = session_kv_bytes(CacheSpec("dynamic"), tiny, 300, QUESTION_RESERVE_TOKENS + 16)
    seen = []
    with app.door.long_job("k", "busy") as job:
        grid = job.needle(specs, [100, 300], [50], 16, on_progress=lambda *_: seen.append(dict(app.kv.holders())))
    assert grid.complete and seen and all(holders == {"grid:k": held} for holders in seen)
    assert app.kv.holders() == {}
    small = _app(tiny, 1000)
    with pytest.raises(ServerKVBudgetError, match="a needle grid of 2 spec"):
        with small.door.long_job("k", "busy") as job:
            job.needle(specs, [300], [50], 16)


def test_mcp_recommend_uses_the_sessions_context_and_refuses_bad_input(tiny, normans):
    app = _app(tiny, None)
    tools = McpTools(app)
    context = normans.select("0").context
    tools.prefill_context(context, "dynamic", "a")
    found = json.loads(tools.recommend_setting("", ["Who were the Normans?"], 0.05, "transformers", "a"))
    assert found["finished"] and found["note"] == "" and found["rows"][0]["spec"] == "dynamic"
    picked = next(row for row in found["rows"] if row["spec"] == found["pick"])
    assert (
        picked["mean_kl"] <= 0.05
        and found["deploy"] == picked["deploy"]
        and found["deploy"][0].startswith(("transformers:", "llama.cpp:"))
    )
    assert set(app.kv.holders()) == {"cache:mcp:a"}  # the recommendation's reservation is released
    for call, message in [
        (lambda: tools.recommend_setting("", ["Who?"], 0.0, "any", "a"), "max_kl=0.0 must be a number > 0"),
        (lambda: tools.recommend_setting("", ["Who?"], 0.02, "mlx", "a"), "engine 'mlx' is not one of any, llama.cpp"),
        (lambda: tools.recommend_setting("", "Who?", 0.02, "any", "a"), "questions must be a list"),
        (lambda: tools.recommend_setting("", ["Who?"], 0.02, "any", "nobody"), "Nothing is prefilled"),
    ]:
        with pytest.raises(gr.Error, match=message):
            call()


def test_the_app_probes_the_pages_start_while_the_page_is_served(tiny, monkeypatch):
    """The probe of the page's starting spec (the recommendation's pick, its residual cut) runs in the start-up load,
    keyed by the spec's every option resolved, so that the first Prefill at the page's fields does not pay it."""
    from kvdemo.serve import server
    from kvdemo.serve.recommended import page_start
    from kvdemo.ui.inputs import spec_from_inputs

    def stored(loaded, measure_missing):  # a recommendation stored for this model
        return SimpleNamespace(pick="turboquant:4", model=loaded.name)

    monkeypatch.setattr(server, "page_default", stored)
    probes = tiny.__dict__.setdefault("_probes", {})
    start = page_start(CacheSpec.parse("turboquant:4")).validate(tiny.config)
    probes.pop(start.full_text, None)
    app = App(loader=lambda source: tiny)
    app.start_loading()
    assert app.wait_for_model() is tiny
    assert start.full_text in probes and probes[start.full_text] is None  # probed, and it serves the model
    fields = spec_from_inputs(start.backend, dict(start.resolved()))  # the spec the page's fields send
    assert fields.validate(tiny.config).full_text == start.full_text  # the same probe: no set-up at the Prefill
