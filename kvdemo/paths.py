"""The user's kvdemo cache folder, where work done once per machine is kept: converted GGUF weights
(`kvdemo.qa.models`), the joined Gemma 3 file (`kvdemo.qa.packaged`), the browser-state secret
(`kvdemo.serve.secret`), optimum-quanto's compiled extension (`kvdemo.cache.formats.quanto.build`) and kvdemo's own C
kernels (`kvdemo.cache.read.c_build`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user's kvdemo cache folder: `$KVDEMO_CACHE_DIR`, else `$XDG_CACHE_HOME/kvdemo`, else
    `~/.cache/kvdemo` (empty variables count as unset). Not created here."""
    if os.environ.get("KVDEMO_CACHE_DIR"):
        return Path(os.environ["KVDEMO_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvdemo"
    return Path.home() / ".cache" / "kvdemo"
