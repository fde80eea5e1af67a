"""Quiet output for notebooks and scripts: no loading progress bars, no advisory log lines from transformers.

A notebook cell's output should hold what the reader came for. Loading a model with transformers draws a
"Loading weights" tqdm bar (on stderr, redrawn with carriage returns), and transformers logs advisory warnings
(generation flags, defaults it picked); neither says anything about the KV cache. `quiet()` turns both off for the
process. Python warnings are left alone (a deprecation in a call kvdemo makes is a bug to fix, and the tests fail on
it), and so is kvdemo's own log (e.g. a converted model copy that could not be written: something to fix).

tqdm's `IProgress not found` warning (a Jupyter kernel without ipywidgets: tqdm falls back to a text bar) is
raised when transformers first imports `tqdm.auto`, that is during `import kvdemo`, before `quiet()` can run;
`kvdemo/__init__.py` therefore ignores that one message from that one module, in every process: it only announces
the fallback.
"""

from __future__ import annotations

import re

# What a notebook's reader does not need in an output, and `quiet()` keeps out: a tqdm bar (redrawn with "\r",
# "Loading weights: 40%|###  | 9/20 [00:01<00:02, 7.5it/s]"), a warning ("FutureWarning: ...", a logged "WARNING"),
# a deprecation notice. The notebook tests and scripts/check_jupyterlab.py check every output against it.
NOISE = re.compile(r"\r|\d+%\||it/s\]|Loading (weights|checkpoint)|tqdm|Warning|WARNING|deprecat", re.IGNORECASE)


def quiet(enable: bool = True) -> None:
    """Turn off (`enable=False`: back on) transformers' and huggingface_hub's progress bars and transformers' log
    below errors, for the whole process. Call it right after `import kvdemo`, before `load_model`.

    What it changes: `transformers.utils.logging.set_verbosity_error()` (back: `set_verbosity_warning()`, the
    library's default) and `disable_progress_bar()` (back: `enable_progress_bar()`), which also covers
    huggingface_hub's download bars. kvdemo's own progress (the CLI's bars, `on_progress` callbacks), its log,
    Python warnings and every exception still show.

    Example:
        >>> import kvdemo
        >>> kvdemo.quiet()
        >>> loaded = kvdemo.load_model()  # no "Loading weights" bar
    """
    from transformers.utils import logging as hf_logging

    if enable:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    else:
        hf_logging.set_verbosity_warning()
        hf_logging.enable_progress_bar()
