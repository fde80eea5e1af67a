"""quanto on CUDA: optimum-quanto 0.2.7 de-quantizes a CUDA tensor with its CUDA extension (`quanto_cuda`), which it
JIT-builds with nvcc on first use (minutes, inside a GPU call whose duration is counted). A build already in the kvdemo
cache folder (`kvdemo.cache.formats.quanto.build`) is loaded; else the extension's library is replaced by quanto's own
pure-torch unpacking (`pure_torch_unpack`, the same integers), unless `KVDEMO_QUANTO_CUDA_BUILD=1` asks quanto to build
it. The quanto card's `on_device` (a ZeroGPU job calls it: `kvdemo.serve.gpu_job`).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def pure_torch_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """optimum-quanto 0.2.7's default `quanto::unpack` (`optimum/quanto/library/unpack.py`), the same operations (that
    module's `unpack` cannot be imported: `torch.library.impl`'s decorator leaves the name None, and the op dispatches
    a CUDA tensor to the extension this stands in for):
    each uint8 of `packed` ([n, ...]) holds 8 / `bits` values of `bits` bits; returns them as uint8,
    [n x 8 / bits, ...], the lowest bits first. Runs on any device."""
    unpacked = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
    return torch.cat(unpacked).to(torch.uint8)


class PureTorchUnpack:
    """Stands in for quanto's CUDA extension library: its `unpack` is `pure_torch_unpack`."""

    unpack = staticmethod(pure_torch_unpack)


FALLBACK_NOTE = (
    "optimum-quanto: its CUDA extension is not built here (building it takes minutes of GPU time); quanto's pure-torch "
    "unpacking runs instead (the same integers)"
)


def quanto_on_device(device: torch.device, extensions: Any = None) -> str | None:
    """Probe quanto's CUDA extension on `device` (nothing on the CPU) and choose what unpacks quanto's stores there.

    Args:
        device: the job's device.
        extensions: quanto's extension module (`optimum.quanto.library.extensions.extension`); None imports it.

    Returns:
        None on the CPU; else a line saying what runs: the built extension, `FALLBACK_NOTE`, quanto's default
        unpacking (no CUDA extension registered), or that optimum-quanto is not installed.
    """
    if device.type != "cuda":
        return None
    if extensions is None:
        try:
            from optimum.quanto.library.extensions import extension  # type: ignore[import-untyped]
        except ImportError:
            return "optimum-quanto is not installed: the quanto backend is refused"
        extensions = extension
    if not extensions.is_extension_available("quanto_cuda"):
        return "optimum-quanto: no CUDA extension is registered; quanto's default (pure-torch) unpacking runs"
    from .build import share_quanto_build

    share_quanto_build()  # loads a build already in the kvdemo cache folder
    ext = extensions.get_extension("quanto_cuda")
    if ext._lib is None and os.environ.get("KVDEMO_QUANTO_CUDA_BUILD") != "1":
        ext._lib = PureTorchUnpack()
    if ext._lib is None:
        return "optimum-quanto: its CUDA extension is built on first use (KVDEMO_QUANTO_CUDA_BUILD=1; needs nvcc)"
    return FALLBACK_NOTE if isinstance(ext._lib, PureTorchUnpack) else "optimum-quanto: its CUDA extension runs"
