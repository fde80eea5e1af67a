"""The KV cache itself, with no model run and no session: the one registry of backends (`registry`), a backend
and its options (`spec`), how `dynamic` stores its tensors (`storage`), the flush policies (`flush`), the
geometry read from a model's config (`geometry`), taking and restoring the post-prefill state (`snapshot`), the
real memory and flushes read from a cache (`telemetry`), the out-of-memory guard (`budget`) and a decode step's
speed limit (`speedlimit`). It imports from no other kvdemo package but `kvdemo.checks` (docs/DESIGN.md,
"The package order")."""

from kvdemo.cache.budget import KVBudgetError
from kvdemo.cache.registry import BACKENDS, GROUP_OPTIONS, Backend, Option
from kvdemo.cache.snapshot import restore, take
from kvdemo.cache.spec import CacheSpec, all_specs, build_cache, estimate_kv_bytes
from kvdemo.cache.speedlimit import SpeedLimit, speed_limit
from kvdemo.cache.telemetry import MemoryReport, StepEvent, kv_memory

__all__ = [
    "BACKENDS",
    "Backend",
    "CacheSpec",
    "GROUP_OPTIONS",
    "KVBudgetError",
    "MemoryReport",
    "Option",
    "SpeedLimit",
    "StepEvent",
    "all_specs",
    "build_cache",
    "estimate_kv_bytes",
    "kv_memory",
    "restore",
    "speed_limit",
    "take",
]
