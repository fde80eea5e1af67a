"""Read a KV cache's real memory and its residual flushes. Nothing here changes the cache.

Memory is counted from the tensors a layer really holds, each storage once
(`untyped_storage().nbytes()`, keyed by the storage's address), never from a formula:

- a quantized store is walked down to its plain tensors: a quanto `WeightQBitsTensor` through
  `__tensor_flatten__` to its packed uint8 data, scale and shift (its own `element_size() * nelement()`
  would give the unpacked size: wrong); an hqq `(W_q, meta)` pair to the packed tensor and the `scale`
  and `zero` in `meta`; an fp8 `(float8 tensor, scale)` pair to both;
- the full-precision tensors (`layer.keys`, `layer.values`: the residual of a quantized layer, all of a
  `DynamicLayer`) are counted as residual bytes. A `DynamicLayer` sliced back by `snapshot.restore`
  holds a view whose storage is still the longer one until the next decode step: it is counted whole;
- given the session's `snapshot.CacheSnapshot`, what it keeps alive beside the cache (the post-prefill
  quantized store after a flush, the post-prefill fp8 store once an answer appended to it, a sliding-window
  layer's post-prefill window) is counted as snapshot bytes, after the cache, so that a storage both hold is
  counted once. docs/DESIGN.md, invariant 4: no figure may under-report what the session holds for its cache.

The reference a `DynamicCache` would need is `kvdemo.cache.model.geometry.full_precision_bytes` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers.cache_utils import BaseQuantizedLayer, Cache, CacheLayerMixin, QuantizedLayer

from kvdemo.cache.model.layer_kinds import STATE_ATTRIBUTES

if TYPE_CHECKING:
    from kvdemo.cache.state.snapshot import CacheSnapshot

_QUANTIZED_ATTRIBUTES = ("_quantized_keys", "_quantized_values", "_answer_keys", "_answer_values")
"""The layer attributes that hold a quantized store: the keys' and the values', and the answer's records that
`GgmlLayer` and `AppendedLayer` write for the tokens decoded since their last update of several tokens
(`kvdemo.cache.layers.appended`)."""
_KV_ATTRIBUTES = (*_QUANTIZED_ATTRIBUTES, "keys", "values")

LAYER_GROUPS = ("quantized", "sliding", "full", "state")
"""What holds a cache's bytes (`MemoryReport.bytes_by_kind`): the quantized layers, the full-precision sliding-window
layers, the full-precision layers that keep every token, and the conv and recurrent states."""


def holder(layer: object) -> str:
    """What holds a cache layer's keys and values: `quantized` (a quantized backend's layer), `sliding` (a
    full-precision sliding-window layer), `full` (a full-precision layer keeping every token), `none`."""
    if isinstance(layer, BaseQuantizedLayer):
        return "quantized"
    if getattr(layer, "keys", None) is None:  # a DummyLayer, states alone, or not filled yet
        return "none"
    return "sliding" if getattr(layer, "is_sliding", False) else "full"


"""The layer attributes that hold the KV cache's tensors (a quantized store, then the full-precision tensors)."""


