"""kvdemo's own C kernels, compiled once per machine into the kvdemo cache folder and loaded with ctypes.

A kernel is one C file beside the module that uses it (`kvdemo/cache/formats/hqq/proximal.c`,
`kvdemo/cache/read/code_attention.c`), with no torch or Python headers: it takes pointers to contiguous float32
buffers (`tensor.data_ptr()`), so it compiles in about a second with the system's C compiler (`$CC`, else `cc`), and
`make` compiles it during the set-up
(`kvdemo.cache.warmup.warm_up`). The library lands in `cache_dir() / "c" / <name>-<key>.so`, keyed by what it
depends on: the source, the flags, the compiler's version and this machine's CPU flags (`-march=native`). A build is
written under a temporary name and renamed into place, so processes that compile at once never load half a file.

Where there is no compiler, or it fails, `load` returns None with the reason (`build_problem`), and the caller runs
its library's own Python path: slower, never different in kind.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from kvdemo.paths import cache_dir

FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-ffast-math", "-ffp-contract=off", "-fno-reciprocal-math")
FLAGS += ("-fopenmp", "-fPIC")
"""The compile flags: vectorised (`-march=native`), the math library's vector functions (`-ffast-math`), no fused
multiply-add and no division turned into a product by a reciprocal (each step rounded as torch's separate operations
round it), OpenMP (`libgomp.so.1`: in a process that has imported torch, the copy torch ships and has loaded, so
the kernels share torch's threads)."""

LINK_FLAGS = ("-shared", "-fopenmp")
"""The link flags, without `-ffast-math`: linked with it, GCC before 13 adds `crtfastmath.o`, whose constructor
sets the CPU's flush-to-zero and denormals-are-zero modes for the whole process as the library loads, and every
subnormal float of torch's would then read as 0 (fp8's smallest codes among them)."""

_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}
_PROBLEMS: dict[str, str] = {}


def _compiler() -> str | None:
    """The C compiler's path: `$CC`, else `cc`, else `gcc`; None where none is installed."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_flags() -> str:
    """This machine's CPU flags (what `-march=native` compiles for): /proc/cpuinfo's first `flags` line, else the
    processor's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key(source: Path, compiler: str) -> str:
    """The first 16 hex digits of the SHA-256 of what the built library depends on: the source's contents and those of
    the C files beside it (a kernel may `#include` one: `code_attention.c` reads ggml's blocks with
    `ggml_dequant.c`'s code), `FLAGS` and `LINK_FLAGS`, the compiler's `--version` and the CPU flags.

    Raises:
        OSError: the source cannot be read.
        subprocess.SubprocessError: the compiler does not answer `--version`.
    """
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    digest = hashlib.sha256()
    flags = " ".join(FLAGS + LINK_FLAGS).encode()
    siblings = [path.read_bytes() for path in sorted(source.parent.glob("*.c")) if path != source]
    for part in (source.read_bytes(), *siblings, flags, version.encode(), _cpu_flags().encode()):
        digest.update(part + b"\0")
    return digest.hexdigest()[:16]


def _build(source: Path) -> Path:
    """The library built from `source` (compiled now unless a build with the same key is there).

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its message).
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (set $CC or install gcc)")
    folder = cache_dir() / "c"
    library = folder / f"{source.stem}-{build_key(source, compiler)}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{source.stem}-", suffix=".so")
    os.close(handle)
    objects = partial[: -len(".so")] + ".o"
    try:
        for command in (
            [compiler, *FLAGS, "-c", str(source), "-o", objects],
            [compiler, *LINK_FLAGS, objects, "-o", partial, "-lm"],
        ):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{Path(compiler).name} failed on {source.name}: {done.stderr.strip()[-500:]}")
        os.replace(partial, library)  # atomic: another process loads the old or the new file, whole
    finally:
        for path in (partial, objects):
            if os.path.exists(path):
                os.unlink(path)
    return library


def load(source: Path) -> ctypes.CDLL | None:
    """The kernel library of `source` (a C file), compiled if needed and loaded once per process; None where it
    cannot be built (`build_problem(source)` says why). Thread-safe."""
    key = str(source)
    with _LOCK:
        if key not in _LOADED:
            try:
                _LOADED[key] = ctypes.CDLL(str(_build(source)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _LOADED[key], _PROBLEMS[key] = None, str(error)
        return _LOADED[key]


def function(source: Path, name: str, restype, argtypes: list):
    """The C function `name` of `source`'s library (`load`), its result and argument types set once; None where the
    library cannot be built (`build_problem(source)` says why)."""
    library = load(source)
    if library is None:
        return None
    found = getattr(library, name)
    if found.argtypes is None:
        found.restype, found.argtypes = restype, argtypes
    return found


def build_problem(source: Path) -> str | None:
    """Why `load(source)` returned None in this process, or None where it loaded (or was not asked yet)."""
    return _PROBLEMS.get(str(source))
