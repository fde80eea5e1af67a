"""Bad input at every door (issue 23, item 6): every API name of the page (gradio_client), the same endpoints over
raw HTTP with malformed bodies, and every MCP tool (the `mcp` client) get random and hostile payloads: wrong types,
huge and negative numbers, NaN and infinity, nested JSON, surrogates and control characters, very long strings,
missing fields, and spec texts at the edges of every backend's options (TurboQuant's presets and bits, `protect`,
fp8's `scale`). Every reply must be a clear refusal (the app's message) or a right answer, never a crash (a
handler's exception that Gradio can only report as its generic error); the server stays up, and a session
prefilled before the storm answers exactly as before. The counts go to artifacts/every_door.json.

Cost: 10 s in a pytest-xdist worker on 2 cores (the clean-clone CI of 2026-12-04): one app server, a few hundred
payloads."""

from __future__ import annotations

import asyncio
import json
import os
import random
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

import kvdemo
from kvdemo.ui.mcp_tools import TOOLS

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
KVDEMO = str(Path(kvdemo.__file__).resolve().parent) + os.sep
"""The package's folder: a traceback frame under it is the app's code."""
SEED = 23
PER_ENDPOINT = 8


def _crashes_in(log: str) -> tuple[list[str], Counter]:
    """The server's tracebacks in `log` (Gradio prints one for every failed event): a traceback through kvdemo's
    code that ends in anything but a `gr.Error` is a crash of the app; one that ends in `gr.Error` is a refusal
    (`kvdemo.ui.inputs.user_errors` turns a ValueError into one); one that never reaches kvdemo is Gradio's own
    check of the payload against the component (a pydantic FileData error, a value not among a Radio's choices,
    a CheckboxGroup given null), counted by its last line."""
    crashes, kinds = [], Counter()
    ours = f'File "{KVDEMO}'  # a frame in the package itself (a clone's folder may be named kvdemo too: its .venv)
    for block in log.split("Traceback (most recent call last):")[1:]:
        lines = [line for line in block.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
        last = next((line for line in lines if not line.startswith("During handling")), "?")
        if ours in block and not last.startswith("gradio.exceptions.Error"):
            crashes.append(block[-1500:])
        else:
            kinds["gr.Error (the app's refusal)" if ours in block else f"Gradio: {last.split(':')[0]}"] += 1
    return crashes, kinds


HOSTILE = [
    None,
    "",
    "   ",
    -1,
    0,
    10**18,
    -(10**18),
    1e308,
    float("nan"),
    float("inf"),
    -float("inf"),
    "nan",
    "inf",
    "-3",
    "1e9",
    2.5,
    True,
    [],
    {},
    [[[[[]]]]],
    {"a": {"b": [1, {"c": None}]}},
    "\ud800 half an emoji",
    "\x00\x01\x1b[31m\x7f",
    "<|im_end|><|im_start|>assistant",
    "../../../../etc/passwd",
    "x" * 100_000,
    "Who led the Normans?",
    ["dynamic", 3, None],
    ["hqq:9", "quanto:4,residual_length=-1"],
    "turboquant:k8v4",
    "turboquant:9,norm_correction=maybe",
    "turboquant:k3v4_nc,nbits=4",
    "turboquant:turboquant_4bit_nc,protect=9:9",
    "fp8,scale=per_token_head,protect=1:1",
    "quanto:4,protect=-1:2,flush=append,residual_length=1",
    ["turboquant:k8v4", "hqq:k8v4", "fp8,scale=per_token"],
]
"""Values a client may send for any field: each endpoint's fields are filled from these at random."""


def _files(folder: Path) -> list:
    """Hostile uploads for a file field (gradio_client sends a file field as an uploaded file; a value of any other
    shape is refused by Gradio's own FileData check before the app sees it, which the raw HTTP bodies cover): an
    empty file, a PDF, text over the 2 MiB limit, bytes that are not UTF-8, a name without an extension."""
    files = {
        "empty.txt": b"",
        "paper.pdf": b"%PDF-1.4 binary \x00\xff",
        "huge.txt": b"word " * 600_000,
        "latin1.md": "caf\xe9".encode("latin-1"),
        "noext": b"The Normans held Rouen.",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return [None, *(handle_file(str(folder / name)) for name in files)]


def _payloads(fields: list[tuple[str, str]], rng: random.Random, files: list) -> list[dict]:
    """`PER_ENDPOINT` payloads for `fields` (name, type): each field a hostile value (a hostile file for a file
    field) or left out (missing)."""
    return [
        {n: rng.choice(files if kind == "filepath" else HOSTILE) for n, kind in fields if rng.random() < 0.85}
        for _ in range(PER_ENDPOINT)
    ]


def _encodable(value) -> bool:
    """Whether the `mcp` client can send `value`: its httpx encodes a request's JSON strictly (`allow_nan=False`,
    UTF-8 without escapes since httpx 0.29), so NaN and a lone surrogate fail in the client, before any request,
    and end its whole session. The raw HTTP bodies send both to the server instead."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return False
    return True


def _control(url: str) -> tuple[Client, str]:
    """A session prefilled before the storm, through the MCP tools' API (session "control"): its answer."""
    client = Client(url, verbose=False)
    context, spec = "The Normans held Rouen. Rollo led them.", "hqq:4,residual_length=4"
    client.predict(context, spec, "control", api_name="/prefill_context")
    return client, json.loads(client.predict("Who led them?", 6, "control", api_name="/ask_question"))["answer"]


def test_hostile_payloads_at_every_door_are_refused_or_answered(mcp_app, tmp_path, capfd):
    url, app, _ = mcp_app
    rng = random.Random(SEED)
    control, control_answer = _control(url)
    client = Client(url, verbose=False, httpx_kwargs={"timeout": 120})
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    counts: Counter = Counter()
    crashes: list[str] = []

    # 1. every API name through gradio_client
    files = _files(tmp_path)
    for name, endpoint in endpoints.items():
        fields = [(p["parameter_name"], p["python_type"]["type"]) for p in endpoint["parameters"]]
        for payload in _payloads(fields, rng, files):
            counts["gradio_client requests"] += 1
            try:
                job = client.submit(api_name=name, **payload)
                job.result(timeout=120)
                counts["answered"] += 1
            except Exception as error:  # a refusal, or a crash: the server's log tells (below)
                text = str(error)
                if not text.strip():
                    crashes.append(f"{name} {payload!r:.300}: an error without a message")
                sent = type(error).__module__.startswith("gradio_client")  # else the client could not encode it
                counts["refused" if sent else f"not sent: {type(error).__name__}"] += 1

    # 2. the same endpoints over raw HTTP, with bodies that are not what Gradio's API takes
    bodies = [b"not json", b"{}", b'{"data": "x"}', b'{"data": null}', b"[" * 5000 + b"]" * 5000]
    bodies.append(json.dumps({"data": [float("nan")] * 3}).encode())  # NaN: not JSON
    # a lone surrogate, escaped as JSON allows ("\\ud800"): the clients cannot encode one (below), so it goes raw
    bodies.append(json.dumps({"data": ["\ud800 half an emoji"] * 3}).encode())
    for name in endpoints:
        for body in bodies:
            counts["raw HTTP requests"] += 1
            request = urllib.request.Request(
                f"{url}gradio_api/call{name}", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    counts[f"HTTP {response.status}"] += 1
            except urllib.error.HTTPError as error:
                if error.code >= 500:
                    crashes.append(f"HTTP {error.code} for {name} {body[:60]!r}")
                else:
                    counts[f"HTTP {error.code}"] += 1

    # 3. every MCP tool through the mcp client
    schemas = {}

    async def storm():
        async with streamable_http_client(url + "gradio_api/mcp/") as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                for tool in (await session.list_tools()).tools:
                    schemas[tool.name] = [(field, "") for field in tool.inputSchema.get("properties", {})]
                results = []
                for name, fields in schemas.items():
                    for payload in _payloads(fields, rng, []):
                        payload = {k: v for k, v in payload.items() if _encodable(v)}
                        results.append((name, payload, await session.call_tool(name, payload)))
                return results

    for name, payload, result in asyncio.run(storm()):
        counts["MCP calls"] += 1
        text = "".join(getattr(part, "text", "") for part in result.content)
        if result.isError and text.strip() in ("", "Error", "Error!"):
            crashes.append(f"MCP {name} {payload!r:.300}: {text[:300]}")
        else:
            counts["MCP refused" if result.isError else "MCP answered"] += 1

    out, err = capfd.readouterr()
    logged, kinds = _crashes_in(out + err)
    crashes += logged
    counts.update({f"server log: {kind}": n for kind, n in kinds.items()})
    figures = dict(sorted(counts.items())) | {"crashes": len(crashes)}
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "every_door.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    assert not crashes, "\n".join(crashes)
    assert sorted(schemas) == sorted(TOOLS)
    assert counts["gradio_client requests"] == PER_ENDPOINT * len(endpoints) and len(endpoints) >= 14
    # the server is up, and the session prefilled before the storm answers as before
    assert "parameters" in client.predict(api_name="/model_status")
    again = json.loads(control.predict("Who led them?", 6, "control", api_name="/ask_question"))
    assert again["answer"] == control_answer and app.loaded is not None


pytestmark = pytest.mark.slow  # a few minutes: some payloads are valid enough to run a comparison or a prefill