@dataclass(frozen=True)
class LayerMemory:
    """Bytes held by one cache layer.

    Attributes:
        quantized_bytes: the quantized store: packed data, scales, zero points (bytes).
        residual_bytes: full-precision keys and values held (bytes): a quantized layer's residual, or all of
            a `DynamicLayer`.
        residual_tokens: tokens held in full precision (for a `DynamicLayer`, all of them).
        seq_length: tokens the layer has seen (`get_seq_length()`; a sliding layer's count goes on past its
            window; 0 for a layer without keys and values).
        snapshot_bytes: bytes of the storages that the layer's snapshot keeps alive and the cache does not hold
            (0 without a snapshot, and right after the prefill or a restore, when both hold the same tensors; a
            layer's cloned recurrent states are always counted: `kvdemo.cache.state.snapshot`).
        state_bytes: the layer's conv and recurrent states (linear-attention and SSM layers; bytes), a fixed size
            whatever the context.
        kind: what holds its keys and values (`LAYER_GROUPS`): `quantized` (a quantized backend's layer, full or
            sliding), `sliding` (a full-precision sliding-window layer, which stops growing at its window), `full`
            (a full-precision layer that keeps every token), or `none` (states alone, or nothing).
    """

    quantized_bytes: int
    residual_bytes: int
    residual_tokens: int
    seq_length: int
    snapshot_bytes: int = 0
    state_bytes: int = 0
    kind: str = "full"

    @property
    def kv_bytes(self) -> int:
        """quantized_bytes + residual_bytes: the layer's keys and values (bytes)."""
        return self.quantized_bytes + self.residual_bytes

    @property
    def cache_bytes(self) -> int:
        """quantized_bytes + residual_bytes + state_bytes: what the cache layer itself holds."""
        return self.quantized_bytes + self.residual_bytes + self.state_bytes

    @property
    def total_bytes(self) -> int:
        """cache_bytes + snapshot_bytes: everything held for this layer."""
        return self.cache_bytes + self.snapshot_bytes


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by a whole cache, per layer and in total (each storage counted once).

    Attributes:
        layers: one `LayerMemory` per cache layer.
        device_allocated_bytes: on CUDA only, `torch.cuda.memory_allocated(device)` when the report was made
            (bytes): everything PyTorch's caching allocator has handed out on the cache's device (the model's
            weights, the cache, activations alive at that moment), beside the tensor accounting above; None on
            CPU.
    """

    layers: tuple[LayerMemory, ...]
    device_allocated_bytes: int | None = None

    @functools.cached_property
    def quantized_bytes(self) -> int:
        """Sum of the layers' quantized bytes."""
        return sum(layer.quantized_bytes for layer in self.layers)

    @functools.cached_property
    def residual_bytes(self) -> int:
        """Sum of the layers' full-precision bytes."""
        return sum(layer.residual_bytes for layer in self.layers)

    @functools.cached_property
    def snapshot_bytes(self) -> int:
        """Sum of the layers' snapshot bytes: what the snapshot keeps alive beside the cache."""
        return sum(layer.snapshot_bytes for layer in self.layers)

    @functools.cached_property
    def state_bytes(self) -> int:
        """Sum of the layers' conv and recurrent states (bytes)."""
        return sum(layer.state_bytes for layer in self.layers)

    @property
    def cache_bytes(self) -> int:
        """quantized_bytes + residual_bytes + state_bytes: what the cache itself holds (bytes)."""
        return self.quantized_bytes + self.residual_bytes + self.state_bytes

    @property
    def total_bytes(self) -> int:
        """Everything held for the cache (bytes): cache_bytes + snapshot_bytes. The figure to show: it never
        under-reports (without a snapshot it equals cache_bytes)."""
        return self.cache_bytes + self.snapshot_bytes

    def bytes_by_kind(self) -> dict[str, int]:
        """What the cache holds by what holds it (bytes, snapshot not included): `quantized` (the layers the backend
        stores, their residual included: what it shrinks), `sliding` (full-precision sliding-window layers: they
        stop growing at their window), `full` (full-precision layers that keep every token), `state` (conv and
        recurrent states: a fixed size). Every key, 0 where the model has none, so that they add up to
        `cache_bytes`. A copy of `_by_kind`, summed once per report."""
        return dict(self._by_kind)

    @functools.cached_property
    def _by_kind(self) -> dict[str, int]:
        """`bytes_by_kind`, computed once: the memory chart reads every event's report at every streamed step."""
        out = dict.fromkeys(LAYER_GROUPS, 0)
        for layer in self.layers:
            if layer.kind in out:
                out[layer.kind] += layer.kv_bytes
            out["state"] += layer.state_bytes
        return out

    @functools.cached_property
    def kept_bytes(self) -> int:
        """What a quantized cache keeps at full precision beside its quantized layers (bytes): the layers of other
        kinds (sliding windows, `sliding=keep`) and the conv and recurrent states; 0 where no layer is quantized
        (`dynamic`) or every layer is."""
        quantized = self._by_kind["quantized"]
        return self.cache_bytes - quantized if quantized else 0

    @property
    def seq_length(self) -> int:
        """Tokens in the cache (the longest layer's count, as `Cache.get_seq_length()` of an attention layer)."""
        return max((layer.seq_length for layer in self.layers), default=0)

    def to_dict(self, per_layer: bool = False) -> dict[str, Any]:
        """Totals as a JSON-ready dict; with `per_layer`, the layers too."""
        out: dict[str, Any] = {
            "kv_bytes": self.total_bytes,
            "quantized_bytes": self.quantized_bytes,
            "residual_bytes": self.residual_bytes,
            "snapshot_bytes": self.snapshot_bytes,
            "seq_length": self.seq_length,
        }
        if self.state_bytes:
            out["state_bytes"] = self.state_bytes
        if any(layer.kind not in ("quantized", "full") for layer in self.layers):  # a model of several kinds
            out["bytes_by_kind"] = self.bytes_by_kind()
        if self.device_allocated_bytes is not None:
            out["device_allocated_bytes"] = self.device_allocated_bytes
        if per_layer:
            out["layers"] = [asdict(layer) for layer in self.layers]
        return out


