"""Issue 43, part 1: the MCP tools report their work's progress, which keeps a client alive past its timeout, and a
client that leaves stops its tool, freeing the comparison's queue slot for the next caller (`kvdemo.ui.mcp_calls`).

On a running app (the tiny model, `mcp_server=True`) with the `mcp` package's client over streamable HTTP. The
Python client does not reset its read timeout on progress, so `_call` does what a client that does (the TypeScript
SDK's `resetTimeoutOnProgress`) does: it gives up when `timeout` seconds pass without a progress notification.

Cost: about 25 s on 2 cores, most of it the two comparisons that must outlast a timeout or be left."""

from __future__ import annotations

import json
import logging
import re
import time

import anyio
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from kvdemo import CacheSpec, QASession
from kvdemo.compare.run import compare
from kvdemo.serve.server import App
from kvdemo.ui import mcp_tools
from kvdemo.ui.mcp_calls import CALL_HEADER, McpCalls, ProgressRelay
from kvdemo.ui.mcp_tools import serve_only_tools
from tests.e2e.conftest import serve

QUESTIONS = ["Who led the Normans?", "Where is Normandy?"]


@pytest.fixture(scope="module")
def mcp_url(tiny):
    """(url, app): the tiny model served with the MCP server on, each backend of the tests used once (the first use
    imports its library: seconds before any progress, once per process)."""
    compare(tiny, "The Normans held Rouen.", ["Who?"], [CacheSpec("hqq", nbits=4), CacheSpec("fp8")], 2)
    app = App(loader=lambda source: tiny)
    demo, url = serve(app, mcp_server=True, show_error=True)
    serve_only_tools(demo)
    assert app.wait_for_model() is tiny
    yield url + "gradio_api/mcp/", app
    demo.close()


async def _call(url: str, name: str, arguments: dict, timeout: float, leave_on: str | None = None) -> dict:
    """One MCP call from its own client, which gives up after `timeout` seconds without progress (or leaves, closing
    its connection, at the first progress message holding `leave_on`). Returns "result" (or "timed_out" or "left":
    the monotonic time), "seen" (each progress notification: seconds since the call, its message), "seconds"."""
    out: dict = {"seen": []}
    start = last = time.monotonic()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        nonlocal last
        last = time.monotonic()
        out["seen"].append((last - start, message or ""))

    async with streamable_http_client(url) as (read, write, _), ClientSession(read, write) as session:
        await session.initialize()
        async with anyio.create_task_group() as group:

            async def run() -> None:
                out["result"] = await session.call_tool(name, arguments, progress_callback=on_progress)
                group.cancel_scope.cancel()

            group.start_soon(run)
            while True:
                await anyio.sleep(0.05)
                if time.monotonic() - last > timeout:
                    out["timed_out"] = time.monotonic()
                elif leave_on is not None and any(leave_on in message for _, message in out["seen"]):
                    out["left"] = time.monotonic()
                else:
                    continue
                group.cancel_scope.cancel()
                break
    out["seconds"] = time.monotonic() - start
    return out


def _steps(seen: list[tuple[float, str]]) -> list[tuple[int, int]]:
    """(done, total) of each progress message of kvdemo's ("Progress <what>: Step <done> of <total>")."""
    return [tuple(map(int, m.groups())) for _, text in seen if (m := re.search(r": Step (\d+) of (\d+)$", text))]


def test_progress_keeps_a_client_alive_past_its_timeout(mcp_url, tiny, normans):
    url, _ = mcp_url
    context = normans.select("0").context
    arguments = {"questions": QUESTIONS, "specs": ["hqq:4", "fp8"], "max_new_tokens": 96, "context": context}
    out = anyio.run(_call, url, "compare_backends", arguments | {"session": "alive"}, 3.0)
    assert "timed_out" not in out and not out["result"].isError, out
    assert out["seconds"] > 3.0  # it outlived the client's timeout
    times = [0.0] + [at for at, _ in out["seen"]]
    assert max(b - a for a, b in zip(times, times[1:])) < 3.0
    steps = _steps(out["seen"])
    assert steps[-1] == (15, 15)  # 3 specs x (a prefill, 2 answers, 2 scores): each unit really done
    assert [done for done, _ in steps] == sorted(done for done, _ in steps) and len(steps) >= 3
    report = json.loads(out["result"].content[0].text)
    assert len(report["results"]) == 3
    for row, text in zip(report["results"], ["dynamic", "hqq:4", "fp8"]):
        alone = QASession(tiny, CacheSpec.parse(text))
        alone.prefill(context)
        assert row["answers"] == [alone.ask(question, 96).text for question in QUESTIONS]


