"""The walkthroughs run top to bottom (shorter: KVDEMO_NOTEBOOK_QUICK=1, same cells) with the project's
kernel, and are committed without outputs."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_walkthroughs_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_residual_and_flushes.ipynb",
        "03_backends_side_by_side.ipynb",
        "04_needle_in_a_haystack.ipynb",
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
    figures = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert figures, f"{path.name} drew no chart"
