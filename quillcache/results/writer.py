"""Writing a study's results: ``results/<study>/summary.csv``, ``meta.json``, ``anchors.csv``
and raw CSVs beside them.

``summary.csv`` has the fixed ``SUMMARY_COLUMNS`` followed by one column per parameter used by
any row (sorted by name; blank where a row does not have it). Floats are written exactly
(``repr``). A write refuses, naming the row, a metric that packs a parameter (``@``) and any
text holding an absolute path of this machine (the repository or home directory), so committed
results never depend on where they were produced.

Invariants:
- a study is one directory name under the results root (``''`` or ``'.'``: the root itself) and
  a raw file one ``<name>.csv`` in it: nothing is ever written outside ``<root>/<study>/`` (a
  name with ``/``, ``..`` or an absolute path is refused, naming it);
- every file appears whole or not at all: it is written to a uniquely named temporary file in the
  same directory, flushed to disk and renamed over the old one (``os.replace``), so neither a
  crash nor a second writer leaves a torn file, and two writers never share a temporary name;
- ``summary.csv``, ``meta.json`` and ``anchors.csv`` are replaced together while the study's
  lock (``flock`` on ``<study>/.lock``) is held exclusively, and the readers read them under the
  same lock held shared (a reader creates the lock file when it is missing, as in a fresh
  checkout), so a reader never sees one run's summary with another run's metadata. Raw files are
  written under the same lock;
- ``meta.json`` records the digest (``table_sha256``) of the ``summary.csv`` and ``anchors.csv``
  (or that there is none) it belongs to and is renamed into place last, after the other files are renamed (or the
  old ``anchors.csv`` removed): a process that dies between the renames leaves the new files with
  the old ``meta.json``, whose digests no longer match, and the readers refuse that pair
  (``ResultsFormatError``) even where they could not take the lock (a read-only checkout). No
  staged temporary file is left behind, whatever stops the write.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

from quillcache.results.meta import collect
from quillcache.results.schema import ANCHOR_COLUMNS, SUMMARY_COLUMNS, Anchor, SummaryRow

_REPO_ROOT = Path(__file__).resolve().parents[2]
LOCK_NAME = ".lock"


def results_root(root: str | os.PathLike | None = None) -> Path:
    """``root``, else $QUILLCACHE_RESULTS, else ./results."""
    return Path(root or os.environ.get("QUILLCACHE_RESULTS", "results"))


def study_path(name: str, root: str | os.PathLike | None = None, *, allow_root: bool = False) -> Path:
    """``<root>/<name>`` (not created); refuses a ``name`` that is not one directory name (a path,
    ``..``). ``allow_root`` (the writers) lets ``''`` and ``'.'`` name the root itself, as a
    command line's ``--out .`` staged in a temporary folder does."""
    base = results_root(root)
    if allow_root and name in ("", "."):
        return base
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or os.sep in name \
            or (os.altsep and os.altsep in name):
        raise ValueError(f"study name {name!r} must be one directory name under {base} "
                         f"(no '/', '..' or absolute path)")
    return base / name


