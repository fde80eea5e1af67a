"""The walkthroughs run top to bottom (shorter: KVDEMO_NOTEBOOK_QUICK=1, same cells) with the project's
kernel, show only what the reader needs (no progress bar, warning or stderr), open with what they show and how
long they take, and are committed without outputs.

Cost: 141 s for 19 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from kvdemo.quiet import NOISE

pytestmark = pytest.mark.model  # each notebook loads the embedded model in its own kernel

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def noise(nb) -> list[str]:
    """Every output of `nb` a reader does not need: stderr streams, and text (stdout, a result's or a display's
    text/plain, text/html or text/markdown) matching `NOISE`; each as "cell <index>: <output type>: <the text>"."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            kind = output.get("output_type")
            if kind == "stream":
                texts = [output.get("text", "")]
                if output.get("name") == "stderr":
                    found.append(f"cell {index}: stderr: {texts[0]!r}")
                    continue
            else:
                data = output.get("data", {})
                texts = [data.get(m, "") for m in ("text/plain", "text/html", "text/markdown")]
            for text in texts:
                text = "".join(text) if isinstance(text, list) else text
                if NOISE.search(text):
                    found.append(f"cell {index}: {kind}: {text[:300]!r}")
    return found


def test_noise_finds_bars_warnings_and_stderr():
    def stream(name, text):
        return {"output_type": "stream", "name": name, "text": text}

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x") for _ in range(5)]
    nb.cells[0].outputs = [stream("stdout", "469 context tokens prefilled in 1.90 s\n")]
    nb.cells[1].outputs = [stream("stderr", "anything")]
    nb.cells[2].outputs = [stream("stdout", "\rLoading weights: 100%|##########| 272/272 [00:00<00:00, 19857.80it/s]")]
    nb.cells[3].outputs = [stream("stdout", "FutureWarning: `past_key_values` is deprecated")]
    nb.cells[4].outputs = [{"output_type": "execute_result", "data": {"text/plain": "tqdm bar"}, "metadata": {}}]
    assert [line.split(":")[0] for line in noise(nb)] == ["cell 1", "cell 2", "cell 3", "cell 4"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_opens_with_what_it_shows_and_its_time(path):
    first = nbformat.read(path, as_version=4).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "**Time on a 2-core CPU**" in first.source, f"{path.name}: say how long it takes"


def test_the_walkthroughs_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_residual_and_flushes.ipynb",
        "03_backends_side_by_side.ipynb",
        "04_needle_in_a_haystack.ipynb",
        "05_why_rotation.ipynb",
        "06_which_kv_setting.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path, monkeypatch):
    monkeypatch.setenv("KVDEMO_NOTEBOOK_QUICK", "1")
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    assert noise(nb) == [], f"{path.name}: outputs a reader does not need"
    figures = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert figures, f"{path.name} drew no chart"


@pytest.mark.slow
def test_jupyterlab_runs_notebook_1_in_chromium():
    """`make notebook` in a real browser (scripts/check_jupyterlab.py): JupyterLab opens notebook 1 in Debian's
    chromium, its first 4 code cells run (load, the case, the prefill, three answers), no output is noise. The
    screenshot goes to artifacts/jupyterlab/notebook1.png. About a minute: marked slow."""
    root = Path(__file__).resolve().parents[1]
    screenshot = root / "artifacts" / "jupyterlab" / "notebook1.png"
    result = subprocess.run(
        [
            sys.executable,
            str(root / "scripts" / "check_jupyterlab.py"),
            "--cells",
            "4",
            "--screenshot",
            str(screenshot),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["noise"] == [] and len(report["prompts"]) == 4  # each "[n]:": ran
    texts = [o["text"] for o in report["outputs"]]
    assert "SmolLM2-135M-Instruct" in texts[0] and any("context tokens prefilled" in t for t in texts)
    assert screenshot.stat().st_size > 10_000


@pytest.mark.process
def test_make_notebook_starts_jupyterlab_as_this_user(tmp_path):
    """`make notebook` serves JupyterLab whoever runs it: as root (containers, this machine) it passes
    `--allow-root`, without which JupyterLab exits with "Running as root is not recommended"."""
    import os
    import signal
    import socket
    import urllib.request

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "kvdemo-test"
    args = f"--no-browser --ip 127.0.0.1 --port {port} --IdentityProvider.token={token}"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path), JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    log = open(tmp_path / "lab.log", "w+")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        ["make", "-s", "notebook", f"LAB_ARGS={args}"],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        status = None
        for _ in range(240):  # up to a minute: JupyterLab starts in a few seconds
            if process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2) as r:
                    status = r.status
                    break
            except OSError:
                time.sleep(0.25)
        log.seek(0)
        assert status == 200, f"make notebook did not serve JupyterLab (exit {process.poll()}): {log.read()[-2000:]}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        log.close()
