"""A prefilled cache as plain tensors and a JSON manifest, and back onto a fresh cache of the same spec: what a session
file (`kvdemo.qa.session_file`) holds. No pickle: every tensor is a plain `torch.Tensor` (safetensors writes them),
and the manifest says where each one goes.

Each layer's state is its attributes (`vars(layer)`, what `kvdemo.cache.state.snapshot` copies), walked recursively:
- a plain tensor: one entry of the tensor dict, named by its path (`L3._quantized_keys.0._scale`);
- a tensor subclass that flattens (`__tensor_flatten__`, PyTorch's protocol for subclasses): its inner tensors and
  its metadata, rebuilt by the class's `__tensor_unflatten__`. Only the subclasses the spec's format declares
  (`Backend.store_types`: quanto's `WeightQBitsTensor` and `PackedTensor`, whose metadata are strings only, quanto's
  own serialization format) are rebuilt; any other (a CUDA kernel's layout, e.g. quanto's Marlin or AWQ packing) is
  refused;
- lists, tuples, the records the format declares (named tuples: TurboQuant's codes, ggml's rows), dicts,
  `torch.Size`, a dtype, plain numbers, strings and None: written as JSON;
- a device: the device the cache is opened on;
- anything else that holds no tensor (a quantizer, a qtype, an optimizer, an `int` subclass that marks an axis): not
  written. It is made by the layer's own constructor from the spec, so the fresh cache's layer holds it already, and
  opening takes that one (`fresh`); the type's name is kept and checked. A value that holds tensors and that the
  format does not declare (a new store type) is refused at save, never skipped: a file without its store would open as
  an empty cache.

Opening builds the empty cache from the spec (`kvdemo.cache.spec.build_cache`, the same classes as the prefill
built), checks every layer's class against the file's, and writes the attributes back: the cache is then the
post-prefill cache, tensor for tensor, and the snapshot is taken from it as after a prefill.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache

FORMAT = 1
"""The manifest's format: a file of another format is refused."""

_SCALARS = (int, float, bool, str, type(None))


def _split(stored: dict[str, type]) -> tuple[dict[str, type], dict[str, type]]:
    """A format's store types (`Backend.store_types()`) as (tensor subclasses, records), each {name: class}."""
    subclasses = {name: cls for name, cls in stored.items() if issubclass(cls, torch.Tensor)}
    return subclasses, {name: cls for name, cls in stored.items() if name not in subclasses}


def _holds_tensors(value: Any) -> bool:
    """Whether `value` (not a plain container or scalar) carries tensors: a tuple subclass with a tensor item, or an
    instance whose attributes hold one (directly or in a list or tuple): a store type, which only its format can
    declare (`Backend.store_types`), never something a layer's constructor makes again."""
    if isinstance(value, tuple):
        items: list[Any] = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
        items = list(vars(value).values())
    else:
        return False
    flat = [v for item in items for v in (item if type(item) in (list, tuple) else [item])]
    return any(isinstance(v, torch.Tensor) for v in flat)


class CacheFileError(ValueError):
    """The manifest does not fit the cache it is opened onto (another spec, model or library version made it)."""


