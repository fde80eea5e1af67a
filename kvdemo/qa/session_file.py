"""A prefilled session saved to one file and opened again, exactly: prefill once, come back later (llama.cpp's
`--prompt-cache` and slot save/restore, LMCache's stored KV), and the file a ZeroGPU job hands on.

The file is safetensors (no pickle: opening it runs no code): the cache's plain tensors
(`kvdemo.cache.state.serialize.cache_state`), the context's ids as the tensor `context_ids` (int64, [tokens]), and in
the header's metadata a JSON manifest under `kvdemo.session`: the format, the kvdemo and transformers versions, the
spec, the model's identity (`model_identity`), the context text and its split (`kvdemo.qa.prompt.PromptSplit`: the ids'
tail, the template's clock), the prefill's seconds and the cache's manifest. `kvdemo.digest` holds the SHA-256 of
that manifest and of every tensor's name, dtype, shape and bytes.

Opening (`open_session`) refuses, with `SessionFileError` (a `ValueError`) and before anything is loaded into a
session: a file that is not a session file or is truncated, one of another session format (`FORMAT`, not kvdemo's
release) or transformers version, one made with another model (name, dtype, config, tokenizer or weights) or another
spec than asked, and one whose bytes do not match its digest (changed or damaged). The digest proves integrity, not
authorship: whoever rewrites a file can rewrite its digest; that yields wrong numbers at worst, never code run, and
the cache's structure is still checked against the spec's (`load_cache_state`).

Figures: `benchmarks/session_file.py` measures saving and opening beside the prefill (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from kvdemo.cache.spec import CacheSpec, build_cache
from kvdemo.cache.state.serialize import CacheFileError, cache_state, load_cache_state
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PromptSplit
from kvdemo.qa.session import QASession

_log = logging.getLogger(__name__)

FORMAT = 2
"""The session file's format: its layout and the model identity it is bound to (the cache's layout has its own,
`kvdemo.cache.state.serialize.FORMAT`). A file opens in any kvdemo of the same format and cache format: raise it when
either changes (2: the whole tokenizer in the identity, the prefill's reserve kept), never for a kvdemo release
alone."""
SUFFIX = ".kvsession"
"""The file name's suffix the page and the command line give a session file (a safetensors file)."""
_MANIFEST, _DIGEST, _IDS = "kvdemo.session", "kvdemo.digest", "context_ids"
_WEIGHT_SAMPLES = 16
"""Values read from each weight tensor (evenly strided) for the model's fingerprint."""


class SessionFileError(ValueError):
    """A session file cannot be opened here: the message says why and what to do (prefill again, or load the model
    or choose the spec it was made with)."""


def versions() -> dict[str, str]:
    """The versions a session file must match: kvdemo's and transformers' (whose cache layers it holds). kvdemo's
    comes from its installed metadata, else (a checkout run in place, as a Space runs it) from `pyproject.toml`."""
    try:
        kvdemo = metadata.version("kvdemo")
    except metadata.PackageNotFoundError:
        found = re.search(r'^version = "([^"]+)"', (Path(__file__).parents[2] / "pyproject.toml").read_text(), re.M)
        kvdemo = found.group(1) if found else "unknown"
    return {"kvdemo": kvdemo, "transformers": metadata.version("transformers")}


def model_identity(loaded: LoadedModel) -> dict[str, Any]:
    """What makes two loaded models the same for a saved cache (and `source`, what `load_model` was given, to load it
    again; not compared): the name, the dtype, a SHA-256 of the config (without its path and version fields), the
    tokenizer's `tokenizer_fingerprint`, and a SHA-256 of a sample of every weight (`_WEIGHT_SAMPLES` evenly strided
    values per tensor, with its name and shape: a fine-tuned twin differs). Reads a few values per tensor and the
    tokenizer's serialized form (tens of milliseconds, also on a GPU)."""
    config = {k: v for k, v in loaded.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    weights = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in loaded.model.state_dict().items():
            flat = tensor.reshape(-1)
            sample = flat[:: max(1, flat.numel() // _WEIGHT_SAMPLES)][:_WEIGHT_SAMPLES]
            weights.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            weights.update(sample.detach().float().cpu().numpy().tobytes())
    return {
        "name": loaded.name,
        "source": loaded.source,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "tokenizer": tokenizer_fingerprint(loaded.tokenizer),
        "weights": weights.hexdigest(),
    }


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of everything that maps a text to ids: a fast tokenizer's whole serialized form
    (`backend_tokenizer.to_str()`: vocabulary, merges, normalizer, pre-tokenizer, post-processor, decoder, added
    tokens), else its vocabulary and added tokens; with the special tokens and the chat template. A session file's
    ids are the context tokenized by it: a tokenizer that differs anywhere (one `Lowercase` normalizer) gives other
    ids for the same text and the next question, so it must not open the file (the class of mlx-lm PR#138: a prompt
    cache keyed without its tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        form = backend.to_str()
    else:
        form = json.dumps(sorted(tokenizer.get_vocab().items()))
        form += json.dumps({str(k): str(v) for k, v in getattr(tokenizer, "added_tokens_decoder", {}).items()})
    extras = {
        "special": getattr(tokenizer, "special_tokens_map", {}),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    digest = hashlib.sha256(form.encode())
    digest.update(json.dumps(extras, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _digest(manifest_text: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the manifest's text and of every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256(manifest_text.encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


@dataclass(frozen=True)
class SavedSession:
    """A session file written by `save_session`: its path, its size (bytes) and the time writing it took (seconds)."""

    path: Path
    bytes: int
    seconds: float


def save_session(session: QASession, path: str | os.PathLike[str]) -> SavedSession:
    """Write `session`'s prefilled context and cache to `path` (written beside it, then renamed: never half a file).

    Args:
        session: a prefilled session with no answer streaming (its cache is the post-prefill one).
        path: where to write; `SUFFIX` is the usual suffix; the folder must exist.

    Returns:
        The path, the file's bytes and the seconds it took.

    Raises:
        ValueError: the session holds no prefill, or an answer is streaming (save after it ends).
        TypeError: a layer holds a tensor layout kvdemo cannot write (`kvdemo.cache.state.serialize`).
        OSError: the file cannot be written (a missing folder, a full disk); nothing is left at `path`.
    """
    if session.cache is None or session.prefill_report is None or session.context is None:
        raise ValueError("prefill a context before saving the session")
    if session.streaming:
        raise ValueError("an answer is streaming; save the session after it ends")
    start = time.perf_counter()
    split, report = session.split, session.prefill_report
    tensors, cache_manifest = cache_state(session.cache, session.spec.info.store_types())
    tensors[_IDS] = torch.tensor(split.prefix, dtype=torch.int64)
    manifest = {
        "format": FORMAT,
        "versions": versions(),
        "spec": session.spec.text,
        "model": model_identity(session.loaded),
        "context": session.context,
        "context_tokens": len(split.prefix),
        "split": {
            "tail": split.tail,
            "matches_template": split.matches_template,
            "note": split.note,
            "clock": split.clock.isoformat() if split.clock else None,
        },
        "prefill_seconds": report.prefill_seconds if report.prefill_seconds is not None else report.seconds,
        "reserve_tokens": session.reserve_tokens,
        "cache": cache_manifest,
    }
    text = json.dumps(manifest, sort_keys=True)
    target = Path(path)
    # a name of its own per writer: two prefills of one context at once must not write into one file
    partial = target.with_name(f"{target.name}.{os.getpid()}-{threading.get_ident()}.part")
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(partial), metadata={_MANIFEST: text, _DIGEST: _digest(text, tensors)})
        os.replace(partial, target)
    except BaseException:  # a full disk, a stop: no half file left behind
        partial.unlink(missing_ok=True)
        raise
    return SavedSession(target, target.stat().st_size, time.perf_counter() - start)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a session file, read from its header alone (no tensor is read).

    Raises:
        SessionFileError: the file is missing, is not a safetensors file, is truncated, or holds no kvdemo session.
    """
    return _open_header(Path(path))[0]


def _open_header(path: Path) -> tuple[dict[str, Any], str, str]:
    """(the manifest, its text as written, the digest) from the file's header."""
    from safetensors import safe_open

    if not path.is_file():
        raise SessionFileError(f"{path} is not a file; give the path of a session file ({SUFFIX})")
    try:
        with safe_open(str(path), framework="pt") as file:
            header = file.metadata() or {}
    except Exception as error:  # safetensors raises its own SafetensorError, or OSError
        _log.info("%s cannot be read as safetensors: %s", path.name, error)
        raise SessionFileError(
            f"{path.name} is not a session file, or it was cut short ({path.stat().st_size:,} bytes): choose the "
            f"{SUFFIX} file that Save session or --save-session wrote"
        ) from None
    if _MANIFEST not in header or _DIGEST not in header:
        raise SessionFileError(f"{path.name} is a safetensors file but holds no kvdemo session")
    try:
        manifest = json.loads(header[_MANIFEST])
    except ValueError:
        raise SessionFileError(f"{path.name}'s session manifest is not JSON: the file was changed or damaged") from None
    return manifest, header[_MANIFEST], header[_DIGEST]


def check_fits(manifest: dict[str, Any], loaded: LoadedModel, spec: CacheSpec | None) -> CacheSpec:
    """The spec a session file holds, once its format, versions, model and spec fit this model and the asked spec.

    Args:
        spec: the spec asked for; None takes the file's.

    Raises:
        SessionFileError: another session format, transformers version, model (its name, dtype, config,
            tokenizer or weights) or spec made it (the message says which, and what would open it).
    """
    theirs = manifest.get("versions") or {}
    if manifest.get("format") != FORMAT:
        raise SessionFileError(
            f"the file is in session format {manifest.get('format')!r} (written by kvdemo {theirs.get('kvdemo')}); "
            f"this kvdemo {versions()['kvdemo']} reads format {FORMAT}: prefill the context again (and save it anew)"
        )
    transformers = versions()["transformers"]  # kvdemo's own version is not compared: FORMAT says the layout
    if theirs.get("transformers") != transformers:
        raise SessionFileError(
            f"the file was written with transformers {theirs.get('transformers')}; this is transformers "
            f"{transformers}, whose cache layers may differ: prefill the context again (and save it anew)"
        )
    model, identity = manifest.get("model") or {}, model_identity(loaded)
    if model.get("name") == identity["name"] and model.get("tokenizer") != identity["tokenizer"]:
        raise SessionFileError(
            f"the file's context was tokenized by another tokenizer than {identity['name']}'s here (its vocabulary, "
            "normalizer or special tokens differ), so its ids would not match this model's questions: load the "
            "tokenizer it was made with, or prefill the context again"
        )
    for field in ("name", "dtype", "config", "tokenizer", "weights"):
        if model.get(field) != identity[field]:
            what = f"{model.get('name')} in {model.get('dtype')}"
            raise SessionFileError(
                f"the file was made with {what}, not this model ({identity['name']} in {identity['dtype']}; they "
                f"differ in their {field}): load that model to open it, or prefill the context again"
            )
    saved = CacheSpec.parse(str(manifest.get("spec")))
    if spec is not None and spec.validate(loaded.config).full_text != saved.validate(loaded.config).full_text:
        raise SessionFileError(
            f"the file holds a `{saved.text}` cache, not `{spec.text}`: choose `{saved.text}` to open it, or prefill "
            "the context again with this spec"
        )
    return saved


def open_session(
    loaded: LoadedModel,
    path: str | os.PathLike[str],
    spec: CacheSpec | None = None,
    kv_budget_bytes: int | None = None,
    session: QASession | None = None,
    shown_as: str | None = None,
) -> QASession:
    """Open a session file: a session whose cache is the saved post-prefill cache, tensor for tensor, on the model's
    device (one copy from the file), so its answers equal a fresh single-question run's.

    Example:
        >>> save_session(session, "normans.kvsession")
        >>> again = open_session(load_model(), "normans.kvsession")
        >>> again.ask("In what country is Normandy located?").text == session.ask(...).text
        True

    Args:
        loaded: the model the file was made with.
        path: the file.
        spec: the spec expected; None takes the file's.
        kv_budget_bytes: as for `QASession`.
        session: a session of this model and the file's spec to open the file into (replacing its prefill); None
            builds a new one.
        shown_as: what `prefill_report.opened_from` calls the file; None: its name.

    Returns:
        The session, prefilled; `prefill_report.opened_from` names the file (`shown_as`) and `seconds` is the load's
        time.

    Raises:
        SessionFileError: see `check_fits`, `read_manifest`; or the bytes do not match the digest (changed or
            damaged), or the cache's structure not the spec's. Raised before anything is loaded into `session`.
        ValueError, KVBudgetError: the context does not fit the window or the budget (`QASession.adopt`).
    """
    start, path = time.perf_counter(), Path(path)
    manifest, text, digest = _open_header(path)
    saved_spec = check_fits(manifest, loaded, spec)
    if session is None:  # the spec's probe (`kvdemo.qa.probe`) is the session's making, not the load's: not timed
        made = time.perf_counter()
        session = QASession(loaded, saved_spec, kv_budget_bytes)
        start += time.perf_counter() - made
    elif session.loaded is not loaded or session.spec.text != saved_spec.validate(loaded.config).text:
        raise SessionFileError(f"this session serves `{session.spec.text}`; the file holds `{saved_spec.text}`")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
    except Exception as error:
        raise SessionFileError(f"{path.name} cannot be read whole: {error}") from None
    if _IDS not in tensors or _digest(text, tensors) != digest:
        raise SessionFileError(
            f"{path.name}'s contents do not match its digest: it was changed or damaged after it was written; "
            "prefill the context again"
        )
    ids = tensors.pop(_IDS)
    split_fields = manifest["split"]
    clock = split_fields.get("clock")
    split = PromptSplit(
        tuple(int(i) for i in ids.tolist()),
        str(split_fields["tail"]),
        bool(split_fields["matches_template"]),
        split_fields.get("note"),
        datetime.fromisoformat(clock) if clock else None,
    )
    cache = build_cache(session.spec, loaded.config)
    try:
        load_cache_state(cache, manifest["cache"], tensors.__getitem__, loaded.device, session.spec.info.store_types())
    except (CacheFileError, KeyError) as error:
        raise SessionFileError(f"{path.name}'s cache does not fit `{session.spec.text}` here: {error}") from None
    opened = (shown_as or path.name, float(manifest["prefill_seconds"]))
    session.adopt(cache, split, str(manifest["context"]), start, opened, int(manifest.get("reserve_tokens", 0)))
    return session
