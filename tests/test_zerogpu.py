"""ZeroGPU's path: the page's model work sent through the door (`kvdemo.serve.door.Door`) to the device worker
(`kvdemo.serve.device.Device`, `kvdemo.serve.gpu_job`) under the CPU harness that plays ZeroGPU's part
(tests/zerogpu_harness.py: fork, pickling queues, generators streamed back, four scheduler policies). Two visitors
prefill on the page, ask two questions each, Stop an answer, run a comparison and a needle grid: under every policy
the answers, the step events, the charts' data, the comparison's answers and bytes and the grid's cells equal those
of the same page run in process, and a Stop ends the answer with its cache restored. The warm sessions give the hits
and misses each policy implies; whatever crosses is picklable, holds no tensor and stays small; a refusal keeps its
message; no worker outlives its harness. What the harness cannot prove (CUDA, the real scheduler, quotas, timings) is
in its docstring and in docs/space.md; tests/test_zerogpu_app.py runs the whole app under a forking `spaces`.

Cost: about 45 s in a pytest-xdist worker (2026-12-05; the tiny model; each policy forks 2 to 11 workers)."""

from __future__ import annotations

import dataclasses
import pickle
import re
import threading
import types
from pathlib import Path

import gradio as gr
import pandas as pd
import psutil
import pytest
import torch

from kvdemo.cache.formats.quanto.device import FALLBACK_NOTE, pure_torch_unpack, quanto_on_device
from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state.telemetry import StepEvent
from kvdemo.charts.steps import memory_frame, residual_frame
from kvdemo.compare.records import ComparisonCancelled
from kvdemo.qa.prompt import PreparedQuestion
from kvdemo.qa.records import Answer
from kvdemo.qa.session import QASession
from kvdemo.qa.session_file import SessionFileError, save_session
from kvdemo.serve import gpu_job as job_module
from kvdemo.serve.device import Device, RemoteSession
from kvdemo.serve.gpu_job import Finished, Raised, SessionRef, WorkOrder, gpu_job, job_seconds, serve_model
from kvdemo.serve.jobs import (
    JOBS,
    AnswerJob,
    CompareJob,
    JobProgress,
    NeedleJob,
    OpenJob,
    PrefillDone,
    PrefillJob,
    RecommendJob,
)
from kvdemo.serve.runner import InProcess, drive
from kvdemo.serve.server import App
from kvdemo.serve.warm_sessions import WARM, WarmSessions
from kvdemo.ui import build_demo, session_box
from kvdemo.ui.tab_view import tab_view
from tests.helpers import at_once, named_handlers
from tests.zerogpu_harness import POLICIES, Harness, WorkerError

SPEC = "hqq:4,residual_length=4"
FIELDS = ("hqq", 4, 64, 4, 0, 0)  # the page's backend and option fields for SPEC
CONTEXTS = {
    "a": "The Normans gave their name to Normandy, a region in France. " * 3,
    "b": "Paris is the capital of France; the Seine runs through it. " * 3,
}
QUESTIONS = ("Where is Normandy?", "What river runs through Paris?")
TOKENS = 8
WARM_PATTERN = {  # the four answers in the order a-q1, b-q1, a-q2, b-q2, after a's and b's prefills
    "reuse": ["hit"] * 4,  # one worker holds both prefills
    "fresh": ["miss"] * 4,  # every call a new worker: each answer opens its file
    "kill": ["miss"] * 4,
    "swap": ["miss", "miss", "hit", "hit"],  # each visitor's next call on the other's worker, then back
}
SMALL_BYTES = 16 * 1024
"""The most one request or record may take, pickled (bytes): a step event of the tiny model is about 1 kB."""


@pytest.fixture(scope="module")
def served(tiny):
    """The tiny model served to the job, in this process, before any worker is forked."""
    serve_model(tiny)
    WARM.clear()
    yield tiny
    WARM.clear()


def _request(visitor: str) -> gr.Request:
    return gr.Request(session_hash=visitor)


def _page(tiny, device: Device | None):
    app = App(loader=lambda source=None: tiny, device=device, recommended_start=False)
    app.start_loading()
    return app, named_handlers(build_demo(app))


