"""Session files on the page and the server: the server's folder of session files (`kvdemo.serve.session_files`: a
prefill saved, the same prefill opened after a restart instead of run, a damaged file removed, the folder bounded) and
the Ask tab's Save session and open (`kvdemo.ui.session_box`: the page set to the file's context and spec, refusals
beside Prefill keeping the tab's cache).

Cost: 2 s in a pytest-xdist worker (the clean-clone CI of 2026-12-05; the tiny model)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import pytest

from kvdemo.cache.registry import GROUP_OPTIONS
from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.session import QASession
from kvdemo.qa.session_file import open_session, save_session
from kvdemo.serve.session_files import SAVED_COPY, SessionFiles
from kvdemo.ui import App, build_demo
from kvdemo.ui.ask_widgets import PrefillView
from tests.helpers import named_handlers

CONTEXT = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them."
QUESTION = "Who led the Normans?"
HQQ = ("hqq", 4, 64, 4, 0, 0)


def _page(tiny, folder=None):
    app = App(loader=lambda source=None: tiny, session_files=SessionFiles(folder, 1 << 30) if folder else None)
    app.start_loading()
    demo = build_demo(app)
    by_name = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    named = {name: by_name[name] for name in ("saving", "opening", "reopen")}
    return app, {**named_handlers(demo), **named}


def _answer(fns, name):
    return list(fns["ask"](QUESTION, 6, gr.Request(session_hash=name)))[-1].chat[-1]["content"]


def test_a_restarted_app_opens_the_saved_prefill_instead_of_running_it(tiny, tmp_path):
    app, fns = _page(tiny, tmp_path)
    summary = fns["prefill"](CONTEXT, *HQQ, gr.Request(session_hash="a"))[0]
    assert summary.startswith("Prefilled **")
    (saved,) = app.session_files.files()
    first = _answer(fns, "a")
    again, fns = _page(tiny, tmp_path)  # a restart: a new App over the same folder
    summary = fns["prefill"](CONTEXT, *HQQ, gr.Request(session_hash="b"))[0]
    assert summary.startswith("Opened **") and "from this server's saved copy of the same prefill in " in summary
    qa = again.sessions.get("b").qa
    assert qa.prefill_report.opened_from == SAVED_COPY and again.kv.holders().get("cache:b", 0) > 0
    assert _answer(fns, "b") == first
    fresh = QASession(tiny, qa.spec)
    fresh.prefill(CONTEXT)
    assert fresh.ask(QUESTION, 6).token_ids == qa.history[-1].token_ids
    other = fns["prefill"](CONTEXT, "quanto", 4, 64, 4, 0, 0, gr.Request(session_hash="b"))[0]
    assert other.startswith("Prefilled **") and len(again.session_files.files()) == 2  # another spec: its own file


def test_a_reload_reopens_the_kept_context_from_its_file(tiny, tmp_path):
    """The page's load, after restoring the Context box and options the browser kept, opens their file."""
    app, fns = _page(tiny, tmp_path)
    fns["prefill"](CONTEXT, *HQQ, gr.Request(session_hash="a"))
    again, fns = _page(tiny, tmp_path)  # a restart, then a reload of the page
    again.wait_for_model()
    fields = dict(zip(("backend", *GROUP_OPTIONS), HQQ))
    call = {"request": gr.Request(session_hash="b"), "progress": lambda *args, **kwargs: None}
    view = PrefillView(*fns["reopen"](CONTEXT, **fields, **call))
    assert view.prefill_info.startswith("Opened **") and view.ask_button["interactive"] is True
    assert again.sessions.get("b").qa.prefill_report.opened_from == SAVED_COPY
    assert fns["reopen"](CONTEXT, **fields, **call) == PrefillView()  # the tab holds a prefill: nothing changes
    unchanged = PrefillView()
    for context, backend in ((CONTEXT + " More.", "hqq"), ("", "hqq"), (CONTEXT, "no such")):
        other = {**call, "request": gr.Request(session_hash=f"c{len(context)}{backend}")}
        assert fns["reopen"](context, **{**fields, "backend": backend}, **other) == unchanged, (context, backend)
    # the same text with another spec: nothing reopens, and the line says which spec the kept prefill has
    other = {**call, "request": gr.Request(session_hash="quanto-tab")}
    said = fns["reopen"](CONTEXT, **{**fields, "backend": "quanto"}, **other)
    assert said == unchanged._replace(prefill_info=said.prefill_info)
    assert said.prefill_info.startswith("ℹ Nothing is prefilled in this tab: the saved prefill of this text is with")
    assert "`hqq:4," in said.prefill_info
    assert len(again.session_files.files()) == 1  # nothing was prefilled or saved


def test_a_damaged_file_is_removed_and_the_prefill_runs(tiny, tmp_path):
    app, fns = _page(tiny, tmp_path)
    fns["prefill"](CONTEXT, *HQQ, gr.Request(session_hash="a"))
    (saved,) = app.session_files.files()
    size = saved.stat().st_size
    saved.write_bytes(saved.read_bytes()[:-10])
    summary = fns["prefill"](CONTEXT, *HQQ, gr.Request(session_hash="a"))[0]
    assert summary.startswith("Prefilled **")
    (written,) = app.session_files.files()
    # written anew, whole: it opens (digest checked); its size is the first file's within the header's 8-byte padding
    # (the manifest holds the new prefill's seconds, whose digits vary)
    assert written.name == saved.name and abs(written.stat().st_size - size) <= 8
    assert open_session(tiny, written).cache_length == app.sessions.get("a").qa.cache_length


