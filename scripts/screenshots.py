"""The README's two screenshots, taken from the running app: `make screenshots`.

1. Start the app in this process on a free loopback port (the embedded model, the page's defaults), as `app.py`
   does, and wait for the model.
2. Drive Debian's chromium through Playwright for Python (`executable_path=shutil.which("chromium")`; never
   `playwright install`) at 1,400 × 900, the screen issue 67 fits the page's first minute to.
3. Ask tab (`docs/images/ask.png`): load the Normans example with its button, prefill at the page's start, ask one
   example question to the end and wait for the full-precision answer beside it; the picture is the screen as the
   user sees it then (scrolled to the chat): the chat, the memory and residual charts with the answer's flushes, the
   full-precision answer under them, the answer's line.
4. Compare tab (`docs/images/compare.png`): `--specs` (by default the tab's own start,
   `kvdemo.cache.catalogue.default_compare_specs`: one spec per backend, and the Ask tab's start in "more specs")
   on one question with `--compare-tokens` new tokens, and the picture of the results once the run ends: the
   status, the table, the answers side by side, the two charts.

Each picture is cropped to its region and, when over `--max-kib`, scaled down with Pillow until it fits.
About 2-4 minutes on 2 near-idle cores (model load, a 1,341-token prefill, an answer and its full-precision twin,
the comparison), more under load.

Example:
    .venv/bin/python scripts/screenshots.py                    # writes docs/images/{ask,compare}.png
    .venv/bin/python scripts/screenshots.py --out /tmp/shots --specs dynamic fp8
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvdemo from this checkout

from PIL import Image  # noqa: E402
from playwright.sync_api import Locator, Page, expect, sync_playwright  # noqa: E402

from kvdemo.cache.catalogue import all_specs, default_compare_specs  # noqa: E402
from kvdemo.quiet import quiet  # noqa: E402
from kvdemo.ui.examples import example  # noqa: E402

WIDTH, HEIGHT = 1400, 900
STREAMING_QUESTION = "Who were the Normans, where did they come from, and what did they do?"
COMPARE_QUESTION = "Who was the Norse leader?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(port: int):
    """The page on 127.0.0.1:`port`, serving the embedded model once it is loaded (as `app.py` at its defaults)."""
    from kvdemo.serve.server import App
    from kvdemo.ui import PAGE_CSS, build_demo

    app = App()
    app.start_loading()
    demo = build_demo(app)
    demo.queue(default_concurrency_limit=1)
    demo.launch(
        server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, ssr_mode=False, quiet=True, css=PAGE_CSS
    )
    app.wait_for_model()
    return demo


def union_clip(page: Page, *locators: Locator, pad: int = 12) -> dict[str, float]:
    """The page region (full page coordinates) holding every locator's box, the page's whole width."""
    boxes = [box for locator in locators if (box := locator.bounding_box()) is not None]
    scroll = page.evaluate("() => window.scrollY")
    top = min(b["y"] for b in boxes) + scroll - pad
    bottom = max(b["y"] + b["height"] for b in boxes) + scroll + pad
    return {"x": 0, "y": max(top, 0), "width": WIDTH, "height": bottom - max(top, 0)}


def save_small(png: bytes, path: Path, max_kib: int) -> tuple[int, int, int]:
    """Write `png` to `path` at most `max_kib` KiB: as taken, else in 256 colours, else scaled down by steps of
    10 % (in 256 colours); returns (width, height, bytes)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    scale, palette = 1.0, False
    while True:
        size = (round(image.width * scale), round(image.height * scale))
        shrunk = image.resize(size, Image.Resampling.LANCZOS) if scale < 1 else image
        buffer = io.BytesIO()
        (shrunk.quantize(256) if palette else shrunk).save(buffer, format="PNG", optimize=True)
        if buffer.tell() <= max_kib * 1024 or scale < 0.3:
            break
        if palette:
            scale *= 0.9
        palette = True
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return size[0], size[1], buffer.tell()


