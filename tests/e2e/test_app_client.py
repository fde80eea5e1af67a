"""The app launched on a free port and driven with gradio_client: the answers equal QASession's, and the
streamed updates arrive before the answer ends.

Cost: 66 s for 4 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gradio_client import Client

from kvdemo import CacheSpec, QASession
from kvdemo.cache.spec import estimate_kv_bytes
from kvdemo.charts.reports import comparison_display_frame
from kvdemo.ui.examples import example

HQQ = CacheSpec("hqq", nbits=4, q_group_size=64, residual_length=16, axis_key=0, axis_value=0)


@pytest.fixture(scope="module")
def client(app_url):
    return Client(app_url, verbose=False)


def _assistant_text(message) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def test_api_names(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/load_model", "/prefill", "/ask", "/stop", "/model_status"} <= names


def test_load_prefill_and_ask_equal_the_core_session(client, embedded):
    assert "SmolLM2-135M-Instruct (embedded GGUF Q4_1)" in client.predict("", api_name="/load_model")
    context, questions = example("Normans")
    questions = ["Who was the Norse leader?", questions[0]]
    summary = client.predict(
        context=context,
        backend="hqq",
        nbits=4,
        q_group_size=64,
        residual_length=16,
        axis_key=0,
        axis_value=0,
        api_name="/prefill",
    )[0]
    reference = QASession(embedded, HQQ)
    tokens = reference.prefill(context).context_tokens
    assert f"Prefilled **{tokens:,} tokens**" in summary and "0.156×" in summary

    for question in questions:
        job = client.submit(question=question, max_new_tokens=12, context=context, api_name="/ask")
        arrivals = []
        for _update in job:
            arrivals.append(time.perf_counter())
        done = time.perf_counter()
        outputs = job.outputs()
        chat, stats = outputs[-1][0], outputs[-1][1]
        expected = reference.ask(question, 12)
        assert _assistant_text(chat[-1]) == expected.text
        assert f"cache length after restore = {tokens:,} (context)" in stats
        assert len(outputs) >= 3 and arrivals[0] < done  # streamed: updates came before the end
        assert outputs[0][1].startswith("reading the question (") and "step 1 ·" in outputs[1][1]

    summary = client.predict(context, "fp8", None, None, None, None, None, api_name="/prefill")[0]
    # a quarter of full precision, and fp8's 60 float32 scales (240 bytes) beside the codes
    ratio = estimate_kv_bytes(CacheSpec("fp8"), embedded.config, tokens, embedded.dtype) / (46_080 * tokens)
    assert "with **fp8**" in summary and f"{ratio:.3f}×" in summary and 0.25 < ratio < 0.2501
    job = client.submit(questions[0], 12, context, api_name="/ask")
    job.result()
    fp8 = QASession(embedded, CacheSpec("fp8"))
    fp8.prefill(context)
    assert _assistant_text(job.outputs()[-1][0][-1]) == fp8.ask(questions[0], 12).text


def test_refusals_reach_the_client_with_their_message(client):
    notice = client.predict("Some context.", "quanto", 3, 64, 16, 0, 0, api_name="/prefill")[7]
    assert notice.startswith("⚠ nbits=3 is not allowed for quanto; allowed: 2, 4")
    notice = client.predict("   ", "fp8", None, None, None, None, None, api_name="/prefill")[7]
    assert notice.startswith("⚠ the context is empty")
    # an answer over a context the page no longer shows is refused, also through the API
    client.predict("Rollo led the Normans.", "fp8", None, None, None, None, None, api_name="/prefill")
    stats = client.predict("Who led them?", 4, "Another text.", api_name="/ask")[1]
    assert stats.startswith("⚠ The Context box has changed since the prefill")


def test_compare_tab_through_the_client(client, embedded):
    from kvdemo.compare.run import compare
    from kvdemo.evals.cases import example_path, load_case

    case = load_case(example_path("normans")).select("0")
    question = case.answerable(1)[0]
    client.predict(
        context=case.context,
        backend="fp8",
        nbits=None,
        q_group_size=None,
        residual_length=None,
        axis_key=None,
        axis_value=None,
        api_name="/prefill",
    )
    before = _assistant_text(client.predict(question.question, 6, case.context, api_name="/ask")[0][-1])
    status, table, tradeoff, speed, files, *_ = client.predict(
        case.context, ["dynamic", "hqq:4"], "quanto:2,residual_length=4", question.question, 4, 0, api_name="/compare"
    )
    assert status.startswith("Compared 3 specs on 1 question (scored against the example's gold answers).")
    rows = [dict(zip(table["headers"], row)) for row in table["data"]]
    direct = compare(
        embedded,
        case.context,
        [question.question],
        [CacheSpec("hqq", nbits=4), CacheSpec("quanto", nbits=2, residual_length=4)],
        4,
        gold_answers=[question.answers],
    ).to_frame()
    shown = comparison_display_frame(direct)
    assert [r["spec"] for r in rows] == shown["spec"].tolist() == ["dynamic", "hqq:4", "quanto:2,residual_length=4"]
    assert [r["KV MiB"] for r in rows] == shown["KV MiB"].tolist()
    assert [r["contains gold"] for r in rows] == shown["contains gold"].tolist()
    assert len(files) == 2 and {Path(f).suffix for f in files} == {".csv", ".json"}  # the full table, to download
    points, bars = (plot.get("value", plot) for plot in (tradeoff, speed))  # updates: the value and its axes
    assert len(points["data"]) == 2 and len(bars["data"]) == 3  # a point per spec but the reference; a bar each
    # the tab's own prefilled cache was untouched: the same answer again
    assert _assistant_text(client.predict(question.question, 6, case.context, api_name="/ask")[0][-1]) == before
    status = client.predict(case.context, ["dynamic"], "quanto:3", question.question, 4, 0, api_name="/compare")[0]
    assert status.startswith("⚠ more specs, line 1: nbits=3 is not allowed for quanto")
