"""What a GPU job's worker keeps between calls (`kvdemo.serve.gpu_job`): the model on the device and a few prefilled
sessions warm (each format's own set-up on the device is its card's `on_device`: quanto's unpacking on CUDA,
`kvdemo.cache.formats.quanto.device`).

- **Warm sessions** (`WarmSessions`, one per process: `WARM`): the sessions of the latest session files, least
  recently used first out, bounded in KV bytes (`PrefillReport.kv_bytes`, the snapshot's included) and in number. A
  session is found by its file's path and the file's state (modification time, size, inode): a file written again
  (the same path, another prefill) is another key, so a warm session is never served for a file that has changed.
  Nothing relies on a hit: a ZeroGPU worker may be replaced at any call, and a miss opens the file.
- **The model on the device** (`device_model`): a model loaded on the CPU is moved to CUDA once per worker, when
  CUDA is available there; `torch.cuda.is_available()` is asked only inside a job.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from pathlib import Path

import torch

from kvdemo.qa.models import LoadedModel
from kvdemo.qa.session import QASession

WARM_BYTES = int(float(os.environ.get("KVDEMO_WARM_SESSIONS_MIB") or 4096) * 2**20)
"""KV bytes the warm sessions of one worker may hold together (env `KVDEMO_WARM_SESSIONS_MIB`, default 4096 MiB)."""
WARM_SESSIONS = 8
"""Warm sessions one worker keeps at most."""


class WarmSessions:
    """Prefilled sessions kept by session file, least recently used first out (module docstring).

    Args:
        max_bytes: KV bytes all sessions together may hold; a session larger than this alone is not kept.
        max_sessions: sessions kept at most (>= 1).
    """

    def __init__(self, max_bytes: int = WARM_BYTES, max_sessions: int = WARM_SESSIONS):
        self.max_bytes, self.max_sessions = max_bytes, max_sessions
        self._held: OrderedDict[tuple[str, int, int, int], QASession] = OrderedDict()

    @staticmethod
    def key(path: Path) -> tuple[str, int, int, int]:
        """The file's resolved path, modification time (ns), size (bytes) and inode.

        Raises:
            OSError: the file cannot be read (missing).
        """
        state = path.stat()
        return str(path.resolve()), state.st_mtime_ns, state.st_size, state.st_ino

    def _drop_path(self, name: str) -> None:
        for key in [key for key in self._held if key[0] == name]:
            del self._held[key]

    def get(self, path: Path, loaded: LoadedModel) -> QASession | None:
        """The warm session of the file at `path` as it is now, on `loaded` (or of the same file under another name:
        its modification time, size and inode); None when there is none (a stale one, of the file before it was
        written again, is dropped)."""
        try:
            key = self.key(path)
        except OSError:
            return None
        session = self._held.get(key)
        if session is None:  # the same file under another name (a hard link the server keeps for the session)
            linked = next((k for k in self._held if k[1:] == key[1:]), None)
            if linked is not None:
                key, session = linked, self._held[linked]
        if session is None or session.loaded is not loaded or session.streaming:
            self._drop_path(key[0])
            return None
        self._held.move_to_end(key)
        return session

    def put(self, path: Path, session: QASession) -> None:
        """Keep `session` (prefilled from, or saved to, the file at `path`) as the most recently used, then drop the
        least recently used until the bounds hold."""
        key = self.key(path)
        self._drop_path(key[0])
        self._held[key] = session
        while self._held and (len(self._held) > self.max_sessions or self.held_bytes > self.max_bytes):
            self._held.popitem(last=False)

    @property
    def held_bytes(self) -> int:
        """KV bytes the warm sessions hold (their prefill reports' `kv_bytes`)."""
        return sum(s.prefill_report.kv_bytes for s in self._held.values() if s.prefill_report is not None)

    def paths(self) -> list[str]:
        """The warm sessions' files, least recently used first."""
        return [key[0] for key in self._held]

    def clear(self) -> None:
        """Drop every warm session."""
        self._held.clear()


WARM = WarmSessions()
"""This process's warm sessions (a ZeroGPU worker's, inherited empty or not by a fork, and then its own)."""

_MOVED: list[tuple[LoadedModel, LoadedModel]] = []


def device_model(loaded: LoadedModel) -> LoadedModel:
    """`loaded` on CUDA where CUDA is available in this process (moved once, kept for the next jobs; the warm
    sessions of another model are dropped), else `loaded` itself."""
    if loaded.device.type == "cuda" or not torch.cuda.is_available():
        return loaded
    if _MOVED and _MOVED[0][0] is loaded:
        return _MOVED[0][1]
    device = torch.device("cuda")
    moved = dataclasses.replace(loaded, model=loaded.model.to(device), device=device)
    _MOVED[:] = [(loaded, moved)]
    WARM.clear()
    return moved