class _Writer:
    """Walks a cache's attributes into manifest nodes, collecting the tensors (each object once, by identity)."""

    def __init__(self, stored: dict[str, type]) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._seen: dict[int, str] = {}
        subclasses, named = _split(stored)
        self._subclasses = {cls: name for name, cls in subclasses.items()}
        self._named = {cls: name for name, cls in named.items()}

    def node(self, value: Any, path: str) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, torch.Size):
            return {"t": "size", "v": list(value)}
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"t": "device"}
        if type(value) in self._named:
            return {"t": "named", "cls": self._named[type(value)], "items": self._items(value, path)}
        if type(value) in (list, tuple):
            return {"t": type(value).__name__, "items": self._items(value, path)}
        if type(value) is dict and all(type(k) in (str, int) for k in value):
            return {"t": "dict", "items": [[k, self.node(v, f"{path}.{k}")] for k, v in value.items()]}
        if type(value) in _SCALARS:
            return {"t": "value", "v": value}
        if _holds_tensors(value):
            raise TypeError(
                f"{path} is a {type(value).__qualname__} holding tensors, a store type no format declares: kvdemo will "
                "not save a cache without its store; add the type to its format's store_types "
                "(kvdemo/cache/formats/<name>/__init__.py)"
            )
        return {"t": "fresh", "type": type(value).__qualname__}

    def _items(self, values: Any, path: str) -> list[dict[str, Any]]:
        return [self.node(v, f"{path}.{i}") for i, v in enumerate(values)]

    def _tensor(self, tensor: torch.Tensor, path: str) -> dict[str, Any]:
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            name = self._subclasses.get(type(tensor))
            if name is None:
                known = ", ".join([*self._subclasses.values(), "plain tensors"])
                raise TypeError(
                    f"{path} is a {type(tensor).__name__}, a tensor layout kvdemo cannot write to a session file "
                    f"(this format's store types: {known})"
                )
            inner_names, meta = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
            inner = {n: self._tensor(getattr(tensor, n), f"{path}.{n}") for n in inner_names}
            return {"t": "sub", "cls": name, "inner": inner, "meta": meta}
        key = self._seen.get(id(tensor))
        if key is None:
            key = self._seen[id(tensor)] = path
            plain = tensor.detach()
            if not plain.is_contiguous() or plain.untyped_storage().nbytes() != plain.numel() * plain.element_size():
                plain = plain.clone(memory_format=torch.contiguous_format)  # a view: its own bytes only
            self.tensors[key] = plain.cpu()
        return {"t": "tensor", "k": key}