def _events(app: App, visitor: str) -> list[tuple]:
    """The last answer's step events of `visitor`'s tab, less their times (measured, never equal)."""
    return [
        (e.step, e.token_id, e.text, e.memory, e.flushed_layers, e.cache_length, e.full_precision_bytes)
        for e in tab_view(app.sessions.peek(visitor)).events
    ]


def _charts(app: App, visitor: str) -> list:
    events = tab_view(app.sessions.peek(visitor)).events
    return [memory_frame(events).to_dict("list"), residual_frame(events).to_dict("list")]


def _page_run(app: App, fns: dict, harness: Harness | None = None) -> dict:
    """Two visitors on the page: prefills, two answers each, a stopped answer and one after it, a comparison and a
    needle grid; what each gave, times left out."""
    out: dict = {}
    for visitor in CONTEXTS:
        if harness is not None:
            harness.visitor = visitor
        fns["prefill"](CONTEXTS[visitor], *FIELDS, _request(visitor))
        qa = app.sessions.peek(visitor).qa
        out[visitor] = qa.prefill_report.context_tokens
    for question in QUESTIONS:
        for visitor in CONTEXTS:
            if harness is not None:
                harness.visitor = visitor
            views = list(fns["ask"](question, TOKENS, _request(visitor)))
            answer = app.sessions.peek(visitor).qa.history[-1]
            out[visitor, question] = (answer.token_ids, answer.finish_reason, answer.cache_length_after)
            out[visitor, question, "events"] = _events(app, visitor)
            out[visitor, question, "charts"] = _charts(app, visitor)
            assert views[-1].chat[-1]["content"] == answer.text
    if harness is not None:
        harness.visitor = "a"
    stream = fns["ask"]("Tell me everything about the Normans.", 60, _request("a"))
    next(stream), next(stream)  # the question shown, then the first step
    fns["stop"](_request("a"))
    list(stream)
    stopped = app.sessions.peek("a").qa.history[-1]
    out["stopped"] = (stopped.finish_reason, stopped.cache_length_after, 1 <= len(stopped.token_ids) < 60)
    list(fns["ask"](QUESTIONS[0], TOKENS, _request("a")))  # after the Stop: the restored cache answers as before
    out["after stop"] = app.sessions.peek("a").qa.history[-1].token_ids
    # the full-precision answer beside it: a `dynamic` prefill and answer, in the worker on a device
    made, shown = list(fns["reference"](_request("a")))
    assert made.startswith("Making the full-precision answer") and shown.startswith("**Full precision**"), shown
    out["reference"] = re.sub(r"[\d.]+ s, once per question", "", shown)  # its time left out
    compared = fns["compare"](CONTEXTS["a"], [SPEC], "", QUESTIONS[0], TOKENS, _request("a"))
    report = compared.report
    out["compare"] = [(r.spec_text, r.kv_bytes, [q.answer for q in r.questions]) for r in report.results]
    grid = fns["needle"]([SPEC], "96", "50", 0, 24, _request("b"))
    assert isinstance(grid.needle_table, pd.DataFrame), grid.needle_status
    table = grid.needle_table
    out["needle"] = table[[c for c in table.columns if not c.endswith((" s", "seconds"))]].to_dict("list")
    return out


