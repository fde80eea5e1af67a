"""The server-wide KV account: bytes reserved under holder names before anything is allocated (`KVAccount`, refused
with `ServerKVBudgetError`), and the one estimate of what a session holds (`prefill_tokens`, `session_kv_bytes`).
`kvdemo.serve.server.App` reserves through it; no Gradio here.
"""

from __future__ import annotations

import threading

from kvdemo.cache.spec import CacheSpec
from kvdemo.cache.state import budget
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prompt import PreparedContext


class ServerKVBudgetError(ValueError):
    """A reservation refused because the server-wide KV budget would be passed (a message for the user).

    Attributes:
        request_bytes: what was asked for; held_bytes: what others hold now; limit_bytes: the budget (bytes).
    """

    def __init__(self, message: str, request_bytes: int, held_bytes: int, limit_bytes: int):
        super().__init__(message)
        self.request_bytes = request_bytes
        self.held_bytes = held_bytes
        self.limit_bytes = limit_bytes


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


class KVAccount:
    """The server-wide KV budget: bytes reserved under holder names (`cache:<session>`, `prefill:<session>`,
    `compare:<session>`; a needle grid holds `grid:<session>`: `kvdemo.serve.door`), whose sum never passes
    `limit_bytes`. A reservation is made before the memory is
    allocated and released when it is freed, so a request that would pass the budget is refused with the figures
    instead of running the server out of memory. Thread-safe.

    Args:
        limit_bytes: the budget (bytes); None: no limit (the reservations are still counted).

    Raises:
        ValueError: limit_bytes < 1.

    Example:
        >>> account = KVAccount(100 * 2**20)
        >>> account.reserve("prefill:a", 60 * 2**20, "a prefill"); account.transfer("prefill:a", "cache:a")
        >>> account.reserve("compare:b", 60 * 2**20, "a comparison")  # raises ServerKVBudgetError
    """

    def __init__(self, limit_bytes: int | None = None):
        if limit_bytes is not None and limit_bytes < 1:
            raise ValueError(f"limit_bytes={limit_bytes} must be >= 1 (or None for no limit)")
        self.limit_bytes = limit_bytes
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Bytes reserved now, all holders together."""
        with self._lock:
            return sum(self._held.values())

    def holders(self) -> dict[str, int]:
        """A copy of the reservations: holder name -> bytes."""
        with self._lock:
            return dict(self._held)

    def reserve(self, holder: str, nbytes: int, what: str, grow_only: bool = False) -> None:
        """Reserve `nbytes` under `holder`, replacing what `holder` held.

        Args:
            holder: the reservation's name; what: the job, for the message (e.g. "a hqq 4-bit cache of 2,172
                tokens").
            grow_only: keep what `holder` holds when it is already `nbytes` or more.

        Raises:
            ServerKVBudgetError (a ValueError): `nbytes` alone pass the whole budget ("too small for this"), or
                the other holders' bytes plus `nbytes` would ("full: try again"); nothing is reserved then
                (`holder` keeps what it held).
        """
        nbytes = int(nbytes)
        with self._lock:
            if grow_only and self._held.get(holder, -1) >= nbytes:
                return
            others = sum(b for h, b in self._held.items() if h != holder)
            limit = self.limit_bytes
            if limit is not None and nbytes > limit:  # alone: waiting for other users would not help
                raise ServerKVBudgetError(
                    f"The server's KV budget is too small for this: {what} needs about {_mib(nbytes)}, more than the "
                    f"whole {_mib(limit)} this server gives all users together. Ask for less: a shorter context, "
                    "fewer max_new_tokens, or a backend with fewer bits (e.g. hqq with nbits 2)",
                    nbytes,
                    others,
                    limit,
                )
            if limit is not None and others + nbytes > limit:
                users = sum(1 for h in self._held if h != holder)
                raise ServerKVBudgetError(
                    f"The server's KV budget is full: {what} needs about {_mib(nbytes)}, and {_mib(others)} of its "
                    f"{_mib(limit)} are held by {users} other cache{'' if users == 1 else 's'} and comparisons "
                    f"({_mib(max(limit - others, 0))} free). Try again when other users finish, or ask for less: a "
                    "shorter context, fewer max_new_tokens, or a backend with fewer bits (e.g. hqq with nbits 2)",
                    nbytes,
                    others,
                    limit,
                )
            self._held[holder] = nbytes

    def transfer(self, source: str, target: str) -> None:
        """Move `source`'s reservation to `target`, replacing what `target` held (a finished prefill becomes its
        session's cache; the old cache is freed). Never raises: the total does not grow."""
        with self._lock:
            nbytes = self._held.pop(source, None)
            if nbytes is not None:
                self._held[target] = nbytes

    def release(self, holder: str) -> int:
        """Drop `holder`'s reservation; returns the bytes it held (0 when none)."""
        with self._lock:
            return self._held.pop(holder, 0)


def prefill_tokens(loaded: LoadedModel, context: object) -> int:
    """The tokens a prefill of `context` on `loaded` would put in the cache (chat template prefix included), before
    it runs: `LoadedModel.context_ids`, the prompt's one definition; 0 for what is not a non-blank text (the session
    refuses that with its own message). A context longer than the model's window is counted at once, without the
    prompt split's probes; a `PreparedContext` is not tokenized again."""
    if isinstance(context, PreparedContext):
        return len(loaded.context_ids(context))
    if not isinstance(context, str) or not context.strip():
        return 0
    return len(loaded.context_ids(context))


def session_kv_bytes(spec: CacheSpec, loaded: LoadedModel, context_tokens: int, reserve_tokens: int) -> int:
    """The most bytes a session of `spec` holds with `context_tokens` prefilled: its cache with `reserve_tokens`
    more decoded (a question and its answer, `QASession.estimate_kv_bytes`), plus what the snapshot keeps alive
    during an answer once the cache replaces its post-prefill store (`kvdemo.cache.state.budget.held_bytes_estimate`).
    For `dynamic` nothing: the restore slices back instead of holding a copy (docs/DESIGN.md, invariant 3).

    Returns:
        Bytes (int).

    Raises:
        ValueError, ImportError: the spec does not validate on the model (`CacheSpec.validate`).
    """
    return budget.held_bytes_estimate(
        spec.validate(loaded.config), loaded.config, loaded.dtype, context_tokens, reserve_tokens
    )  # the one estimate, the session's own guard uses it too
