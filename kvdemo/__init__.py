"""kvdemo: ask several questions over one prefilled context with a quantized KV cache, restored exactly
after every answer, and see the cache's real memory and residual flushes.

Public surface: `load_model`, `LoadedModel`, `CacheSpec`, `BACKENDS`, `build_cache`, `QASession`
(and its `PrefillReport`, `StepEvent`, `Answer`), `kv_memory`, `MemoryReport`, `quiet` (no loading bars).

The packages, in the order imports point (docs/DESIGN.md, "The package order"): the faces, `ui` (the Gradio page)
and `cli` (`python -m kvdemo`, `__main__`); `serve` (what the page shares across users); `compare` and `needle` (jobs
over several specs); `evals` (measures against full precision); `charts` (figures from records); `qa` (one context,
many questions); `cache` (the KV cache itself); and beneath them all `checks` (argument checks), `quiet` (quiet
output) and `paths` (the kvdemo cache folder).
"""

import importlib
import os
import warnings
from typing import TYPE_CHECKING, Any

# OpenMP threads that wait for work spin for at most 20,000 iterations before they sleep (libgomp's GOMP_SPINCOUNT;
# read when torch loads, so it acts only if torch is not imported yet; a value set by the user, or
# OMP_WAIT_POLICY, is kept). libgomp's default spins up to 300,000 iterations: on a small shared CPU (2 cores, other
# processes or a second session) the spinning threads take the cores from the ones doing the matrix-vector
# products. Measured on 2 cores (benchmarks/speed.py, docs/benchmarks.md): idle, the same step time as the default
# (52-55 ms at 2 threads); with one busy process beside it, 0.56 s per step instead of 3.7 s.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

# In a Jupyter kernel without ipywidgets, transformers' first `import tqdm.auto` (when it loads) warns "IProgress not
# found" and falls back to a text bar: nothing to act on, so that one message from that one module is ignored.
warnings.filterwarnings("ignore", message="IProgress not found", module=r"tqdm\.auto")

from kvdemo.quiet import quiet  # loads nothing heavy; eager, so that the name is the function, not its module

# The other public names load on first use (PEP 562 `__getattr__`), so that `import kvdemo` and
# `python -m kvdemo --help` read no torch: each name's module is imported when the name is first read.
_PUBLIC = {
    "BACKENDS": "kvdemo.cache.registry",
    "Answer": "kvdemo.qa.records",
    "CacheSpec": "kvdemo.cache.spec",
    "LoadedModel": "kvdemo.qa.models",
    "MemoryReport": "kvdemo.cache.state.telemetry",
    "PrefillReport": "kvdemo.qa.records",
    "QASession": "kvdemo.qa.session",
    "StepEvent": "kvdemo.cache.state.telemetry",
    "build_cache": "kvdemo.cache.spec",
    "kv_memory": "kvdemo.cache.state.telemetry",
    "load_model": "kvdemo.qa.models",
}
__all__ = [  # quiet and the keys of _PUBLIC (tests/test_cli.py checks it), written out for mypy and ruff
    "BACKENDS",
    "Answer",
    "CacheSpec",
    "LoadedModel",
    "MemoryReport",
    "PrefillReport",
    "QASession",
    "StepEvent",
    "build_cache",
    "kv_memory",
    "load_model",
    "quiet",
]

if TYPE_CHECKING:
    from kvdemo.cache.registry import BACKENDS
    from kvdemo.cache.spec import CacheSpec, build_cache
    from kvdemo.cache.state.telemetry import MemoryReport, StepEvent, kv_memory
    from kvdemo.qa.models import LoadedModel, load_model
    from kvdemo.qa.records import Answer, PrefillReport
    from kvdemo.qa.session import QASession


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept (PEP 562).

    Raises:
        AttributeError: `name` is not one of `__all__` (nor a submodule already imported).
    """
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvdemo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
