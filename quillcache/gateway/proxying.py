"""Pieces of the gateway's proxy that stand alone: where whole SSE events end in a buffer
(:func:`sse_event_end`), which of them is an engine's error event (:func:`sse_error_event`), and the watch that
turns a client's ``http.disconnect`` into the cancellation of its request's task (:class:`ClientWatch`).

Invariants: ``sse_event_end`` never cuts inside an event (any mix of LF, CR and CRLF line ends, as the
SSE spec allows); ``sse_error_event`` names an event only when its data is a JSON object that is an OpenAI
error (``{"error": {...}}``, or vLLM's older ``{"object": "error", ...}``), never a token whose text merely
contains the word; a ``ClientWatch`` cancels its task at most once, only while open, and says so in ``fired``.
"""

from __future__ import annotations

import asyncio
import json
import re

__all__ = ["ClientWatch", "sse_error_event", "sse_event_end"]

_EVENT_SPLIT = re.compile(rb"\r\n\r\n|\n\n|\r\r|\n\r\n|\r\n\n|\n\r")


def sse_event_end(buf: bytes) -> int:
    r"""The end of the last whole SSE event in ``buf`` (just past its blank line), 0 when there is none.

    SSE lines end in LF, CR or CRLF; an event ends at a blank line, i.e. two line ends in a row. CR-LF
    is one line end; every other pair of ``\r``/``\n`` bytes is two: ``\n\n``, ``\r\r`` and ``\n\r``
    (an LF - alone or CRLF's - then CR or CRLF) are the only patterns, and the LF of a CRLF that ends
    the blank line is kept with it."""
    if buf.endswith(b"\n\n"):  # the common case: a chunk of LF-framed events
        return len(buf)
    end = buf.rfind(b"\n\n") + 2  # 1 when there is none
    for sep in (b"\r\r", b"\n\r"):
        i = buf.rfind(sep) + 2
        if i > end:
            end = i + 1 if buf[i:i + 1] == b"\n" else i
    return end if end > 1 else 0


def sse_error_event(events: bytes) -> int | None:
    """The index of the first event of ``events`` (whole SSE events, as ``sse_event_end`` cuts them) whose data
    is an error object, or None. Cheap when there is none: the events are parsed only when the bytes hold
    ``"error"``."""
    if b'"error"' not in events:
        return None
    for i, event in enumerate(e for e in _EVENT_SPLIT.split(events) if e.strip()):
        data = b"\n".join(line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:"))
        if not data.lstrip().startswith(b"{") or b'"error"' not in data:
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if isinstance(obj, dict) and (isinstance(obj.get("error"), dict) or obj.get("object") == "error"):
            return i
    return None


class ClientWatch:
    """While open, cancels the request's task when the client disconnects (``http.disconnect``), so that
    whatever it awaits - the engine's headers, a whole body, the next stream chunk - stops and the
    upstream connection is closed (the engine sees it). ``fired`` tells that cancellation from any other
    (a server shutdown). The gateway opens one per admitted request, after its body was read (so
    ``receive`` yields nothing but the disconnect), and closes it when the exchange finishes; the task
    must be the one that awaits the upstream and runs the response."""

    __slots__ = ("fired", "_open", "_task", "_watcher")

    def __init__(self, receive) -> None:
        self.fired = False
        self._open = True
        self._task = asyncio.current_task()
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self._open:
                    self.fired = True
                    self._task.cancel()
                return

    def absorb(self) -> None:
        """The client's cancellation was handled: the task is not being cancelled any more (Python 3.11+
        counts cancellations; 3.10 has nothing to undo)."""
        uncancel = getattr(self._task, "uncancel", None)
        if uncancel is not None:
            uncancel()

    def close(self) -> None:
        self._open = False
        self._watcher.cancel()
