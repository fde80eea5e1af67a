"""kvdemo: ask several questions over one prefilled context with a quantized KV cache, restored exactly
after every answer, and see the cache's real memory and residual flushes.

Public surface: `load_model`, `LoadedModel`, `CacheSpec`, `BACKENDS`, `build_cache`, `QASession`
(and its `PrefillReport`, `StepEvent`, `Answer`), `kv_memory`, `MemoryReport`, `quiet` (no loading bars).
"""

import os
import warnings

# OpenMP threads that wait for work spin for at most 20,000 iterations before they sleep (libgomp's GOMP_SPINCOUNT;
# read when torch loads, so it acts only if torch is not imported yet; a value set by the user, or
# OMP_WAIT_POLICY, is kept). libgomp's default spins up to 300,000 iterations: on a small shared CPU (2 cores, other
# processes or a second session) the spinning threads take the cores from the ones doing the matrix-vector
# products. Measured on 2 cores (benchmarks/speed.py, README "Benchmarks"): idle, the same step time as the default
# (52-55 ms at 2 threads); with one busy process beside it, 0.56 s per step instead of 3.7 s.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

# In a Jupyter kernel without ipywidgets, transformers' first `import tqdm.auto` (just below) warns "IProgress not
# found" and falls back to a text bar: nothing to act on, so that one message from that one module is ignored.
warnings.filterwarnings("ignore", message="IProgress not found", module=r"tqdm\.auto")

from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec, build_cache
from kvdemo.cache.telemetry import MemoryReport, StepEvent, kv_memory
from kvdemo.qa.models import LoadedModel, load_model
from kvdemo.qa.records import Answer, PrefillReport
from kvdemo.qa.session import QASession
from kvdemo.quiet import quiet

__all__ = [
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
