"""The reference implementations kvdemo's formats are checked against (requirements-oracles.txt: torchao's NVFP4,
MLX's affine quantization), run in a child process with `.venv/oracles` on its path, so that neither kvdemo nor
transformers in the test process ever imports them (transformers imports torchao wherever it finds it).

`make setup` installs them; a test that needs one fails, and says how to install it, where they are missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ORACLES = Path(sys.prefix) / "oracles"
"""Where `make setup` installs them (`pip install --target`)."""


def run_oracle(script: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
    """Run `script` (Python source that reads the dict `inputs` of numpy arrays and fills the dict `outputs`) in a
    child process with the oracles importable; returns `outputs`.

    Raises:
        AssertionError: the oracles are not installed, or the script failed (its stderr in the message)."""
    assert ORACLES.is_dir(), f"the reference implementations are missing from {ORACLES}: run `make setup`"
    with tempfile.TemporaryDirectory() as folder:
        given, taken = Path(folder) / "inputs.npz", Path(folder) / "outputs.npz"
        np.savez(given, **inputs)
        program = (
            f"import numpy as np\ninputs = dict(np.load({str(given)!r}))\noutputs = {{}}\n{script}\n"
            f"np.savez({str(taken)!r}, **outputs)\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ORACLES)}
        done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"the oracle failed:\n{done.stderr[-3000:]}"
        with np.load(taken) as outputs:
            return dict(outputs)