def test_a_client_that_leaves_frees_the_comparison_slot(mcp_url, tiny, normans, monkeypatch, caplog):
    url, app = mcp_url
    monkeypatch.setattr(mcp_tools, "MCP_COMPARE_SECONDS", 90.0)  # were the leaving not heard, the bound would end it
    context = normans.select("0").context
    long = {"questions": QUESTIONS * 4, "max_new_tokens": 256, "context": context, "session": "leaver"}
    short = {"questions": QUESTIONS[:1], "specs": ["fp8"], "max_new_tokens": 2, "context": context, "session": "next"}

    async def both() -> tuple[dict, dict, float]:
        left = await _call(url, "compare_backends", long, 60.0, leave_on="dynamic: answer")
        sent = time.monotonic()
        return left, await _call(url, "compare_backends", short, 60.0), sent

    with caplog.at_level(logging.INFO, logger="kvdemo.ui.mcp_calls"):
        left, second, sent = anyio.run(both)
    assert "left" in left and "result" not in left  # it left 1 unit into a comparison of 6 specs x 17 units
    assert not second["result"].isError and second["seconds"] < 8.0, second
    assert "an MCP client left its call (cancelled); stopping its tool" in caplog.text
    assert not app.sessions.peek("mcp:leaver").compare_lock.locked()  # its comparison ended
    report = json.loads(second["result"].content[0].text)
    alone = QASession(tiny, CacheSpec("fp8"))
    alone.prefill(context)
    assert [row["spec"] for row in report["results"]] == ["dynamic", "fp8"] and report["note"] == ""
    assert report["results"][1]["answers"] == [alone.ask(QUESTIONS[0], 2).text]


def test_prefill_and_answer_report_their_tokens(tiny, normans, monkeypatch):
    """What the tools hand their progress (the relay, recorded here): the prefill's chunks and the answer's decode
    steps. (On the tiny model both end within Gradio's 10 ms between progress messages, so the client may hear
    none: the comparison above shows the way to the client.)"""
    relayed = []
    record = lambda done, total, what: relayed.append((done, total, what))
    monkeypatch.setattr(mcp_tools, "ProgressRelay", lambda: record)
    app = App(loader=lambda source: tiny)
    app.start_loading()
    tools = mcp_tools.McpTools(app)
    context = normans.select("0").context
    prefilled = json.loads(tools.prefill_context(context, "fp8", "p"))
    tokens = prefilled["context_tokens"]
    assert relayed == [(tokens, tokens, f"prefilling {tokens} of {tokens} tokens")]  # one chunk of 256 or fewer
    assert prefilled["deploy"][0].startswith('transformers: model.generate(..., cache_implementation="quantized"')
    relayed.clear()
    answer = json.loads(tools.ask_question(QUESTIONS[0], 64, "p"))
    alone = QASession(tiny, CacheSpec("fp8"))
    alone.prefill(context)
    assert answer["answer"] == alone.ask(QUESTIONS[0], 64).text and answer["tokens"] == 64
    assert relayed == [(0, 64, "answering: the question's forward pass")] + [
        (n, 64, "answering: tokens decoded") for n in range(1, 65)
    ]


def test_a_comparison_notes_every_block_of_decode_steps(tiny):
    notes = []
    compare(tiny, "The Normans held Rouen.", ["Who?"], [], 32, on_progress=lambda *a: notes.append(a))
    answering = [what for done, _, what in notes if done == 1 and "answering" in what]
    assert answering == [f"dynamic: answering 1/1, {n} tokens" for n in (8, 16, 24, 32)]  # every TOKEN_BLOCK steps
    assert (2, 3, "dynamic: scoring 1/1, 8 tokens") in notes and notes[-1] == (3, 3, "dynamic: scored 1/1")


def test_progress_relay_forwards_units_at_most_once_per_interval():
    sent = []
    relay = ProgressRelay(lambda progress, desc, unit: sent.append((progress, desc)), every=3600.0)
    for done, what in [(0, "a"), (1, "b"), (1, "c"), (4, "d")]:
        relay(done, 4, what)
    assert sent == [((0, 4), "a"), ((4, 4), "d")]  # the first, then the end (always)


def test_a_call_that_left_is_stopped_when_it_starts_or_at_once():
    class Request:
        def __init__(self, call):
            self.headers = {CALL_HEADER: call}

    calls, stops = McpCalls(remember=2), []
    calls.abandon("queued", "cancelled")  # left while it waited in the queue
    with calls.watching(Request("queued"), lambda: stops.append("queued")) as gone:
        assert stops == ["queued"] and gone() == "cancelled"
    with calls.watching(Request("running"), lambda: stops.append("running")) as gone:
        assert gone() is None
        calls.abandon("running", "ClosedResourceError while relaying progress")
        assert stops == ["queued", "running"] and gone() == "ClosedResourceError while relaying progress"
    with calls.watching(None, lambda: stops.append("direct")) as gone:  # not through the bridge
        assert gone() is None
    for call in ("x", "y", "z"):
        calls.abandon(call, "cancelled")
    assert calls._gone == {"y": "cancelled", "z": "cancelled"}  # bounded
