"""The words of the cache options that take words: the flush policies of the residual backends
(`kvdemo.cache.layers.flush`), `dynamic`'s storage policies (`kvdemo.cache.layers.storage`), the rotations
(`kvdemo.cache.layers.rotation`), hqq's `optimize` switch (`kvdemo.cache.layers.hqq_optimize`) and what a quantized
backend does with sliding-window layers (`kvdemo.cache.layer_kinds`, `kvdemo.cache.layers.sliding`).

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