def cache_state(cache: Cache, stored: dict[str, type]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A cache's state as plain tensors and a manifest (the module docstring says how each attribute is written).

    Args:
        cache: a prefilled cache (after `snapshot.restore`, it is the post-prefill state).
        stored: its format's store types (`Backend.store_types()`), by the name the manifest gives them.

    Returns:
        (tensors, manifest): {path: a contiguous CPU tensor}, and a JSON-able dict with the cache's and each layer's
        class and attributes.

    Raises:
        TypeError: a layer holds a tensor subclass or a store type (a record holding tensors) that `stored` does not
            declare: refused, never skipped.
    """
    writer = _Writer(stored)
    layers = [
        {"class": type(layer).__qualname__, "vars": {k: writer.node(v, f"L{i}.{k}") for k, v in vars(layer).items()}}
        for i, layer in enumerate(cache.layers)
    ]
    cache_vars = {k: writer.node(v, f"cache.{k}") for k, v in vars(cache).items() if k != "layers"}
    manifest = {"format": FORMAT, "class": type(cache).__qualname__, "vars": cache_vars, "layers": layers}
    return writer.tensors, manifest


_MISSING = object()
"""What the fresh layer holds where it holds nothing of that name."""


class _Reader:
    """Rebuilds attribute values from manifest nodes and the tensor dict, on `device`."""

    def __init__(self, tensors: Callable[[str], torch.Tensor], device: torch.device, stored: dict[str, type]) -> None:
        self.tensors, self.device = tensors, device
        self._subclasses, self._named = _split(stored)
        self._made: dict[str, torch.Tensor] = {}

    def value(self, node: dict[str, Any], fresh: Any, where: str) -> Any:
        kind = node.get("t")
        if kind == "tensor":
            key = node["k"]
            if key not in self._made:
                self._made[key] = self.tensors(key).to(self.device, copy=True)  # owned, aligned memory
            return self._made[key]
        if kind == "sub":
            cls = self._subclasses.get(node["cls"])
            if cls is None:
                raise CacheFileError(f"{where}: unknown tensor layout {node['cls']!r}")
            inner = {n: self.value(v, None, f"{where}.{n}") for n, v in node["inner"].items()}
            return cls.__tensor_unflatten__(  # type: ignore[attr-defined]  # a subclass of the format's
                inner, {str(k): str(v) for k, v in node["meta"].items()}, None, None
            )
        if kind in ("list", "tuple", "named"):
            own = list(fresh) if isinstance(fresh, (list, tuple)) else []
            items = [self.value(v, _at(own, i), f"{where}.{i}") for i, v in enumerate(node["items"])]
            if kind == "named":
                if node["cls"] not in self._named:
                    raise CacheFileError(f"{where}: unknown record {node['cls']!r}")
                return self._named[node["cls"]](*items)
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            mine: dict[Any, Any] = fresh if isinstance(fresh, dict) else {}
            return {k: self.value(v, mine.get(k, _MISSING), f"{where}.{k}") for k, v in node["items"]}
        if kind == "size":
            return torch.Size(int(n) for n in node["v"])
        if kind == "dtype":
            dtype = getattr(torch, str(node["v"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CacheFileError(f"{where}: unknown dtype {node['v']!r}")
            return dtype
        if kind == "device":
            return self.device
        if kind == "value" and type(node.get("v")) in _SCALARS:
            return node["v"]
        if kind == "fresh":
            if type(fresh).__qualname__ != node.get("type"):
                raise CacheFileError(
                    f"{where} is a {type(fresh).__qualname__} in the cache this spec builds, a {node.get('type')} in "
                    "the file: another kvdemo or library version wrote it"
                )
            return fresh
        raise CacheFileError(f"{where}: unknown entry {json.dumps(node)[:80]}")


def _at(items: list[Any], index: int) -> Any:
    """`items[index]`, or `_MISSING` where the fresh layer has no such item."""
    return items[index] if index < len(items) else _MISSING


def load_cache_state(
    cache: Cache,
    manifest: dict[str, Any],
    tensors: Callable[[str], torch.Tensor],
    device: torch.device,
    stored: dict[str, type],
) -> None:
    """Write a saved state (`cache_state`'s manifest and tensors) onto `cache`, an empty cache built from the same
    spec and model config, so it becomes the cache that was saved.

    Args:
        cache: from `build_cache(spec, config)`, nothing fed yet; changed in place.
        manifest: `cache_state`'s manifest.
        tensors: `tensors(path)` gives the tensor saved under that path (e.g. safetensors' `get_tensor`).
        device: where the tensors go (the model's device).
        stored: the spec's format's store types (`Backend.store_types()`), by the name the manifest gives them.

    Raises:
        CacheFileError: the manifest is of another format, its layer count or a layer's class differs from the cache
            this spec builds, or an attribute kvdemo's constructor makes is of another type. Nothing is written to
            `cache` before every layer's class has been checked.
    """
    if manifest.get("format") != FORMAT:
        raise CacheFileError(f"the cache is in format {manifest.get('format')!r}; this kvdemo reads format {FORMAT}")
    layers = manifest["layers"]
    if len(layers) != len(cache.layers) or type(cache).__qualname__ != manifest.get("class"):
        raise CacheFileError(
            f"the file holds a {manifest.get('class')} of {len(layers)} layers; this spec builds a "
            f"{type(cache).__qualname__} of {len(cache.layers)}"
        )
    for index, (layer, saved) in enumerate(zip(cache.layers, layers)):
        if type(layer).__qualname__ != saved["class"]:
            raise CacheFileError(f"layer {index} is a {saved['class']} in the file, a {type(layer).__qualname__} here")
    reader = _Reader(tensors, device, stored)
    built = []
    for index, (layer, saved) in enumerate(zip(cache.layers, layers)):
        own = vars(layer)
        built.append(
            {k: reader.value(v, own.get(k, _MISSING), f"layer {index}: {k}") for k, v in saved["vars"].items()}
        )
    cache_vars = {k: reader.value(v, getattr(cache, k, _MISSING), k) for k, v in manifest["vars"].items()}
    for layer, state in zip(cache.layers, built):
        vars(layer).clear()
        vars(layer).update(state)
    for name, value in cache_vars.items():
        setattr(cache, name, value)
