"""The whole app as a ZeroGPU Space runs it, on the CPU: `python app.py` with `SPACES_ZERO_GPU` set and a stand-in
`spaces` that forks a fresh worker for every `@spaces.GPU` call (tests/stand_in/spaces, on the CPU harness), driven
through gradio_client by the maintainers' smoke script (`scripts/zerogpu_smoke.py`): a prefill, three questions, a
Stop and a comparison on the page's own endpoints; then, with the page at concurrency 2, two visitors at once, each
prefilling its own context and asking twice. Every job ran in a worker of its own, never in the server's process;
the answers equal an in-process `QASession`'s on the same model; the Stop ended its answer with the cache restored; no
worker holds a connection of the page open (a browser's Stop would wait behind it) or outlives the app.

Cost: about 60 s in one process on 2 cores (2026-12-05): the app's start and the embedded model's load (15-25 s), six
forked jobs, a 500-token prefill, a comparison of two specs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from kvdemo.cache.spec import CacheSpec
from kvdemo.paths import cache_dir
from kvdemo.qa.session import QASession
from tests.e2e.conftest import free_port
from tests.helpers import at_once

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import zerogpu_smoke  # noqa: E402


def _wait_for(url: str, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the app exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the app did not answer on {url} in {timeout} s")


VISITORS = {
    "a": (zerogpu_smoke.normans_context().split("\n\n")[0], "Who gave their name to Normandy?"),
    "b": (zerogpu_smoke.normans_context().split("\n\n")[1], "Who was the duke in the battle of Hastings?"),
}
"""Two visitors' contexts and questions, for the page at concurrency 2."""


def _two_visitors_at_once(url: str) -> dict[str, list[str]]:
    """Two gradio_client visitors, each in its own thread: a prefill, then the same question twice; their answers."""
    from gradio_client import Client

    out: dict[str, list[str]] = {}
    together = threading.Barrier(2)

    def visit(visitor: str) -> None:
        context, question = VISITORS[visitor]
        client = Client(url, verbose=False, analytics_enabled=False)
        together.wait(60)
        client.predict(context, *zerogpu_smoke.SPEC_FIELDS.values(), api_name="/prefill")
        answers = [zerogpu_smoke._ask(client, question, context, zerogpu_smoke.MAX_NEW_TOKENS) for _ in range(2)]
        out[visitor] = [answer["answer"] for answer in answers]

    at_once(visit, VISITORS)
    return out


@pytest.mark.process
def test_the_app_on_zerogpu_runs_every_job_in_a_forked_worker(embedded, tmp_path):
    port, log = free_port(), tmp_path / "jobs.log"
    env = dict(
        os.environ,
        SPACES_ZERO_GPU="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "stand_in"), str(ROOT)]),
        KVDEMO_STAND_IN_LOG=str(log),
        KVDEMO_STAND_IN_POLICY="fresh",
        KVDEMO_SESSION_FILES_MIB="0",  # the worker's own folder: a new prefill, not one an earlier run saved
        GRADIO_ANALYTICS_ENABLED="False",
        HF_HUB_OFFLINE="1",
    )
    folder = cache_dir() / "gpu-sessions"
    for old in folder.glob("*.kvsession") if folder.is_dir() else []:  # the jobs' own session files
        old.unlink()
    with open(tmp_path / "app.log", "w", encoding="utf-8") as printed_to:
        app = subprocess.Popen(
            [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--concurrency", "2"],
            cwd=ROOT, env=env, stdout=printed_to, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            _wait_for(f"http://127.0.0.1:{port}/", app)
            out = zerogpu_smoke.smoke(f"http://127.0.0.1:{port}/")
            smoke_jobs = len(log.read_text(encoding="utf-8").splitlines())
            both = _two_visitors_at_once(f"http://127.0.0.1:{port}/")
            workers = [psutil.Process(int(line.split()[0])) for line in log.read_text(encoding="utf-8").splitlines()]
            # a worker holds none of the page's connections (a browser would wait on them: its Stop, queued)
            held = {w.pid: w.net_connections(kind="tcp") for w in workers if w.is_running()}
            assert held and not any(held.values()), held
        finally:
            app.terminate()  # the stand-in kills its workers on SIGTERM
            try:
                app.wait(timeout=60)
            except subprocess.TimeoutExpired:
                app.kill()
    printed = (tmp_path / "app.log").read_text(encoding="utf-8")
    jobs = [line.split() for line in log.read_text(encoding="utf-8").splitlines()]
    alive = [int(pid) for pid, _ in jobs if psutil.pid_exists(int(pid))]
    left = [pid for pid in alive if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "workers outlived the app"
    assert out["problems"] == [], printed[-3000:]
    assert "the page's model work runs in @spaces.GPU jobs" in printed
    smoke_kinds = [kind for _, kind in jobs[:smoke_jobs]]
    assert smoke_kinds == ["prefill", "answer", "answer", "answer", "answer", "compare"], jobs
    assert sorted(kind for _, kind in jobs[smoke_jobs:]) == ["answer"] * 4 + ["prefill"] * 2
    pids = [int(pid) for pid, _ in jobs]
    assert len(set(pids)) == len(pids) and app.pid not in pids  # a fresh worker each, never the server's process
    assert out["stop"]["stopped"] and out["stop"]["restored"] and out["stop"]["tokens"] < zerogpu_smoke.STOP_TOKENS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run (the harness forks them from a one-thread parent)
    try:
        fields = zerogpu_smoke.SPEC_FIELDS
        spec = CacheSpec(fields["backend"], **{k: v for k, v in fields.items() if k != "backend"})
        reference = QASession(embedded, spec)
        tokens = reference.prefill(zerogpu_smoke.normans_context()).context_tokens
        expected = [reference.ask(q, zerogpu_smoke.MAX_NEW_TOKENS).text for q in zerogpu_smoke.QUESTIONS]
        alone = {}
        for visitor, (context, question) in VISITORS.items():
            reference = QASession(embedded, spec)
            reference.prefill(context)
            alone[visitor] = [reference.ask(question, zerogpu_smoke.MAX_NEW_TOKENS).text] * 2
    finally:
        torch.set_num_threads(threads)
    assert out["context_tokens"] == tokens
    assert [answer["answer"] for answer in out["answers"]] == expected
    assert both == alone  # two visitors at once, each with its own answers (the page at concurrency 2)
