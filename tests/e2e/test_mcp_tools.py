"""The app's MCP tools (`kvdemo.ui.mcp_tools`) on a running app with `mcp_server=True`: the schema endpoint lists
exactly the typed tools with their docstrings' descriptions; an MCP client (the `mcp` package, over Gradio's
streamable HTTP transport and its SSE transport) calls them, and each named session answers as the same session
run alone; bad input comes back as an MCP error carrying the app's message."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from gradio_client import Client
from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

from kvdemo import CacheSpec, QASession
from kvdemo.ui.ask_widgets import START_SPEC
from kvdemo.ui.mcp_tools import TOOLS


def _mcp(url: str, calls: list[tuple[str, dict]], transport: str = "http") -> tuple[list, list]:
    """(tool names, one CallToolResult per call) from one MCP client session."""

    async def run():
        connect = (
            streamable_http_client(url + "gradio_api/mcp/")
            if transport == "http"
            else sse_client(url + "gradio_api/mcp/sse")
        )
        async with connect as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                tools = (await session.list_tools()).tools
                results = [await session.call_tool(name, arguments) for name, arguments in calls]
                return tools, results

    return asyncio.run(run())


def _text(result) -> str:
    return "".join(part.text for part in result.content)


def test_the_schema_lists_the_typed_tools_with_their_descriptions(mcp_app):
    url, _, served = mcp_app
    assert served == sorted(TOOLS)
    with urllib.request.urlopen(url + "gradio_api/mcp/schema", timeout=30) as response:
        schema = {tool["name"]: tool for tool in json.load(response)}
    assert sorted(schema) == sorted(TOOLS)  # the tabs' endpoints (prefill, ask, stop, ...) are no tools
    prefill, ask, compare = (schema[name] for name in ("prefill_context", "ask_question", "compare_backends"))
    assert prefill["description"].startswith("Prefill a text once into a new KV cache of the chosen backend")
    assert ask["description"].startswith("Answer a question about the text prefilled by prefill_context")
    assert compare["description"].startswith("Compare KV cache backends on one text")
    properties = prefill["inputSchema"]["properties"]
    assert properties["context"]["type"] == properties["spec"]["type"] == properties["session"]["type"] == "string"
    assert properties["spec"]["default"] == START_SPEC.text  # the Ask tab's starting spec
    assert properties["spec"]["description"].startswith("the KV cache, backend[:nbits][,option=value...]")
    assert prefill["inputSchema"]["required"] == ["context"]
    assert ask["inputSchema"]["properties"]["max_new_tokens"] == {
        "type": "integer",
        "default": 64,
        "description": "the most tokens the answer may have (>= 1; it also ends at the end-of-turn token)",
    }
    assert compare["inputSchema"]["properties"]["questions"]["type"] == "array"
    assert compare["inputSchema"]["properties"]["questions"]["items"] == {"type": "string"}
    # the tabs' endpoints are still there for gradio_client
    endpoints = Client(url, verbose=False).view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert {"/prefill", "/ask", "/compare", *(f"/{name}" for name in TOOLS)} <= set(endpoints)


def test_an_mcp_client_prefills_and_asks_in_its_own_session(mcp_app, tiny, normans):
    url, _, _ = mcp_app
    contexts = {"alice": normans.select("0").context, "bob": normans.select("1").context}
    specs = {"alice": "hqq:4,residual_length=4", "bob": "dynamic"}
    question = normans.select("0").answerable(1)[0].question
    calls = [
        ("prefill_context", {"context": contexts[name], "spec": specs[name], "session": name})
        for name in ("alice", "bob")
    ]
    calls += [
        ("ask_question", {"question": question, "max_new_tokens": 6, "session": name}) for name in ("alice", "bob")
    ]
    tools, results = _mcp(url, calls)
    assert sorted(tool.name for tool in tools) == sorted(TOOLS)
    assert not any(result.isError for result in results), [_text(r) for r in results]
    prefilled = [json.loads(_text(r)) for r in results[:2]]
    answers = [json.loads(_text(r)) for r in results[2:]]
    for name, info, answer in zip(("alice", "bob"), prefilled, answers):
        alone = QASession(tiny, CacheSpec.parse(specs[name]))
        tokens = alone.prefill(contexts[name]).context_tokens
        expected = alone.ask(question, 6)
        assert info["context_tokens"] == tokens and info["spec"] == specs[name]
        assert answer["answer"] == expected.text and answer["tokens"] == len(expected.token_ids)
        assert answer["cache_length_after"] == tokens and answer["flushes"] == expected.flush_count


def test_bad_input_comes_back_as_an_mcp_error_with_the_apps_message(mcp_app):
    url, _, _ = mcp_app
    _, results = _mcp(
        url,
        [
            ("ask_question", {"question": "Who?", "session": "nobody-prefilled"}),
            ("prefill_context", {"context": "Some text.", "spec": "hqq:9", "session": "x"}),
            ("prefill_context", {"context": "   ", "session": "x"}),
            ("prefill_context", {"context": "Some text.", "session": "a b"}),
            ("compare_backends", {"questions": [], "session": "x"}),
        ],
    )
    assert all(result.isError for result in results)
    messages = [_text(result) for result in results]
    assert "Nothing is prefilled in this session: call prefill_context first" in messages[0]
    assert "nbits=9 is not allowed for hqq; allowed: 1, 2, 3, 4, 8" in messages[1]
    assert "the context is empty; paste or upload the text to ask about" in messages[2]
    assert "session='a b' must be 1-64 letters, digits" in messages[3]
    assert "questions must be a list of 1-20 question texts" in messages[4]


def test_compare_over_the_sse_transport(mcp_app, tiny, normans):
    url, _, _ = mcp_app
    paragraph = normans.select("0")
    question = paragraph.answerable(1)[0].question
    tools, results = _mcp(
        url,
        [
            (
                "compare_backends",
                {"questions": [question], "specs": ["hqq:4"], "max_new_tokens": 4, "context": paragraph.context},
            )
        ],
        transport="sse",
    )
    assert sorted(tool.name for tool in tools) == sorted(TOOLS)
    assert not results[0].isError, _text(results[0])
    report = json.loads(_text(results[0]))
    specs = [CacheSpec.parse(text) for text in ("dynamic", "hqq:4")]
    assert [row["spec"] for row in report["results"]] == [spec.label for spec in specs]
    for row, spec in zip(report["results"], specs):
        alone = QASession(tiny, spec)
        assert row["KV bytes"] == alone.prefill(paragraph.context, max_new_tokens=4).kv_bytes
        assert row["answers"] == [alone.ask(question, 4).text]
    assert report["scored_against_gold"] is True  # a paragraph of a shipped example with one of its questions


def test_one_call_runs_no_longer_than_its_stated_bound(mcp_app, tiny, monkeypatch):
    """Issue 23, item 1: a streamable HTTP client that sends `notifications/cancelled` and keeps its connection
    never reaches a Gradio tool (the stateless transport cannot match it to the call; a client that leaves does:
    `kvdemo.ui.mcp_calls`), so each call is bounded too, as its description says: an answer past
    `MCP_ANSWER_SECONDS` ends after its current decode step (stopped, the cache restored, the next call served),
    a comparison past `MCP_COMPARE_SECONDS` returns the specs finished so far. Bounds of 0.3 s here."""
    from kvdemo.ui import mcp_tools

    url, _, _ = mcp_app
    monkeypatch.setattr(mcp_tools, "MCP_ANSWER_SECONDS", 0.3)
    monkeypatch.setattr(mcp_tools, "MCP_COMPARE_SECONDS", 0.3)
    context = "The Normans held Rouen. Rollo led them."
    specs = ["hqq:4,residual_length=2", "quanto:4,residual_length=2", "fp8"]
    tools, results = _mcp(
        url,
        [
            ("prefill_context", {"context": context, "spec": "hqq:4,residual_length=4", "session": "slow"}),
            ("ask_question", {"question": "Tell me all you know.", "max_new_tokens": 400, "session": "slow"}),
            ("ask_question", {"question": "Who led them?", "max_new_tokens": 3, "session": "slow"}),
            ("compare_backends", {"questions": ["Who?"] * 4, "specs": specs, "max_new_tokens": 64, "context": context}),
        ],
    )
    assert not any(result.isError for result in results), [_text(r) for r in results]
    described = {tool.name: tool.description for tool in tools}
    assert "at most 30 seconds" in described["ask_question"] and "at most 300 seconds" in described["compare_backends"]
    prefilled, long, short, compared = (json.loads(_text(r)) for r in results)
    assert long["finish_reason"] == "stopped" and 0 < long["tokens"] < 400
    assert long["note"] == "stopped at this tool's bound of 0.3 s per call; ask with a lower max_new_tokens, or again"
    assert long["cache_length_after"] == prefilled["context_tokens"]  # restored as after any answer
    alone = QASession(tiny, CacheSpec.parse("hqq:4,residual_length=4"))
    alone.prefill(context)
    assert short["answer"] == alone.ask("Who led them?", 3).text and short["note"] == ""  # served next, unchanged
    assert compared["note"].startswith("stopped at this tool's bound of 0.3 s per call; the finished specs follow")
    assert len(compared["results"]) < 1 + len(specs)  # dynamic first, then the specs done within the bound
