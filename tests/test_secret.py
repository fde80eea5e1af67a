"""kvdemo.serve.secret: the browser state's secret, the same across restarts (issue 23: gradio-app/gradio#10263),
from the environment, else a private file made once, else (the folder cannot be written) a new one with a warning;
and the page's `gr.BrowserState` encrypts with it."""

from __future__ import annotations

import logging
import stat

import gradio as gr

from kvdemo.serve.secret import ENV, SECRET_FILE, browser_state_secret


def test_the_file_is_made_once_private_and_read_again(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    folder = tmp_path / "cache" / "kvdemo"  # not there yet: made, owner only
    first = browser_state_secret(folder)
    assert len(first) >= 32 and browser_state_secret(folder) == first  # a restart reads the same
    path = folder / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert path.read_text().strip() == first
    assert browser_state_secret(tmp_path / "elsewhere") != first  # drawn, not a constant
    path.write_text("\n")  # an empty file is made again
    again = browser_state_secret(folder)
    assert len(again) >= 32 and again != first and browser_state_secret(folder) == again


def test_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "  set-in-the-space-settings  ")
    assert browser_state_secret(tmp_path) == "set-in-the-space-settings"
    assert not (tmp_path / SECRET_FILE).exists()  # nothing written when it is given
    monkeypatch.setenv(ENV, "")  # empty counts as unset
    assert browser_state_secret(tmp_path) == (tmp_path / SECRET_FILE).read_text().strip()


def test_a_folder_that_cannot_be_written_gives_a_secret_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="kvdemo.serve.secret"):
        one, two = browser_state_secret(blocker), browser_state_secret(blocker)
    assert len(one) >= 32 and one != two  # the page still works, as Gradio's own random secret would
    assert "will not survive a restart" in caplog.text and ENV in caplog.text


def test_the_page_keeps_its_state_with_that_secret(tmp_path, monkeypatch, tiny):
    from kvdemo.serve.server import App
    from kvdemo.ui import build_demo

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    kept = [
        [b for b in build_demo(App(loader=lambda source: tiny)).blocks.values() if isinstance(b, gr.BrowserState)]
        for _ in range(2)  # two starts of the server
    ]
    assert [len(k) for k in kept] == [1, 1]
    assert kept[0][0].secret == kept[1][0].secret == (tmp_path / SECRET_FILE).read_text().strip()
    assert kept[0][0].storage_key == "kvdemo-ask-tab"