@pytest.fixture(scope="module")
def in_process(served, tmp_path_factory, monkeypatch_module):
    """The same page run with its model work in this process: the reference."""
    monkeypatch_module.setenv("KVDEMO_CACHE_DIR", str(tmp_path_factory.mktemp("in-process")))
    app, fns = _page(served, None)
    out = _page_run(app, fns)
    assert out["a", QUESTIONS[0]][0] != out["b", QUESTIONS[0]][0]  # a session served for the wrong file would show
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _no_tensor(value, where="") -> None:
    """Fail on a tensor anywhere inside `value` (dataclasses, tuples, lists, dicts walked)."""
    assert not isinstance(value, torch.Tensor), f"a tensor crossed at {where}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for item in dataclasses.fields(value):
            _no_tensor(getattr(value, item.name), f"{where}.{item.name}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_tensor(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _no_tensor(item, f"{where}[{i}]")


def _no_orphans(harness: Harness) -> None:
    assert not harness.alive()
    assert not [pid for pid in harness.forked if psutil.pid_exists(pid)]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_page_runs_its_model_work_in_the_worker_under_every_policy(served, in_process, policy, tmp_path):
    with Harness(policy) as harness:
        device = Device(harness.gpu(duration=job_seconds)(job_module._gpu_job), str(tmp_path / "s"), tmp_path / "x")
        app, fns = _page(served, device)
        out = _page_run(app, fns, harness)
        assert isinstance(app.sessions.peek("a").qa, RemoteSession)  # no cache in this process
        assert out == in_process
        assert out["stopped"] == ("stopped", out["a"], True)
        warm = [
            v.warm for kind, _, v in harness.crossed
            if kind == "yield" and isinstance(v, Finished) and isinstance(v.result, Answer)
        ]  # fmt: skip
        assert warm[:4] == WARM_PATTERN[policy]
        kinds = [v[0][0].kind for kind, _, v in harness.crossed if kind == "args"]
        assert kinds == ["prefill"] * 2 + ["answer"] * 6 + ["prefill", "answer"] + ["compare", "needle"]
        assert harness.durations == [job_seconds(v[0][0]) for kind, _, v in harness.crossed if kind == "args"]
        for kind, size, value in harness.crossed:
            _no_tensor(value, kind)
            assert 0 < size <= SMALL_BYTES or kind == "yield" and not isinstance(value, (StepEvent, JobProgress))
    _no_orphans(harness)
    assert not WARM.paths()  # the main process ran no job: its warm set stays empty


def test_refusals_keep_their_message_and_a_bug_raises(served, tmp_path):
    with Harness("reuse") as harness:
        device = Device(harness.gpu(duration=job_seconds)(job_module._gpu_job), str(tmp_path), tmp_path / "x")
        app, fns = _page(served, device)
        fns["prefill"](CONTEXTS["a"], *FIELDS, _request("a"))
        view = fns["prefill"](CONTEXTS["a"] * 40, *FIELDS, _request("a"))  # past the tiny model's window: here
        assert "window" in view.notice
        assert [kind for kind, *_ in harness.crossed].count("args") == 1  # refused here, before any job
        a = app.sessions.peek("a").qa
        order = WorkOrder(AnswerJob(a.prepare_question("Why?", 4)), a.ref(), "another/model", "")
        (refused,) = harness.stream(job_module._gpu_job, order)  # a job prepared for another model
        assert isinstance(refused, Raised) and "prepared for another/model" in str(refused.error)
        gone = RemoteSession(a.loaded, a.spec, session_path=str(tmp_path / "gone.kvsession"), split=a.split,
                             prefill_report=a.prefill_report)  # fmt: skip
        with pytest.raises(SessionFileError, match="is not a file; give the path of a session file"):
            drive(device.run(AnswerJob(gone.prepare_question("Why?", 4)), gone))  # its own type, as in process
        with pytest.raises(WorkerError, match="AttributeError"):  # a bug is not a refusal: it raises, as on ZeroGPU
            list(harness.stream(job_module._gpu_job, None))
        with app.door.long_job("a", "busy") as job:  # Cancel reaches the worker through the stop file

            def cancel_after_dynamic(done: int, total: int, what: str) -> None:
                if what.startswith(f"{SPEC}: prefilling"):
                    job.cancel.set()

            with pytest.raises(ComparisonCancelled) as cancelled:
                job.compare(
                    CONTEXTS["a"], QUESTIONS[:1], [CacheSpec.parse(SPEC)], TOKENS, on_progress=cancel_after_dynamic
                )
        assert [r.spec_text for r in cancelled.value.report.results] == ["dynamic"]
        assert len(harness.forked) == 1
    _no_orphans(harness)


def test_the_records_cross_pickled_and_small(served, tmp_path):
    """The one wire format is pickle: every record a job yields comes back equal and small; the charts draw from
    the events as they came."""
    prepared = served.prepare(CONTEXTS["a"])
    ref = SessionRef(CacheSpec.parse(SPEC), None, hold=str(tmp_path / "a.kvsession"))
    records = list(gpu_job(WorkOrder(PrefillJob(prepared, TOKENS), ref, served.name, "", str(tmp_path))))
    done = records[-1]
    assert isinstance(done, Finished) and isinstance(done.result, PrefillDone) and done.warm == ""
    assert records[:-1] and all(isinstance(r, JobProgress) for r in records[:-1])
    question = PreparedQuestion(QUESTIONS[0], tuple(served.layout.question_ids(done.result.split, QUESTIONS[0])),
                                TOKENS, done.result.split)  # fmt: skip
    ref = SessionRef(CacheSpec.parse(SPEC), None, done.result.path)
    answer = list(gpu_job(WorkOrder(AnswerJob(question), ref, served.name, "")))
    events, end = answer[:-1], answer[-1]
    assert events and all(isinstance(e, StepEvent) for e in events) and end.warm == "hit"
    crossed = [pickle.loads(pickle.dumps(r)) for r in records + answer]
    assert crossed[: len(records) - 1] == records[:-1] and crossed[len(records) : -1] == events
    assert crossed[-1].result == end.result and crossed[len(records) - 1].result == done.result
    assert memory_frame(crossed[len(records) : -1]).equals(memory_frame(events))
    assert all(len(pickle.dumps(r)) <= SMALL_BYTES for r in answer)
    WARM.clear()


def test_a_warm_session_is_never_served_for_a_rewritten_file(served, tmp_path):
    """In this process (off ZeroGPU `gpu_job` is the plain generator): the prefill keeps its session warm; a file
    written again at the same path is another key; the byte and count bounds drop the least recently used."""
    assert gpu_job is job_module._gpu_job  # `spaces` is not installed here
    path, question = tmp_path / "visitor.kvsession", QUESTIONS[0]

    def ask(session: QASession, spec: str = SPEC) -> Finished:
        prepared = session.prepare_question(question, TOKENS)
        ref = SessionRef(CacheSpec.parse(spec), None, str(path))
        *_, end = gpu_job(WorkOrder(AnswerJob(prepared), ref, served.name, ""))
        if isinstance(end, Raised):
            raise end.error
        return end

    reference, sessions = {}, {}
    for visitor, context in CONTEXTS.items():
        session = sessions[visitor] = QASession(served, CacheSpec.parse(SPEC))
        session.prefill(context, max_new_tokens=TOKENS)
        reference[visitor] = session.ask(question, TOKENS).token_ids
    try:
        ref = SessionRef(CacheSpec.parse(SPEC), None, hold=str(path))
        job = PrefillJob(served.prepare(CONTEXTS["a"]), TOKENS)
        list(gpu_job(WorkOrder(job, ref, served.name, "", str(tmp_path / "folder"))))
        answer = ask(sessions["a"])
        assert (answer.warm, answer.result.token_ids) == ("hit", reference["a"])
        other = QASession(served, CacheSpec.parse(SPEC))
        other.prefill(CONTEXTS["b"], max_new_tokens=TOKENS)
        save_session(other, path)  # another process writes the file again
        answer = ask(sessions["b"])
        assert (answer.warm, answer.result.token_ids) == ("miss", reference["b"])
        with pytest.raises(ValueError, match="the question was prepared for another prefill"):
            ask(sessions["a"])  # a's question on b's file: refused, never answered on either
        assert WARM.paths() == [str(path.resolve())]
        with pytest.raises(SessionFileError, match="holds a `hqq:4,residual_length=4` cache, not `quanto:4`"):
            ask(sessions["b"], "quanto:4")
    finally:
        WARM.clear()
    first = QASession(served, CacheSpec.parse(SPEC))
    first.prefill(CONTEXTS["a"], max_new_tokens=TOKENS)
    one = first.prefill_report.kv_bytes
    save_session(first, tmp_path / "a.kvsession")
    held = WarmSessions(max_bytes=one - 1)
    held.put(tmp_path / "a.kvsession", first)  # larger than the bound alone: not kept
    assert held.paths() == [] and held.held_bytes == 0
    held = WarmSessions(max_bytes=one)
    held.put(tmp_path / "a.kvsession", first)
    assert held.held_bytes == one and held.get(tmp_path / "a.kvsession", served) is first
    held.put(path, other)  # both would pass the bound: the least recently used goes first
    assert str((tmp_path / "a.kvsession").resolve()) not in held.paths() and held.held_bytes <= one
    held = WarmSessions(max_sessions=1)
    held.put(tmp_path / "a.kvsession", first)
    held.put(path, other)
    assert held.paths() == [str(path.resolve())] and held.get(path, served) is other
    assert held.get(tmp_path / "a.kvsession", served) is None
    assert held.get(path, dataclasses.replace(served)) is None  # another model's session is not served


def test_the_duration_is_computed_from_the_job(served):
    def seconds(job) -> int:
        return job_seconds(WorkOrder(job, None, "", ""))

    short, long = served.prepare("A short text."), served.prepare("x " * 3_000)
    tokens = len(long.ids)
    assert seconds(PrefillJob(short, 8)) == job_module.MIN_SECONDS  # 15 s + a few tokens x 4 ms
    assert seconds(PrefillJob(long, 8)) == round(15 + tokens * 0.004)
    question = PreparedQuestion("Why?", (1, 2, 3), 8, long.split)
    assert seconds(AnswerJob(question)) == round(15 + 5 + (3 + 8) * 0.12)
    assert seconds(AnswerJob(PreparedQuestion("q", (1,) * 100, 100, long.split))) == round(15 + 5 + 200 * 0.12)
    assert seconds(OpenJob("x")) == job_module.MIN_SECONDS  # 15 + 5
    compare = CompareJob(long, ("a", "b"), (CacheSpec.parse("hqq:4"),), 32)
    assert seconds(compare) == round(15 + 2 * (tokens * 0.004 + 2 * 2 * 32 * 0.12))  # dynamic and hqq:4
    specs = (CacheSpec.parse("hqq:4"), CacheSpec.parse("dynamic"))
    assert seconds(NeedleJob(specs, (1024, 2048), (0.0, 50.0), 8)) == round(
        15 + 4 * 0.004 * 1536 + 4 * 2 * 2 * 8 * 0.12
    )
    assert seconds(RecommendJob("x" * 3_000)) == round(15 + 4 + 3 * 32 * 0.12 + 50 * 4)
    assert seconds(RecommendJob("x" * 10**7)) == job_module.MAX_SECONDS


def test_quanto_on_cuda_falls_back_to_its_pure_torch_unpacking(monkeypatch):
    from optimum.quanto.tensor.packed import pack_weights  # type: ignore[import-untyped]

    monkeypatch.delenv("KVDEMO_QUANTO_CUDA_BUILD", raising=False)
    assert quanto_on_device(torch.device("cpu")) is None
    ext = types.SimpleNamespace(_lib=None)
    registry = types.SimpleNamespace(is_extension_available=lambda name: True, get_extension=lambda name: ext)
    assert quanto_on_device(torch.device("cuda"), registry) == FALLBACK_NOTE
    assert quanto_on_device(torch.device("cuda"), registry) == FALLBACK_NOTE  # probed again: the same choice
    values = torch.randint(0, 16, (64, 12), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    for bits in (2, 4):
        codes = values % (2**bits)
        assert torch.equal(ext._lib.unpack(pack_weights(codes, bits), bits), codes)
        assert torch.equal(pure_torch_unpack(pack_weights(codes, bits), bits), codes)
    none = types.SimpleNamespace(is_extension_available=lambda name: False)
    assert "no CUDA extension is registered" in quanto_on_device(torch.device("cuda"), none)


@pytest.mark.process
def test_the_job_is_decorated_with_spaces_gpu_where_spaces_is_installed():
    """A stand-in `spaces` (ZeroGPU's is not installable here): the job is `@spaces.GPU(duration=job_seconds)`, a
    generator function, so that `spaces` streams its records back (`generator_function_wrapper`)."""
    import subprocess
    import sys

    code = (
        "import inspect, sys, types\n"
        "made = {}\n"
        "def GPU(duration):\n"
        "    def wrap(fn):\n"
        "        made['duration'], made['fn'] = duration, fn\n"
        "        return fn\n"
        "    return wrap\n"
        "sys.modules['spaces'] = types.SimpleNamespace(GPU=GPU)\n"
        "from kvdemo.serve import gpu_job as g\n"
        "assert made['duration'] is g.job_seconds and made['fn'] is g.gpu_job and g.gpu_job is not g._gpu_job\n"
        "assert inspect.isgeneratorfunction(g.gpu_job)\n"
        "print('decorated', g.gpu_job.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "decorated gpu_job", done.stderr[-2000:]


def test_on_zerogpu_the_app_places_the_model_on_cuda_at_start_up(monkeypatch):
    import app as app_module

    for name in ("KVDEMO_CONCURRENCY", "SPACE_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as ZeroGPU's main process reports it
    monkeypatch.setattr(app_module, "ZERO_GPU", True)
    assert app_module.parse_args([]).concurrency == 1
    monkeypatch.setattr(app_module, "ZERO_GPU", False)
    assert app_module.parse_args([]).concurrency == 2  # a GPU Space's page
    asked = {}
    monkeypatch.setattr("kvdemo.qa.models.load_model", lambda source=None, device=None: asked.update(device=device))
    app_module._zero_gpu_loader("some/model")
    assert asked == {"device": "cuda"}  # on `cuda` at start-up, as ZeroGPU's docs ask (its main process emulates it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    app_module._zero_gpu_loader("some/model")
    assert asked == {"device": "cpu"}  # the CPU stand-in: the same call
    assert isinstance(app_module._zero_gpu_device(1), Device)


def test_the_recommend_tab_runs_in_the_worker_with_the_same_pick(served, tmp_path, monkeypatch):
    """The Recommend tab's job in the worker (progress back, Cancel by the stop file): the same pick, rows and
    figures as in process (times left out)."""
    text = " ".join([CONTEXTS["a"], CONTEXTS["b"]] * 2)
    questions = QUESTIONS[0]
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    app, fns = _page(served, None)
    here = fns["recommend"](text, questions, 0.5, "transformers", _request("a"))
    with Harness("reuse") as harness:
        device = Device(harness.gpu(duration=job_seconds)(job_module._gpu_job), str(tmp_path), tmp_path / "x")
        app, fns = _page(served, device)
        there = fns["recommend"](text, questions, 0.5, "transformers", _request("a"))
        kinds = [v[0][0].kind for kind, _, v in harness.crossed if kind == "args"]
        notes = [v for kind, _, v in harness.crossed if kind == "yield" and isinstance(v, JobProgress)]
    _no_orphans(harness)
    assert kinds == ["recommend"] and len(notes) > 3  # one job, its progress streamed back
    assert there.pick == here.pick and "### Pick:" in there.pick
    timeless = [c for c in here.recommend_table.columns if "second" not in c]
    assert there.recommend_table[timeless].equals(here.recommend_table[timeless])


def test_a_session_keeps_its_own_file_and_its_stop_files_go_with_its_jobs(served, tmp_path):
    """Found by a tester: another visitor's prefill trimmed the jobs' bounded folder of session files and removed a
    live session's file, so its answers and Save session failed for good; an answer closed before its first step left
    its stop file armed; a comparison far past ZeroGPU's call bound was sent anyway (ZeroGPU would end it midway). Now
    each session holds its own link to its file (removed with the session), a job's stop file goes with the job, and
    such a job is refused before any GPU time is asked, saying what to cut."""
    import gc

    folder, stops = tmp_path / "sessions", tmp_path / "stops"
    with Harness("fresh") as harness:
        job = harness.gpu(duration=job_seconds)(job_module._gpu_job)
        app, fns = _page(served, Device(job, str(folder), stops, folder_bytes=1))  # every save trims the folder
        for visitor in CONTEXTS:
            harness.visitor = visitor
            fns["prefill"](CONTEXTS[visitor], *FIELDS, _request(visitor))
        assert list(folder.glob("*.kvsession")) == []  # both trimmed: the folder holds nothing
        harness.visitor = "a"
        list(fns["ask"](QUESTIONS[0], TOKENS, _request("a")))  # a fresh worker opens a's own copy
        a = app.sessions.peek("a").qa
        assert (
            a.history[-1].finish_reason in ("eos", "max_new_tokens")
            and a.history[-1].cache_length_after == a.cache_length
        )
        file, notice = session_box.save(app, _request("a"))  # the session box's Save session
        assert Path(file).stat().st_size == Path(a.session_path).stat().st_size > 0, notice
        held = sorted((stops.parent / "held-sessions").glob("*.kvsession"))
        assert len(held) == 2 and a.session_path in map(str, held)
        stream = fns["ask"](QUESTIONS[0], TOKENS, _request("a"))
        next(stream)  # the question shown; then the browser leaves before the first step
        stream.close()
        assert a.running is None and not app.sessions.peek("a").lock.locked()
        fns["stop"](_request("a"))
        fns["prefill"](CONTEXTS["a"], *FIELDS, _request("a"))
        assert list(stops.glob("*")) == []  # no stop file left by a job that ended
        del a
        app.sessions.free("a"), app.sessions.free("b")
        gc.collect()
        assert list((stops.parent / "held-sessions").glob("*")) == []  # the sessions' own copies went with them
        sent = len(harness.crossed)
        huge = fns["compare"](CONTEXTS["a"] * 5, ["fp8", "quanto:4", "hqq:2"], "", "\n".join(["Why?"] * 20), 256,
                              _request("a"))  # fmt: skip
        assert "one ZeroGPU call may take at most 300 s here: ask for fewer specs or questions" in huge.compare_status
        assert "daily ZeroGPU time is 2 minutes unauthenticated, 5 minutes with a free account" in huge.compare_status
        assert len(harness.crossed) == sent  # refused here: no job sent
    _no_orphans(harness)


def _trail(app: App) -> list:
    """Each visitor's session as the page holds it: its context tokens, its split's tail and its answers (a
    failure's message: two visitors tokenizing at once once split a context one token early)."""
    return [
        (v, qa.prefill_report.context_tokens, qa.split.tail, [(a.question, a.cache_length_after) for a in qa.history])
        for v in CONTEXTS
        if (qa := app.sessions.peek(v).qa) is not None
    ]


def test_two_visitors_at_once_get_their_own_answers_and_a_stop_touches_one(served, in_process, tmp_path):
    """Two visitors on the page at the same time (the page's concurrency above 1): their prefills and answers
    interleave in two workers, each answer equals the same page's in process, and a Stop of one visitor's answer ends
    that answer alone."""
    with Harness("reuse") as harness:
        device = Device(harness.gpu(duration=job_seconds)(job_module._gpu_job), str(tmp_path / "s"), tmp_path / "x")
        app, fns = _page(served, device)
        out: dict = {}
        together = threading.Barrier(2)

        def visit(visitor: str) -> None:
            together.wait(30)
            fns["prefill"](CONTEXTS[visitor], *FIELDS, _request(visitor))
            for question in QUESTIONS:
                list(fns["ask"](question, TOKENS, _request(visitor)))
                answer = app.sessions.peek(visitor).qa.history[-1]
                out[visitor, question] = (answer.token_ids, answer.finish_reason, answer.cache_length_after)
            together.wait(30)  # a stops its long answer while b answers
            if visitor == "a":
                stream = fns["ask"]("Tell me everything about the Normans.", 60, _request("a"))
                next(stream), next(stream)  # the question shown, then the first step
                fns["stop"](_request("a"))
                list(stream)
                stopped = app.sessions.peek("a").qa.history[-1]
                out["stopped"] = (stopped.finish_reason, stopped.cache_length_after)
            else:
                list(fns["ask"](QUESTIONS[1], 24, _request("b")))
                out["b beside the stop"] = app.sessions.peek("b").qa.history[-1].finish_reason

        at_once(visit, CONTEXTS)
        assert harness.most_at_once == 2 and len(harness.forked) >= 2  # the calls overlapped, in two workers
        for visitor in CONTEXTS:
            for question in QUESTIONS:
                assert out[visitor, question] == in_process[visitor, question], (visitor, question, _trail(app))
        assert out["stopped"] == ("stopped", in_process["a"])
        assert out["b beside the stop"] in ("eos", "max_new_tokens")
    _no_orphans(harness)


def test_each_kinds_refusal_reaches_the_caller_with_its_own_type_and_message(served, tmp_path):
    """The same job record refused in this process and in the worker: the same exception type and message (the
    worker's exception is pickled whole and raised again in the server)."""
    spec = CacheSpec.parse(SPEC)
    prepared, other = served.prepare(CONTEXTS["a"]), served.prepare(CONTEXTS["b"])

    def refusals(runner) -> list[tuple[type, str]]:
        tight = runner.session(served, spec, 1)  # a 1-byte budget: the prefill refuses it
        prefilled = runner.session(served, spec, None)
        drive(runner.run(PrefillJob(prepared, TOKENS), prefilled))
        foreign = PreparedQuestion("Why?", (1, 2), 4, other.split)  # prepared for another prefill
        jobs = [
            (PrefillJob(prepared, TOKENS), tight),
            (OpenJob(str(tmp_path / "missing.kvsession")), runner.session(served, spec, None)),
            (AnswerJob(foreign), prefilled),
            (CompareJob(prepared, ("  ",), (spec,), 4), None),
            (NeedleJob((spec,), (served.max_context_tokens * 4,), (50.0,), 4), None),
            (RecommendJob("Too short a text."), None),
        ]
        assert {type(job) for job, _ in jobs} == set(JOBS)  # every kind: a new one gets its refusal here
        out = []
        for job, session in jobs:
            with pytest.raises((ValueError, ImportError)) as refused:
                drive(runner.run(job, session))
            out.append((type(refused.value), str(refused.value)))
        return out

    here = refusals(InProcess(lambda: served, lambda: None))
    with Harness("reuse") as harness:
        device = Device(harness.gpu(duration=job_seconds)(job_module._gpu_job), str(tmp_path / "s"), tmp_path / "x")
        there = refusals(device)
        raised = [v for kind, _, v in harness.crossed if kind == "yield" and isinstance(v, Raised)]
    _no_orphans(harness)
    assert there == here and len(raised) == len(here) == 6  # each refused in the worker, not before it
    assert [t.__name__ for t, _ in here] == [
        "KVBudgetError", "SessionFileError", "ValueError", "ValueError", "ValueError", "ValueError"
    ]  # fmt: skip


class _Left(Exception):
    """The caller's own failure in a progress callback (its connection gone)."""


def test_a_caller_that_leaves_stops_the_work_and_its_answer_is_recorded(served, tmp_path):
    """Found by a breaker: a long job whose caller raised in its progress callback ran on to its end, unaccounted (its
    reservation and slot already freed; in the worker too), and on the worker an answer closed early was missing
    from the session's history. Now leaving stops the work at its next check, on both runners, and a closed answer is
    recorded `stopped` on both."""

    def leave(app: App) -> tuple:
        notes = []

        def on_progress(done: int, total: int, what: str) -> None:
            notes.append(what)
            if len(notes) == 2:
                raise _Left

        with app.door.long_job("a", "busy") as job, pytest.raises(_Left):
            job.compare(CONTEXTS["a"], QUESTIONS * 3, [CacheSpec.parse(SPEC)] * 1, 40, on_progress=on_progress)
        running = [t.name for t in threading.enumerate() if t.name in ("kvdemo-job", "kvdemo-stop-watch")]
        fns = named_handlers(build_demo(app))
        fns["prefill"](CONTEXTS["a"], *FIELDS, _request("a"))
        with app.door.answer("a", QUESTIONS[0], 40) as run:
            next(iter(run))  # the caller leaves after the first step
        last = app.sessions.peek("a").qa.history[-1]
        return running, app.kv.holders(), last.finish_reason, 1 <= len(last.token_ids) <= 2

    here = leave(_page(served, None)[0])
    with Harness("reuse") as harness:
        there = leave(_page(served, Device(harness.gpu(duration=job_seconds)(job_module._gpu_job), str(tmp_path / "s"),
                                           tmp_path / "x"))[0])  # fmt: skip
    _no_orphans(harness)
    assert here[0] == there[0] == []  # no job thread left running
    assert "compare:a" not in here[1] and "compare:a" not in there[1]
    assert here[2:] == there[2:] == ("stopped", True)
    assert list((tmp_path / "x").glob("*.stop")) == []
