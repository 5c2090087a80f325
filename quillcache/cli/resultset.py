"""A command's result files written as one set (``hitrate``, ``replay``).

``write_result_set(out, names, stage_files, prefix=...)``: ``stage_files(stage)`` writes this run's
files into ``stage``, a temporary folder inside ``out``, and returns ``{name: staged path}`` (every
name one of ``names``); they are then renamed into ``out`` (``os.replace``, atomic per file) with
Ctrl-C, SIGTERM and SIGHUP held off until all are, and a file of ``names`` this run did not produce
(a stale ``pool.csv`` of an earlier run, say) is removed. So:

- an exception while staging (an ``OSError``, Ctrl-C, a stop signal) leaves ``out`` as it was:
  the stage removed, and the folders made for this run removed again; an ``OSError`` says so;
- a folder in the way of a name is refused before any rename (``IsADirectoryError``), ``out`` as
  it was;
- a signal during the renames takes effect once this run's complete set is in place:
  ``ResultsWritten`` (a ``KeyboardInterrupt`` carrying the signal) is raised then;
- no file of ``out`` outside ``names`` is touched; only a process killed outright mid-rename can
  leave a mix (and a ``<prefix>*`` temporary folder).

``write_reported(command, out, write)`` runs ``write()`` (a command's ``write_results``) and turns
each of those outcomes into the command's one stderr line and exit status: ``(paths, None)`` when
written, ``(None, status)`` otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from quillcache.cli.signals import describe, exit_status, interrupts_deferred

__all__ = ["ResultsWritten", "write_reported", "write_result_set"]

T = TypeVar("T")


class ResultsWritten(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM/SIGHUP: ``signum``) came while the results were renamed into place: they
    were all renamed first (``paths``)."""

    def __init__(self, paths: list[Path], signum: int = signal.SIGINT) -> None:
        super().__init__(paths)
        self.paths = paths
        self.signum = int(signum)


def write_result_set(out: Path, names: Sequence[str], stage_files: Callable[[Path], dict[str, Path]], *,
                     prefix: str) -> dict[str, Path]:
    """Write the set ``stage_files`` stages as a whole (module docstring); ``{name: path in out}``."""
    made = []
    p = out
    while not p.exists() and p.parent != p:
        made.append(p)
        p = p.parent
    stage = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=prefix, dir=out))
        staged = stage_files(stage)
        unknown = set(staged) - set(names)
        if unknown:
            raise ValueError(f"staged files {sorted(unknown)} are not among the result set's {list(names)}")
    except BaseException as exc:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        for d in made:  # innermost first; stops at one that is not empty
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"{exc.strerror or exc} (the files there are as they were)") from exc
        raise
    try:
        caught = _move_into_place(out, names, staged)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    written = {name: out / name for name in names if name in staged}
    if caught:
        raise ResultsWritten(list(written.values()), caught[0])
    return written


def _move_into_place(out: Path, names: Sequence[str], staged: dict[str, Path]) -> list[int]:
    """Rename the staged files into ``out`` and remove the stale ones, Ctrl-C and the stop signals
    deferred until done; the signals that came meanwhile."""
    for name in names:  # what would make a rename or removal fail half-way, before any
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise IsADirectoryError(21, f"{name} is a folder, not a file (the files there are as they were)",
                                    str(out / name))
    with interrupts_deferred() as caught:
        for name in names:
            try:
                if name in staged:
                    os.replace(staged[name], out / name)
                else:
                    (out / name).unlink(missing_ok=True)
            except OSError as exc:  # rare past the check above; say that the set is now mixed
                raise OSError(exc.errno, f"{name}: {exc.strerror or exc}; the files before it in "
                                         f"{', '.join(names)} are this run's, the rest the previous "
                                         f"run's") from exc
    return caught


def write_reported(command: str, out: Path, write: Callable[[], T]) -> tuple[T | None, int | None]:
    """``(write(), None)``; or, when the write did not simply succeed, ``(None, status)`` after one line on
    stderr: ``quillcache COMMAND: ...`` saying whether the results were written (a signal during the renames:
    ``ResultsWritten``, exit 128 + the signal, 130 for Ctrl-C), left as they were (a signal before them), or
    could not be written (``OSError``: ``quillcache COMMAND: error: ...``, exit 2)."""
    try:
        return write(), None
    except ResultsWritten as exc:
        print(f"quillcache {command}: {describe(exc)}; the results were written under {out} first", file=sys.stderr)
        return None, exit_status(exc)
    except KeyboardInterrupt as exc:
        print(f"quillcache {command}: {describe(exc)}; the files under {out} are as they were", file=sys.stderr)
        return None, exit_status(exc)
    except OSError as exc:
        print(f"quillcache {command}: error: cannot write results under {out}: {exc.strerror or exc}",
              file=sys.stderr)
        return None, 2
