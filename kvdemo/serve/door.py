"""One door per job: `Door` runs every job a caller asks of the shared `App`: a prefill (or a session file opened in
its place), an answer, a Stop, a saved session file, and the long jobs (a comparison, a needle grid, a
recommendation). The Ask tab, the session box, the other tabs, the MCP tools and the command line only call it
(`tests/test_door_callers.py` names its callers); it does, once, for every caller:

- the per-session lock (`UserSession.lock`: one prefill or answer at a time; a long job's own slot, `long_job`);
- the KV reservation within the server-wide budget (`KVAccount`: `prefill:<key>` becoming `cache:<key>`, grown for
  an answer, `compare:<key>` and `grid:<key>` for the long jobs' duration);
- the session file (`SessionFiles`: opened instead of a prefill of the same context, model and spec; saved after);
- the install in the store (`UserSession.qa`, the freed reason forgotten; the page's view of the tab is the UI's);
- progress (callbacks) and cancellation (Stop: `UserSession.interrupt`; Cancel: `SessionStore.long_job`'s event).

Where the model work runs is the door's runner's business (`kvdemo.serve.runner`): the door builds a job record
(`kvdemo.serve.jobs`) and hands it over, in this process (`InProcess`: a `QASession` in `UserSession.qa`) or on a
ZeroGPU Space in `@spaces.GPU` jobs (`kvdemo.serve.device.Device`: a `RemoteSession` in its place, the cache in the
worker). Either way the callers get the same records (`PrefillReport`, `StepEvent`, `Answer`, `ComparisonReport`,
`NeedleGrid`, `Recommendation`) and the same exceptions, with their own types.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol, cast

from kvdemo import checks
from kvdemo.cache.registry import BASELINE
from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state.telemetry import StepEvent
from kvdemo.compare.recommendation import Recommendation
from kvdemo.compare.records import ComparisonReport
from kvdemo.needle.records import NeedleGrid
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS, QUESTION_RESERVE_TOKENS
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PreparedContext, PreparedQuestion
from kvdemo.qa.records import PrefillReport
from kvdemo.qa.session import Session
from kvdemo.qa.session_file import SavedSession, check_fits, read_manifest
from kvdemo.serve.accounting import KVAccount, prefill_tokens, session_kv_bytes
from kvdemo.serve.jobs import (
    AnswerJob,
    CompareJob,
    LongJobRecord,
    NeedleJob,
    OpenJob,
    PrefillDone,
    PrefillJob,
    RecommendJob,
)
from kvdemo.serve.runner import InProcess, Runner, drive, progress
from kvdemo.serve.runs import AnswerRun, FullPrecisionAnswer, Prefilled
from kvdemo.serve.session_files import SessionFiles
from kvdemo.serve.store import SessionStore, UserSession

MAX_CONTEXT_BYTES = 2 * 1024 * 1024
"""The longest context a server prefills, in UTF-8 bytes (an upload's limit too): a model's window holds
thousands of tokens, tens of KiB of text, and a megabytes-long paste would only cost seconds of tokenizing
before the window refuses it."""

ANSWER_BUSY = "An answer or a prefill is already running in this session; wait for it to end (or press Stop)"


class Served(Protocol):
    """What the door reads of the shared state (`kvdemo.serve.server.App`, which makes the door: the server sits
    above the door, not beside it)."""

    sessions: SessionStore
    kv: KVAccount
    kv_budget_bytes: int | None
    session_files: SessionFiles | None
    loaded: LoadedModel | None

    def wait_for_model(self, timeout: float | None = None) -> LoadedModel: ...


class Door:
    """The one door of `app`'s jobs (module docstring).

    Args:
        app: the server state: the model, the sessions, the KV account and the folder of session files.
        runner: where the model work runs: None in this process (`InProcess`); a `Device` on a ZeroGPU Space.
    """

    def __init__(self, app: Served, runner: Runner | None = None):
        self.app = app
        self.runner: Runner = runner or InProcess(app.wait_for_model, lambda: app.session_files)

    # ---- a session's own jobs ----------------------------------------------------------------------
    def new_session(self, loaded: LoadedModel, spec: CacheSpec) -> Session:
        """An empty session of `spec` on `loaded`, with the app's per-cache budget. Raises ValueError, ImportError:
        the spec does not validate, or (in process) the model cannot serve it (`QASession`)."""
        return self.runner.session(loaded, spec, self.app.kv_budget_bytes)

    def prefill(
        self,
        key: str,
        spec: CacheSpec,
        context: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        on_progress: Callable[[int, int], None] | None = None,
        on_quantize: Callable[[int, int], None] | None = None,
    ) -> Prefilled:
        """Prefill `context` into a new cache of `spec` for the session of `key` (created when missing), replacing
        its context once the prefill succeeds: what runs in it is stopped first, the lock is taken, the cache is
        reserved (`prefill_reserved`), and the session is installed (`_install`).

        Raises:
            ServerFull, ModelNotLoaded, ValueError, KVBudgetError, ServerKVBudgetError, ImportError: refused (the
                session keeps its previous cache). PrefillStopped: Stop before the next chunk (the previous cache
                stays).
        """
        loaded = self.app.wait_for_model()
        user = self.app.sessions.get(key)
        user.interrupt()
        asked = time.monotonic()
        with user.lock:
            locked = time.monotonic()
            session = self.new_session(loaded, spec)
            set_up = time.monotonic() - locked
            user.prefilling = session
            user.prefill_stop.clear()  # a Stop from now on stops this prefill (the one above stopped what ran)
            try:
                stop = user.prefill_stop
                self.prefill_reserved(key, session, context, max_new_tokens, on_progress, on_quantize, stop)
            finally:
                user.prefilling = None
            self._install(key, user, session)
        return Prefilled(session, locked - asked, set_up)

    def prefill_reserved(
        self,
        key: str,
        session: Session,
        context: str | PreparedContext,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        on_progress: Callable[[int, int], None] | None = None,
        on_quantize: Callable[[int, int], None] | None = None,
        stop: threading.Event | None = None,
    ) -> PrefillReport:
        """The prefill of `session` (not installed: `prefill` does that) within the server-wide KV budget.

        The session's most bytes (`session_kv_bytes`, with `QUESTION_RESERVE_TOKENS + max_new_tokens` decoded)
        are reserved as `prefill:<key>` before the prefill runs; the session's previous cache still counts
        meanwhile. When the prefill succeeds the reservation becomes `cache:<key>` (replacing the old cache's);
        when it fails it is released and the old one stays.

        Raises:
            ValueError, KVBudgetError: the context is over `MAX_CONTEXT_BYTES`, or does not fit the model's
                window or the session's budget (before any reservation); nothing ran.
            ServerKVBudgetError (a ValueError): the reservation would pass the budget; nothing ran.
            ValueError, ImportError, PrefillStopped: what the prefill raises (the reservation is released).
        """
        reserve = QUESTION_RESERVE_TOKENS + checks.max_new_tokens(max_new_tokens)
        size = len(context.encode("utf-8", "surrogatepass")) if isinstance(context, str) else 0
        if size > MAX_CONTEXT_BYTES:
            raise ValueError(
                f"the context is {size / 2**20:,.1f} MiB of text; the limit is {MAX_CONTEXT_BYTES / 2**20:.0f} MiB, "
                f"and the model's {session.loaded.max_context_tokens:,}-token window holds far less: paste a part of it"
            )
        if isinstance(context, str):  # tokenized once: for the reservation and the prefill (a blank one refused)
            context = session.loaded.prepare(context)
        tokens = prefill_tokens(session.loaded, context)
        session.check_prefill(tokens, reserve)  # the window and the session's budget first: waiting would not help
        what = (
            f"a {session.spec.label} KV cache for {tokens:,} context tokens + {reserve} for a question and its answer"
        )
        with self._reserving(key, session, tokens, reserve, what):
            notes = self.runner.run(PrefillJob(context, max_new_tokens), session, stop)  # `stop`: a Stop since the lock
            return cast(PrefillDone, drive(notes, progress(on_progress, on_quantize))).report

    @contextmanager
    def _reserving(self, key: str, session: Session, tokens: int, reserve: int, what: str) -> Iterator[None]:
        """The most bytes `session` holds with `tokens` prefilled and `reserve` decoded, reserved as `prefill:<key>`
        for the `with` block: released when the block fails, else made the session's cache's (`cache:<key>`, released
        at once where the session was freed meanwhile: its tab closed, nothing will hold this cache).

        Raises:
            ServerKVBudgetError (a ValueError): the reservation would pass the budget; the block does not run.
        """
        holder = f"prefill:{key}"
        self.app.kv.reserve(holder, session_kv_bytes(session.spec, session.loaded, tokens, reserve), what)
        try:
            yield
        except BaseException:
            self.app.kv.release(holder)
            raise
        self.app.kv.transfer(holder, f"cache:{key}")
        if key not in self.app.sessions:
            self.app.kv.release(f"cache:{key}")

    def _install(self, key: str, user: UserSession, session: Session) -> None:
        """`session` becomes the one of `key`'s tab (the page's view of the tab goes with the session it was made
        for: `kvdemo.ui.tab_view`), and the reason an earlier session was freed forgotten."""
        user.qa = session
        self.app.sessions.forget_freed(key)

    def open_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        spec: CacheSpec | None = None,
        check: Callable[[CacheSpec], Any] | None = None,
    ) -> Session:
        """Open the session file at `path` into the session of `key` (created when missing) in place of a prefill:
        its header read once, `check(spec)` called with the file's spec before anything is opened (the page refuses
        a spec its fields cannot show), the cache reserved as a prefill's, the session installed.

        Args:
            spec: the spec the file must hold; None takes the file's.

        Raises:
            SessionFileError (a ValueError): the file cannot be opened here (the message says why); what `check`
                raises; ValueError, KVBudgetError, ServerKVBudgetError: as for `prefill`. Nothing changes then.
        """
        loaded = self.app.wait_for_model()
        user = self.app.sessions.get(key)
        user.interrupt()
        with user.lock:
            manifest = read_manifest(path)
            fits = check_fits(manifest, loaded, spec)
            if check is not None:
                check(fits)
            session = self.new_session(loaded, fits)
            tokens = int(manifest.get("context_tokens") or 0)
            reserve = QUESTION_RESERVE_TOKENS + DEFAULT_MAX_NEW_TOKENS
            session.check_prefill(tokens, reserve)
            with self._reserving(key, session, tokens, reserve, f"a {session.spec.label} session file"):
                drive(self.runner.run(OpenJob(str(path)), session))
            self._install(key, user, session)
        return session

    def save_file(self, key: str, path: Path | Callable[[Session], Path]) -> tuple[Session, SavedSession]:
        """Write the prefilled session of `key` to a session file at `path` (or at `path(session)`, named after the
        session saved), after any running answer (on a device, a copy of the session's own file). Returns the session
        saved and the file written.

        Raises:
            ValueError: nothing is prefilled in that session; TypeError, OSError: as `save_session`.
        """
        user = self.app.sessions.peek(key)
        with user.lock if user is not None else nullcontext():  # after a running answer: the post-prefill cache
            session = user.qa if user is not None else None
            if session is None:
                raise ValueError("nothing is prefilled in this tab; press Prefill first")
            target = path(session) if callable(path) else path
            return session, self.runner.save(session, target)

    def reserve_answer(self, key: str, session: Session, question: str, max_new_tokens: int) -> PreparedQuestion:
        """Before an answer: grow the session's reservation `cache:<key>` to cover it (the prefill reserved
        `QUESTION_RESERVE_TOKENS` + its own max_new_tokens); never shrinks it.

        Returns:
            The question tokenized and checked once (`prepare_question`).

        Raises:
            ServerKVBudgetError (a ValueError): the larger reservation would pass the budget; nothing ran.
            ValueError: an empty question, no prefill, a bad max_new_tokens, an answer that does not fit the
                window or the session's budget (the session's messages).
        """
        max_new_tokens = checks.max_new_tokens(max_new_tokens)
        if session.prefill_report is None:
            raise ValueError("prefill a context before asking a question")
        prepared = session.prepare_question(question, max_new_tokens)  # the window and the session's budget first
        decoded = len(prepared.ids) + max_new_tokens
        context = session.prefill_report.context_tokens
        self.app.kv.reserve(
            f"cache:{key}",
            session_kv_bytes(session.spec, session.loaded, context, decoded),
            f"an answer of up to {max_new_tokens} tokens on your {context:,}-token {session.spec.label} cache",
            grow_only=True,
        )
        if key not in self.app.sessions:  # freed meanwhile: its cache goes once this answer ends
            self.app.kv.release(f"cache:{key}")
        return prepared

    @contextmanager
    def answer(self, key: str, question: str, max_new_tokens: Any, busy: str = ANSWER_BUSY) -> Iterator[AnswerRun]:
        """An answer to `question` on the prefilled session of `key`, within the server's KV budget, as an
        `AnswerRun` to iterate for its decode steps; the session's lock is held for the `with` block, and leaving it
        closes the answer (the cache restored, the answer recorded, also when stopped or failed). Stop applies from
        the Ask click (`UserSession.queue_answer`) or, for a call that no button queued, from now. `max_new_tokens`:
        a whole number >= 1, as the page's fields send it (`checks.max_new_tokens`).

        Raises:
            ValueError(busy): another answer or a prefill runs in this session.
            ValueError: the session was freed or holds nothing, the model changed since its prefill, or what
                `reserve_answer` raises; nothing ran.
        """
        max_new_tokens = checks.max_new_tokens(max_new_tokens)
        user = self.app.sessions.peek(key)
        if user is None:
            raise ValueError("this session was freed; prefill again to rebuild the cache")
        if not user.lock.acquire(blocking=False):
            raise ValueError(busy)
        try:
            with user.answering() as stop:
                session = user.qa  # read under the lock: a prefill that just finished has replaced it
                if session is None:
                    raise ValueError("this session was freed; prefill again to rebuild the cache")
                if self.app.loaded is not session.loaded:
                    raise ValueError("The model changed since your prefill; prefill again to rebuild the cache on it")
                prepared = self.reserve_answer(key, session, question, max_new_tokens)
                with self._streaming(session, prepared, stop) as stream:
                    yield AnswerRun(session, prepared, stream)
        finally:
            self.app.sessions.touch(user)
            user.lock.release()

    @contextmanager
    def _streaming(
        self, session: Session, prepared: PreparedQuestion, stop: threading.Event
    ) -> Iterator[Generator[StepEvent, None, None]]:
        """`session`'s answer to `prepared` as a stream of `StepEvent`s (`AnswerJob`), for the `with` block: leaving
        it closes the stream (the cache restored, the answer recorded in the session's history). `stop` (a Stop since
        the Ask click) ends it after its current decode step."""
        stream = cast("Generator[StepEvent, None, None]", self.runner.run(AnswerJob(prepared), session, stop))
        with closing(stream):
            yield stream

    def reference(
        self, key: str, question: str, max_new_tokens: Any, on_progress: Callable[[int, int], None] | None = None
    ) -> FullPrecisionAnswer:
        """The full-precision answer to `question` on the context prefilled in the session of `key`: a `dynamic`
        (`BASELINE`) session of the same model prefilled with the same text (a saved session file opened in its
        place where the app's folder holds one), asked the same question greedily, then dropped. Made once per
        (model, context, question, max_new_tokens) and kept in the session (`UserSession.references`) across its
        prefills of that text, whatever their spec: what the page shows beside a quantized answer. The session's lock
        is held meanwhile; Stop ends it as it ends an answer (`UserSession.interrupt`: the reference answer is then
        `stopped`, and not kept); its cache is reserved as `reference:<key>` within the server's KV budget and
        released after.

        Raises:
            ValueError(ANSWER_BUSY): another answer or a prefill runs in this session.
            ValueError: nothing is prefilled, the model changed, or what `reserve_answer`'s checks raise.
            ServerKVBudgetError (a ValueError): the reference cache would pass the server's budget.
            PrefillStopped: Stop came during its prefill.
        """
        max_new_tokens = checks.max_new_tokens(max_new_tokens)
        user = self.app.sessions.peek(key)
        if user is None or user.qa is None:
            raise ValueError("prefill a context before asking for the full-precision answer")
        if not user.lock.acquire(blocking=False):
            raise ValueError(ANSWER_BUSY)
        began = time.monotonic()
        try:
            session = user.qa
            if self.app.loaded is not session.loaded or session.context is None:
                raise ValueError("The model changed since your prefill; prefill again to rebuild the cache on it")
            found = (id(session.loaded), session.context, question.strip(), max_new_tokens)
            if found in user.references:
                return FullPrecisionAnswer(user.references[found], 0.0, cached=True)
            baseline = self.new_session(session.loaded, CacheSpec.parse(BASELINE))
            context = session.loaded.prepare(session.context)
            tokens, reserve = prefill_tokens(session.loaded, context), QUESTION_RESERVE_TOKENS + max_new_tokens
            holder = f"reference:{key}"
            self.app.kv.reserve(
                holder,
                session_kv_bytes(baseline.spec, baseline.loaded, tokens, reserve),
                f"the full-precision ({BASELINE}) reference cache for {tokens:,} context tokens",
            )
            user.reference = baseline
            try:
                drive(self.runner.run(PrefillJob(context, max_new_tokens), baseline), progress(on_progress))
                prepared = baseline.prepare_question(question, max_new_tokens)
                with self._streaming(baseline, prepared, user.answer_stop) as stream:  # Stop since the Ask click
                    for _ in stream:
                        pass
                answer = baseline.history[-1]
            finally:
                user.reference = None
                self.app.kv.release(holder)
            if answer.finish_reason != "stopped":
                user.references[found] = answer
            return FullPrecisionAnswer(answer, time.monotonic() - began, cached=False)
        finally:
            self.app.sessions.touch(user)
            user.lock.release()

    def stop(self, key: str) -> None:
        """Stop what runs in the session of `key`: its answer after the current decode step (the cache restored, the
        answer `stopped`), its prefill before the next chunk; nothing when none runs."""
        user = self.app.sessions.peek(key)
        if user is not None:
            user.interrupt()

    # ---- long jobs ------------------------------------------------------------------------------------
    @contextmanager
    def long_job(self, key: str, busy: str) -> Iterator[LongJob]:
        """The session of `key`'s long-job slot (`SessionStore.long_job`: one at a time, refused rather than queued,
        Cancel from the click), as a `LongJob` whose methods run a comparison, a grid or a recommendation.

        Raises:
            ServerFull: a new session cannot be made; ValueError(busy): a long job of this session is running.
        """
        user = self.app.sessions.get(key)
        with self.app.sessions.long_job(user, busy) as cancel:
            yield LongJob(self, key, cancel)

    @contextmanager
    def holding(self, holder: str, nbytes: int, what: str) -> Iterator[int]:
        """Reserve `nbytes` under `holder` for the `with` block and release them at its end, however it ends.

        Raises:
            ServerKVBudgetError (a ValueError): the reservation would pass the budget; the block does not run.
        """
        self.app.kv.reserve(holder, nbytes, what)
        try:
            yield nbytes
        finally:
            self.app.kv.release(holder)


class LongJob:
    """A long job of one session (`Door.long_job`): `cancel` is set by Cancel (or a caller's bound); each method
    builds its job record (`kvdemo.serve.jobs`), reserves its KV bytes for its run and hands it to the door's runner.

    Attributes:
        cancel: the job's cancel event (set it to stop at the next prefill chunk or decode step).
    """

    def __init__(self, door: Door, key: str, cancel: threading.Event):
        self.door, self.key, self.cancel = door, key, cancel

    def run(self, job: LongJobRecord, on_progress: Callable[[int, int, str], None] | None = None) -> Any:
        """`job` run holding `<job.holder>:<key>` (`LongJobRecord.reservation`); returns its result.

        Raises:
            ServerKVBudgetError, ValueError, ImportError: refused (nothing ran); `Cancelled`: cancelled (with what
                finished).
        """
        nbytes, what = job.reservation(self.door.app.wait_for_model())
        with self.door.holding(f"{job.holder}:{self.key}", nbytes, what):
            return drive(self.door.runner.run(job, None, self.cancel), progress(on_progress))

    def compare(
        self,
        context: str,
        questions: Sequence[str],
        specs: Sequence[CacheSpec],
        max_new_tokens: int,
        gold_answers: Sequence[Sequence[str]] | None = None,
        perplexity_tokens: int = 0,
        continuation: str | None = None,
        plans: Sequence[tuple[CacheSpec, float]] = (),
        on_progress: Callable[[int, int, str], None] | None = None,
    ) -> ComparisonReport:
        """`kvdemo.compare.run.compare` on the context, tokenized once here for the reservation and every spec
        (`CompareJob`). Raises: as `run`; ComparisonCancelled holds the specs finished."""
        job = CompareJob(
            self.door.app.wait_for_model().prepare(context), tuple(questions), tuple(specs), max_new_tokens,
            None if gold_answers is None else tuple(tuple(g) for g in gold_answers), perplexity_tokens, continuation,
            tuple(plans), self.door.app.kv_budget_bytes,
        )  # fmt: skip
        return cast(ComparisonReport, self.run(job, on_progress))

    def needle(
        self,
        specs: Sequence[CacheSpec],
        lengths: Sequence[int],
        depths: Sequence[float],
        max_new_tokens: int,
        needles_per_context: int | None = 1,
        seed: int = 0,
        on_progress: Callable[[int, int, str], None] | None = None,
    ) -> NeedleGrid:
        """`kvdemo.needle.grid.needle_grid` (`NeedleJob`). Raises: as `run`; NeedleCancelled holds the cells
        finished."""
        job = NeedleJob(
            tuple(specs), tuple(lengths), tuple(depths), max_new_tokens, needles_per_context, seed,
            self.door.app.kv_budget_bytes,
        )  # fmt: skip
        return cast(NeedleGrid, self.run(job, on_progress))

    def recommend(
        self,
        context: str,
        questions: Sequence[str] = (),
        max_kl: float | None = None,
        bytes_per_token: float | None = None,
        engine: str = "any",
        plans: bool = True,
        on_progress: Callable[[int, int, str], None] | None = None,
    ) -> Recommendation:
        """`kvdemo.compare.recommend.recommend` (`RecommendJob`). Raises: as `run`; RecommendationCancelled holds the
        rows measured so far."""
        job = RecommendJob(context, tuple(questions), max_kl, bytes_per_token, engine, plans)
        return cast(Recommendation, self.run(job, on_progress))
