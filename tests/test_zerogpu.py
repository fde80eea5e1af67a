"""ZeroGPU's path (`kvdemo.serve.gpu_job`) under the CPU harness that plays ZeroGPU's part (tests/zerogpu_harness.py:
fork, pickling queues, one worker pool per function, four scheduler policies): two visitors prefill their contexts
and ask two questions each; every answer equals an in-process `QASession`'s, token for token, under every policy; the
warm sessions give the hits and misses each policy implies; whatever crosses is plain, picklable and a few kB; the
comparison and the needle grid are one call each; a refused request comes back with its message; no worker outlives
its harness. What the harness cannot prove (CUDA, the real scheduler, quotas, timings) is in its docstring and in
docs/space.md.

Cost: 24 s in a pytest-xdist worker (the clean-clone CI of 2026-12-05; the tiny model; each policy forks 1 to 6
workers; one subprocess imports the job under a stand-in `spaces`)."""

from __future__ import annotations

import dataclasses
import types

import psutil
import pytest
import torch

from kvdemo.cache.spec import CacheSpec
from kvdemo.compare.run import compare
from kvdemo.needle.grid import needle_grid
from kvdemo.qa.session import QASession
from kvdemo.qa.session_file import save_session
from kvdemo.serve import gpu_job as job_module
from kvdemo.serve.gpu_job import GpuJobError, GpuRequest, gpu_job, job_seconds, run_job, serve_model
from kvdemo.serve.warm_sessions import FALLBACK_NOTE, WARM, WarmSessions, pure_torch_unpack, quanto_on_device
from tests.zerogpu_harness import POLICIES, Harness, WorkerError

SPEC = "hqq:4"
CONTEXTS = {
    "a": "The Normans gave their name to Normandy, a region in France. " * 3,
    "b": "Paris is the capital of France; the Seine runs through it. " * 3,
}
QUESTIONS = ("Where is Normandy?", "What river runs through Paris?")
TOKENS = 8
WARM_PATTERN = {  # answers in the order a-q1, b-q1, a-q2, b-q2, after a's and b's prefills
    "reuse": ["hit"] * 4,  # one worker holds both prefills
    "fresh": ["miss"] * 4,  # every call a new worker: each answer opens its file
    "kill": ["miss"] * 4,
    "swap": ["miss", "miss", "hit", "hit"],  # each visitor's next call on the other's worker, then back
}
WORKERS = {"reuse": 1, "fresh": 6, "kill": 6, "swap": 2}
SMALL_BYTES = 4096
"""The most a prefill's or an answer's request or result may take, pickled (bytes)."""


@pytest.fixture(scope="module")
def served(tiny):
    """The tiny model served to the job, in this process, before any worker is forked."""
    serve_model(tiny)
    WARM.clear()
    yield tiny
    WARM.clear()


@pytest.fixture(scope="module")
def reference(served):
    """In-process answers: {(visitor, question): token ids} and {visitor: context tokens}."""
    out: dict = {}
    for visitor, context in CONTEXTS.items():
        session = QASession(served, CacheSpec.parse(SPEC))
        out[visitor] = session.prefill(context, max_new_tokens=TOKENS).context_tokens
        for question in QUESTIONS:
            out[visitor, question] = session.ask(question, TOKENS).token_ids
    assert out["a", QUESTIONS[0]] != out["b", QUESTIONS[0]]  # a session served for the wrong file would show
    return out


