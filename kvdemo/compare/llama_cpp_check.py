"""A recommendation's pick run in llama.cpp itself (`recommend --engine llama.cpp --verify`): llama-cpp-python on
the same GGUF, fed the very ids kvdemo scored (`TokenIds`), with the pick's `-ctk`/`-ctv` against llama.cpp's own
f16 cache, flash attention on in both (llama.cpp needs it for a quantized V cache; `llama_cpp_command` deploys with
`-fa on`). A third run, llama.cpp's q8_0 cache, measures llama.cpp's own arithmetic: its CPU flash attention
accumulates an f16 V in f16 and a quantized one in f32, and rounds the query to the key type's dot-product type
(q8_0 for q8_0 and q4_0 keys, q8_1 for q4_1 and q5_1; ggml-cpu `ops.cpp`,
`ggml_compute_forward_flash_attn_ext_f16_one_chunk`), so switching to any quantized type switches kernels. q8_0's
storage moves the model by KL 0.0002-0.0013 (kvdemo's figure), while llama.cpp's q8_0 run moves it by 0.002-0.011
(docs/ggml.md, docs/recommend.md): that is a floor under every quantized type's figure in llama.cpp, printed beside
the two figures so that a reader can tell the engine's arithmetic from the cache. The bar: the two
figures within 2x of each other.

Each run: the prefix evaluated once, then for each question the cache cut back to the prefix
(`llama_memory_seq_rm`, llama.cpp's own restore), the question's ids, and `dynamic`'s answer fed one decode step
per token, as kvdemo's `QASession.score` feeds them; row i is the distribution before answer token i.

llama-cpp-python is not a dependency (`make bench-peers` installs the pinned build); `check_available` says so
before a model loads.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvdemo.compare.recommendation import EngineCheck, Recommendation, TokenIds

LLAMA_CPP_VERSION = "0.3.36"
"""The llama-cpp-python release `make bench-peers` installs (the Makefile's `LLAMA_CPP_VERSION`)."""

GGML_TYPE_IDS = {"f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20}
"""`enum ggml_type` (ggml/include/ggml.h): the values llama-cpp-python's `type_k`/`type_v` take."""


def check_available() -> str:
    """llama-cpp-python's version, where it imports.

    Raises:
        ImportError: it is not installed; the message says how to install it.
    """
    try:
        import llama_cpp  # noqa: PLC0415  (optional)
    except ImportError as error:
        raise ImportError(
            f"--verify runs llama.cpp through llama-cpp-python, which is not installed: `make bench-peers` (or pip "
            f"install llama-cpp-python=={LLAMA_CPP_VERSION}) builds it, about 10 minutes on 2 cores"
        ) from error
    return str(llama_cpp.__version__)


def check_gguf(model: str | None) -> Path:
    """The GGUF file llama.cpp reads for `--model` (None: the embedded model's own GGUF).

    Raises:
        ValueError: `model` is not a .gguf file (a Hub id or a folder of safetensors); the message says what works.
        OSError: the file does not exist.
    """
    if model is None:
        from kvdemo.qa.models import embedded_gguf_path  # noqa: PLC0415

        return embedded_gguf_path()
    path = Path(model).expanduser()
    if path.suffix.lower() != ".gguf":
        raise ValueError(
            f"--verify runs llama.cpp on the model's GGUF file, and --model {model} is not one: give --model "
            "path/to/model.gguf (kvdemo reads GGUF files too), or leave --verify out"
        )
    if not path.is_file():
        raise OSError(f"--model {model}: no such file")
    return path


def verify(found: Recommendation, gguf: Path, threads: int | None = None) -> EngineCheck:
    """Run `found`'s pick in llama.cpp on `gguf` and return its figures beside kvdemo's (see the module's
    docstring). Three runs of the text, flash attention on: f16, the pick's types, and q8_0 (the floor; not again
    where the pick is q8_0).

    Args:
        found: a finished recommendation whose pick llama.cpp stores (`RecommendRow.llama_cpp_command`; `--engine
            llama.cpp`), with its `token_ids`.
        gguf: the GGUF file kvdemo loaded the model from.
        threads: llama.cpp's threads (default: torch's, `torch.get_num_threads()`).

    Raises:
        ValueError: the pick is not a llama.cpp cache type (nothing to run), or the record has no ids.
        ImportError: llama-cpp-python is not installed.
    """
    import torch  # noqa: PLC0415

    from kvdemo.evals.metrics import kl_divergence  # noqa: PLC0415

    picked, ids = found.picked, found.token_ids
    if picked is None or ids is None:
        raise ValueError("the recommendation has no pick to verify (it was stopped, or found no answer tokens)")
    command = picked.llama_cpp_command
    found_types = re.search(r" -ctk (\S+) -ctv (\S+)", command or "")
    if command is None or found_types is None:
        raise ValueError(
            f"the pick is {picked.spec}, not one of llama.cpp's cache types, so there is nothing to run in llama.cpp; "
            "--verify needs --engine llama.cpp"
        )
    version = check_available()
    type_k, type_v = found_types.groups()  # what the deploy line runs, as it says it
    rotation = "none" if "LLAMA_ATTN_ROT_DISABLE=1" in command else "auto"
    threads = threads or torch.get_num_threads()
    start = time.perf_counter()
    reference = llama_cpp_logprobs(gguf, ids, "f16", "f16", True, "auto", threads)
    pick = llama_cpp_logprobs(gguf, ids, type_k, type_v, True, rotation, threads)
    floor = pick if (type_k, type_v, rotation) == ("q8_0", "q8_0", "auto") else (
        llama_cpp_logprobs(gguf, ids, "q8_0", "q8_0", True, "auto", threads)
    )  # fmt: skip
    answers = torch.tensor([t for answer in ids.answers for t in answer])
    return EngineCheck(
        engine="llama.cpp",
        version=version,
        spec=picked.spec,
        command=command,
        kl=float(kl_divergence(reference, pick).mean()),
        kvdemo_kl=picked.mean_kl if picked.mean_kl is not None else math.nan,
        floor_kl=float(kl_divergence(reference, floor).mean()),
        same_top_p=100.0 * float((reference.argmax(-1) == answers).double().mean()),
        positions=len(answers),
        seconds=time.perf_counter() - start,
    )


def llama_cpp_logprobs(
    gguf: Path, ids: TokenIds, type_k: str, type_v: str, flash: bool, rotation: str, threads: int
) -> Any:
    """llama.cpp's log-probabilities at every answer token of `ids` (module docstring), with a cache of `type_k` and
    `type_v` (`GGML_TYPE_IDS`), flash attention on or off (`flash`; a quantized V needs it on), `rotation` `auto` or
    `none`: a float32 tensor [answer tokens in all, vocab].

    Raises:
        ImportError: llama-cpp-python is not installed.
    """
    import llama_cpp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from llama_cpp._utils import suppress_stdout_stderr  # noqa: PLC0415

    longest = max(len(q) + len(a) for q, a in zip(ids.questions, ids.answers))
    # llama.cpp's own log lines ("using full-size SWA cache") go to stderr whatever `verbose` says
    with _rotation(rotation), suppress_stdout_stderr(disable=False):
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=len(ids.prefix) + longest + 8,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=GGML_TYPE_IDS[type_k],
            type_v=GGML_TYPE_IDS[type_v],
            flash_attn=flash,
            swa_full=True,  # a sliding layer keeps every token, so the cut back to the prefix is exact
            verbose=False,
        )
    try:

        def logprobs() -> torch.Tensor:
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            return torch.log_softmax(torch.from_numpy(logits.astype(np.float64)), -1).float()

        llm.eval(list(ids.prefix))
        rows = []
        for question, answer in zip(ids.questions, ids.answers):
            llm._ctx.kv_cache_seq_rm(-1, len(ids.prefix), -1)  # llama.cpp's own cut back to the prefix
            llm.n_tokens = len(ids.prefix)
            llm.eval(list(question))
            rows.append(logprobs())
            for token in answer[:-1]:
                llm.eval([token])
                rows.append(logprobs())
        return torch.stack(rows)
    finally:
        llm.close()


@contextmanager
def _rotation(rotation: str) -> Iterator[None]:
    """`rotation=none` as llama.cpp takes it: `LLAMA_ATTN_ROT_DISABLE=1` while the context (its KV cache) is made
    (llama-kv-cache.cpp reads it there); `auto` leaves llama.cpp's own rule."""
    if rotation != "none":
        yield
        return
    old = os.environ.get("LLAMA_ATTN_ROT_DISABLE")
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["LLAMA_ATTN_ROT_DISABLE"]
        else:
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = old
