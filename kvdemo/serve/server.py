"""What the page shares across users, with no Gradio in it: the loaded model (one for everyone), the
per-tab session store (`SessionStore`, keyed by Gradio's `session_hash`), bounded in count and idle time, and
the server-wide KV budget (`KVAccount`): the bytes every session's cache, every prefill in progress and every
running comparison may hold together, reserved before anything is allocated.

Every job on this state (a prefill, an answer, a session file, a comparison, a grid, a recommendation) goes through
`App.door` (`kvdemo.serve.door.Door`); the page (`kvdemo.ui`) otherwise reads this state through `App` and
`SessionStore`. Errors meant for the user are `ValueError`s, turned into `gr.Error` by the page in one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvdemo.cache.spec import CacheSpec
from kvdemo.compare.recommendation import Recommendation
from kvdemo.qa.models import LoadedModel, is_hub_id, load_model
from kvdemo.qa.probe import check_model
from kvdemo.serve.accounting import KVAccount
from kvdemo.serve.door import Door
from kvdemo.serve.recommended import page_default, page_start
from kvdemo.serve.runner import Runner
from kvdemo.serve.session_files import SessionFiles
from kvdemo.serve.store import SessionStore

_log = logging.getLogger(__name__)


class ModelNotLoaded(ValueError):
    """No model is loaded (the start-up load failed or is still running); the message says what to do."""


def switched_reason(loaded: LoadedModel) -> str:
    """Why a session was freed when the server switched to the model `loaded` (`App.load`): the reason its page
    shows, and how a tab knows its session went with the model it replaced."""
    return f"the model was switched to {loaded.name}"


class App:
    """The shared state behind the page: the model (one for every user) and the per-user sessions.

    Args:
        model_source: what `load_model` is given at start-up (None: the embedded model).
        max_sessions: most browser sessions kept at once.
        loader: the model loader (tests pass one that builds a small model).
        idle_seconds: free a session unused this long (seconds; None: never).
        kv_budget_bytes: the largest KV cache one prefill may build (estimated before it runs; None: no limit).
        allow_local_paths: whether the Load button may read local folders and files (else Hub ids only).
        public: a public server: the model is chosen by its operator and visitors cannot replace it (it
            would end every other user's session).
        server_kv_budget_bytes: the server-wide KV budget (`KVAccount`): every session's cache and snapshot,
            every prefill in progress and every running comparison together (bytes; None: no limit).
        session_files: where prefills are saved and opened again instead of run (`SessionFiles`); None: no files.
        measure_defaults: measure a model's page default (`kvdemo.serve.recommended`) when none is stored, at its
            load (a minute or more, once per model); False: only a stored one is used.
        recommended_start: the Ask tab starts each model on its page default (`recommended`); False: on its fixed
            spec (`kvdemo.ui.ask_widgets.START_SPEC`) for every model.
        device: the runner of the jobs' model work on a device (`kvdemo.serve.device.Device`: a ZeroGPU worker);
            None: in this process (`kvdemo.serve.runner.InProcess`).

    Attributes:
        kv: the `KVAccount`; a freed session's cache is released from it (`SessionStore.on_free`).
    """

    def __init__(
        self,
        model_source: str | None = None,
        max_sessions: int = 32,
        loader: Callable[..., LoadedModel] = load_model,
        idle_seconds: float | None = 1800.0,
        kv_budget_bytes: int | None = None,
        allow_local_paths: bool = True,
        public: bool = False,
        server_kv_budget_bytes: int | None = None,
        session_files: SessionFiles | None = None,
        measure_defaults: bool = False,
        recommended_start: bool = True,
        device: Runner | None = None,
    ):
        self.model_source = model_source
        self.loader = loader
        self.kv = KVAccount(server_kv_budget_bytes)
        self.sessions = SessionStore(max_sessions, idle_seconds, on_free=lambda key: self.kv.release(f"cache:{key}"))
        self.kv_budget_bytes = kv_budget_bytes
        self.allow_local_paths = allow_local_paths
        self.public = public
        self.session_files = session_files
        self.loaded: LoadedModel | None = None
        self.load_error: str | None = None
        self.measure_defaults = measure_defaults
        self.recommended_start = recommended_start
        self.recommended: Recommendation | None = None
        """The loaded model's page default (`kvdemo.serve.recommended`): stored, or measured at its load where
        `measure_defaults`; None: the page starts on its fixed spec."""
        self._ready = threading.Event()
        self.door = Door(self, device)
        """Every job on this state goes through it (`kvdemo.serve.door`): prefill, answer, Stop, session files and the
        long jobs, in this process or, with `device`, in a ZeroGPU worker."""

    def start_sweeper(self, every_seconds: float | None = None) -> None:
        """Free idle sessions in a background thread, every `every_seconds` (default: a quarter of the idle
        time, at most a minute), also when nobody makes a request."""
        if self.sessions.idle_seconds is None:
            return
        every = every_seconds or min(60.0, self.sessions.idle_seconds / 4)

        def sweep_forever() -> None:
            while True:
                time.sleep(every)
                self.sessions.sweep()

        threading.Thread(target=sweep_forever, daemon=True, name="kvdemo-session-sweeper").start()

    def start_loading(self) -> None:
        """Load the start-up model in a background thread, so the page is served while it loads."""
        threading.Thread(target=self._load_startup, daemon=True).start()

    def _load_startup(self) -> None:
        try:
            self.loaded = self.loader(self.model_source)
            _log.info("model loaded: %s", self.loaded.name)
            self.recommended = page_default(self.loaded, measure_missing=False)  # a stored one: milliseconds
            self._probe_start()
        except Exception as error:  # shown on the page; the user can load another model
            self.load_error = f"{type(error).__name__}: {error}"
            _log.warning("the model did not load (%s); load another on the page", self.load_error)
        finally:
            self._ready.set()
        if self.loaded is not None and self.recommended is None and self.measure_defaults:
            # measured once the page may use the model: pages opened meanwhile start on the fixed spec
            loaded = self.loaded
            found = page_default(loaded, measure_missing=True)
            if self.loaded is loaded:  # not replaced by a Load meanwhile
                self.recommended = found

    def page_start(self) -> CacheSpec | None:
        """The Ask tab's starting spec for the model loaded now: its recommendation's pick with the page's residual
        (`kvdemo.serve.recommended.page_start`); None where the page starts on its fixed spec: `recommended_start`
        off, no recommendation for this model, or a pick that does not parse (none is stored so; a guard)."""
        found, loaded = self.recommended, self.loaded
        if found is None or loaded is None or found.model != loaded.name or not self.recommended_start:
            return None
        try:
            return page_start(CacheSpec.parse(found.pick))
        except ValueError:
            return None

    def _probe_start(self) -> None:
        """Run the probe of the page's starting spec (`kvdemo.qa.probe.check_model`, a few tokens through its cache,
        kept on the model) while the page is served, so that the first Prefill at the page's start does not pay it
        (1-2 s idle, 13-17 s on a busy machine). It is per process and per model object: `make setup` cannot pay it.
        A refusal is left to the Prefill, which says it."""
        start = self.page_start()
        if start is None or self.loaded is None:
            return
        try:
            check_model(self.loaded, start.validate(self.loaded.config))
        except ValueError as error:
            _log.info("the page's start does not serve %s: %s", self.loaded.name, error)

    def wait_for_model(self, timeout: float | None = None) -> LoadedModel:
        """The shared model, once the start-up load is done.

        Raises:
            ModelNotLoaded: there is none (the message gives the load error).
        """
        self._ready.wait(timeout)
        if self.loaded is None:
            raise ModelNotLoaded(f"No model is loaded ({self.load_error or 'still loading'}). Load one above.")
        return self.loaded

    def load(self, source: str | None, on_progress: Callable[[int, int, str], None] | None = None) -> LoadedModel:
        """Load a model for everyone (a Hub id, a local folder or a .gguf file; None or blank: the start-up
        model) and make it the shared one; on any failure the current model stays. A new model frees every session
        prefilled on the previous one (`SessionStore.free_other_models`): their pages say so at the next action.

        Raises:
            ValueError: a public server (visitors cannot replace the shared model), a local path where only Hub
                ids are allowed, or the load failed (the loader's message, and which model is kept).
        """
        if self.public:
            name = self.loaded.name if self.loaded else "its start-up model"
            raise ValueError(
                f"This public server serves one model to everyone ({name}); loading another would end the other "
                "users' sessions. Run kvdemo on your own machine to try other models"
            )
        source = source.strip() if isinstance(source, str) and source.strip() else self.model_source
        if source != self.model_source and source is not None and not self.allow_local_paths and not is_hub_id(source):
            raise ValueError(
                f"{source[:80]!r} is not a Hugging Face Hub id; this server loads only the embedded model and Hub "
                "ids like HuggingFaceTB/SmolLM2-135M-Instruct (local paths are disabled)"
            )
        try:
            loaded = self.loader(source)
        except Exception as error:  # any failure (bad id, offline, out of memory) keeps the current model
            keeping = f" Keeping {self.loaded.name}." if self.loaded else ""
            kind = "" if isinstance(error, (ValueError, ImportError, OSError)) else f"{type(error).__name__}: "
            raise ValueError(f"{kind}{str(error)[:400]}.{keeping}") from None
        recommended = page_default(loaded, self.measure_defaults, on_progress)  # before it is shared; once per model
        previous, self.loaded, self.load_error, self.recommended = self.loaded, loaded, None, recommended
        if previous is not loaded:
            dropped = self.sessions.free_other_models(loaded, switched_reason(loaded))
            _log.info("model switched to %s; %d session(s) of the previous model freed", loaded.name, dropped)
        return loaded

    @classmethod
    def serving(cls, loaded: LoadedModel, **options: Any) -> App:
        """An App whose model is `loaded`, ready at once (the command line, a notebook, a test): its jobs go through
        the same door as the page's. `options`: as for `App` (no start-up load runs)."""
        app = cls(loader=lambda source: loaded, **options)
        app.loaded = loaded
        app._ready.set()
        return app
