"""Stops, faults, idle and crowded sessions, memory over time, and what user text may never reach
(issue 6), on the app's handlers with tiny random Llamas.

Cost: 83 s for 21 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import gradio as gr
import psutil
import pytest

from kvdemo import CacheSpec, QASession
from kvdemo.serve.server import App
from kvdemo.serve.store import SessionStore
from kvdemo.ui import build_demo
from tests.helpers import fail_forward_at, make_tiny, named_handlers, refused

CONTEXT = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them."
QUESTION = "Who led the Normans?"
HQQ = ("hqq", 4, 64, 4, 0, 0)
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _req(name: str = "tab-1") -> gr.Request:
    return gr.Request(session_hash=name)


def _handlers(loaded, **app_kwargs):
    app = App(loader=lambda source=None: loaded, **app_kwargs)
    app.start_loading()
    app.wait_for_model()
    demo = build_demo(app)
    return app, named_handlers(demo)


def _fresh_answer(loaded, question=QUESTION, n=6, context=CONTEXT, spec=CacheSpec("hqq", nbits=4, residual_length=4)):
    session = QASession(loaded, spec)
    session.prefill(context)
    return session.ask(question, n)


def test_tab_closed_mid_answer_restores_the_cache_and_frees_the_session(tiny):
    app, fns = _handlers(tiny)
    fns["prefill"](CONTEXT, *HQQ, _req())
    qa = app.sessions.get("tab-1").qa
    context_tokens = qa.cache_length
    stream = fns["ask"](QUESTION, 40, _req())
    next(stream), next(stream)
    fns["unload"](_req())  # what Gradio calls when the tab closes
    rest = list(stream)  # the answer ends after its current decode step
    assert len(rest) <= 2 and qa.history[-1].finish_reason == "stopped"
    assert qa.cache_length == context_tokens == qa.history[-1].cache_length_after
    assert qa.ask(QUESTION, 6).token_ids == _fresh_answer(tiny).token_ids  # restored exactly
    assert len(app.sessions) == 0
    assert "Your session was freed because its browser tab was closed; press Prefill again" in refused(
        fns["ask"](QUESTION, 6, _req())
    )
    fns["prefill"](CONTEXT, *HQQ, _req())
    assert app.sessions.freed_reason("tab-1") is None
    assert list(fns["ask"](QUESTION, 6, _req()))[-1][0][-1]["content"] == _fresh_answer(tiny).text


def test_fault_inside_a_decode_step_shows_a_message_and_restores(tiny, monkeypatch):
    app, fns = _handlers(tiny)
    fns["prefill"](CONTEXT, *HQQ, _req())
    qa = app.sessions.get("tab-1").qa
    context_tokens = qa.cache_length
    fail_forward_at(monkeypatch, tiny, 3, "injected fault")
    updates = []
    with pytest.raises(gr.Error) as error:
        for update in fns["ask"](QUESTION, 10, _req()):
            updates.append(update)
    assert len(updates) == 3  # "reading the question", then two decode steps before the fault
    assert error.value.message.startswith(
        "The answer failed after 2 decode step(s) (RuntimeError: injected fault). "
        "The cache was restored to the prefilled context"
    )
    assert qa.history[-1].finish_reason == "error" and qa.cache_length == context_tokens
    monkeypatch.undo()
    assert list(fns["ask"](QUESTION, 6, _req()))[-1][0][-1]["content"] == _fresh_answer(tiny).text
    assert not app.sessions.get("tab-1").busy  # the session's lock was released


def test_idle_sessions_are_freed_and_their_users_told(tiny):
    app, fns = _handlers(tiny, idle_seconds=60)
    clock = FakeClock()
    app.sessions.clock = clock
    fns["prefill"](CONTEXT, *HQQ, _req("idle"))
    fns["prefill"](CONTEXT, *HQQ, _req("busy"))
    busy_stream = fns["ask"](QUESTION, 30, _req("busy"))
    next(busy_stream)  # an answer is running in "busy"
    clock.now += 61
    assert app.sessions.sweep() == 1  # "idle" is freed, "busy" is not
    assert "Your session was freed because it was idle for more than 1 minutes" in refused(
        fns["ask"](QUESTION, 6, _req("idle"))
    )
    assert list(busy_stream)[-1][0][-1]["content"]  # the running answer finishes normally
    assert app.sessions.get("busy").qa is not None


def test_the_number_of_sessions_is_capped_least_recently_used_idle_first(tiny):
    app, fns = _handlers(tiny, max_sessions=2)
    fns["prefill"](CONTEXT, *HQQ, _req("a"))
    fns["prefill"](CONTEXT, *HQQ, _req("b"))
    stream = fns["ask"](QUESTION, 30, _req("a"))  # "a" is the oldest, but busy
    next(stream)
    fns["prefill"](CONTEXT, *HQQ, _req("c"))
    assert len(app.sessions) == 2 and app.sessions.freed_reason("b").startswith("this server keeps at most 2 sessions")
    list(stream)
    assert "Your session was freed because this server keeps at most 2 sessions" in refused(
        fns["ask"](QUESTION, 6, _req("b"))
    )


def test_session_store_arguments_are_checked():
    with pytest.raises(ValueError, match="max_sessions=0 must be >= 1"):
        SessionStore(0)
    with pytest.raises(ValueError, match="idle_seconds=0"):
        SessionStore(4, idle_seconds=0)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_memory_stays_bounded_over_200_questions_and_50_sessions(embedded):
    """Resident memory after 200 questions (4 tokens each, flushing) in one session, and after 50 sessions
    opened, used and closed, stays within 5 % of where it was after the model load and one warm-up session.
    The model (4 layers, 4 KV heads) makes each session's dynamic cache ~2.7 MiB, so 50 leaked caches would
    add ~20 %."""
    loaded = make_tiny(embedded.tokenizer, kv_heads=4, layers=4, seed=1)
    app, fns = _handlers(loaded, max_sessions=8)
    context = " ".join([CONTEXT] * 14)  # ~ 345 tokens
    dynamic = ("dynamic", None, None, None, None, None)
    fns["prefill"](context, *dynamic, _req("warm-up"))
    list(fns["ask"](QUESTION, 2, _req("warm-up")))
    fns["unload"](_req("warm-up"))
    start = _rss()
    fns["prefill"](context, *HQQ, _req("long"))  # residual_length 4: the answers flush
    for i in range(200):
        list(fns["ask"](f"{QUESTION} ({i})", 4, _req("long")))
    qa = app.sessions.get("long").qa
    assert len(qa.history) == 200 and qa.cache_length == qa.prefill_report.context_tokens
    assert sum(a.flush_count for a in qa.history) >= 200 * 4  # every layer flushed in every answer
    fns["unload"](_req("long"))
    del qa
    after_questions = _rss()
    for i in range(50):
        fns["prefill"](context, *(HQQ if i % 2 else dynamic), _req(f"s{i}"))
        list(fns["ask"](QUESTION, 1, _req(f"s{i}")))
        fns["unload"](_req(f"s{i}"))
    after_sessions = _rss()
    figures = {
        "rss_start_mib": start / 2**20,
        "after_200_questions_mib": after_questions / 2**20,
        "after_50_sessions_mib": after_sessions / 2**20,
    }
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "memory.json").write_text(json.dumps(figures, indent=2))
    assert len(app.sessions) == 0
    assert after_questions < start * 1.05, figures
    assert after_sessions < start * 1.05, figures


def test_model_loading_never_trusts_remote_code(monkeypatch, tmp_path):
    import transformers

    from kvdemo.qa import models

    seen = []

    def capture(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", capture)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", capture)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(OSError):
        models.load_model(str(tmp_path))
    with pytest.raises(OSError):
        models.load_model("some-org/some-model")
    assert seen and all(value is False for value in seen)
    source = "\n".join(p.read_text() for p in Path(models.__file__).parents[1].rglob("*.py"))
    assert "trust_remote_code=True" not in source


def test_no_user_text_reaches_a_shell_or_executed_code():
    """The package never starts a process, evaluates text or renders user text as a template: user text
    reaches the tokenizer's chat template only as a message's content (data), never as template source."""
    package = Path(__file__).resolve().parents[1] / "kvdemo"
    source = {p.relative_to(package).as_posix(): p.read_text() for p in package.rglob("*.py")}
    forbidden = re.compile(
        r"\b(subprocess|os\.system|os\.popen|(?<!\.)eval\(|(?<!\.)exec\(|shell=True|"
        r"pickle\.load|jinja2|Template\(|trust_remote_code=True)"
    )
    hits = {name: forbidden.findall(text) for name, text in source.items() if forbidden.search(text)}
    # one process kvdemo starts: the C compiler on a kernel it ships (`kvdemo.cache.read.c_build`), an argument list
    # of the compiler's path, fixed flags and paths in the package and the cache folder; never a shell, no user text
    assert set(hits.pop("cache/read/c_build.py", ["subprocess"])) == {"subprocess"}
    assert "shell=" not in source["cache/read/c_build.py"]
    assert hits == {}


def test_switching_backend_mid_answer_finishes_on_the_old_cache_then_asks_for_a_prefill(tiny):
    app, fns = _handlers(tiny)
    fns["prefill"](CONTEXT, *HQQ, _req())
    stream = fns["ask"](QUESTION, 6, _req())
    next(stream)
    note, _, ask_button, _ = fns["gate"](CONTEXT, "fp8", None, None, None, None, None, _req())
    assert "Press **Prefill** to rebuild it" in note and ask_button["interactive"] is False
    final = list(stream)[-1]
    assert final[0][-1]["content"] == _fresh_answer(tiny).text  # the answer ran on its own (hqq) cache
    fns["prefill"](CONTEXT, "fp8", None, None, None, None, None, _req())
    expected = _fresh_answer(tiny, spec=CacheSpec("fp8")).text
    assert list(fns["ask"](QUESTION, 6, _req()))[-1][0][-1]["content"] == expected


def test_prefill_during_an_answer_stops_it_then_replaces_the_context(tiny):
    import threading

    app, fns = _handlers(tiny)
    fns["prefill"](CONTEXT, *HQQ, _req())
    old = app.sessions.get("tab-1").qa
    stream = fns["ask"](QUESTION, 40, _req())
    next(stream)
    other = "Southern California is a megaregion in the United States."
    done = threading.Thread(target=fns["prefill"], args=(other, *HQQ, _req()))
    done.start()  # like a second click in the browser: it waits for the running answer
    list(stream)  # the answer sees the stop request and ends after its current step
    done.join(timeout=60)
    assert not done.is_alive() and old.history[-1].finish_reason == "stopped"
    assert old.cache_length == old.prefill_report.context_tokens
    qa = app.sessions.get("tab-1").qa
    assert qa is not old and qa.context == other
    answer = list(fns["ask"]("What is it?", 5, _req()))[-1][0][-1]["content"]
    assert answer == _fresh_answer(tiny, "What is it?", 5, context=other).text


def test_a_full_server_refuses_new_sessions_instead_of_cutting_a_running_answer(tiny):
    app, fns = _handlers(tiny, max_sessions=1)
    fns["prefill"](CONTEXT, *HQQ, _req("a"))
    stream = fns["ask"](QUESTION, 30, _req("a"))
    next(stream)
    assert "The server is full: all 1 sessions are busy answering. Try again in a minute" in refused(
        fns["prefill"](CONTEXT, *HQQ, _req("b"))
    )
    assert list(stream)[-1][0][-1]["content"] == _fresh_answer(tiny, n=30).text  # "a" answered to the end


def test_handlers_that_only_read_or_stop_never_create_or_evict_sessions(tiny):
    app, fns = _handlers(tiny, max_sessions=1)
    fns["prefill"](CONTEXT, *HQQ, _req("a"))
    for i in range(5):  # an API client cycling session ids through the read-only endpoints
        assert fns["stop"](_req(f"x{i}")) is None
        assert fns["cancel_compare"](_req(f"x{i}")) is None
        assert fns["compare_questions"](CONTEXT, _req(f"x{i}")) == ""
        line, notice, ask, _ = fns["gate"](CONTEXT, "fp8", None, None, None, None, None, _req(f"x{i}"))
        assert "nothing prefilled in this tab yet" in line and ask["interactive"] is False
    assert len(app.sessions) == 1 and app.sessions.peek("a").qa is not None


def test_a_public_server_keeps_its_model(tiny):
    app, fns = _handlers(tiny, public=True)
    assert "This public server serves one model to everyone (tiny-llama-2x2x64)" in refused(
        fns["load_model"]("HuggingFaceTB/SmolLM2-135M-Instruct")
    )
    assert app.loaded is tiny


def test_cancel_pressed_while_the_comparison_waits_in_the_queue_is_kept(tiny):
    app, fns = _handlers(tiny)
    compare_queued = next(f.fn for f in build_demo(app).fns.values() if getattr(f.fn, "__name__", "") == "queued")
    fns["cancel_compare"](_req())  # nothing is queued: ignored
    status = compare_queued(["fp8"], "", QUESTION, 3, _req())  # the button's click, before the run leaves the queue
    assert status.startswith("Submitted. One comparison runs at a time") and "Queued" not in status
    fns["cancel_compare"](_req())  # pressed while waiting
    view = fns["compare"](CONTEXT, ["fp8"], "", QUESTION, 3, _req())
    status, table = view.compare_status, view.compare_table
    assert status.startswith("Cancelled after 0 spec(s).") and len(table) == 0 and list(table.columns)[0] == "spec"
    status, *_ = fns["compare"](CONTEXT, ["fp8"], "", QUESTION, 3, _req())  # the next run is not affected
    assert status.startswith("Compared 2 specs")


@pytest.mark.parametrize(
    "env, argv, message",
    [
        ({"KVDEMO_PORT": "eighty"}, [], "argument --port: invalid int value: 'eighty'"),
        ({"KVDEMO_IDLE_MINUTES": "soon"}, [], "argument --idle-minutes: invalid float value: 'soon'"),
        ({"KVDEMO_CONCURRENCY": "0"}, [], "--concurrency and --max-sessions must be >= 1"),
        ({}, ["--kv-budget-mib", "-1"], "--idle-minutes and --kv-budget-mib must be >= 0"),
        ({"KVDEMO_PUBLIC": "1"}, ["--model", "/srv/models/x"], "--public serves the embedded model or a Hub id"),
    ],
)
def test_bad_app_settings_stop_with_a_message(monkeypatch, capsys, env, argv, message):
    import app as app_module

    for name in ("SPACE_ID", "KVDEMO_PORT", "KVDEMO_IDLE_MINUTES", "KVDEMO_CONCURRENCY", "KVDEMO_PUBLIC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        app_module.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_app_settings_reach_the_app(monkeypatch):
    import app as app_module

    monkeypatch.delenv("SPACE_ID", raising=False)
    args = app_module.parse_args(["--public", "--idle-minutes", "5", "--kv-budget-mib", "64", "--concurrency", "2"])
    assert (args.public, args.idle_minutes, args.kv_budget_mib, args.concurrency) == (True, 5.0, 64.0, 2)
    assert app_module.parse_args(["--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--public"]).public


def test_bad_compare_input_is_refused_at_the_click(tiny):
    app, fns = _handlers(tiny)
    compare_queued = next(f.fn for f in build_demo(app).fns.values() if getattr(f.fn, "__name__", "") == "queued")
    for args, message in (
        ((["fp8"], "hqq:9", QUESTION, 3), "more specs, line 1: nbits=9"),
        (([], "", QUESTION, 3), "Tick at least one spec"),
        ((["fp8"], "", "", 3), "Give at least one question"),
        ((["fp8"], "", QUESTION, 10_000), "max_new_tokens=10000 is more than a comparison runs here"),
    ):
        assert message in refused(compare_queued(*args, _req()))
    assert app.sessions.peek("tab-1") is None  # refused before anything was queued or created
