"""app.py's load, session-file and MCP settings (`--server-kv-budget-mib`, `--queue-size`, `--session-files-mib`,
`--max-upload-mib`, `--mcp` and their environment variables) and that `main` hands them to the app, the queue and
`launch`."""

from __future__ import annotations

import pytest

import app as app_module

SETTINGS = (
    "SPACE_ID",
    "KVDEMO_SERVER_KV_BUDGET_MIB",
    "KVDEMO_QUEUE_SIZE",
    "KVDEMO_MCP",
    "KVDEMO_SESSION_FILES_MIB",
    "KVDEMO_MAX_UPLOAD_MIB",
)


@pytest.fixture
def env(monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_the_environment_and_the_command_line(env):
    args = app_module.parse_args([])
    assert (args.server_kv_budget_mib, args.queue_size, args.mcp) == (4096.0, 64, False)
    assert (args.session_files_mib, args.max_upload_mib) == (2048.0, 512.0)
    env.setenv("KVDEMO_SERVER_KV_BUDGET_MIB", "512")
    env.setenv("KVDEMO_QUEUE_SIZE", "8")
    env.setenv("KVDEMO_MCP", "yes")
    args = app_module.parse_args([])
    assert (args.server_kv_budget_mib, args.queue_size, args.mcp) == (512.0, 8, True)
    args = app_module.parse_args(["--server-kv-budget-mib", "0", "--queue-size", "0", "--no-mcp"])
    assert (args.server_kv_budget_mib, args.queue_size, args.mcp) == (0.0, 0, False)


@pytest.mark.parametrize(
    "variables, argv, message",
    [
        (
            {},
            ["--queue-size", "-1"],
            "--server-kv-budget-mib, --session-files-mib and --queue-size must be >= 0 (0 turns",
        ),
        ({"KVDEMO_SERVER_KV_BUDGET_MIB": "-5"}, [], "--server-kv-budget-mib, --session-files-mib and --queue-size"),
        (
            {"KVDEMO_SESSION_FILES_MIB": "-1"},
            [],
            "--session-files-mib and --queue-size must be >= 0 (0 turns them off)",
        ),
        ({}, ["--max-upload-mib", "1"], "--max-upload-mib must be >= 2 (a context file may be 2 MiB)"),
        ({"KVDEMO_QUEUE_SIZE": "lots"}, [], "argument --queue-size: invalid int value: 'lots'"),
        ({"KVDEMO_SERVER_KV_BUDGET_MIB": "4 GiB"}, [], "argument --server-kv-budget-mib: invalid float value: '4 GiB'"),
    ],
)
def test_bad_settings_stop_with_a_message(env, capsys, variables, argv, message):
    for name, value in variables.items():
        env.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        app_module.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


class FakeDemo:
    """Records what `main` asks of the page: the queue's settings and launch's."""

    def __init__(self):
        self.calls = {}
        self.mcp_server_obj = None
        self.mcp_error = "Error launching MCP server: the mcp package is missing"

    def queue(self, **kwargs):
        self.calls["queue"] = kwargs

    def launch(self, **kwargs):
        self.calls["launch"] = kwargs

    def block_thread(self):
        self.calls["block_thread"] = True

    def close(self):
        self.calls["close"] = True


@pytest.fixture
def fake_page(env):
    import kvdemo.ui

    made = {}

    class FakeApp:
        loaded = None  # the start-up load has not finished: the log says it runs in the background

        def __init__(self, **kwargs):
            made["app"] = kwargs

        def start_loading(self):
            pass

        def start_sweeper(self):
            pass

    def build_demo(app):
        made["demo"] = FakeDemo()
        return made["demo"]

    env.setattr(kvdemo.ui, "App", FakeApp)
    env.setattr(kvdemo.ui, "build_demo", build_demo)
    return made


def test_main_hands_the_settings_to_the_app_the_queue_and_launch(fake_page):
    app_module.main(["--server-kv-budget-mib", "256", "--queue-size", "16", "--concurrency", "1"])
    calls = fake_page["demo"].calls
    assert fake_page["app"]["server_kv_budget_bytes"] == 256 * 2**20
    assert calls["queue"] == {"default_concurrency_limit": 1, "max_size": 16}
    assert calls["launch"]["mcp_server"] is False and calls["block_thread"]
    assert calls["launch"]["state_session_capacity"] == 4 * 32  # Gradio's per-session state, bounded like ours
    assert calls["launch"]["max_file_size"] == 512 * 2**20  # a session file to open; a context is checked at 2 MiB
    files = fake_page["app"]["session_files"]
    assert files.max_bytes == 2048 * 2**20 and files.folder.name == "sessions"
    app_module.main(["--server-kv-budget-mib", "0", "--queue-size", "0", "--concurrency", "1"])
    assert fake_page["app"]["server_kv_budget_bytes"] is None
    assert fake_page["demo"].calls["queue"] == {"default_concurrency_limit": 1, "max_size": None}
    app_module.main(["--session-files-mib", "0", "--max-upload-mib", "64", "--concurrency", "1"])
    assert fake_page["app"]["session_files"] is None and fake_page["demo"].calls["launch"]["max_file_size"] == 64 << 20


def test_an_mcp_server_that_does_not_start_stops_the_app_with_gradios_message(fake_page):
    with pytest.raises(SystemExit, match="kvdemo: --mcp: Error launching MCP server: the mcp package is missing"):
        app_module.main(["--mcp", "--concurrency", "1"])
    calls = fake_page["demo"].calls
    assert calls["launch"]["mcp_server"] is True and calls["close"] and "block_thread" not in calls


def test_the_server_log_is_printed_as_kvdemo_lines(capsys):
    """The kvdemo loggers (INFO and up; the server's messages go through `logging`) come out on standard output as
    `kvdemo: <message>`, the lines a Space's log shows and scripts/rehearse_space.py reads; DEBUG does not."""
    import logging

    logger = logging.getLogger("kvdemo")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        app_module.log_to_stdout()
        logging.getLogger("kvdemo.serve.server").info("model loaded: %s", "tiny")
        logging.getLogger("kvdemo.ui.inputs").debug("not shown")
        assert capsys.readouterr().out == "kvdemo: model loaded: tiny\n"
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