STEP_KINDS = ("question pass", "decode step", "flush step")
"""The kinds of decode step: the question's own forward pass (step 0), decode steps without a flush, and decode
steps during which at least one layer flushed."""


@dataclass(frozen=True)
class StepEvent:
    """The telemetry record of one decode step of an answer (made by `QASession.stream`).

    Attributes:
        step: 0 for the token produced by the question's forward pass, then 1, 2, ...
        token_id: the greedy token of this step.
        text: the answer decoded so far (special tokens skipped; whole characters only: a character whose last
            byte has not come yet is held back, `kvdemo.qa.text.TextStream`).
        seconds: wall time of this step's forward pass (seconds).
        elapsed: seconds since the answer started.
        memory: the bytes held for the cache after this step's update, the snapshot's included.
        flushed_layers: indices of the layers whose residual flushed at this step.
        cache_length: tokens in the cache after this step (the restore brings it back afterwards).
        full_precision_bytes: what a `DynamicCache` in the model's dtype would hold for `cache_length` tokens.
    """

    step: int
    token_id: int
    text: str
    seconds: float
    elapsed: float
    memory: MemoryReport
    flushed_layers: tuple[int, ...]
    cache_length: int
    full_precision_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (the memory per layer): the command line's and the MCP tools' JSON (a
        device worker's records cross pickled, `kvdemo.serve.gpu_job`)."""
        out = asdict(self)
        out["memory"] = self.memory.to_dict(per_layer=True)
        out["flushed_layers"] = list(self.flushed_layers)
        return out

    @property
    def is_flush_step(self) -> bool:
        """A decode step after the question's own pass during which at least one layer flushed: the one
        definition of a flush step (the step-time chart, the flush timings, the comparison's flush seconds)."""
        return self.step > 0 and bool(self.flushed_layers)

    @property
    def kind(self) -> str:
        """Which of `STEP_KINDS` this step is: the question's pass (step 0, whatever flushed in it), a flush
        step, or a decode step without a flush."""
        return STEP_KINDS[0] if self.step == 0 else STEP_KINDS[2] if self.is_flush_step else STEP_KINDS[1]


def _plain_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The plain tensors inside a cache attribute: tensor subclasses are opened with `__tensor_flatten__`,
    tuples, lists and dicts are walked."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            for name in names:
                yield from _plain_tensors(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _plain_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _plain_tensors(item)


def _bytes(objs: tuple[Any, ...], seen: set[tuple[str, int]], devices: set[torch.device] | None = None) -> int:
    total = 0
    for obj in objs:
        for tensor in _plain_tensors(obj):
            if devices is not None:
                devices.add(tensor.device)
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total


def storage_bytes(*objects: Any) -> int:
    """Bytes of every distinct tensor storage inside `objects` (tensors, tensor subclasses opened to their packed
    data, scales and zero points, and tuples, lists and dicts of them), each storage counted once across all of
    them, as `kv_memory` counts. For code that holds cache attributes outside a cache (e.g. a benchmark's copies).

    Example:
        >>> storage_bytes([vars(layer) for layer in cache.layers])  # the whole cache's bytes
    """
    return _bytes(objects, set())


def _tokens(tensor: torch.Tensor | None) -> int:
    return tensor.shape[-2] if tensor is not None and tensor.dim() == 4 else 0


def kv_memory(cache: Cache, snapshot: CacheSnapshot | None = None) -> MemoryReport:
    """Measure the bytes each layer of `cache` holds, from its tensors, and what `snapshot` keeps alive beside it.

    Args:
        cache: a `DynamicCache` or `QuantizedCache` (any layer with `keys`/`values`, and for quantized layers
            `_quantized_keys`/`_quantized_values`).
        snapshot: the `snapshot.CacheSnapshot` taken of this cache after its prefill (as `QASession` holds it),
            or None. Its saved KV attributes are walked after the whole cache; a storage the cache holds too is
            not counted again.

    Returns:
        A `MemoryReport`; each tensor storage is counted once across the whole cache and snapshot: the cache's
        in `quantized_bytes`/`residual_bytes`, the rest of the snapshot's in `snapshot_bytes`. When the cache's
        tensors are on a CUDA device, `device_allocated_bytes` is `torch.cuda.memory_allocated` of that device.

    Raises:
        ValueError: the snapshot has another number of layers than the cache.

    Example:
        >>> report = kv_memory(session.cache, session._snapshot)
        >>> report.total_bytes == report.quantized_bytes + report.residual_bytes + report.snapshot_bytes
        True
    """
    if snapshot is not None and len(snapshot.layers) != len(cache.layers):
        raise ValueError(
            f"the snapshot has {len(snapshot.layers)} layers but the cache has {len(cache.layers)}; "
            "it was taken from another cache"
        )
    seen: set[tuple[str, int]] = set()
    devices: set[torch.device] = set()
    layers = []
    for layer in cache.layers:
        quantized = _bytes(tuple(getattr(layer, name, None) for name in _QUANTIZED_ATTRIBUTES), seen, devices)
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        holds_kv = isinstance(keys, torch.Tensor) and hasattr(layer, "get_seq_length")  # not a DummyLayer's None
        layers.append(
            LayerMemory(
                quantized_bytes=quantized,
                residual_bytes=_bytes((keys, values), seen, devices),
                residual_tokens=_tokens(keys),
                seq_length=int(cast(CacheLayerMixin, layer).get_seq_length()) if holds_kv else 0,
                state_bytes=_bytes(tuple(getattr(layer, name, None) for name in STATE_ATTRIBUTES), seen, devices),
                kind=holder(layer),
            )
        )
    if snapshot is not None:
        for index, saved in enumerate(snapshot.layers):
            attributes = saved.attributes or {}
            states = saved.states or {}
            held = _bytes(tuple(attributes.get(name) for name in _KV_ATTRIBUTES), seen)
            held += _bytes(tuple(states.get(name) for name in STATE_ATTRIBUTES), seen)
            if held:
                layers[index] = dataclasses.replace(layers[index], snapshot_bytes=held)
    cuda = sorted((d for d in devices if d.type == "cuda"), key=str)
    allocated = torch.cuda.memory_allocated(cuda[0]) if cuda else None
    return MemoryReport(tuple(layers), device_allocated_bytes=allocated)


def flushed_layers(cache: Cache) -> tuple[int, ...]:
    """The layers that flushed at the update just made: call it right after a forward pass that added tokens.

    A `QuantizedLayer` (quanto, hqq) keeps new tokens in its residual until `residual tokens + new tokens
    >= residual_length`, and then re-quantizes the whole layer and empties the residual
    (`transformers.cache_utils.QuantizedLayer.update`). After an update that added tokens, an empty residual
    therefore means a flush. fp8 and `DynamicLayer`s never flush.
    """
    return tuple(
        index
        for index, layer in enumerate(cache.layers)
        if isinstance(layer, QuantizedLayer) and layer.is_initialized and _tokens(layer.keys) == 0
    )


def expected_flush_steps(question_tokens: int, residual_length: int, steps: int) -> list[int]:
    """The decode steps at which a `QuantizedLayer` flushes during an answer, by transformers' rule
    (`QuantizedLayer.update`): new tokens join the residual until residual + new >= residual_length, then the
    layer is re-quantized and the residual emptied. Step 0 adds the question's tokens, each later step one
    token; the residual is empty after the prefill.
    """
    flushes, residual = [], 0
    for step in range(steps):
        new = question_tokens if step == 0 else 1
        if residual + new >= residual_length:
            flushes.append(step)
            residual = 0
        else:
            residual += new
    return flushes