def test_the_folder_keeps_the_most_recently_used_files_within_its_bound(tiny, tmp_path):
    files = SessionFiles(tmp_path, 1 << 30)
    sessions = []
    for text in ("First text about Normandy.", "Second text about Paris.", "Third text about Rome."):
        qa = QASession(tiny, CacheSpec("dynamic"))
        qa.prefill(text)
        sessions.append((qa, qa.prepare(text)))
        files.save(qa, sessions[-1][1])
    sizes = [p.stat().st_size for p in files.files()]
    assert len(sizes) == 3
    assert files.open(*sessions[0]) is not None  # used: now the most recent
    files.max_bytes = sum(sizes) - 1
    files.trim()
    kept = files.files()
    names = [files.path(qa.loaded, qa.spec, prepared).name for qa, prepared in (sessions[2], sessions[0])]
    assert [p.name for p in kept] == names
    with pytest.raises(ValueError, match="max_bytes=0 must be >= 1"):
        SessionFiles(tmp_path, 0)


def test_the_folder_neither_follows_nor_opens_a_symlink(tiny, tmp_path):
    """llama.cpp #26315's class: a symlink in the save folder must not make a save write outside it, nor a prefill
    open a file the folder does not hold."""
    outside, folder = tmp_path / "outside", tmp_path / "sessions"
    outside.mkdir()
    folder.mkdir()
    files = SessionFiles(folder, 1 << 30)
    qa = QASession(tiny, CacheSpec("dynamic"))
    qa.prefill("Rollo led the Normans.")
    prepared = qa.prepare("Rollo led the Normans.")
    target = outside / "elsewhere.kvsession"
    target.write_bytes(b"keep me")
    files.path(qa.loaded, qa.spec, prepared).symlink_to(target)  # the file's own name is a link out of the folder
    assert files.save(qa, prepared) is None and target.read_bytes() == b"keep me"
    assert files.open(qa, prepared) is None and files.files() == []
    files.trim()
    assert target.read_bytes() == b"keep me"
    linked = SessionFiles(tmp_path / "linked", 1 << 30)  # the folder itself a link
    (tmp_path / "linked").symlink_to(outside, target_is_directory=True)
    assert linked.save(qa, prepared) is None and sorted(p.name for p in outside.iterdir()) == ["elsewhere.kvsession"]
    assert linked.files() == []
    files.path(qa.loaded, qa.spec, prepared).unlink()  # the link alone; a real file is then written and opened
    assert files.save(qa, prepared) == files.path(qa.loaded, qa.spec, prepared) and files.open(qa, prepared) is not None


def test_save_session_then_open_it_in_another_tab(tiny, tmp_path):
    app, fns = _page(tiny)
    request = gr.Request(session_hash="a")
    path, notice = fns["saving"](request)
    assert path is not None and notice.startswith("⚠ nothing is prefilled in this tab")
    fns["prefill"](CONTEXT, *HQQ, request)
    path, notice = fns["saving"](request)
    assert path.endswith(".kvsession") and "download it from the session file box below" in notice
    qa = app.sessions.get("a").qa
    assert notice.startswith(f"Saved the cache's `{qa.spec.full_text}` over {qa.prefill_report.context_tokens} tokens")
    assert qa.spec.full_text.startswith("hqq:4,q_group_size=64,residual_length=4,axis_key=0,axis_value=0,")
    first = _answer(fns, "a")
    context, backend, *rest = fns["opening"](path, gr.Request(session_hash="b"))
    values, view, box = rest[: len(GROUP_OPTIONS)], PrefillView(*rest[len(GROUP_OPTIONS) : -1]), rest[-1]
    assert context == CONTEXT and backend == "hqq" and values[:3] == [4, 64, 4]
    assert view.prefill_info.startswith("Opened **") and view.ask_button["interactive"] is True
    assert f"from the session file `{Path(path).name}`" in view.prefill_info and box is None  # ready for the next
    gate = fns["gate"](context, backend, *values, gr.Request(session_hash="b"))
    assert gate[2]["interactive"] is True  # the page shows what the cache holds
    assert _answer(fns, "b") == first


def test_files_the_page_cannot_open_are_refused_and_the_cache_stays(tiny, tmp_path):
    app, fns = _page(tiny)
    request = gr.Request(session_hash="a")
    fns["prefill"](CONTEXT, *HQQ, request)
    held = app.sessions.get("a").qa
    planned = QASession(tiny, CacheSpec.parse("quanto,plan=k4v2+k2v2"))
    planned.prefill(CONTEXT)
    save_session(planned, tmp_path / "planned.kvsession")
    (tmp_path / "text.kvsession").write_text("not a session")
    for path, message in (
        (tmp_path / "planned.kvsession", "the page's option fields cannot show `quanto,plan=k4v2+k2v2`"),
        (tmp_path / "text.kvsession", "is not a session file, or it was cut short"),
    ):
        out = fns["opening"](str(path), request)
        notice = out[2 + len(GROUP_OPTIONS) + PrefillView._fields.index("notice")]
        assert notice.startswith("⚠ ") and message in notice, notice
        assert out[0] == gr.skip() and app.sessions.get("a").qa is held
        assert out[-1] is None  # the refused file is taken out of the box
    assert app.sessions.get("a").qa.context == CONTEXT
    assert app.kv.holders().get("cache:a", 0) > 0
