"""Several users at once on the running app (gradio_client): sessions are isolated (2, then 8 concurrent
clients with different contexts and backends, each answer equal to the same session run alone), the queue
makes waiting requests show their place and none fails, a client that disconnects mid-answer leaves its
cache restored, and the server serves no file it should not.

Cost: 53 s for 5 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest
from gradio_client import Client
from gradio_client.utils import Status

from kvdemo import CacheSpec, QASession
from kvdemo.evals.cases import example_path, load_case

SPECS = [
    ("dynamic", None, None, None),
    ("fp8", None, None, None),
    ("hqq", 4, 64, 16),
    ("quanto", 4, 64, 16),
    ("hqq", 2, 64, 8),
    ("quanto", 2, 64, 8),
    ("hqq", 8, 64, 4),
    ("dynamic", None, None, None),
]


def _text(message) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def _spec(backend, nbits, group, residual) -> CacheSpec:
    if backend in ("dynamic", "fp8"):
        return CacheSpec(backend)
    return CacheSpec(backend, nbits=nbits, q_group_size=group, residual_length=residual, axis_key=0, axis_value=0)


def _user(app_url: str, context: str, spec: tuple, question: str, results: dict, key: int, statuses: list) -> None:
    try:
        client = Client(app_url, verbose=False)
        backend, nbits, group, residual = spec
        client.predict(context, backend, nbits, group, residual, 0, 0, api_name="/prefill")
        job = client.submit(question, 8, context, api_name="/ask")
        while not job.done():
            statuses.append(job.status())
            time.sleep(0.02)
        outputs = job.outputs()
        results[key] = (_text(outputs[-1][0][-1]), outputs[-1][1])
    except Exception as error:  # recorded, so that the test shows which user failed and why
        results[key] = error


def _run_users(app_url: str, n: int, embedded) -> list:
    case = load_case(example_path("normans"))
    users = []
    for i in range(n):
        paragraph = case.select(str(i))
        question = paragraph.answerable(1)[0].question
        users.append((paragraph.context, SPECS[i % len(SPECS)], question))
    results: dict = {}
    statuses: list = []
    threads = [
        threading.Thread(target=_user, args=(app_url, c, s, q, results, i, statuses))
        for i, (c, s, q) in enumerate(users)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert sorted(results) == list(range(n))
    failures = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert failures == {}  # none fails
    for i, (context, spec, question) in enumerate(users):
        alone = QASession(embedded, _spec(*spec))
        tokens = alone.prefill(context).context_tokens
        text, stats = results[i]
        assert text == alone.ask(question, 8).text, (i, spec)
        assert f"cache length after restore = {tokens:,} (context)" in stats
    return statuses


def test_two_then_eight_concurrent_users_are_isolated_and_the_queue_shows_places(app_url, embedded):
    _run_users(app_url, 2, embedded)
    statuses = _run_users(app_url, 8, embedded)
    queued = [s for s in statuses if s.code == Status.IN_QUEUE and s.rank is not None]
    # with one answer at a time (the app's concurrency limit), waiting users were told their place
    assert queued and max(s.rank for s in queued) >= 1
    assert all(s.queue_size is None or s.queue_size >= 1 for s in queued)


def test_client_disconnecting_mid_answer_leaves_the_cache_restored(app_url, embedded):
    case = load_case(example_path("normans")).select("0")
    client = Client(app_url, verbose=False)
    client.predict(case.context, "hqq", 4, 64, 4, 0, 0, api_name="/prefill")
    job = client.submit("Tell me everything about the Normans.", 300, case.context, api_name="/ask")
    seen = 0
    for _ in job:
        seen += 1
        if seen == 3:
            break
    job.cancel()  # the client goes away mid-answer
    fresh = QASession(embedded, CacheSpec("hqq", nbits=4, q_group_size=64, residual_length=4, axis_key=0, axis_value=0))
    tokens = fresh.prefill(case.context).context_tokens
    question = case.answerable(1)[0].question
    expected = fresh.ask(question, 8).text
    deadline = time.time() + 120
    while True:  # the cancelled answer stops after its current step and releases the session
        chat, stats, *_ = client.predict(question, 8, case.context, api_name="/ask")
        if "already running" not in stats:
            break
        assert time.time() < deadline
        time.sleep(0.5)
    assert _text(chat[-1]) == expected
    assert f"cache length after restore = {tokens:,} (context)" in stats
    table = client.predict(question, 8, case.context, api_name="/ask")[5]  # this session's answers, one row each
    rows = [dict(zip(table["headers"], row)) for row in table["data"]]
    assert rows[0]["finish"] == "stopped" and rows[0]["tokens"] < 300  # the disconnect ended that answer
    assert rows[0]["cache length after"] == tokens


@pytest.mark.parametrize("path", ["/etc/passwd", "kvdemo/data/cases/normans.json", "../../etc/hostname"])
def test_the_server_serves_no_local_files(app_url, path):
    for route in (f"gradio_api/file={path}", f"file={path}"):
        try:
            with urllib.request.urlopen(app_url + route, timeout=10) as response:
                body = response.read()
            assert b"root:" not in body and b"paragraphs" not in body, route
        except urllib.error.HTTPError as error:
            assert error.code in (403, 404), route