def _plain(value, where="") -> None:
    """Fail on anything but plain values (and the request dataclass): no tensor, no tensor subclass, no object."""
    assert not isinstance(value, torch.Tensor), f"a tensor crossed at {where}"
    if isinstance(value, GpuRequest):
        for item in dataclasses.fields(value):
            _plain(getattr(value, item.name), f"{where}.{item.name}")
    elif isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str, where
            _plain(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _plain(item, f"{where}[{i}]")
    else:
        assert type(value) in (str, int, float, bool, type(None)), f"{type(value).__name__} crossed at {where}"


def _run(harness: Harness, visitor: str, request: GpuRequest) -> dict:
    return run_job(request, lambda r: harness.call(gpu_job, r, visitor=visitor, duration=job_seconds))


def _no_orphans(harness: Harness) -> None:
    assert not harness.alive()
    assert not [pid for pid in harness.forked if psutil.pid_exists(pid)]


@pytest.mark.parametrize("policy", POLICIES)
def test_answers_are_identical_under_every_policy(served, reference, policy, tmp_path):
    with Harness(policy) as harness:
        paths = {}
        for visitor, context in CONTEXTS.items():
            request = GpuRequest("prefill", SPEC, context, folder=str(tmp_path), max_new_tokens=TOKENS)
            result = _run(harness, visitor, request)
            assert (result["device"], result["quanto"], result["spec"]) == ("cpu", None, SPEC)
            assert result["context_tokens"] == reference[visitor]
            assert result["file_bytes"] > result["kv_bytes"] > 0
            paths[visitor] = result["session_path"]
        assert paths["a"] != paths["b"] and all(p.startswith(str(tmp_path)) for p in paths.values())
        warm = []
        for question in QUESTIONS:
            for visitor in CONTEXTS:
                request = GpuRequest(
                    "answer", SPEC, session_path=paths[visitor], question=question, max_new_tokens=TOKENS
                )
                result = _run(harness, visitor, request)
                assert tuple(result["token_ids"]) == reference[visitor, question], (policy, visitor, question)
                assert result["context_tokens"] == result["cache_length_after"] == reference[visitor]
                warm.append(result["warm"])
        assert warm == WARM_PATTERN[policy]
        assert len(harness.forked) == WORKERS[policy]
        assert len(harness.crossed) == 2 * 6 and harness.durations == [
            job_seconds(v[0][0]) for _, _, v in harness.crossed[::2]
        ]
        for direction, size, value in harness.crossed:
            _plain(value[0][0] if direction == "args" else value, direction)
            assert 0 < size <= SMALL_BYTES, (direction, size)
    _no_orphans(harness)
    assert not WARM.paths()  # the main process ran no job: its warm set stays empty


def test_compare_and_needle_are_one_call_each_and_refusals_keep_their_message(served, tmp_path):
    ask = GpuRequest("compare", context=CONTEXTS["a"], questions=QUESTIONS[:1], specs=(SPEC,), max_new_tokens=TOKENS)
    grid = GpuRequest("needle", specs=(SPEC,), lengths=(96,), depths=(50.0,), max_new_tokens=TOKENS)
    with Harness("reuse") as harness:
        compared = _run(harness, "a", ask)["report"]
        needles = _run(harness, "a", grid)["grid"]
        with pytest.raises(GpuJobError, match="is not a file; give the path of a session file"):
            _run(harness, "a", GpuRequest("answer", session_path=str(tmp_path / "gone.kvsession"), question="Why?"))
        with pytest.raises(GpuJobError, match="kind='decode' is not a GPU job"):
            _run(harness, "a", GpuRequest("decode"))
        with pytest.raises(WorkerError, match="AttributeError"):  # a bug is not a refusal: it raises, as on ZeroGPU
            harness.call(gpu_job, None)
        assert len(harness.forked) == 1
        for direction, size, value in harness.crossed:
            _plain(value[0][0] if direction == "args" else value, direction)
            assert size <= 16 * 1024, (direction, size)
    _no_orphans(harness)
    here = compare(served, CONTEXTS["a"], QUESTIONS[:1], [CacheSpec.parse(SPEC)], TOKENS).to_dict()
    assert [r["spec_text"] for r in compared["results"]] == ["dynamic", SPEC]
    for theirs, ours in zip(compared["results"], here["results"], strict=True):
        assert [q["answer"] for q in theirs["questions"]] == [q["answer"] for q in ours["questions"]]
        assert theirs["kv_bytes"] == ours["kv_bytes"] > 0
    cells = needle_grid(served, [SPEC], [96], [50.0], max_new_tokens=TOKENS).cells
    assert [(c["answer"], c["hit"], c["score"]) for c in needles["cells"]] == [
        (c.answer, c.hit, c.score) for c in cells
    ]


def test_a_warm_session_is_never_served_for_a_rewritten_file(served, reference, tmp_path):
    """In this process (off ZeroGPU `gpu_job` is the plain function): the prefill keeps its session warm; a file
    written again at the same path is another key; the byte and count bounds drop the least recently used."""
    assert gpu_job is job_module._gpu_job  # `spaces` is not installed here
    path, question = tmp_path / "visitor.kvsession", QUESTIONS[0]
    try:
        run_job(GpuRequest("prefill", SPEC, CONTEXTS["a"], session_path=str(path), max_new_tokens=TOKENS))
        answer = run_job(GpuRequest("answer", session_path=str(path), question=question, max_new_tokens=TOKENS))
        assert (answer["warm"], tuple(answer["token_ids"])) == ("hit", reference["a", question])
        other = QASession(served, CacheSpec.parse(SPEC))
        other.prefill(CONTEXTS["b"], max_new_tokens=TOKENS)
        save_session(other, path)  # another process writes the file again
        answer = run_job(GpuRequest("answer", session_path=str(path), question=question, max_new_tokens=TOKENS))
        assert (answer["warm"], tuple(answer["token_ids"])) == ("miss", reference["b", question])
        assert WARM.paths() == [str(path.resolve())]
        with pytest.raises(GpuJobError, match="holds a `hqq:4` cache, not `quanto:4`"):
            run_job(GpuRequest("answer", "quanto:4", session_path=str(path), question=question))
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


def test_the_duration_is_computed_from_the_job():
    assert job_seconds(GpuRequest("prefill", context="A short text.")) == job_module.MIN_SECONDS  # 15.02 s
    assert job_seconds(GpuRequest("answer", question="Why?", max_new_tokens=8)) == 21  # 15 + 5 + 8 x 0.12
    # 15 s to start + 30,000 characters / 3 per token x 4 ms
    assert job_seconds(GpuRequest("prefill", context="x" * 30_000)) == 55
    assert (
        job_seconds(GpuRequest("answer", question="q" * 300, max_new_tokens=100)) == 32
    )  # 15 + 5 + 300 / 3 x 0.004 + 100 x 0.12
    long = GpuRequest("compare", context="x" * 30_000, questions=("a", "b"), specs=("hqq:4",), max_new_tokens=32)
    assert job_seconds(long) == round(15 + 2 * (40 + 2 * 2 * 32 * 0.12))  # dynamic and hqq:4
    grid = GpuRequest("needle", specs=("hqq:4", "dynamic"), lengths=(1024, 2048), depths=(0.0, 50.0), max_new_tokens=8)
    assert job_seconds(grid) == round(15 + 4 * 0.004 * 1536 + 4 * 2 * 2 * 8 * 0.12)
    assert job_seconds(dataclasses.replace(long, context="x" * 10**7)) == job_module.MAX_SECONDS


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


def test_the_api_endpoints_run_the_job_and_refuse_other_paths(served, reference, tmp_path, monkeypatch):
    """On ZeroGPU app.py adds `gpu_prefill` and `gpu_answer` (`kvdemo.ui.gpu_api`); here the job runs in-process."""
    import gradio as gr

    from kvdemo.ui import App, build_demo
    from kvdemo.ui.gpu_api import add_gpu_api

    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    app = App(loader=lambda source=None: served)
    app.start_loading()
    demo = build_demo(app)
    try:
        assert add_gpu_api(demo, app) == ["gpu_prefill", "gpu_answer"]
        fns = {f.api_name: f.fn for f in demo.fns.values()}
        made = fns["gpu_prefill"](CONTEXTS["a"], SPEC, TOKENS)
        assert made["session_path"].startswith(str(tmp_path / "sessions")) and made["opened"] is False
        assert made["context_tokens"] == reference["a"]
        answer = fns["gpu_answer"](made["session_path"], QUESTIONS[0], TOKENS)
        assert tuple(answer["token_ids"]) == reference["a", QUESTIONS[0]] and answer["warm"] == "hit"
        WARM.clear()  # another worker: the file is opened
        answer = fns["gpu_answer"](made["session_path"], QUESTIONS[1], TOKENS)
        assert tuple(answer["token_ids"]) == reference["a", QUESTIONS[1]] and answer["warm"] == "miss"
        assert fns["gpu_prefill"](CONTEXTS["a"], SPEC, TOKENS)["opened"] is True  # the same context: its file
        for path in (str(tmp_path / "elsewhere.kvsession"), str(tmp_path / "sessions" / "x.txt"), "", "/etc/passwd"):
            with pytest.raises(gr.Error, match="session_path must be a path gpu_prefill returned"):
                fns["gpu_answer"](path, "Why?", 4)
        with pytest.raises(gr.Error, match="the context is empty"):
            fns["gpu_prefill"]("  ", SPEC, 4)
        with pytest.raises(gr.Error, match="nbits=5"):
            fns["gpu_prefill"](CONTEXTS["a"], "hqq:5", 4)
    finally:
        WARM.clear()
        serve_model(served)


@pytest.mark.process
def test_the_job_is_decorated_with_spaces_gpu_where_spaces_is_installed():
    """A stand-in `spaces` (ZeroGPU's is not installable here): the job is `@spaces.GPU(duration=job_seconds)`."""
    import subprocess
    import sys

    code = (
        "import sys, types\n"
        "made = {}\n"
        "def GPU(duration):\n"
        "    def wrap(fn):\n"
        "        made['duration'], made['fn'] = duration, fn\n"
        "        return fn\n"
        "    return wrap\n"
        "sys.modules['spaces'] = types.SimpleNamespace(GPU=GPU)\n"
        "from kvdemo.serve import gpu_job as g\n"
        "assert made['duration'] is g.job_seconds and made['fn'] is g.gpu_job and g.gpu_job is not g._gpu_job\n"
        "print('decorated', g.gpu_job.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "decorated gpu_job", done.stderr[-2000:]


def test_on_zerogpu_the_page_runs_on_the_cpu(monkeypatch):
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
    app_module._cpu_loader("some/model")
    assert asked == {"device": "cpu"}
