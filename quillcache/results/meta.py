"""Run metadata written beside every study's summary (``meta.json``).

A result is only comparable with the machine, code and profile that produced it, so every
``write_summary`` records them: the study, its profile (``quick`` reduced form, ``full`` for the
report's numbers, ``custom`` for a user's own run), the git commit (and whether the tree had
uncommitted changes), the CPU model and core count, Python and platform, and the UTC time.
Nothing in it is an absolute path of the machine.

It also records the digest (sha256 of the parsed rows, ``writer.table_sha256``) of the
``summary.csv`` (``summary_sha256``) and ``anchors.csv`` (``anchors_sha256``; null: the run
wrote none) it was written with, and ``write_summary``
renames it into place last, so a reader can tell a summary or anchors file that is not this
run's (a write interrupted between its renames) and refuses it. A ``meta.json`` written before
digests were recorded has neither field (both None): its files are accepted unchecked.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

PROFILES = ("quick", "full", "custom")


@dataclass(frozen=True, kw_only=True)
class RunMeta:
    study: str
    profile: str
    git_commit: str
    git_dirty: bool
    cpu_model: str
    cpu_count: int
    python: str
    platform: str
    date_utc: str
    wall_s: float | None = None
    summary_sha256: str | None = None
    anchors_sha256: str | None = None

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"profile {self.profile!r} is not one of {', '.join(PROFILES)}")
        for name in ("summary_sha256", "anchors_sha256"):
            digest = getattr(self, name)
            if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
                raise ValueError(f"{name} {digest!r} is not a sha256 digest (64 lowercase hex digits)")
        if self.anchors_sha256 is not None and self.summary_sha256 is None:
            raise ValueError("anchors_sha256 is set but summary_sha256 is not (digests are recorded together)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, origin: str = "meta.json") -> "RunMeta":
        """Parse ``meta.json``; any damage (not JSON, not an object, a field missing or of the
        wrong type, an unknown profile) is a ValueError naming ``origin`` and what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{origin}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        known = {f.name: f.type for f in fields(cls)}
        if not isinstance(raw, dict):
            raise ValueError(f"{origin}: holds a JSON {type(raw).__name__}, not an object with the fields "
                             f"{', '.join(sorted(known))}")
        missing = sorted(set(known) - _OPTIONAL - set(raw))
        if "summary_sha256" in raw and "anchors_sha256" not in raw:
            missing.append("anchors_sha256 (null where the run wrote no anchors.csv)")
        if missing:
            raise ValueError(f"{origin}: missing fields {', '.join(missing)}")
        for name, kind in known.items():
            value = raw.get(name)
            if not isinstance(value, _FIELD_TYPES[kind]) or (isinstance(value, bool) and bool not in
                                                             _FIELD_TYPES[kind]):
                raise ValueError(f"{origin}: field {name!r} is {value!r}, expected {kind}")
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except ValueError as exc:
            raise ValueError(f"{origin}: {exc}") from None


# The JSON types each annotation of RunMeta accepts (bool is refused where a number is expected).
_FIELD_TYPES = {"str": (str,), "bool": (bool,), "int": (int,), "float | None": (int, float, type(None)),
                "str | None": (str, type(None))}
# Fields a meta.json may lack: written before they were recorded.
_OPTIONAL = frozenset({"wall_s", "summary_sha256", "anchors_sha256"})
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[2])
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else ``platform.processor()``, else 'unknown'."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def collect(study: str, profile: str, *, wall_s: float | None = None) -> RunMeta:
    """The metadata of a run that is finishing now."""
    commit = _git("rev-parse", "HEAD")
    # "dirty" means the code differs from the commit: the generated outputs a run itself rewrites
    # (results, the paper, the notebook, the README's measured block) do not count
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!results", ":!paper",
                  ":!notebooks/analysis.ipynb", ":!README.md")
    return RunMeta(
        study=study, profile=profile,
        git_commit=commit or "unknown", git_dirty=bool(status) if status is not None else False,
        cpu_model=cpu_model(), cpu_count=os.cpu_count() or 1,
        python=sys.version.split()[0], platform=f"{platform.system()} {platform.machine()}",
        date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        wall_s=None if wall_s is None else round(float(wall_s), 1),
    )
