"""What the page shares across users, with no Gradio in it: the loaded model (one for everyone), the
per-tab session store (`SessionStore`, keyed by Gradio's `session_hash`), bounded in count and idle time, and
the server-wide KV budget (`KVAccount`): the bytes every session's cache, every prefill in progress and every
running comparison may hold together, reserved before anything is allocated.

The page (`kvdemo.ui`) reads and changes this state only through `App` and `SessionStore`; errors meant for
the user are `ValueError`s, turned into `gr.Error` by the page in one place.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvdemo import checks
from kvdemo.cache.spec import CacheSpec
from kvdemo.compare.recommendation import Recommendation
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS, QUESTION_RESERVE_TOKENS
from kvdemo.qa.models import LoadedModel, is_hub_id, load_model
from kvdemo.qa.prompt import PreparedContext, PreparedQuestion
from kvdemo.qa.records import PrefillReport
from kvdemo.qa.session import QASession
from kvdemo.qa.session_file import check_fits, open_session, read_manifest
from kvdemo.serve.accounting import KVAccount, prefill_tokens, session_kv_bytes
from kvdemo.serve.recommended import page_default
from kvdemo.serve.session_files import SessionFiles
from kvdemo.serve.store import SessionStore

_log = logging.getLogger(__name__)

MAX_CONTEXT_BYTES = 2 * 1024 * 1024
"""The longest context a server prefills, in UTF-8 bytes (an upload's limit too): a model's window holds
thousands of tokens, tens of KiB of text, and a megabytes-long paste would only cost seconds of tokenizing
before the window refuses it."""


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

    # ---- the server-wide KV budget ------------------------------------------------------------------
    def prefill(
        self,
        key: str,
        qa: QASession,
        context: str | PreparedContext,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        on_progress: Callable[[int, int], None] | None = None,
        on_quantize: Callable[[int, int], None] | None = None,
    ) -> PrefillReport:
        """`qa.prefill(context, max_new_tokens, on_progress=..., on_quantize=...)` for the session of `key`, within
        the server-wide KV budget.

        The session's most bytes (`session_kv_bytes`, with `QUESTION_RESERVE_TOKENS + max_new_tokens` decoded)
        are reserved as `prefill:<key>` before the prefill runs; the session's previous cache still counts
        meanwhile (it is alive until the new one replaces it). When the prefill succeeds the reservation becomes
        `cache:<key>` (replacing the old cache's); when it fails it is released and the old one stays.

        Example:
            >>> qa = QASession(app.wait_for_model(), CacheSpec.parse("hqq:4"), kv_budget_bytes=app.kv_budget_bytes)
            >>> app.prefill(request.session_hash, qa, context).context_tokens
            2172

        Raises:
            ValueError, KVBudgetError: the context is over `MAX_CONTEXT_BYTES`, or does not fit the model's
                window or the session's budget (`QASession.check_prefill`, before any reservation); nothing ran.
            ServerKVBudgetError (a ValueError): the reservation would pass the budget; nothing ran.
            ValueError, ImportError: what `QASession.prefill` raises (the reservation is released).
        """
        reserve = QUESTION_RESERVE_TOKENS + checks.max_new_tokens(max_new_tokens)
        size = len(context.encode("utf-8", "surrogatepass")) if isinstance(context, str) else 0
        if size > MAX_CONTEXT_BYTES:
            raise ValueError(
                f"the context is {size / 2**20:,.1f} MiB of text; the limit is {MAX_CONTEXT_BYTES / 2**20:.0f} MiB, "
                f"and the model's {qa.loaded.max_context_tokens:,}-token window holds far less: paste a part of it"
            )
        if isinstance(context, str) and context.strip():  # tokenized once: for the reservation and the prefill
            context = qa.prepare(context, max_tokens=qa.loaded.max_context_tokens)
        tokens = prefill_tokens(qa, context)
        qa.check_prefill(tokens, reserve)  # the window and the session's budget first: waiting would not help them
        nbytes = session_kv_bytes(qa.spec, qa.loaded, tokens, reserve)
        holder = f"prefill:{key}"
        self.kv.reserve(
            holder,
            nbytes,
            f"a {qa.spec.label} KV cache for {tokens:,} context tokens + {reserve} for a question and its answer",
        )
        try:
            report = self._prefill_or_open(qa, context, max_new_tokens, on_progress, on_quantize)
        except BaseException:
            self.kv.release(holder)
            raise
        self.kv.transfer(holder, f"cache:{key}")
        if key not in self.sessions:  # freed (its tab closed) while prefilling: nothing will hold this cache
            self.kv.release(f"cache:{key}")
        return report

    def _prefill_or_open(
        self,
        qa: QASession,
        context: str | PreparedContext,
        max_new_tokens: int,
        on_progress: Callable[[int, int], None] | None,
        on_quantize: Callable[[int, int], None] | None,
    ) -> PrefillReport:
        """`qa.prefill`, or the session file of the same context, model and spec when `session_files` holds one (and
        the prefill saved there when it does not)."""
        files = self.session_files
        if files is None or not isinstance(context, PreparedContext):
            return qa.prefill(context, max_new_tokens, on_progress=on_progress, on_quantize=on_quantize)
        opened = files.open(qa, context)
        if opened is not None:
            return opened
        report = qa.prefill(context, max_new_tokens, on_progress=on_progress, on_quantize=on_quantize)
        files.save(qa, context)
        return report

    def open_file(self, key: str, path: str | os.PathLike[str]) -> QASession:
        """A new session of the model served here holding the session file at `path` (`open_session`), its cache
        reserved within the server-wide KV budget as a prefill's is (`prefill`).

        Raises:
            SessionFileError (a ValueError): the file cannot be opened here (the message says why); nothing ran.
            ValueError, KVBudgetError, ServerKVBudgetError: as for `prefill`.
        """
        loaded = self.wait_for_model()
        manifest = read_manifest(path)
        qa = QASession(loaded, check_fits(manifest, loaded, None), kv_budget_bytes=self.kv_budget_bytes)
        tokens, reserve = int(manifest.get("context_tokens") or 0), QUESTION_RESERVE_TOKENS + DEFAULT_MAX_NEW_TOKENS
        qa.check_prefill(tokens, reserve)
        holder = f"prefill:{key}"
        self.kv.reserve(holder, session_kv_bytes(qa.spec, loaded, tokens, reserve), f"a {qa.spec.label} session file")
        try:
            open_session(loaded, path, qa.spec, session=qa)
        except BaseException:
            self.kv.release(holder)
            raise
        self.kv.transfer(holder, f"cache:{key}")
        if key not in self.sessions:
            self.kv.release(f"cache:{key}")
        return qa

    def reserve_answer(self, key: str, qa: QASession, question: str, max_new_tokens: int) -> PreparedQuestion:
        """Before `qa.stream(question, max_new_tokens)`: grow the session's reservation `cache:<key>` to cover
        that answer (the prefill reserved `QUESTION_RESERVE_TOKENS` + its own max_new_tokens); never shrinks it.

        Returns:
            The question tokenized and checked once (`QASession.prepare_question`): hand it to `qa.stream`.

        Raises:
            ServerKVBudgetError (a ValueError): the larger reservation would pass the budget; nothing ran.
            ValueError: an empty question, no prefill, a bad max_new_tokens, an answer that does not fit the
                window or the session's budget (`QASession.check_answer`; the session's messages).
        """
        max_new_tokens = checks.max_new_tokens(max_new_tokens)
        if qa.prefill_report is None:
            raise ValueError("prefill a context before asking a question")
        prepared = qa.prepare_question(question, max_new_tokens)  # the window and the session's budget first
        decoded = len(prepared.ids) + max_new_tokens
        nbytes = session_kv_bytes(qa.spec, qa.loaded, qa.prefill_report.context_tokens, decoded)
        self.kv.reserve(
            f"cache:{key}",
            nbytes,
            f"an answer of up to {max_new_tokens} tokens on your "
            f"{qa.prefill_report.context_tokens:,}-token {qa.spec.label} cache",
            grow_only=True,
        )
        if key not in self.sessions:  # freed meanwhile: its cache goes once this answer ends
            self.kv.release(f"cache:{key}")
        return prepared

    @contextmanager
    def holding(self, holder: str, nbytes: int, what: str) -> Iterator[int]:
        """Reserve `nbytes` under `holder` for the `with` block (a comparison, a grid of runs) and release them
        at its end, however it ends. Yields `nbytes`.

        Raises:
            ServerKVBudgetError (a ValueError): the reservation would pass the budget; the block does not run.
        """
        self.kv.reserve(holder, nbytes, what)
        try:
            yield nbytes
        finally:
            self.kv.release(holder)

    def needle_grid(
        self, key: str, loaded: LoadedModel, specs: Sequence[CacheSpec], lengths: Sequence[int], max_new_tokens: int
    ):
        """`holding` for `kvdemo.needle.grid.needle_grid(loaded, specs, lengths, ..., max_new_tokens)` run by the
        session of `key` (holder `grid:<key>`): one spec at a time, so at most the largest `session_kv_bytes` of
        its specs at the longest length, with `QUESTION_RESERVE_TOKENS + max_new_tokens` decoded.

        Raises:
            ServerKVBudgetError (a ValueError): the grid would pass the budget; nothing ran.
        """
        longest = max(lengths, default=0)
        reserve = QUESTION_RESERVE_TOKENS + max_new_tokens
        nbytes = max((session_kv_bytes(s, loaded, longest, reserve) for s in specs), default=0)
        return self.holding(f"grid:{key}", nbytes, f"a needle grid of {len(specs)} spec(s) up to {longest:,} tokens")

    def prepare(self, loaded: LoadedModel, context: str) -> PreparedContext:
        """`context` tokenized once for a job over several specs (a comparison): its reservation
        (`comparison`) and every spec's prefill (`kvdemo.compare.run.compare`) take the result.

        Raises:
            ValueError: an empty context, or one with a broken character (`QASession.prepare`).
        """
        return QASession(loaded).prepare(context, max_tokens=loaded.max_context_tokens)

    def comparison(
        self,
        key: str,
        loaded: LoadedModel,
        context: str | PreparedContext,
        specs: Sequence[CacheSpec],
        max_new_tokens: int,
    ):
        """`holding` for `kvdemo.compare.run.compare(loaded, context, questions, specs, max_new_tokens)` run by the
        session of `key` (holder `compare:<key>`; a `PreparedContext`, handed on to `compare`, is not tokenized
        again): it runs one spec at a time, `dynamic` first, so it holds at
        most the largest `session_kv_bytes` of those specs (its reference log-probabilities are not KV and are
        not counted).

        Example:
            >>> with app.comparison(key, loaded, context, specs, 32):
            ...     report = compare(loaded, context, questions, specs, 32)

        Raises:
            ServerKVBudgetError (a ValueError): the comparison would pass the budget; ValueError, ImportError: a
                spec that does not validate on the model.
        """
        reserve = QUESTION_RESERVE_TOKENS + checks.max_new_tokens(max_new_tokens)
        tokens = prefill_tokens(QASession(loaded, CacheSpec("dynamic")), context)
        nbytes = max(
            session_kv_bytes(spec.validate(loaded.config), loaded, tokens, reserve)
            for spec in [CacheSpec("dynamic"), *specs]
        )
        what = f"a comparison of {len(specs)} spec(s) on {tokens:,} context tokens"
        return self.holding(f"compare:{key}", nbytes, what)

    def recommendation(self, key: str, loaded: LoadedModel, context: str):
        """`holding` for `kvdemo.compare.recommend.recommend(loaded, context, ...)` run by the session of `key`
        (holder `compare:<key>`): `dynamic`'s reference cache for the whole run and one candidate's at a time, at most
        as large as `dynamic`'s, so twice `dynamic`'s bytes (the per-layer plan's pass holds no more).

        Raises:
            ServerKVBudgetError (a ValueError): it would pass the budget."""
        reserve = QUESTION_RESERVE_TOKENS + checks.max_new_tokens(32)
        tokens = prefill_tokens(QASession(loaded, CacheSpec("dynamic")), context)
        nbytes = 2 * session_kv_bytes(CacheSpec("dynamic").validate(loaded.config), loaded, tokens, reserve)
        return self.holding(f"compare:{key}", nbytes, f"a recommendation on {tokens:,} context tokens")
