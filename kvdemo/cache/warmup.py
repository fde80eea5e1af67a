"""One-time work of the quantized backends done at install time (`make` runs `warm_up` once): optimum-quanto
compiles its C++ extension on its first de-quantize in a fresh install, hqq's first quantization compiles kvdemo's
fused solver (`kvdemo.cache.formats.hqq.optimize`, about a second), and the decode kernel over the stored codes
(`kvdemo.cache.read.code_attention`, about 2 seconds) is compiled."""

from __future__ import annotations

import time
from typing import cast

from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec, build_cache


def warm_up(backends: tuple[str, ...] | None = None) -> dict[str, float]:
    """Run one prefill-sized update and one decode-step update through each installed quantized backend's
    own cache layer, on random tensors of shape [1, 1, 8, 64], so that one-time work happens now: optimum-quanto
    compiles its C++ extension on its first de-quantize on a machine (23-45 s on 2 cores, written into the kvdemo
    cache folder by `kvdemo.cache.formats.quanto.build`, needs g++ and ninja); hqq's first quantization compiles
    kvdemo's fused solver (`kvdemo.cache.read.c_build`). `make` runs this once after installing.

    Returns:
        Seconds spent per backend.
    """
    import torch
    from transformers import LlamaConfig
    from transformers.cache_utils import BaseQuantizedLayer

    config = LlamaConfig(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
    )
    seconds = {}
    for name in backends or tuple(BACKENDS):
        info = BACKENDS[name]
        if not info.quantized or not info.installed():
            continue
        spec = CacheSpec(name, residual_length=1) if info.has_residual else CacheSpec(name)
        start = time.perf_counter()
        layer = cast(BaseQuantizedLayer, build_cache(spec, config).layers[0])  # a QuantizedCache's
        states = torch.randn(1, 1, 8, 64)
        layer.update(states, states)
        layer.update(states[:, :, :1], states[:, :, :1])
        seconds[name] = time.perf_counter() - start
    from kvdemo.cache.read import code_attention

    start = time.perf_counter()
    code_attention.kernel()  # compiled once per machine into the cache folder
    seconds["decode kernel"] = time.perf_counter() - start
    return seconds
