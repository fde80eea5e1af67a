"""optimum-quanto's C++ extension, built once per machine and environment and then only loaded.

optimum-quanto 0.2.7 JIT-builds its extension (`optimum.quanto.library.extensions`: `quanto_cpp` on CPU) with
`torch.utils.cpp_extension.load` into a `build` folder inside site-packages, on its first de-quantize in each process.
Every process runs ninja there again, and ninja compiles again whenever the command line differs from the one it
logged (another compiler, flag or source path), so two kinds of process rebuilt it in turn, 170-200 s each,
while the others waited on its lock. Here, before kvdemo builds its first quanto cache
(`kvdemo.cache.registry`), each extension is pointed at one folder of the kvdemo cache folder
(`kvdemo.paths.cache_dir() / "quanto" / <key>`), keyed by what the built library depends on; the first process
compiles into it under torch's own lock, and every later one imports the built module directly, without ninja.
`make` builds it during the set-up (`kvdemo.cache.warmup.warm_up`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import sysconfig
import threading
from pathlib import Path

from kvdemo.paths import cache_dir

_LOCK = threading.Lock()
_DONE: dict[str, Path] = {}


def build_key(name: str, sources: list[str], extra_cflags: list[str] | None) -> str:
    """The folder name of one extension's build: its name, then the first 16 hex digits of the SHA-256 of what the
    built library depends on: torch's version and folder (the headers and libraries it is built against and links),
    Python's headers, the flags and the sources' contents. Not the compiler or the sources' paths: whichever process
    comes first compiles, with its own command, and every other loads that build.

    Raises:
        OSError: a source cannot be read.
    """
    import torch

    digest = hashlib.sha256()
    for part in (
        torch.__version__,
        os.path.dirname(torch.__file__),
        sysconfig.get_paths()["include"],
        " ".join(extra_cflags or []),
    ):
        digest.update(part.encode() + b"\0")
    for source in sources:
        digest.update(Path(source).read_bytes() + b"\0")
    return f"{name}-{digest.hexdigest()[:16]}"


def _import_built(name: str, folder: Path):
    """The built module `folder/<name>.so` imported (as torch's `cpp_extension.load` imports it), or None."""
    library = folder / f"{name}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"
    if not library.exists() or (folder / "lock").exists():  # not built yet, or a build under way
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.setdefault(name, module)
    return module


def share_quanto_build() -> dict[str, Path]:
    """Point each of optimum-quanto's extensions not yet loaded in this process at its build folder in the kvdemo
    cache folder (module docstring), and load the ones already built there. Idempotent and thread-safe; quanto not
    installed: nothing to do.

    Returns:
        Extension name -> its build folder (created if missing).
    """
    with _LOCK:
        if _DONE:
            return dict(_DONE)
        try:
            from optimum.quanto.library.extensions import extension  # type: ignore[import-untyped]
        except ImportError:
            return {}
        for name, ext in extension._extensions.items():
            if ext._lib is not None:  # loaded already in this process, from wherever quanto put it
                _DONE[name] = Path(ext.build_directory)
                continue
            folder = cache_dir() / "quanto" / build_key(name, ext.sources, ext.extra_cflags)
            folder.mkdir(parents=True, exist_ok=True)
            ext.build_directory = str(folder)
            version = folder / "pytorch_version.txt"
            if version.exists():
                import torch

                if version.read_text().strip() == torch.__version__:
                    ext._lib = _import_built(name, folder)  # None: quanto builds it on first use, as it would
            _DONE[name] = folder
        return dict(_DONE)
