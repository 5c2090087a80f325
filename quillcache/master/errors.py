"""Typed errors of the master service: one :class:`ErrorCode` per failure, one exception class per code.

Contract:
- Every refusal names what it is about (the key, segment, client or value) and carries a stable
  :class:`ErrorCode` (an ``IntEnum``: the numbers are the wire values, never renumbered).
- Single-key calls raise the code's exception class (all subclasses of :class:`MasterError`);
  batch calls never raise for one bad key: they return, per key, the value or the
  :class:`MasterError` instance that a single-key call would have raised.
- A refused call changed nothing (the only exception is an eviction a ``put_start`` ran before it
  still found no space: that eviction is logged and stays done, as in Mooncake; a put larger than
  every segment evicts nothing, since no eviction could make room for it).
"""

from __future__ import annotations

import enum

__all__ = [
    "ErrorCode",
    "InvalidParamsError",
    "LeaseHeldError",
    "LogFailedError",
    "MasterError",
    "NeedRemountError",
    "NoSpaceError",
    "NotLeaderError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "ObjectNotReadyError",
    "RecordEncodeError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "StaleEpochError",
    "StaleObjectError",
    "error_for",
]


class ErrorCode(enum.IntEnum):
    """Why a master call was refused (wire values; REFERENCE §9 names in comments)."""

    OBJECT_NOT_FOUND = 1
    OBJECT_ALREADY_EXISTS = 2
    NO_SPACE = 3  # Mooncake NO_AVAILABLE_HANDLE
    INVALID_PARAMS = 4
    SEGMENT_NOT_FOUND = 5
    SEGMENT_ALREADY_EXISTS = 6
    NEED_REMOUNT = 7  # unknown or expired client: register again with mount_segment
    OBJECT_NOT_READY = 8  # put_start without put_end yet (Mooncake REPLICA_IS_NOT_READY)
    LEASE_HELD = 9  # a read lease is live (Mooncake OBJECT_HAS_LEASE)
    NOT_LEADER = 10
    STALE_EPOCH = 11  # a record or writer of an older epoch than the newest seen
    LOG_FAILED = 12  # the operation log could not be written/synced: the master is read-only
    STALE_OBJECT = 13  # a copy from outside the pool older than the pool's last word on its key (removed / re-put)


class MasterError(Exception):
    """Base class: ``code`` (an :class:`ErrorCode`) and a message naming the key/segment/value."""

    code: ErrorCode = ErrorCode.INVALID_PARAMS

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}: {self.message!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MasterError) and other.code == self.code
                and other.message == self.message)

    def __hash__(self) -> int:
        return hash((self.code, self.message))


class ObjectNotFoundError(MasterError, KeyError):
    code = ErrorCode.OBJECT_NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class ObjectExistsError(MasterError):
    code = ErrorCode.OBJECT_ALREADY_EXISTS


class NoSpaceError(MasterError):
    code = ErrorCode.NO_SPACE


class InvalidParamsError(MasterError, ValueError):
    code = ErrorCode.INVALID_PARAMS


class RecordEncodeError(InvalidParamsError):
    """INVALID_PARAMS: a state change whose operation-log record cannot be encoded (a string that is
    not valid UTF-8, an int outside msgpack's range), or that would make its call's record larger than
    the operation log takes (``wal.MAX_PAYLOAD_BYTES``). Raised before the change is applied: the
    refused record changed nothing (the argument checks refuse such values first; this is the
    backstop)."""


class SegmentNotFoundError(MasterError):
    code = ErrorCode.SEGMENT_NOT_FOUND


class SegmentExistsError(MasterError):
    code = ErrorCode.SEGMENT_ALREADY_EXISTS


class NeedRemountError(MasterError):
    code = ErrorCode.NEED_REMOUNT


class ObjectNotReadyError(MasterError):
    code = ErrorCode.OBJECT_NOT_READY


class LeaseHeldError(MasterError):
    code = ErrorCode.LEASE_HELD


class NotLeaderError(MasterError):
    code = ErrorCode.NOT_LEADER


class StaleEpochError(MasterError):
    code = ErrorCode.STALE_EPOCH


class LogFailedError(MasterError):
    code = ErrorCode.LOG_FAILED


class StaleObjectError(MasterError):
    code = ErrorCode.STALE_OBJECT


_BY_CODE: dict[ErrorCode, type[MasterError]] = {
    cls.code: cls
    for cls in (ObjectNotFoundError, ObjectExistsError, NoSpaceError, InvalidParamsError, SegmentNotFoundError,
                SegmentExistsError, NeedRemountError, ObjectNotReadyError, LeaseHeldError, NotLeaderError,
                StaleEpochError, LogFailedError, StaleObjectError)
}
assert set(_BY_CODE) == set(ErrorCode)


def error_for(code: ErrorCode | int, message: str) -> MasterError:
    """The exception of ``code`` (e.g. decoding an error that came over the wire)."""
    return _BY_CODE[ErrorCode(code)](message)