def shoot_ask(page: Page, timeout_ms: int) -> bytes:
    """The Ask tab at 1,400 × 900 after one answer at the page's start and the full-precision answer beside it."""
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
    page.get_by_role("button", name="Example: Normans").click()
    page.get_by_role("button", name="Prefill", exact=True).click()
    summary = page.get_by_text(re.compile(r"^Prefilled [\d,]+ tokens in [\d.]+ s"))
    expect(summary).to_be_visible(timeout=timeout_ms)
    ask = page.get_by_role("button", name="Ask", exact=True)
    page.get_by_role("button", name=example("Normans")[1][0], exact=True).click()
    ask.click()
    expect(page.get_by_text("cache length after restore")).to_be_visible(timeout=timeout_ms)
    expect(page.get_by_text(re.compile(r"^Full precision \(dynamic, "))).to_be_visible(timeout=timeout_ms)
    page.get_by_text("answers", exact=True).first.scroll_into_view_if_needed()  # the row: chat and live charts
    page.evaluate("window.scrollBy(0, -60)")  # the options' note above the row's top, as a user scrolls
    page.wait_for_timeout(1000)  # the charts' last frame drawn
    return page.screenshot()


def shoot_compare(page: Page, specs: list[str], tokens: int, timeout_ms: int) -> bytes:
    """The Compare tab after a run of `specs` on one question (the Ask tab's Normans context)."""
    page.set_viewport_size({"width": WIDTH, "height": 1600})
    page.get_by_role("tab", name="Compare backends").click()
    page.get_by_text("specs to compare:").click()  # the checkboxes, folded
    for spec in all_specs():  # tick `specs`, untick the others
        box = page.get_by_role("checkbox", name=spec.text, exact=True)
        if box.is_checked() != (spec.text in specs):
            box.click()
    page.get_by_text("specs to compare:").click()  # folded again, as a user leaves it
    page.get_by_label("max_new_tokens", exact=True).locator("visible=true").fill(str(tokens))
    page.get_by_label("questions, one per line").fill(COMPARE_QUESTION)
    page.get_by_role("button", name="Run comparison").click()
    done = page.get_by_text(re.compile(r"^Compared \d+ specs on 1 question"))  # and the Ask tab's start
    expect(done).to_be_visible(timeout=timeout_ms)
    page.wait_for_timeout(1500)  # the charts drawn
    clip = union_clip(
        page,
        done,
        page.get_by_role("grid", name=re.compile("^comparison")),
        page.get_by_role("img").filter(has_text="Memory against fidelity"),
        page.get_by_role("img").filter(has_text="Decode speed"),
    )
    return page.screenshot(clip=clip, full_page=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="folder for ask.png, compare.png")
    parser.add_argument(
        "--specs",
        nargs="+",
        default=[s.text for s in default_compare_specs()],
        help="the Compare tab's specs, by spaces (a spec holds commas; default: the tab's own start)",
    )
    parser.add_argument("--compare-tokens", type=int, default=24, help="max_new_tokens of the comparison")
    parser.add_argument("--max-kib", type=int, default=280, help="scale a picture down until it fits")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for any one step")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium")
    if chromium is None:
        parser.error("Debian's chromium is needed: sudo apt-get install chromium (never `playwright install`)")
    quiet()  # no loading bars in the log
    start, port = time.perf_counter(), free_port()
    demo = start_app(port)
    print(f"app up with the model in {time.perf_counter() - start:.0f} s", flush=True)
    timeout_ms = args.timeout * 1000
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium)
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            page.goto(f"http://127.0.0.1:{port}/")
            expect(page.get_by_text("135 M parameters")).to_be_visible(timeout=timeout_ms)
            shots = {"ask.png": shoot_ask(page, timeout_ms)}
            print(f"ask.png taken at {time.perf_counter() - start:.0f} s", flush=True)
            shots["compare.png"] = shoot_compare(page, args.specs, args.compare_tokens, timeout_ms)
            print(f"compare.png taken at {time.perf_counter() - start:.0f} s", flush=True)
            browser.close()
    finally:
        demo.close()
    for name, png in shots.items():
        width, height, size = save_small(png, args.out / name, args.max_kib)
        print(f"{args.out / name}: {width}x{height}, {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