def results_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    """``<root>/<name>``, created (``name`` must be one directory name; '' or '.': the root)."""
    out = study_path(name, root, allow_root=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def study_lock(study_dir: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold the study's lock: exclusive for a writer, shared for a reader; either creates the lock
    file when it is missing. A reader that can neither create nor open it (a read-only file system
    or checkout: EROFS, EACCES, EPERM) reads unlocked, relying on ``meta.json``'s digests to refuse
    a summary or anchors file of another run."""
    path = Path(study_dir) / LOCK_NAME
    fd = None
    try:
        fd = os.open(path, (os.O_RDONLY if shared else os.O_RDWR) | os.O_CREAT, 0o644)
    except OSError as exc:
        if not shared or exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)  # an existing lock file on a read-only file system
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _local_paths() -> list[str]:
    paths = {str(_REPO_ROOT), str(Path.cwd().resolve()), os.path.expanduser("~")}
    return sorted((p for p in paths if p not in ("", "/") and len(p) > 4), key=len, reverse=True)


def _check_text(where: str, text: str, local: list[str]) -> None:
    for p in local:
        if p + "/" in text or text.endswith(p):
            raise ValueError(f"{where} holds the absolute local path {p!r}; write a path relative to the "
                             f"repository (results must not depend on the machine): {text[:120]!r}")


def _check_rows(name: str, rows: Sequence[SummaryRow | Anchor]) -> None:
    local = _local_paths()
    for i, row in enumerate(rows):
        where = f"results/{name}: row {i} ({row.metric!r}, {row.subject!r})"
        if "@" in row.metric:
            raise ValueError(f"{where}: a metric name holds no parameter; put it in params (e.g. "
                             f"params={{'capacity_blocks': 1000}}) instead of {row.metric!r}")
        for text in (row.metric, row.subject, row.notes, *(v for v in row.params.values() if isinstance(v, str))):
            _check_text(where, text, local)


def _stage(path: Path, write: Callable[[IO[str]], None]) -> Path:
    """Write a uniquely named temporary file beside ``path`` with ``write`` and flush it to disk;
    return its name (``_publish`` renames it over ``path``). Nothing is left behind on error."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


@contextlib.contextmanager
def _staging() -> Iterator[dict[Path, Path]]:
    """A ``{path: staged temporary file}`` map to fill with ``_stage`` and empty with ``_publish``;
    whatever is still staged on leaving (an error, Ctrl-C, a process killed between renames aside)
    is unlinked."""
    staged: dict[Path, Path] = {}
    try:
        yield staged
    finally:
        for tmp in staged.values():
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _publish(directory: Path, staged: dict[Path, Path], remove: Sequence[Path] = ()) -> None:
    """Rename every staged file into place in ``staged``'s order, removing each from ``staged``
    once renamed; ``remove`` is removed just before the last rename (the one that commits the
    set: ``meta.json``). The caller holds the study's lock."""
    last = list(staged)[-1:]
    for path in list(staged):
        if path in last:
            for old in remove:
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()
        os.replace(staged[path], path)
        del staged[path]
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the renames survive a crash once write_summary has returned
    finally:
        os.close(dfd)


def table_sha256(text: str) -> str:
    """The digest ``meta.json`` records for a summary or anchors CSV: the sha256 of its non-blank
    rows as the csv module parses them (a cell's line breaks counted as ``\\n``), so a blank line
    an editor added or line endings git converted do not change it, and any changed cell does."""
    rows = [[c.replace("\r\n", "\n") for c in cells] for cells in csv.reader(io.StringIO(text, newline="")) if cells]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode("utf-8")).hexdigest()


def _sha256(path: Path) -> str:
    return table_sha256(path.read_text(encoding="utf-8"))


def _rows_writer(path: Path, fixed: Sequence[str], rows: Sequence[SummaryRow | Anchor]) -> Callable[[IO[str]], None]:
    params = sorted({k for r in rows for k in r.params})
    clash = set(params) & set(fixed)
    if clash:
        raise ValueError(f"{path}: parameters {sorted(clash)} clash with fixed columns")

    def write(fh: IO[str]) -> None:
        w = csv.DictWriter(fh, fieldnames=[*fixed, *params], restval="")
        w.writeheader()
        for row in rows:
            w.writerow(row.as_dict())

    return write


def write_summary(name: str, rows: Iterable[SummaryRow], root: str | os.PathLike | None = None, *,
                  profile: str, anchors: Iterable[Anchor] = (), started_at: float | None = None) -> Path:
    """Write ``<root>/<name>/summary.csv``, its ``meta.json`` (``profile`` is quick, full or
    custom; ``started_at`` a ``time.monotonic()`` stamp for the wall time) and, when given,
    ``anchors.csv`` (else any old one is removed), all three replaced together under the study's
    lock, ``meta.json`` (with the other two files' sha256) last; return the summary's path."""
    rows = list(rows)
    anchors = list(anchors)
    _check_rows(name, rows)
    _check_rows(name, anchors)
    meta = collect(name, profile, wall_s=None if started_at is None else time.monotonic() - started_at)
    out = results_dir(name, root)
    path, anchors_path = out / "summary.csv", out / "anchors.csv"
    write_rows = _rows_writer(path, SUMMARY_COLUMNS, rows)
    write_anchors = _rows_writer(anchors_path, ANCHOR_COLUMNS, anchors) if anchors else None
    with study_lock(out), _staging() as staged:
        staged[path] = _stage(path, write_rows)
        if write_anchors is not None:
            staged[anchors_path] = _stage(anchors_path, write_anchors)
        meta = dataclasses.replace(meta, summary_sha256=_sha256(staged[path]),
                                   anchors_sha256=_sha256(staged[anchors_path]) if anchors else None)
        staged[out / "meta.json"] = _stage(out / "meta.json", lambda fh: fh.write(meta.to_json()))  # renamed last
        _publish(out, staged, remove=() if anchors else (anchors_path,))
    return path


def write_raw(name: str, filename: str, header: Sequence[str], records: Iterable[Sequence], root=None) -> Path:
    """Write a raw CSV beside the summary (``filename`` a plain ``<name>.csv`` inside the study's
    directory; a path, ``..`` or a hidden name is refused)."""
    stem = filename[:-4] if isinstance(filename, str) and filename.endswith(".csv") else ""
    if (Path(filename).name != filename or not stem or stem.startswith(".")
            or filename in ("summary.csv", "anchors.csv")):
        raise ValueError(f"raw file name {filename!r} must be a plain '<name>.csv' inside the study's directory, "
                         f"other than summary/anchors")
    out = results_dir(name, root)
    path = out / filename
    records = list(records)

    def write(fh: IO[str]) -> None:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(records)

    with study_lock(out), _staging() as staged:
        staged[path] = _stage(path, write)
        _publish(out, staged)
    return path
