"""kvdemo: ask several questions over one prefilled context with a quantized KV cache, restored exactly
after every answer, and see the cache's real memory and residual flushes.

Public surface: `load_model`, `LoadedModel`, `CacheSpec`, `BACKENDS`, `build_cache`, `QASession`
(and its `PrefillReport`, `StepEvent`, `Answer`), `kv_memory`, `MemoryReport`, `quiet` (no loading bars).
"""

import warnings

# In a Jupyter kernel without ipywidgets, transformers' first `import tqdm.auto` (just below) warns "IProgress not
# found" and falls back to a text bar: nothing to act on, so that one message from that one module is ignored.
warnings.filterwarnings("ignore", message="IProgress not found", module=r"tqdm\.auto")

from kvdemo.backends import BACKENDS
from kvdemo.models import LoadedModel, load_model
from kvdemo.quiet import quiet
from kvdemo.session import Answer, PrefillReport, QASession, StepEvent
from kvdemo.spec import CacheSpec, build_cache
from kvdemo.telemetry import MemoryReport, kv_memory

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
