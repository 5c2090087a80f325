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
from dataclasses import dataclass, field

from quillcache.transfer.types import Outcome, RequestStatus, TransferRequest, TransferTimeoutError

__all__ = ["Item", "TransferBatch"]


@dataclass(eq=False)
class Item:
    """One request as a backend executes it: the local bytes and the deadline it must meet."""

    batch: "TransferBatch"
    index: int
    request: TransferRequest
    local_view: memoryview
    deadline_s: float  # time.monotonic() by which it must be terminal
    attempts: int = 0

    def finish(self, outcome: Outcome, reason: str = "", transferred_bytes: int = 0) -> None:
        self.batch.finish(self.index, outcome, reason, transferred_bytes)

    def remaining_s(self) -> float:
        return self.deadline_s - time.monotonic()


@dataclass(eq=False)
class TransferBatch:
    """The handle ``submit`` returns; ``statuses()`` is a snapshot, ``wait`` blocks until all are terminal."""

    requests: tuple[TransferRequest, ...]
    _release: Callable[[int], None]
    _statuses: list[RequestStatus] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _open: int = 0
    submitted_at_s: float = field(default_factory=time.monotonic)
    finished_at_s: float | None = None

    def __post_init__(self) -> None:
        self._statuses = [RequestStatus(Outcome.PENDING)] * len(self.requests)
        self._open = len(self.requests)
        if not self._open:
            self.finished_at_s = self.submitted_at_s

    def finish(self, index: int, outcome: Outcome, reason: str = "", transferred_bytes: int = 0) -> None:
        if not outcome.done:
            raise ValueError("finish needs a terminal outcome")
        with self._cond:
            if self._statuses[index].outcome.done:
                return
            self._statuses[index] = RequestStatus(outcome, reason, transferred_bytes)
            self._open -= 1
            if not self._open:
                self.finished_at_s = time.monotonic()
                self._cond.notify_all()
        self._release(index)

    @property
    def done(self) -> bool:
        return self._open == 0

    def statuses(self) -> list[RequestStatus]:
        with self._cond:
            return list(self._statuses)

    def wait(self, timeout_s: float | None = None) -> list[RequestStatus]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeoutError(f"{self._open} of {len(self.requests)} requests still in flight "
                                               f"after {timeout_s} s")
                self._cond.wait(left)
            return list(self._statuses)

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for s in self._statuses:
            counts[s.outcome.value] = counts.get(s.outcome.value, 0) + 1
        return f"TransferBatch({len(self.requests)} requests, {counts})"
