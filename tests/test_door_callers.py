"""One door per job (`kvdemo.serve.door.Door`): the test names the door's callers and what each asks of it, read from
the code (every call on a `door` or on a long job it opened), and checks that no caller assembles a job itself: no
session built, prefilled, streamed or opened, no comparison, grid or recommendation run, no KV reservation and no
long-job slot taken outside the door. A new caller is one line of `CALLERS`; a caller that starts assembling a job
again fails here with the line that does it.

Cost: under a second (it parses the callers' modules)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CALLERS = {
    "kvdemo/ui/ask_tab.py": {"prefill", "answer", "stop", "reference"},
    "kvdemo/ui/session_box.py": {"open_file", "save_file"},
    "kvdemo/ui/mcp_tools.py": {"prefill", "answer", "stop", "long_job", "job.compare", "job.recommend"},
    "kvdemo/ui/compare_tab.py": {"long_job", "job.compare"},
    "kvdemo/ui/needle_tab.py": {"long_job", "job.needle"},
    "kvdemo/ui/recommend_tab.py": {"long_job", "job.recommend"},
    "kvdemo/cli/ask.py": {"prefill", "open_file", "save_file", "answer"},
    "kvdemo/cli/main.py": {"long_job", "job.compare", "job.needle", "job.recommend"},
}
"""Each caller of the door, and what it asks: the door's methods, and `job.<kind>` for a long job's."""

THE_DOOR = {
    "kvdemo/serve/door.py": "the door itself",
    "kvdemo/serve/jobs.py": "the job records: each kind's model work, run by a runner",
    "kvdemo/serve/runner.py": "the runner in this process (and the app's session files as a job's place)",
    "kvdemo/serve/device.py": "the runner of a device worker: a job sent there, its records turned back",
    "kvdemo/serve/gpu_job.py": "the worker's side: a job record run in a ZeroGPU worker, its sessions kept warm",
    "kvdemo/serve/session_files.py": "the door's folder of session files (opened in place of a prefill, saved after)",
    "kvdemo/serve/warm_sessions.py": "the worker's warm sessions",
    "kvdemo/serve/recommended.py": "the page default, measured once per model at its load, before any session",
    "kvdemo/serve/store.py": "the session store's own protocols, which the door takes (the long-job slot)",
}
"""The modules of kvdemo/serve/, kvdemo/ui/ and kvdemo/cli/ allowed to run a job's parts, and why."""

ASSEMBLY_CALLS = {"QASession", "open_session", "save_session", "compare", "needle_grid", "recommend", "prefill_from"}
"""Functions that build or run a job's parts (called by name)."""
ASSEMBLY_METHODS = {"stream", "prefill", "ask", "score", "long_job", "reserve", "transfer"}
"""Methods that do (called on anything but the door or a long job it opened)."""


def _modules() -> list[Path]:
    folders = [ROOT / "kvdemo" / name for name in ("serve", "ui", "cli")]
    return sorted(p for folder in folders for p in folder.glob("*.py")) + [ROOT / "app.py"]


def _door_calls(tree: ast.AST) -> tuple[set[str], list[tuple[int, str]]]:
    """(what the module asks of the door: method names, `job.<kind>` for a long job's), and every call that
    assembles a job elsewhere: (line, what)."""
    asked, assembled = set(), []
    for node in ast.walk(tree):  # a long job's kind, called or handed on (`functools.partial(job.compare, ...)`)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("job", "other"):
            if node.attr in ("compare", "needle", "recommend"):
                asked.add(f"job.{node.attr}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ASSEMBLY_CALLS:
            assembled.append((node.lineno, func.id))
        if not isinstance(func, ast.Attribute):
            continue
        owner = func.value
        on_door = (isinstance(owner, ast.Name) and owner.id == "door") or (
            isinstance(owner, ast.Attribute) and owner.attr == "door"
        )
        on_job = isinstance(owner, ast.Name) and owner.id in ("job", "other")
        if on_door:
            asked.add(func.attr)
        elif not on_job and func.attr in ASSEMBLY_METHODS | ASSEMBLY_CALLS:
            assembled.append((node.lineno, f".{func.attr}"))
    return asked, assembled


def test_the_door_has_these_callers_and_no_one_else_assembles_a_job():
    found = {}
    for path in _modules():
        name = path.relative_to(ROOT).as_posix()
        if name in THE_DOOR:
            continue
        asked, assembled = _door_calls(ast.parse(path.read_text(encoding="utf-8")))
        assert not assembled, f"{name} assembles a job itself (go through App.door): {assembled}"
        if asked:
            found[name] = asked
    assert found == CALLERS


def test_the_door_holds_every_part_of_a_job():
    """What the callers no longer do is done in the door: the lock, the reservations, the session file, the
    install in the store, the long-job slot (read from `Door`'s own code)."""
    text = (ROOT / "kvdemo/serve/door.py").read_text(encoding="utf-8")
    for part in (
        "user.lock",
        "kv.reserve(",
        "kv.transfer(",
        "self.runner.run(PrefillJob(",
        "self.runner.run(OpenJob(",
        "user.qa = session",
        "sessions.long_job(",
        "user.interrupt()",
        "user.answering()",
    ):
        assert part in text, part
