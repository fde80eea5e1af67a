"""The secret the page's kept state is encrypted with, the same across server restarts.

Gradio's `gr.BrowserState` encrypts what it keeps in the browser's localStorage (here the Ask tab's Context box
and options) with a secret; left to itself it draws a new one at every start, so a restarted server (a Space
restarts often) cannot read what the browser kept, and the page comes back empty without a word
(gradio-app/gradio#10263). `browser_state_secret` gives a stable one instead:

1. `$KVDEMO_STATE_SECRET` when set and not empty (on a Space: a secret in the Space's settings, since a Space's
   disk is new at every restart);
2. else the file `browser-state-secret` in the kvdemo cache folder (`kvdemo.paths.cache_dir`), created on
   first use with 32 random bytes (`secrets.token_urlsafe`), readable by its owner only (mode 0600), in a folder
   created with mode 0700; never in the repository;
3. else, when that folder cannot be written (a read-only home), a new secret for this process, as Gradio does,
   with one line in the server log saying why a restart will not find the kept state.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from kvdemo.paths import cache_dir

SECRET_FILE = "browser-state-secret"
ENV = "KVDEMO_STATE_SECRET"

_log = logging.getLogger(__name__)


def browser_state_secret(folder: Path | None = None) -> str:
    """The secret for `gr.BrowserState(secret=...)`, from the environment, else the file (made once), else new.

    Args:
        folder: where the file lives (default: `cache_dir()`).

    Returns:
        The secret (text; at least 32 characters when made here).
    """
    given = os.environ.get(ENV, "").strip()
    if given:
        return given
    path = (folder or cache_dir()) / SECRET_FILE
    try:
        return path.read_text(encoding="utf-8").strip() or _write(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        return _fallback(path, error)
    try:
        return _write(path)
    except FileExistsError:  # another process made it first: read what it wrote
        return path.read_text(encoding="utf-8").strip()
    except OSError as error:
        return _fallback(path, error)


def _write(path: Path) -> str:
    """A new secret written to `path` (mode 0600, its folder 0700 when created here); raises OSError."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    value = secrets.token_urlsafe(32)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if path.exists() else os.O_EXCL)
    descriptor = os.open(path, flags, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(value + "\n")
    return value


def _fallback(path: Path, error: OSError) -> str:
    _log.warning(
        "the page's kept state will not survive a restart: cannot read or write %s (%s); set %s",
        path,
        error.strerror or error,
        ENV,
    )
    return secrets.token_urlsafe(32)
