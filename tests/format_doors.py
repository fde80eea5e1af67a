"""A format copied under a new name, run through every door: run by `tests/test_format_folder.py` in a child process
whose `kvdemo` is a temporary copy of the package with one format's folder copied under `sys.argv[1]` and that name
added to the registry's `FORMATS`, nothing else edited. Prints one JSON object of what each door gave, beside the same
calls on the original format (`sys.argv[2]`), which the test compares.

`python -m tests.format_doors NEW ORIGINAL CONTEXT_FILE SESSION_FILE`, from the copy's folder, with the project's root
on PYTHONPATH after it (for `tests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
from pathlib import Path

MAX_NEW_TOKENS = 6
QUESTION = "Who led the Normans?"


def _cli(argv: list[str]) -> tuple[int, str]:
    """`python -m kvdemo <argv>` in this process: (exit status, stdout)."""
    from kvdemo.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    return status, out.getvalue()


def _page_and_mcp(new: str, context: str) -> dict:
    """The page's `/prefill` and `/ask` through gradio_client, and the MCP tool `prefill_context` then `ask_question`,
    on one server of the embedded model."""
    from gradio_client import Client
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from kvdemo.serve.server import App
    from kvdemo.ui.mcp_tools import serve_only_tools
    from tests.e2e.conftest import serve

    app = App(recommended_start=False)
    demo, url = serve(app, mcp_server=True, show_error=True)
    serve_only_tools(demo)
    app.wait_for_model()
    client = Client(url, verbose=False)
    choices = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/prefill"]["parameters"][1]
    summary = client.predict(context, new, 4, None, None, None, None, api_name="/prefill")[0]
    chat = client.predict(QUESTION, MAX_NEW_TOKENS, context, api_name="/ask")[0]
    content = chat[-1]["content"]
    page_answer = content if isinstance(content, str) else "".join(part["text"] for part in content)

    async def mcp() -> list[str]:
        async with streamable_http_client(url + "gradio_api/mcp/") as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                calls = [
                    ("prefill_context", {"context": context, "spec": f"{new}:4", "session": "copy"}),
                    ("ask_question", {"question": QUESTION, "max_new_tokens": MAX_NEW_TOKENS, "session": "copy"}),
                ]
                results = [await session.call_tool(name, arguments) for name, arguments in calls]
                return ["".join(getattr(part, "text", "") for part in result.content) for result in results]

    prefilled, answered = asyncio.run(mcp())
    demo.close()
    return {
        "page_backend_choices": json.dumps(choices.get("type", choices)),
        "page_summary": summary,
        "page_answer": page_answer,
        "mcp_prefill": prefilled,
        "mcp_answer": answered,
    }


def main(new: str, original: str, context_file: str, session_file: str) -> dict:
    """Every door's result for the copied format `new` and, where the test compares, for `original`."""
    import kvdemo
    from kvdemo import CacheSpec, QASession
    from kvdemo.cache.registry import BACKENDS
    from kvdemo.compare.candidates import candidate_specs
    from kvdemo.qa.models import load_model
    from kvdemo.qa.session_file import open_session, save_session

    context = Path(context_file).read_text(encoding="utf-8")
    loaded = load_model()
    answers, kv_bytes = {}, {}
    for name in (new, original):
        session = QASession(loaded, CacheSpec.parse(f"{name}:4"))
        kv_bytes[name] = session.prefill(context).kv_bytes
        answers[name] = session.ask(QUESTION, MAX_NEW_TOKENS).token_ids
        if name == new:
            save_session(session, session_file)
    reopened = open_session(loaded, session_file)
    values = [v for layer in reopened.cache.layers for v in vars(layer).values()]
    values += [item for v in values if type(v) is list for item in v]  # an `append` store's blocks
    stored = {type(v).__module__ for v in values if isinstance(v, tuple) and type(v) is not tuple}  # its records
    status, out = _cli(
        ["ask", "--backend", new, "--nbits", "4", "--context-file", context_file, "--question", QUESTION]
        + ["--max-new-tokens", str(MAX_NEW_TOKENS), "--json"]
    )
    compared, table = _cli(
        ["compare", "--context-file", context_file, "--question", QUESTION, "--spec", f"{new}:4"]
        + ["--max-new-tokens", str(MAX_NEW_TOKENS), "--json"]
    )
    return {
        "package": str(Path(kvdemo.__file__).parent),
        "formats": list(BACKENDS),
        "session": answers[new],
        "original": answers[original],
        "kv_bytes": kv_bytes,
        "text": loaded.tokenizer.decode(answers[original]),
        "reopened": reopened.ask(QUESTION, MAX_NEW_TOKENS).token_ids,
        "reopened_spec": reopened.spec.text,
        "stored_modules": sorted(stored),
        "ask_status": status,
        "ask": json.loads(out) if status == 0 else out,
        "compare_status": compared,
        "compare": json.loads(table) if compared == 0 else table,
        "candidates": [spec.text for spec in candidate_specs(loaded.config) if spec.backend == new],
        "original_candidates": [spec.text for spec in candidate_specs(loaded.config) if spec.backend == original],
        **_page_and_mcp(new, context),
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
