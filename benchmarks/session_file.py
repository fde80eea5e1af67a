"""Session files (`kvdemo.qa.session_file`) against the prefill they replace, measured side by side in one run: for
each context length (2k and 8k tokens of the needle grid's Wikipedia haystack, embedded model) and each backend, the
prefill's seconds, the file's bytes, the seconds to save it and to open it (checks, read, SHA-256, one copy into owned
memory, the cache rebuilt and the snapshot taken; the spec's one-off probe when a session is made is not counted, as
the prefill's seconds do not count it either), and prefill / open. Every opened session's first answer is checked
against the prefilled one's, token for token.

The floor of an open is its bytes moved twice (the file's pages into a tensor, then the copy into owned memory) and
hashed once, at the machine's copy bandwidth measured here (a 256 MiB `torch.Tensor.copy_`) and hashlib's SHA-256
speed: `floor = bytes x (2 / copy + 1 / sha256)`.

Run: `.venv/bin/python benchmarks/session_file.py [--lengths 2048,8000] [--specs dynamic,hqq:4,...]`; prints a table
and writes artifacts/bench/session_file.json. About 6 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from kvdemo import CacheSpec, QASession, load_model
from kvdemo.needle.haystack import haystack_text
from kvdemo.qa.session_file import open_session, save_session

QUESTION = "What is this text about?"
SPECS = "dynamic,quanto:4,hqq:4,fp8,turboquant:4"


def bandwidths() -> tuple[float, float]:
    """(copy bytes/s of a 256 MiB tensor, SHA-256 bytes/s of 64 MiB), best of three."""
    a, b = torch.empty(64 << 20, dtype=torch.float32), torch.empty(64 << 20, dtype=torch.float32)
    a.fill_(1.0)
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        b.copy_(a)
        copies.append(time.perf_counter() - start)
    data = os.urandom(64 << 20)
    hashes = []
    for _ in range(3):
        start = time.perf_counter()
        hashlib.sha256(data).digest()
        hashes.append(time.perf_counter() - start)
    return a.numel() * 4 / min(copies), len(data) / min(hashes)


def context_of(loaded, tokens: int) -> str:
    """The haystack's first `tokens` tokens as text (the chat template adds a few)."""
    ids = loaded.tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return loaded.tokenizer.decode(ids[:tokens])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8000")
    parser.add_argument("--specs", default=SPECS)
    args = parser.parse_args()
    loaded = load_model()
    copy_bps, sha_bps = bandwidths()
    load = os.getloadavg()[0]
    print(f"copy {copy_bps / 1e9:.1f} GB/s, SHA-256 {sha_bps / 1e9:.2f} GB/s, load average {load:.2f}")
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="kvdemo-bench-"))
    QASession(loaded, CacheSpec("dynamic")).prefill(context_of(loaded, 512))  # warm-up: the first forward pass's
    # one-off costs (thread pool, allocator) are no prefill's
    for length in (int(n) for n in args.lengths.split(",")):
        context = context_of(loaded, length)
        for text in args.specs.split(","):
            spec = CacheSpec.parse(text)
            session = QASession(loaded, spec)
            report = session.prefill(context, max_new_tokens=8)
            path = folder / f"{length}-{text}.kvsession"
            saved = save_session(session, path)
            expected = session.ask(QUESTION, 8).token_ids
            opened = QASession(loaded, spec)
            open_session(loaded, path, session=opened)  # page cache warm: the same as a file just written
            start = time.perf_counter()
            open_session(loaded, path, session=opened)
            seconds = time.perf_counter() - start
            assert opened.ask(QUESTION, 8).token_ids == expected, text
            floor = saved.bytes * (2 / copy_bps + 1 / sha_bps)
            rows.append(
                {
                    "tokens": report.context_tokens,
                    "spec": text,
                    "prefill_s": round(report.seconds, 3),
                    "file_bytes": saved.bytes,
                    "save_s": round(saved.seconds, 3),
                    "open_s": round(seconds, 3),
                    "prefill_over_open": round(report.seconds / seconds, 1),
                    "open_floor_s": round(floor, 4),
                    "open_over_floor": round(seconds / floor, 1),
                }
            )
            print(json.dumps(rows[-1]))
            path.unlink()
            del session, opened
    print(f"\n{'tokens':>6} {'spec':<14} {'prefill s':>9} {'file MiB':>8} {'save s':>6} {'open s':>6} "
          f"{'prefill/open':>12} {'floor s':>7} {'open/floor':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['spec']:<14} {r['prefill_s']:>9.2f} {r['file_bytes'] / 2**20:>8.1f} "
            f"{r['save_s']:>6.2f} {r['open_s']:>6.3f} {r['prefill_over_open']:>11.0f}x {r['open_floor_s']:>7.3f} "
            f"{r['open_over_floor']:>9.1f}x"
        )
    out = Path("artifacts/bench")
    out.mkdir(parents=True, exist_ok=True)
    machine = {"copy_GBps": copy_bps / 1e9, "sha256_GBps": sha_bps / 1e9, "load_average_start": load}
    machine["load_average_end"] = os.getloadavg()[0]
    (out / "session_file.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    print(f"load average at the end {machine['load_average_end']:.2f}")


if __name__ == "__main__":
    main()
