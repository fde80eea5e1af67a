"""The speed limit of a decode step: the bytes it must read, over the machine's memory bandwidth.

A decode step of one sequence is a chain of matrix-vector products: every weight matrix is read once and the
whole KV cache is read once by attention, while the arithmetic per byte is tiny (2 flops per float32 weight).
On a CPU it is bound by memory bandwidth, so the time to read those bytes once is a floor no implementation
of the same model and cache can beat (the roofline model, Williams, Waterman and Patterson 2009):

    floor seconds = (weight bytes + KV bytes) / bandwidth

- weight bytes: every parameter once (`model.parameters()` yields a tied embedding / LM head once; the
  embedding lookup reads one row of it, the LM head reads all of it);
- KV bytes: what attention reads of the live cache: the quantized store with its scales and zero points (as
  `kvdemo.cache.state.telemetry.kv_memory` counts it) and the full-precision keys and values of the tokens held (a
  quantized layer's residual, all of a dynamic layer: tokens x the model's per-token bytes). Storage held beyond those
  tokens (`storage=growing`'s spare room, `kvdemo.cache.layers.storage`; a view not yet replaced after a restore) is
  memory, not read: `SpeedLimit.unread_bytes`, outside the floor;
- bandwidth: `probe_bandwidth`, a large tensor copy timed once per process (STREAM's "copy" kernel,
  McCalpin 1995: bytes read + bytes written over the best time).

The ceiling on what a smaller KV cache can buy follows from the same sum: below `crossover_tokens` the
weights are most of the bytes read, so even a KV cache of zero bytes would make the step at most twice as fast.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from kvdemo.cache.model.geometry import full_precision_bytes, kv_geometry
from kvdemo.cache.state.telemetry import MemoryReport, kv_memory

PROBE_MIB = 256
"""The probe's tensor size: far above any CPU's last-level cache, so the copy runs from DRAM."""


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each once (tied weights once): what a decode step reads of the model.

    Example:
        >>> weight_bytes(loaded.model)  # SmolLM2-135M in float32
        538164480
    """
    return sum(p.numel() * p.element_size() for p in model.parameters())


def probe_bandwidth(mib: int = PROBE_MIB, repeats: int = 5) -> float:
    """The machine's memory bandwidth in bytes per second, measured once per process and thread count (cached).

    Method: STREAM's copy kernel (McCalpin 1995, https://www.cs.virginia.edu/stream/): `b[:] = a` over a float32
    tensor of `mib` MiB, best of `repeats` timed copies after one untimed warm-up, counting the bytes read and the
    bytes written (2 x `mib` MiB per copy). It runs with the threads torch uses (`torch.get_num_threads()`), as
    the model does. It takes about 2 x `mib` MiB of memory for a fraction of a second.

    Raises:
        ValueError: `mib` or `repeats` is below 1.
    """
    if mib < 1 or repeats < 1:
        raise ValueError(f"mib and repeats must be at least 1, got {mib} and {repeats}")
    with _PROBING:  # answers that end together on a server wait for one probe, not 2 x `mib` MiB each
        return _probe(mib, repeats, torch.get_num_threads())


_PROBING = threading.Lock()


@functools.lru_cache(maxsize=8)
def _probe(mib: int, repeats: int, threads: int) -> float:
    """`probe_bandwidth` for one thread count (`threads` only keys the cache: torch's own setting is used)."""
    source = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up: pages touched, threads started
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best


