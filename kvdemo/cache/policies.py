"""The words of the cache options that take words: the flush policies of the residual backends
(`kvdemo.cache.layers.flush`), `dynamic`'s storage policies (`kvdemo.cache.layers.storage`), the rotations
(`kvdemo.cache.layers.rotation`), hqq's `optimize` switch (`kvdemo.cache.formats.hqq.optimize`) and what a quantized
backend does with sliding-window layers (`kvdemo.cache.model.layer_kinds`, `kvdemo.cache.layers.sliding`), the edge
layers a quantized backend protects (`protect`) and TurboQuant's norm
correction (`kvdemo.cache.formats.turboquant.layers`).

Plain tuples that import nothing, so that the registry, and with it the command line's `--help`, reads the
allowed values without loading torch or transformers (which the modules that implement the policies need)."""

FLUSH_POLICIES = ("requantize", "append")
"""The flush policies: transformers' (the default) first."""

STORAGE_POLICIES = ("concat", "growing")
"""The `storage` option of the `dynamic` backend: `concat` is transformers' `DynamicLayer` (a `torch.cat` of the
whole cache at every update, the default), `growing` is `kvdemo.cache.layers.storage.GrowingLayer`."""

ROTATIONS = ("none", "hadamard")
"""The `rotation` option's values: transformers' behaviour (no rotation) first."""

OPTIMIZE_CHOICES = ("true", "false")
"""hqq's `optimize` option: its half-quadratic optimiser of zero points on (hqq's and transformers' default) or off."""

SLIDING_CHOICES = ("keep", "quantize")
"""The `sliding` option of the quantized backends: `keep` a sliding-window layer at full precision as transformers
builds it (`DynamicSlidingWindowLayer`; vLLM's `kv_cache_dtype_skip_layers=sliding_window`, mlx-lm's rotating cache;
the default), or `quantize` it like the full-attention layers, forgetting the tokens past its window
(`kvdemo.cache.layers.sliding`; llama.cpp builds both caches with the same `-ctk`/`-ctv` types)."""

PROTECT_CHOICES = ("0:0", "1:1", "2:2", "3:3", "4:4", "vllm")
"""The `protect` option of the quantized backends, `first:last`: how many of the layers a backend quantizes, counted
from the first and from the last, it keeps at full precision instead (`kvdemo.cache.model.layer_kinds.layer_actions`).
vLLM's TurboQuant keeps the first 2 and last 2 attention layers of dense models ("without it GSM8K drops ~30 points on
Qwen3-4B", `TurboQuantConfig.get_boundary_skip_layers`); off (`0:0`) by default. `vllm` is vLLM's own rule, on its
TurboQuant presets: decoder layers 0, 1, L-2 and L-1 (min(2, L // 2) at each end, whatever their kind) on a model
without state layers, none on a hybrid one (a linear-attention, conv or Mamba layer: vLLM's `is_hybrid`)."""

VLLM_PROTECT = PROTECT_CHOICES[-1]
"""`protect=vllm`: vLLM's boundary rule (`PROTECT_CHOICES`)."""

NORM_CORRECTION_CHOICES = ("false", "true")
"""TurboQuant's `norm_correction`: store each key's norm as it is (the paper), or divided by its code's norm so the
de-quantized key keeps the key's norm (vLLM's `_nc` presets)."""


def parse_protect(protect: str) -> tuple[int, int]:
    """`first:last` (a `PROTECT_CHOICES` word but `vllm`) as two integers. Raises ValueError: not two integers >= 0."""
    first, sep, last = str(protect).partition(":")
    if not sep or not first.isdigit() or not last.isdigit():
        raise ValueError(f"protect={protect!r} must be first:last, e.g. 2:2")
    return int(first), int(last)


TURBOQUANT_LAYOUTS = ("kvdemo", "vllm")
"""TurboQuant's `layout`: kvdemo's own (the exact marginal's code, signed rotation, fp8 keys with a scale; the default)
or vLLM's store byte for byte (`kvdemo.cache.formats.turboquant.vllm`; the presets under vLLM's names)."""


def vllm_write_path(layout: object, residual_length: object, flush: object) -> bool:
    """Whether turboquant's options are vLLM's write path, each token coded as it comes with no residual
    (`kvdemo.cache.formats.turboquant.vllm_layers`): `layout=vllm`, `residual_length=1`, `flush=append` (every
    preset)."""
    return str(layout) == TURBOQUANT_LAYOUTS[1] and str(residual_length) == "1" and str(flush) == FLUSH_POLICIES[1]
