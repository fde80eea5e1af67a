"""The server's folder of session files (`kvdemo.qa.session_file`): every prefill the page runs is saved, and a prefill
of the same context with the same model and spec opens the file instead of running again, after a restart of the app
too (llama.cpp's `--prompt-cache`, per context). The folder is kept within a byte bound, the least recently used
files removed first. A file that cannot be opened (another session format, damaged) is removed and the prefill runs.

The folder neither follows nor opens a symlink: a link in it (or the folder itself a link) is never read, written
through or trimmed through (llama.cpp #26315: a symlink in the save folder made a save write outside it).

A file's name is the SHA-256 of what makes the cache: the session format and transformers version, the model's
identity, the spec's full text and the context's prefilled ids, tail and text (the chat template's date is in the ids,
so a prefill on another day of a template that writes the date does not open yesterday's file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PreparedContext
from kvdemo.qa.session import QASession
from kvdemo.qa.session_file import (
    FORMAT,
    SUFFIX,
    SessionFileError,
    model_identity,
    open_session,
    read_manifest,
    save_session,
    versions,
)

_log = logging.getLogger(__name__)

SAVED_COPY = "this server's saved copy of the same prefill"
"""`PrefillReport.opened_from` of a prefill opened from the folder (whose file names are hashes: no use to a user)."""


class SessionFiles:
    """A folder of session files within `max_bytes`.

    Args:
        folder: where the files are kept (made when first written).
        max_bytes: the most bytes the folder's files may hold together (bytes, >= 1); a file larger than this alone
            is not kept.

    Raises:
        ValueError: max_bytes < 1.
    """

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes!r} must be >= 1")
        self.folder, self.max_bytes = Path(folder), max_bytes

    def path(self, loaded: LoadedModel, spec: CacheSpec, prepared: PreparedContext) -> Path:
        """The file that holds (or would hold) `prepared` prefilled by `loaded` into a cache of `spec` (validated)."""
        split = prepared.split
        made_of = json.dumps(
            [
                [FORMAT, versions()["transformers"]],  # not kvdemo's release: a file of the same format still opens
                model_identity(loaded),
                spec.full_text,
                list(split.prefix),
                split.tail,
                prepared.text,
            ],
            sort_keys=True,
        )
        return self.folder / (hashlib.sha256(made_of.encode("utf-8", "surrogatepass")).hexdigest()[:32] + SUFFIX)

    def open(self, qa: QASession, prepared: PreparedContext) -> Path | None:
        """Open the file of `prepared` into `qa` when there is one (`qa.prefill_report` is then the file's): its path;
        None when there is none or it cannot be opened (it is then removed). Raises what `QASession.adopt` raises (the
        window, the budget)."""
        path = self.path(qa.loaded, qa.spec, prepared)
        if self._linked(path) or not path.is_file():
            return None
        try:
            open_session(qa.loaded, path, qa.spec, session=qa, shown_as=SAVED_COPY)  # its name is a hash
        except SessionFileError as error:
            _log.warning("removing the session file %s: %s", path.name, error)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: trimmed last
        return path

    def save(self, qa: QASession, prepared: PreparedContext) -> Path | None:
        """Write `qa`'s prefill of `prepared` to its file, then trim the folder to `max_bytes`; the path, or None when
        it could not be written (logged: a full disk never fails the prefill) or is larger than the bound alone."""
        path = self.path(qa.loaded, qa.spec, prepared)
        if self._linked(path):
            return None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_session(qa, path)
        except (OSError, TypeError, ValueError) as error:
            _log.warning("could not save the session file %s: %s", path.name, error)
            return None
        self.trim()
        return path if path.exists() else None

    def saved_of(self, context: str) -> list[tuple[str, str]]:
        """(model name, spec text) of each file in the folder that holds a prefill of `context`, the most recently
        used first: what a reload can say when none of them is the page's model and spec (reads each file's header
        only; a file that cannot be read is passed over)."""
        found = []
        for path in reversed(self.files()):
            try:
                manifest = read_manifest(path)
            except SessionFileError:
                continue
            if manifest.get("context") == context:
                found.append((str((manifest.get("model") or {}).get("name")), str(manifest.get("spec"))))
        return found

    def _linked(self, path: Path) -> bool:
        """Whether the folder or `path` is a symlink (logged): then nothing is read or written there."""
        link = next((p for p in (self.folder, path) if p.is_symlink()), None)
        if link is not None:
            _log.warning("not following the symlink %s in the session folder", link)
        return link is not None

    def files(self) -> list[Path]:
        """The folder's session files, least recently used first (no symlink, and none in a linked folder)."""
        if self.folder.is_symlink() or not self.folder.is_dir():
            return []
        files = [p for p in self.folder.glob("*" + SUFFIX) if not p.is_symlink()]
        return sorted(files, key=lambda p: p.stat().st_mtime)

    def trim(self) -> None:
        """Remove the least recently used files until the rest hold at most `max_bytes`."""
        files = self.files()
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.max_bytes:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)