@dataclass(frozen=True)
class SpeedLimit:
    """The floor of one decode step and where its bytes come from.

    Attributes:
        weight_bytes: bytes of the model's parameters read per step.
        kv_bytes: bytes of the KV cache read per step: each layer's quantized store plus its full-precision tokens
            (residual_tokens x the model's keys-and-values bytes per token and layer).
        unread_bytes: bytes the cache holds and a step does not read (`kv_memory(cache).cache_bytes` - kv_bytes):
            the spare room of `storage=growing`, the rest of a storage a restored view still keeps; 0 otherwise.
        kv_tokens: tokens in the cache (`get_seq_length()`).
        bandwidth: bytes per second (`probe_bandwidth`).
        dequantized_bytes: bytes of full-precision keys and values a step of a quantized cache makes by
            de-quantizing its whole store in every layer (every stored token at each step, no copy kept between
            steps: joined whole by transformers' `QuantizedLayer.update` and the fp8 layer, block by block by
            `kvdemo.cache.layers.blockwise`; `benchmarks/flush.py` and `benchmarks/decode.py` measure the time); 0 for
            `dynamic` and for the layers whose decode attention reads the stored codes (`code_layers`). Not in the
            floor.
        code_layers: layers whose decode attention reads the stored codes with no de-quantized copy
            (`kvdemo.cache.read.code_attention`; `benchmarks/code_attention.py` measures the time).
        full_precision_kv_bytes: what a `dynamic` cache of the same tokens in the model's dtype would read
            (`kvdemo.cache.model.geometry.full_precision_bytes`): the floor a quantized cache's is compared with.
        rotation_flops: floating-point operations a step of a rotated cache (`rotation=hadamard`) adds, each a
            [head_dim] x [head_dim, head_dim] product of 2 x head_dim^2 flops: on the query side
            (`kvdemo.cache.layers.rotation.QueryRotationMixin`) the new token's key and value per KV head and its query
            and attention output per query head, in every layer; on the read side (`RotationMixin`) every stored
            token's key and value per KV head in every layer. 0 without a rotation. Bytes are unchanged.
        rotation_side: `query` or `read` (the rotated layers' way), "" without a rotation.
    """

    weight_bytes: int
    kv_bytes: int
    kv_tokens: int
    bandwidth: float
    dequantized_bytes: int = 0
    unread_bytes: int = 0
    rotation_flops: int = 0
    rotation_side: str = ""
    code_layers: int = 0
    full_precision_kv_bytes: int = 0

    @property
    def bytes_read(self) -> int:
        """weight_bytes + kv_bytes."""
        return self.weight_bytes + self.kv_bytes

    @property
    def floor_seconds(self) -> float:
        """bytes_read / bandwidth (seconds): no decode step on this machine can take less."""
        return self.bytes_read / self.bandwidth

    @property
    def kv_share(self) -> float:
        """The KV cache's share of the bytes read (0-1)."""
        return self.kv_bytes / self.bytes_read if self.bytes_read else 0.0

    @property
    def kv_bytes_per_token(self) -> float:
        """kv_bytes / kv_tokens (0 for an empty cache)."""
        return self.kv_bytes / self.kv_tokens if self.kv_tokens else 0.0

    @property
    def crossover_tokens(self) -> int | None:
        """The context length (tokens) above which this cache's KV read exceeds the weights' read, at this cache's
        bytes per token; None for an empty cache. Below it, shrinking the KV cache can at most halve the floor."""
        per_token = self.kv_bytes_per_token
        return math.ceil(self.weight_bytes / per_token) if per_token else None

    @property
    def full_precision_floor_seconds(self) -> float:
        """The floor of a step over a `dynamic` cache of the same tokens: (weight_bytes + full_precision_kv_bytes) /
        bandwidth (seconds)."""
        return (self.weight_bytes + self.full_precision_kv_bytes) / self.bandwidth

    def ratio(self, step_seconds: float) -> float:
        """How many floors a measured step takes: step_seconds / floor_seconds."""
        return step_seconds / self.floor_seconds

    def to_dict(self) -> dict[str, float | int | str | None]:
        """The figures as a JSON-ready dict (bytes, bytes per second, seconds, tokens)."""
        return {
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "kv_tokens": self.kv_tokens,
            "bandwidth_bytes_per_second": self.bandwidth,
            "floor_seconds": self.floor_seconds,
            "crossover_tokens": self.crossover_tokens,
            "dequantized_bytes": self.dequantized_bytes,
            "code_layers": self.code_layers,
            "full_precision_kv_bytes": self.full_precision_kv_bytes,
            "full_precision_floor_seconds": self.full_precision_floor_seconds,
            "unread_bytes": self.unread_bytes,
            "rotation_flops": self.rotation_flops,
            "rotation_side": self.rotation_side,
        }


def speed_limit(model: PreTrainedModel, cache: Cache, bandwidth: float | None = None) -> SpeedLimit:
    """The floor of a decode step of `model` on `cache` as it is now (see the module docstring).

    Args:
        model: the causal LM.
        cache: its live KV cache (any backend), e.g. `QASession.cache` after a prefill.
        bandwidth: bytes per second; None probes it (`probe_bandwidth`, cached per process).

    Example:
        >>> limit = speed_limit(loaded.model, session.cache)
        >>> f"{limit.floor_seconds * 1000:.1f} ms, step / floor {limit.ratio(0.082):.1f}x"
    """
    from kvdemo.cache.layers.attention import layer_reads

    memory = kv_memory(cache)
    # keys and values of one token in one layer, in the model's dtype (what a layer de-quantizes each step)
    layers = kv_geometry(model.config).layers
    parameter = next(model.parameters())
    layer_token_bytes = full_precision_bytes(model.config, 1, parameter.dtype) // layers
    reads = layer_reads(cache, model)
    quantized_tokens = sum(
        stats.seq_length - stats.residual_tokens
        for stats, read in zip(memory.layers, reads)
        if stats.quantized_bytes and read != "codes"
    )
    kv_read = sum(layer.quantized_bytes + layer_token_bytes * layer.residual_tokens for layer in memory.layers)
    flops, side = rotation_flops(model.config, cache, memory)
    return SpeedLimit(
        weight_bytes=weight_bytes(model),
        kv_bytes=kv_read,
        unread_bytes=max(memory.cache_bytes - kv_read, 0),
        kv_tokens=int(cache.get_seq_length()),
        bandwidth=probe_bandwidth() if bandwidth is None else bandwidth,
        dequantized_bytes=layer_token_bytes * quantized_tokens,
        code_layers=reads.count("codes"),
        full_precision_kv_bytes=full_precision_bytes(model.config, int(cache.get_seq_length()), parameter.dtype),
        rotation_flops=flops,
        rotation_side=side,
    )


def rotation_flops(model_config, cache: Cache, memory: MemoryReport | None = None) -> tuple[int, str]:
    """The flops a decode step (one new token) of `cache` spends rotating (`SpeedLimit.rotation_flops`): each layer's
    own count of head_dim x head_dim products (`rotation_cost(query_heads, kv_heads, stored tokens)`, on the layers
    that rotate: the query side's per new token, the read side's per stored token, held - residual as `kv_memory`
    counts them), each product 2 x head_dim^2 flops; and the first side named (`query`, `read`; "" for a cache
    without rotated layers). `memory`: `kv_memory(cache)` when the caller has it (None reads it)."""
    geo = kv_geometry(model_config)
    query_heads = int(model_config.get_text_config(decoder=True).num_attention_heads)
    product = 2 * geo.head_dim**2
    flops, side = 0, ""
    for layer, stats in zip(cache.layers, (memory or kv_memory(cache)).layers):
        cost = getattr(layer, "rotation_cost", None)
        if cost is not None:
            products, where = cost(query_heads, geo.kv_heads, stats.seq_length - stats.residual_tokens)
            flops, side = flops + products * product, side or where
    return flops, side
