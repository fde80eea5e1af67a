"""kvdemo's `ggml` backend beside llama.cpp itself, on the same GGUF and the same token ids, and its decode step
beside `dynamic`'s.

0. **The blocks against llama.cpp's own KV writes**: rows of real keys and values (the embedded model's, from a
   prefill) quantized by kvdemo and by the `from_float` of ggml-cpu's type traits in llama-cpp-python's own
   `libggml-cpu` (what `ggml_set_rows` calls when llama.cpp writes its cache), byte for byte, for every type.
1. **Mean KL of the quantized cache against the full-precision one**, teacher-forced on a real text: the context
   (a SQuAD article of `../shared/cases`) prefilled, then each token of a continuation fed one decode step at a time;
   at every step the next-token distribution with the quantized cache against the one with the full-precision cache:
   - llama.cpp (llama-cpp-python, `type_k`/`type_v` q8_0 and q4_0 against f16, flash attention on in both, as
     `recommend --verify` runs it), its own runs; and its f16 cache with flash attention off, the floor its own
     kernels set (an f16 V is accumulated in f16, a quantized one in f32);
   - kvdemo's matching `ggml` spec against `dynamic` (`QASession.score_text`).
   Both read the same ids (kvdemo's prompt layout), and both prefills attend through the blocks. What differs
   (docs/ggml.md): llama.cpp runs the GGUF's quantized weights, kvdemo the de-quantized ones in float32; llama.cpp's
   attention takes dot products on the blocks with the query converted to q8_0, and its f16 and quantized kernels
   accumulate differently.
2. **The decode step** at about 2,048 context tokens: `dynamic`, `ggml:q8_0`, `ggml:q4_0` (and `quanto:4` for
   reference), interleaved rounds in one process, medians and ratios to `dynamic`'s.

Written to `artifacts/bench/ggml.json` with the load average beside the figures.

    .venv/bin/python benchmarks/ggml.py                     # the embedded model (needs `make bench-peers` for part 1)
    .venv/bin/python benchmarks/ggml.py --model gemma3      # Gemma 3 270M where `make gemma` installed it
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvdemo import CacheSpec, QASession, load_model  # noqa: E402
from kvdemo.cache.spec import build_cache  # noqa: E402
from kvdemo.compare.llama_cpp_check import GGML_TYPE_IDS, llama_cpp_logprobs  # noqa: E402
from kvdemo.compare.recommendation import TokenIds  # noqa: E402
from kvdemo.evals.cases import load_case  # noqa: E402
from kvdemo.qa.models import embedded_gguf_path  # noqa: E402
from kvdemo.qa.packaged import gemma3_path  # noqa: E402

TYPES = ("q8_0", "q4_0")
CASES = ROOT.parent / "shared" / "cases"


def engine_blocks(rows: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per block type, the share of bytes and of blocks where kvdemo's blocks of `rows` ([n, width] float32) differ
    from ggml-cpu's `from_float` (llama-cpp-python's own library), and the largest code difference seen."""
    import ctypes  # noqa: PLC0415

    import llama_cpp  # noqa: PLC0415  (optional: `make bench-peers` builds it)

    from kvdemo.cache.formats.ggml import BLOCK_BYTES
    from kvdemo.cache.formats.ggml.blocks import quantize_rows

    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    library.ggml_cpu_init()

    class Traits(ctypes.Structure):
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]  # fmt: skip

    library.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    from_float_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    rows = rows.float().contiguous()
    out = {}
    for name, number in GGML_TYPE_IDS.items():
        if name not in BLOCK_BYTES:  # f16: no blocks
            continue
        from_float = from_float_type(library.ggml_get_type_traits_cpu(number).contents.from_float)
        theirs = torch.empty(rows.shape[0], rows.shape[1] // 32 * BLOCK_BYTES[name], dtype=torch.uint8)
        for i in range(rows.shape[0]):
            from_float(rows[i].data_ptr(), theirs[i].data_ptr(), rows.shape[1])
        ours = quantize_rows(rows, name)
        blocks = (ours != theirs).view(rows.shape[0], -1, BLOCK_BYTES[name]).any(-1)
        out[name] = {"bytes_differing": float((ours != theirs).float().mean()), "blocks_differing": float(
            blocks.float().mean()), "blocks": int(blocks.numel())}  # fmt: skip
    return out


def real_rows(loaded, context: str) -> torch.Tensor:
    """The keys and values of every layer after a prefill of `context` (one row per token and head), float32."""
    session = QASession(loaded, CacheSpec.parse("dynamic"))
    session.prefill(context)
    rows = [t.reshape(-1, t.shape[-1]) for layer in session.cache.layers for t in (layer.keys, layer.values)]
    return torch.cat(rows).float()


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(reference || other), both log-probabilities [n, vocab] (nats)."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def texts(loaded, context_tokens: int, continuation_tokens: int) -> tuple[str, list[int]]:
    """A context of about `context_tokens` tokens (the Southern California article's first paragraphs) and the
    ids of a continuation (the Normans article's first paragraph, which the tests do not score)."""
    article = load_case(CASES / "southern_california.json")
    context = ""
    for paragraph in article.paragraphs:
        if len(loaded.tokenizer(context + paragraph).input_ids) > context_tokens:
            break
        context += paragraph + "\n\n"
    follow = load_case(CASES / "normans.json").paragraphs[0]
    return context.strip(), loaded.tokenizer(follow, add_special_tokens=False).input_ids[:continuation_tokens]


def kvdemo_scores(loaded, context: str, ids: list[int]) -> dict[str, torch.Tensor]:
    """Teacher-forced log-probabilities of `ids` after `context` for `dynamic` and each `ggml` type, and the prompt's
    ids (the same for every spec)."""
    out = {}
    for text in ("dynamic", *(f"ggml:{t}" for t in TYPES)):
        session = QASession(loaded, CacheSpec.parse(text))
        session.prefill(context)
        out[text] = session.score_text(ids)
        out["prefix"] = torch.tensor(session._split.prefix)
    return out


def llama_cpp_scores(gguf: Path, prefix: list[int], ids: list[int], threads: int) -> dict[str, torch.Tensor]:
    """llama.cpp's log-probabilities of `ids[1:]` after `prefix + ids[:1]`, one decode step per token
    (`kvdemo.compare.llama_cpp_check.llama_cpp_logprobs`, what `recommend --verify` runs; llama.cpp's default
    rotation): the f16 cache with flash attention on (`f16`) and off (`f16 unfused`), and each of `TYPES` with it on
    (a quantized V needs it)."""
    text = TokenIds(tuple(prefix), ((ids[0],),), (tuple(ids[1:]),))
    runs = {"f16": ("f16", True), "f16 unfused": ("f16", False), **{t: (t, True) for t in TYPES}}
    return {name: llama_cpp_logprobs(gguf, text, t, t, flash, "auto", threads) for name, (t, flash) in runs.items()}


def steps(loaded, tokens: int, rounds: int) -> dict[str, float]:
    """Median decode-step seconds at `tokens` context tokens, interleaved rounds."""
    specs = ("dynamic", "ggml:q8_0", "ggml:q4_0", "quanto:4")
    ids = torch.tensor([loaded.context_ids(texts(loaded, tokens + 400, 1)[0])[:tokens]])
    caches, times = {}, {s: [] for s in specs}
    with torch.no_grad():
        for text in specs:
            caches[text] = build_cache(CacheSpec.parse(text), loaded.config)
            loaded.model(ids, past_key_values=caches[text], use_cache=True)
        token = torch.tensor([[ids[0, -1].item()]])
        for _ in range(rounds):
            for text in specs:
                start = time.perf_counter()
                loaded.model(token, past_key_values=caches[text], use_cache=True)
                times[text].append(time.perf_counter() - start)
    return {text: statistics.median(t[1:]) for text, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("embedded", "gemma3"), default="embedded")
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--continuation-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = embedded_gguf_path() if args.model == "embedded" else gemma3_path()
    loaded = load_model(None if args.model == "embedded" else str(gguf))
    out: dict = {"model": loaded.name, "load_average_start": os.getloadavg()}
    context, ids = texts(loaded, args.context_tokens, args.continuation_tokens)
    try:
        out["blocks_against_ggml_cpu"] = engine_blocks(real_rows(loaded, context))
    except ImportError:
        out["blocks_against_ggml_cpu"] = "llama-cpp-python is not installed: make bench-peers"
    ours = kvdemo_scores(loaded, context, ids)
    prefix = [int(t) for t in ours.pop("prefix")]
    out["tokens"] = {"context": len(prefix), "scored": len(ids) - 1}
    out["kvdemo_kl"] = {t: kl(ours["dynamic"], ours[f"ggml:{t}"]) for t in TYPES}
    try:
        theirs = llama_cpp_scores(gguf, prefix, ids, args.threads)
        out["llama_cpp_kl"] = {t: kl(theirs["f16"], theirs[t]) for t in TYPES}  # flash attention on in both
        out["llama_cpp_kl_against_unfused_f16"] = {t: kl(theirs["f16 unfused"], theirs[t]) for t in TYPES}
        out["llama_cpp_kernel_kl"] = kl(theirs["f16 unfused"], theirs["f16"])  # its own arithmetic's difference
        out["f16_vs_dynamic_kl"] = kl(ours["dynamic"], theirs["f16"])  # the weights' own difference
    except ImportError:
        out["llama_cpp_kl"] = "llama-cpp-python is not installed: make bench-peers"
    if args.model == "embedded":
        seconds = steps(loaded, 2048, args.rounds)
        out["step_ms_at_2048"] = {k: round(v * 1000, 2) for k, v in seconds.items()}
        out["step_ratio_to_dynamic"] = {k: round(v / seconds["dynamic"], 3) for k, v in seconds.items()}
    out["load_average_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    path = ROOT / "artifacts" / "bench" / f"ggml-{args.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
