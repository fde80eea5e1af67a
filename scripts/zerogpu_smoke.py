"""The smoke test a maintainer runs on a real ZeroGPU Space (or any running kvdemo app) with gradio_client: the page's
own endpoints, as a browser calls them: a prefill of the Normans example, three questions, a Stop in the middle of a
fourth answer, and a comparison. It prints what each took and what came back, as a Markdown table to paste into
docs/space.md, and exits 1 when something is wrong (an answer that did not restore its cache, a Stop that did not
stop, a comparison that did not finish).

    python scripts/zerogpu_smoke.py https://<user>-<space>.hf.space          # a Space (public, or HF_TOKEN set)
    python scripts/zerogpu_smoke.py http://127.0.0.1:7860 --json out.json   # any running app

On ZeroGPU each of these calls is one or more `@spaces.GPU` jobs (`kvdemo.serve.gpu_job`): the first pays the worker's
start (the fork, CUDA, the model moved to the GPU), the others show the GPU's speed, and the answers' `warm` state
shows in the Space's log. `tests/test_zerogpu_app.py` runs this script against the app under a forking stand-in
`spaces` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPEC_FIELDS = {"backend": "hqq", "nbits": 4, "q_group_size": 64, "residual_length": 16, "axis_key": 0, "axis_value": 0}
"""The cache the smoke test prefills: hqq 4-bit, a flush every 16 tokens (every part of the step path runs)."""
QUESTIONS = ("Who was the Norse leader?", "In what country is Normandy located?", "When were the Normans in Normandy?")
MAX_NEW_TOKENS = 16
STOP_TOKENS = 200
"""The answer stopped after its first decode steps: long enough that only the Stop can end it early."""


def _text(message: Any) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def normans_context() -> str:
    """Paragraphs 0-2 of the shipped Normans article (SQuAD 2.0, CC BY-SA 4.0): about 500 tokens."""
    case = json.loads((ROOT / "kvdemo" / "data" / "cases" / "normans.json").read_text(encoding="utf-8"))
    return "\n\n".join(case["paragraphs"][:3])


def _ask(client: Any, question: str, context: str, max_new_tokens: int, stop_after: int = 0) -> dict[str, Any]:
    """One question through `/ask`, streamed; `stop_after` > 0 presses `/stop` once that many steps have shown."""
    start = time.perf_counter()
    job = client.submit(question, max_new_tokens, context, api_name="/ask")
    first, stopped_at = None, None
    for update in job:
        line = str(update[1] or "")
        if first is None and line.startswith("step "):
            first = time.perf_counter() - start
        step = re.match(r"step (\d+)", line)
        if stop_after and stopped_at is None and step and int(step.group(1)) >= stop_after:
            client.predict(api_name="/stop")
            stopped_at = int(step.group(1))
    outputs = job.outputs()
    chat, stats = outputs[-1][0], str(outputs[-1][1])
    tokens = re.match(r"([\d,]+) tokens?", stats)
    decode = re.search(r"decode ([\d.,]+) tokens/s", stats)
    return {
        "question": question,
        "answer": _text(chat[-1]),
        "tokens": int(tokens.group(1).replace(",", "")) if tokens else 0,
        "seconds": round(time.perf_counter() - start, 2),
        "first_step_seconds": None if first is None else round(first, 2),
        "decode_tokens_per_second": float(decode.group(1).replace(",", "")) if decode else None,
        "stopped": "· stopped ·" in stats,
        "restored": "(context)**" in stats,
        "line": stats,
    }


def smoke(url: str, token: str | None = None) -> dict[str, Any]:
    """Run the smoke test against the app at `url`; returns every figure and answer (see the module docstring)."""
    from gradio_client import Client

    client = Client(url, token=token, verbose=False, analytics_enabled=False)
    context = normans_context()
    out: dict[str, Any] = {"url": url, "spec": SPEC_FIELDS}
    start = time.perf_counter()
    prefill = client.predict(context, *SPEC_FIELDS.values(), api_name="/prefill")
    out["prefill"] = {"seconds": round(time.perf_counter() - start, 2), "line": str(prefill[0]), "notice": prefill[7]}
    tokens = re.search(r"(?:Prefilled|Opened) \*\*([\d,]+)", str(prefill[0]))
    out["context_tokens"] = int(tokens.group(1).replace(",", "")) if tokens else None
    out["answers"] = [_ask(client, question, context, MAX_NEW_TOKENS) for question in QUESTIONS]
    out["stop"] = _ask(client, "Tell me everything the text says about the Normans.", context, STOP_TOKENS, 3)
    start = time.perf_counter()
    compared = client.predict(context, ["fp8"], "", QUESTIONS[0], 8, 0, api_name="/compare")
    out["compare"] = {"seconds": round(time.perf_counter() - start, 2), "status": str(compared[0])}
    out["problems"] = problems(out)
    return out


def problems(out: dict[str, Any]) -> list[str]:
    """What went wrong in a smoke run (empty when nothing did)."""
    found = [] if out["context_tokens"] else [f"the prefill did not finish: {out['prefill']}"]
    for answer in out["answers"]:
        if not answer["restored"] or answer["stopped"] or not answer["answer"]:
            found.append(f"{answer['question']!r}: {answer['line']}")
    stop = out["stop"]
    if not (stop["stopped"] and stop["restored"] and stop["tokens"] < STOP_TOKENS):
        found.append(f"the Stop did not stop the answer: {stop['line']}")
    if not out["compare"]["status"].startswith("Compared 2 specs"):
        found.append(f"the comparison did not finish: {out['compare']['status']}")
    return found


def table(out: dict[str, Any]) -> str:
    """The figures as a Markdown table for docs/space.md."""
    rows = [("prefill", f"{out['context_tokens']} tokens", out["prefill"]["seconds"], "")]
    for answer in [*out["answers"], out["stop"]]:
        speed = answer["decode_tokens_per_second"]
        what = "stopped" if answer["stopped"] else f"{answer['tokens']} tokens"
        rows.append((f"ask: {answer['question'][:40]}", what, answer["seconds"], f"{speed} tokens/s" if speed else ""))
    rows.append(("compare (dynamic, fp8; 1 question, 8 tokens)", "", out["compare"]["seconds"], ""))
    lines = ["| step | result | seconds | decode |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the Space's or app's URL")
    parser.add_argument("--json", help="also write every figure and answer to this file")
    args = parser.parse_args(argv)
    out = smoke(args.url, os.environ.get("HF_TOKEN"))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, ensure_ascii=False), encoding="utf-8")
    print(table(out))
    for problem in out["problems"]:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
