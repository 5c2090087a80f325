"""A submitted batch: its requests, their outcomes, and what a backend gets to execute.

Invariants:
- Each request of a batch ends in exactly one terminal outcome; ``finish`` on a request that is
  already terminal is ignored (the first outcome wins), so a backend cannot report a request twice.
- A request's local range is checked out of the engine's ``RegionTable`` from submit until its
  outcome is final and released exactly once then, so its region cannot be unregistered under it.
- ``wait`` returns only when every request is terminal; past its timeout it raises
  ``TransferTimeoutError`` and leaves the batch running (requests keep their own deadlines).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from quillcache.transfer.types import Outcome, RequestStatus, TransferRequest, TransferTimeoutError

__all__ = ["Item", "TransferBatch"]

_PENDING = RequestStatus(Outcome.PENDING)
_COMPLETED = Outcome.COMPLETED


class Item:
    """One request as a backend executes it: the local bytes and the deadline it must meet."""

    __slots__ = ("batch", "index", "request", "local_view", "deadline_s", "attempts")

    def __init__(self, batch: "TransferBatch", index: int, request: TransferRequest, local_view: memoryview,
                 deadline_s: float) -> None:
        self.batch, self.index, self.request = batch, index, request
        self.local_view = local_view
        self.deadline_s = deadline_s  # time.monotonic() by which it must be terminal
        self.attempts = 0

    def finish(self, outcome: Outcome, reason: str = "", transferred_bytes: int = 0) -> None:
        self.batch.finish(self.index, outcome, reason, transferred_bytes)

    def remaining_s(self) -> float:
        return self.deadline_s - time.monotonic()


class TransferBatch:
    """The handle ``submit`` returns; ``statuses()`` is a snapshot, ``wait`` blocks until all are terminal."""

    __slots__ = ("requests", "_release", "_statuses", "_finished_at", "_lock", "_cond", "_open", "submitted_at_s",
                 "finished_at_s")

    def __init__(self, requests: tuple[TransferRequest, ...], release: Callable[[int], None]) -> None:
        self.requests = requests
        self._release = release
        n = len(requests)
        self._statuses = [_PENDING] * n
        self._finished_at = [float("nan")] * n
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None  # made by the first wait that has to block
        self._open = n
        self.submitted_at_s = time.monotonic()
        self.finished_at_s: float | None = self.submitted_at_s if not n else None

    def finish(self, index: int, outcome: Outcome, reason: str = "", transferred_bytes: int = 0) -> None:
        if outcome is Outcome.PENDING:
            raise ValueError("finish needs a terminal outcome")
        now = time.monotonic()
        with self._lock:
            if self._statuses[index] is not _PENDING:
                return
            self._statuses[index] = RequestStatus(outcome, reason, transferred_bytes)
            self._finished_at[index] = now
            self._open -= 1
            if not self._open:
                self.finished_at_s = now
                if self._cond is not None:
                    self._cond.notify_all()
        self._release(index)

    def latencies_s(self) -> list[float]:
        """Seconds from submit to each request's terminal outcome (NaN while it is pending)."""
        with self._lock:
            return [t - self.submitted_at_s for t in self._finished_at]

    @property
    def done(self) -> bool:
        return self._open == 0

    def statuses(self) -> list[RequestStatus]:
        with self._lock:
            return list(self._statuses)

    def wait(self, timeout_s: float | None = None) -> list[RequestStatus]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            if self._open and self._cond is None:
                self._cond = threading.Condition(self._lock)
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeoutError(f"{self._open} of {len(self.requests)} requests still in flight "
                                               f"after {timeout_s} s")
                self._cond.wait(left)  # type: ignore[union-attr]
            return list(self._statuses)

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for s in self._statuses:
            counts[s.outcome.value] = counts.get(s.outcome.value, 0) + 1
        return f"TransferBatch({len(self.requests)} requests, {counts})"
