"""Load: 16 `gradio_client` clients on loopback (`load_clients`, in a process of their own) against one app (a small
model with a large KV cache per token, one answer at a time, a short queue and a server-wide KV budget that cannot
hold every session at once), each prefilling, asking, stopping, re-prefilling or disconnecting mid-answer. Nothing
fails except the two refusals meant for users (the queue is full; the server's KV budget is full), every answer
equals the same session run alone, and once the clients have left no session, reservation or `QASession` is left
and the app's resident memory is back at its baseline. The figures go to artifacts/load.json.

Cost: 147 s for 1 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import ctypes
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path

import psutil
import pytest
import torch

from kvdemo import CacheSpec, QASession
from kvdemo.ui import App, build_demo
from tests.helpers import make_tiny

from .conftest import free_port
from .load_clients import CLIENTS, DEADLINE_SECONDS, contexts_and_questions

pytestmark = pytest.mark.slow

QUEUE_SIZE = 8
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"


def _alive(kind: type) -> list:
    """Every object of `kind` alive in this process."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated lazy attributes
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, kind)]


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage `tensor`'s data lives in, or None for a wrapper tensor that has none of its own (a tensor
    subclass whose data are inner tensors, alive and counted themselves; an earlier test module in this process may
    leave one): torch raises "invalid python storage" for those."""
    if tensor.device.type != "cpu":
        return None
    try:
        storage = tensor.untyped_storage()
        storage.data_ptr()
    except RuntimeError:
        return None
    return storage


def _storages() -> dict[int, int]:
    """Every CPU tensor storage alive in this process (the model's weights and any cache): data pointer -> bytes."""
    return {s.data_ptr(): s.nbytes() for t in _alive(torch.Tensor) if (s := _storage(t)) is not None}


def _new_tensors(baseline: dict[int, int]) -> str:
    """The CPU tensors alive now whose storage was not alive at `baseline` (`_storages`), with what holds each:
    the message of a failed leak check."""
    lines = []
    for tensor in _alive(torch.Tensor):
        if (storage := _storage(tensor)) is not None and storage.data_ptr() not in baseline:
            holders = [type(r).__name__ for r in gc.get_referrers(tensor)][:5]
            lines.append(f"{tuple(tensor.shape)} {tensor.dtype} held by {holders}")
    return "new tensors: " + "; ".join(lines[:20])


def _rss(trim: bool = False) -> int:
    """Resident bytes of this process (the app; its clients run in another); with `trim`, after glibc's
    `malloc_trim(0)` has handed the heap's free pages back to the system (memory freed but kept by malloc's
    per-thread arenas for reuse is held by nobody)."""
    gc.collect()
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def _round(app: App, url: str, earlier: weakref.WeakSet) -> tuple[dict, dict]:
    """The clients' process (`load_clients`) once, then every session freed: by `demo.unload` as the clients
    leave, else (a client that never left) by the idle sweep once its idle time has passed. Returns what the
    clients did and the app's peaks (resident bytes, KV bytes held)."""
    peak, sampling = {"rss": 0, "kv": 0}, threading.Event()

    def sample():
        while not sampling.wait(0.05):
            peak["rss"] = max(peak["rss"], psutil.Process().memory_info().rss)
            peak["kv"] = max(peak["kv"], app.kv.held_bytes)

    threading.Thread(target=sample, daemon=True).start()
    clients = subprocess.run(
        [sys.executable, "-m", "tests.e2e.load_clients", url],
        capture_output=True,
        text=True,
        timeout=DEADLINE_SECONDS + 180,
        cwd=ROOT,
    )
    assert clients.returncode == 0, clients.stderr[-3000:]
    run = json.loads(clients.stdout.strip().splitlines()[-1])
    peak["left"] = _wait_for_sweep(app, 20)
    app.sessions.idle_seconds = 1.0  # the idle time passes
    _wait_for_sweep(app)
    app.sessions.idle_seconds = 600.0
    peak["answers_still_ending"] = _wait_for_answers_to_end(earlier)
    sampling.set()
    return run, peak


def _made_here(kind: type, before: weakref.WeakSet) -> list:
    """The objects of `kind` alive now that were not alive in `before`: what this test made, whatever test modules
    ran earlier in this process (two pytest-xdist workers run the modules in no fixed order)."""
    return [o for o in _alive(kind) if o not in before]


def test_sixteen_clients_prefilling_asking_stopping_and_leaving(embedded):
    earlier = weakref.WeakSet(_alive(QASession))  # sessions of earlier modules in this process: not this test's
    # 6 layers x 8 KV heads x head_dim 128 in float32: 48 KiB per token in a dynamic cache
    loaded = make_tiny(embedded.tokenizer, kv_heads=8, head_dim=128, layers=6, seed=3)
    contexts, _ = contexts_and_questions()
    one_dynamic = 48 * 1024 * (max(len(embedded.tokenizer(c)["input_ids"]) for c in contexts) + 128 + 40)
    app = App(
        loader=lambda source: loaded, max_sessions=32, idle_seconds=600.0, server_kv_budget_bytes=int(3.5 * one_dynamic)
    )  # a fraction of the clients' caches at once
    app.start_loading()
    app.start_sweeper(every_seconds=0.5)
    demo = build_demo(app)
    demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)
    port = free_port()
    demo.launch(
        server_name="127.0.0.1",
        server_port=port,
        prevent_thread_lock=True,
        ssr_mode=False,
        quiet=True,
        state_session_capacity=4 * app.sessions.max_sessions,
    )  # as app.py
    url = f"http://127.0.0.1:{port}/"
    try:
        app.wait_for_model()
        before = _rss(trim=True)
        # the baseline: after one round of the same load (imports, every backend's kernels, Gradio's and the
        # clients' thread pools, malloc's per-thread arenas); then a second round must leave nothing behind
        warm_up, _ = _round(app, url, earlier)
        assert warm_up["failures"] == [], "\n".join(warm_up["failures"])
        baseline, baseline_trimmed, baseline_storages = _rss(), _rss(trim=True), _storages()
        run, peak = _round(app, url, earlier)
        after, after_trimmed, after_storages = _rss(), _rss(trim=True), _storages()
        new_tensors = _new_tensors(baseline_storages)
    finally:
        demo.close()

    assert run["failures"] == [], "\n".join(run["failures"])  # nothing fails but the refusals, which were tried again
    assert len(app.sessions) == 0 and app.kv.holders() == {}  # every session freed, every reservation released
    assert not _made_here(QASession, earlier)  # no cache kept alive by anything
    # not one tensor byte more than before the round
    assert sum(after_storages.values()) == sum(baseline_storages.values()), new_tensors
    for item in warm_up["answers"] + run["answers"]:
        alone = QASession(loaded, CacheSpec.parse(item["spec"]))
        tokens = alone.prefill(item["context"]).context_tokens
        expected = alone.ask(item["question"], item["max_new_tokens"])
        assert item["answer"]["answer"] == expected.text, item
        assert item["answer"]["cache_length_after"] == tokens
    assert len(run["answers"]) >= CLIENTS and run["disconnects"] == CLIENTS // 4
    assert run["stops"].count("stopped") == CLIENTS // 4, run["stops"]  # every Stop client stopped an answer
    assert all(text.startswith(("Queue is full", "The server's KV budget is full")) for text in run["refusal_texts"])
    assert peak["kv"] <= app.kv.limit_bytes  # the account never passed the budget
    figures = {
        "clients": CLIENTS,
        "queue_size": QUEUE_SIZE,
        "server_kv_budget_mib": round(app.kv.limit_bytes / 2**20, 1),
        "wall_seconds": round(run["wall_seconds"], 1),
        "requests": run["requests"],
        "answers": len(run["answers"]),
        "refusals": run["refusals"],
        "refusal_messages": run["refusal_texts"],
        "stops": run["stops"],
        "disconnects": run["disconnects"],
        "sessions_left_after_the_clients_left": peak["left"],
        "sessions_alive_after_the_sweep": peak["answers_still_ending"],
        "first_token_seconds_p50": round(_percentile(run["first_token"], 50), 3),
        "first_token_seconds_p95": round(_percentile(run["first_token"], 95), 3),
        "kv_held_peak_mib": round(peak["kv"] / 2**20, 1),
        "rss_before_the_warm_up_round_trimmed_mib": round(before / 2**20, 1),
        "rss_baseline_mib": round(baseline / 2**20, 1),
        "rss_peak_mib": round(peak["rss"] / 2**20, 1),
        "rss_after_mib": round(after / 2**20, 1),
        "rss_baseline_trimmed_mib": round(baseline_trimmed / 2**20, 1),
        "rss_after_trimmed_mib": round(after_trimmed / 2**20, 1),
    }
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "load.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    # Resident memory, with malloc's free pages handed back: glibc's per-thread arenas fragment, so it moves from
    # round to round without a trend (four rounds here: 838, 914, 864, 898 MiB; on 2026-11-30 +6.6 % alone and
    # +17 % while a browser and a second app ran beside it). The exact check of a leak is the tensor bytes above;
    # this bound catches what they cannot see (Python objects kept per request) once it passes a fifth
    assert after_trimmed < baseline_trimmed * 1.20, figures
    assert peak["kv"] > 0.5 * app.kv.limit_bytes, figures  # the load reached the budget (not a test of nothing)


def _wait_for_sweep(app: App, timeout: float = 120) -> int:
    """Until every session is freed (by `demo.unload` when its client left, or by the idle sweep; a running
    answer finishes first) or `timeout` seconds; returns how many are left."""
    deadline = time.perf_counter() + timeout
    while len(app.sessions) and time.perf_counter() < deadline:
        time.sleep(0.2)
    gc.collect()
    return len(app.sessions)


def _wait_for_answers_to_end(earlier: weakref.WeakSet, timeout: float = 60) -> int:
    """Until no `QASession` made since `earlier` is alive, or `timeout` seconds. A session freed while its answer
    runs (its client left) ends that answer after the current decode step, in the Gradio worker thread running it;
    until then the step's frames hold its cache. Returns how many were still alive (0: all ended)."""
    deadline = time.perf_counter() + timeout
    while (alive := len(_made_here(QASession, earlier))) and time.perf_counter() < deadline:
        time.sleep(0.5)
    return alive
