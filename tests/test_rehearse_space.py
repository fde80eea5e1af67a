"""The rehearsed Space (`scripts/rehearse_space.py`): a fresh venv from requirements.txt alone, `SPACE_ID` set,
the Hub model served from a pre-seeded Hugging Face cache offline, `python app.py` on 0.0.0.0:7860, and a question
answered through `gradio_client`. Minutes of pip and CPU: marked slow (`pytest -m "not slow"` skips it; `make test`
and CI run it). The report goes to artifacts/space_rehearsal.json.

Cost: 74 s for 1 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import rehearse_space  # noqa: E402

from .e2e.conftest import free_port  # noqa: E402


@pytest.mark.slow
def test_the_rehearsed_space_serves_on_all_interfaces_and_answers(tmp_path):
    port = 7860 if rehearse_space.free(7860) else free_port()  # another app may hold 7860 on a shared machine
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "rehearse_space.py"),
            "--port",
            str(port),
            "--workdir",
            str(tmp_path / "space"),
            "--timeout",
            "2400",
        ],
        capture_output=True,
        text=True,
        timeout=2700,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    (ROOT / "artifacts").mkdir(exist_ok=True)
    (ROOT / "artifacts" / "space_rehearsal.json").write_text(json.dumps(report, indent=2))
    assert report["checks"] == {
        "listens_on_0.0.0.0": True,
        "model_from_the_seeded_cache": True,
        "embedded_wheel_absent": True,
        "answered": True,
        "cache_restored": True,
    }
    assert report["prefill"]["model"] == rehearse_space.HUB_ID
    assert report["prefill"]["spec"] == "hqq:4,residual_length=16"
    assert 0 < report["answer"]["tokens"] <= 32 and report["answer"]["tokens_per_second"] > 0
    assert not (tmp_path / "space").exists()  # cleaned up: venv, cache and checkout removed
