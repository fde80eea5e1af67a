"""kvdemo.quiet: transformers' bars and log off and back on; tqdm's widget-fallback warning ignored on import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import transformers.utils.logging as hf_logging
from huggingface_hub.utils import are_progress_bars_disabled

import kvdemo
from kvdemo.quiet import NOISE


def test_quiet_turns_bars_and_log_off_and_back_on():
    before = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    try:
        kvdemo.quiet()
        assert hf_logging.get_verbosity() == hf_logging.ERROR
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
        kvdemo.quiet(False)
        assert hf_logging.get_verbosity() == hf_logging.WARNING
        assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    finally:
        hf_logging.set_verbosity(before[0])
        (hf_logging.enable_progress_bar if before[1] else hf_logging.disable_progress_bar)()


@pytest.mark.process
def test_import_ignores_only_tqdms_widget_fallback_warning():
    """In a Jupyter kernel without ipywidgets, `import tqdm.auto` warns "IProgress not found"; importing kvdemo
    first hides that one warning and no other (faked here: tqdm.autonotebook's check for a kernel)."""
    code = (
        "import warnings, kvdemo\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.warn_explicit('IProgress not found. Please update jupyter and ipywidgets.', UserWarning,"
        " 'tqdm/auto.py', 21, module='tqdm.auto')\n"
        "    warnings.warn_explicit('another warning', UserWarning, 'tqdm/auto.py', 22, module='tqdm.auto')\n"
        "print([str(w.message) for w in caught])\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True).stdout
    assert out.strip() == "['another warning']"


def test_noise_matches_bars_and_warnings_not_results():
    assert NOISE.search("\rLoading weights:  40%|####      | 109/272 [00:00<00:00, 9.1it/s]")
    assert NOISE.search("FutureWarning: `past_key_values` is deprecated") and NOISE.search("WARNING | kernel")
    assert not NOISE.search("469 context tokens prefilled in 1.90 s\nKV cache: 3,376,800 bytes (7,200 bytes/token)")
