"""``quillcache hitrate TRACE``: hit rate of eviction policies at several capacities, and the share
of the LRU→Belady gap each closes (the hit-rate-only replay of :mod:`quillcache.hitrate`).

Capacities are block counts (``10k``), ``inf``, or shares of the trace's distinct blocks (``1%``,
``0.5%``): a share resolves after loading to ``max(1, int(distinct blocks * share))``, the rule of the
hit-rate study's generalisation table, so one command line means the same cache pressure on traces
of any size; the table heads say both, and ``hitrate.csv`` has a ``capacity_share`` column.

Belady (with bypass) bounds every policy's prefix hits only when the trace's hash ids are
prefix-chained: every block id follows the same parent (the id before it in its request, or none)
wherever it is referenced, so no id occurs twice in a request (``TraceArrays.prefix_chained``). A
trace that is not is refused like bad input, the one line (``FILE:LINE: ...``, the words ``replay``
refuses it with: ``quillcache.hitrate.arrays.unchained_message``) naming the first block reference that
breaks the chain by its line, unless ``--allow-unchained`` is given: then Belady runs as a heuristic (so
labelled in the table, the ``label`` column of ``hitrate.csv`` and the notes of ``summary.csv``,
whose rows all get ``prefix_chained = false``), and ``gap_closed`` is NA (empty in the CSV) in every
row, bounds' included.

Bad input (a missing or malformed trace, unsorted timestamps, a trace with no block reference (no
hit rate: 0 / 0; ``replay`` refuses such a trace too), an unknown policy, a capacity that is not a positive
integer up to ``MAX_CAPACITY_BLOCKS``, a share in (0, 100%] or ``inf``, an empty ``--out``) prints ONE line
``quillcache hitrate: error: ...`` on stderr and exits with status 2;
nothing is written. ``--out`` is checked to be writable before any work.
Results go under ``--out`` (default ``results/hitrate_cli/<trace stem>/``): ``hitrate.csv`` (one
row per policy and capacity: hit rate, hit blocks, gap closed, replay speed, ``policy_class``:
``online``, ``semi_online`` (lookahead: it sees the queued requests) or ``offline`` (Belady and the
oracle bounds), and ``label``, the table's note on the row), ``summary.csv`` + ``meta.json`` in the
project's results schema (``quillcache.results.read_summary`` reads them; as in the hit-rate study,
semi-online rows are the metrics ``semi_online_hit_rate`` and ``semi_online_gap_closed``, with their
window ``window_requests`` in the params, never ``hit_rate``/``gap_closed`` beside the online ones),
a ``hitrate.parquet`` twin when pyarrow is importable and, with ``--anatomy``, ``anatomy.csv``
(its header row only when there is nothing to compare). A run replaces that set as a whole
(``write_results``, ``quillcache.cli.resultset``): every file is written into a temporary folder
inside ``--out``, then renamed into place with ``os.replace``, Ctrl-C, SIGTERM and SIGHUP held off
until all are, and a file of the set this run does not produce (an earlier run's ``anatomy.csv`` or
``hitrate.parquet``) is removed. So Ctrl-C (exit status 130), SIGTERM/SIGHUP (128 + the signal) or a
failed write (exit status 2) leaves ``--out`` with the previous run's files as they were, a signal
during the renames takes effect once this run's complete set is in place, and other
files in ``--out`` are never touched; only a process killed outright mid-rename can leave a mix (and
a ``.hitrate-*`` temporary folder). With ``--on-error skip`` the malformed lines skipped are a
``lines_skipped`` row of ``summary.csv`` (none when no line was skipped) and one line on stderr, ``--quiet`` or not.
``lru`` and ``belady`` (the offline bound; with ``--allow-unchained`` possibly a heuristic) always
run: the gap needs both.
``--bounds`` adds two offline bounds after them (``quillcache.hitrate.bounds``): ``reuse_oracle``,
an LRU that knows which blocks will be referenced again, never when; and ``timing_oracle``, Belady
knowing exactly which blocks return but *when* only up to a factor ``exp(sigma * Z)`` per request,
with ``sigma`` measured on the trace itself for "a conversation comes back after the same gap as its
previous turn" (``quillcache.hitrate.turns``; left out, with a note, when the trace has no such
turns). So the table also says how much of the gap on this trace is *which* blocks return and how
much is *when*. With ``sigma`` known, ``joint_oracle@F`` rows (``--bound-flip-rates``, default
``DEFAULT_BOUND_FLIP_RATES``) are wrong about both at once: the timing oracle's error, and which
blocks return inverted for a share F of the requests (giving up on blocks long overdue): the gap
a predictor that wrong on both counts could close at best. ``--anatomy A,B`` says where two
policies differ (``quillcache.hitrate.anatomy``): at every finite capacity, the block references A hits and B misses and the reverse, by the block's uses
in the whole trace and the requests since its previous use; two tables of the net difference
(A only - B only) and ``anatomy.csv`` with every cell (``--anatomy quillchain,belady`` shows what a
policy misses that the offline bound hits).
"""

from __future__ import annotations

import argparse
import os  # noqa: F401 - tests patch hitrate.os.replace, the rename quillcache.cli.resultset uses
import sys
from collections.abc import Sequence
from pathlib import Path

from quillcache.cli.hitrate_specs import (MAX_CAPACITY_BLOCKS, Share, joint_label, parse_capacities,
                                         parse_flip_rates, resolve_capacities)
from quillcache.cli.resultset import ResultsWritten, write_reported, write_result_set

__all__ = ["DEFAULT_BOUND_FLIP_RATES", "DEFAULT_CAPACITIES", "MAX_CAPACITY_BLOCKS", "RESULT_FILES", "ResultsWritten",
           "Share", "anatomy_frame", "configure", "joint_label", "parse_anatomy", "parse_capacities", "parse_flip_rates",
           "policy_class", "resolve_capacities", "run", "write_results"]

DEFAULT_CAPACITIES = "1k,10k,30k,50k,100k,inf"
DEFAULT_BOUND_FLIP_RATES = "5%,10%,20%"  # --bounds: joint-oracle shares of requests wrong about which blocks return
DEFAULT_OUT = Path("results") / "hitrate_cli"

EPILOG = """\
examples:
  # every policy at 1k, 10k, 30k, 50k, 100k blocks and unlimited on the Mooncake conversation trace
  quillcache hitrate ../shared/traces/conversation_trace.jsonl

  # the same cache pressure on a trace of any size: 1%, 3%, 10% and 30% of its distinct blocks
  quillcache hitrate trace.jsonl --policies quillchain,s3fifo,sieve --capacities 1%,3%,10%,30%

  # two policies (lru and belady are always added), three capacities, results elsewhere
  quillcache hitrate trace.jsonl --policies quillchain,s3fifo --capacities 2000,20k,inf --out /tmp/hr

  # where QuillChain and S3-FIFO differ at 2k and 20k blocks: references one hits and the other misses,
  # by how often the block is used and how long ago it was used before
  quillcache hitrate trace.jsonl --policies quillchain,s3fifo --capacities 2k,20k --anatomy quillchain,s3fifo

  # a generated trace of 16-token blocks (the size is read from its lines), malformed lines skipped
  quillcache gen-trace sessions --out s.jsonl --sessions 500
  quillcache hitrate s.jsonl --on-error skip

hit rate: the prefix-aware block hit rate of REFERENCE §5 (a request hits its leading cached
blocks up to the first miss); "gap closed" = (policy - lru) / (belady - lru) at that capacity.
Belady is an upper bound only on a prefix-chained trace (every block id follows the same parent
wherever it occurs): another trace is refused, or run with --allow-unchained, Belady then a
heuristic and no gap closed. hitrate.csv says each row's class (online, semi_online, offline);
summary.csv names the semi-online rows semi_online_hit_rate / semi_online_gap_closed.
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("trace", help="a JSON-Lines trace (Mooncake format or the project's generated schemas)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policy names (default: every online policy with a hit-rate kernel; "
                        "the semi-online lookahead, which sees the queued requests, only when named, and then "
                        "reported apart: class semi_online in hitrate.csv, semi_online_* metrics in summary.csv)")
    p.add_argument("--capacities", default=DEFAULT_CAPACITIES,
                   help=f"comma-separated capacities in blocks; k/M suffixes; N%% = that share of the trace's "
                        f"distinct blocks; inf = unlimited (default {DEFAULT_CAPACITIES})")
    p.add_argument("--out", default=None, help=f"results directory (default {DEFAULT_OUT}/<trace stem>/)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="a malformed trace line: stop naming it (default) or skip it (counted on stderr, also with "
                        "--quiet, and as the lines_skipped row of summary.csv)")
    p.add_argument("--bounds", action="store_true",
                   help="also run the reuse oracle (offline: knows which blocks are referenced again, never when), "
                        "the timing oracle (offline: knows which, and when as roughly as 'the same gap as the "
                        "previous turn') and the joint oracle (as roughly when, and wrong about which for a share "
                        "of requests: --bound-flip-rates)")
    p.add_argument("--bound-flip-rates", default=None,
                   help="with --bounds: one joint-oracle row per share of requests it is wrong about which blocks "
                        f"return, on top of the timing oracle's error (e.g. 5%%,0.1; none = no joint rows; default "
                        f"{DEFAULT_BOUND_FLIP_RATES.replace('%', '%%')})")
    p.add_argument("--anatomy", default=None, metavar="A,B",
                   help="also compare two policies reference by reference at every finite capacity: the block "
                        "references A hits and B misses and the reverse, by the block's uses in the trace and the "
                        "requests since its previous use (written to anatomy.csv)")
    p.add_argument("--allow-unchained", action="store_true",
                   help="run a trace whose hash ids are not prefix-chained (an id after different parents, or "
                        "twice in one request) instead of refusing it: Belady is then no bound, so it is labelled "
                        "a heuristic and no gap closed is computed (NA in every row)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table (the files are still written)")


def _fail(msg: str) -> int:
    print(f"quillcache hitrate: error: {msg}", file=sys.stderr)
    return 2


def _cap_label(cap, shares: dict[int, Share]) -> str:
    if _is_na(cap):
        return "unlimited"
    share = shares.get(int(cap))
    return f"{share.text} = {int(cap):,}" if share else f"{int(cap):,}"


def _policies(text: str | None) -> list[str]:
    from quillcache.hitrate import HITRATE_KERNELS, SEMI_ONLINE

    names = ([n for n in HITRATE_KERNELS if n not in SEMI_ONLINE] if text is None
             else [s.strip() for s in text.split(",") if s.strip()])
    if not names:
        raise ValueError("--policies: no policy named")
    unknown = [n for n in names if n not in HITRATE_KERNELS]
    if unknown:
        raise ValueError(f"--policies: unknown policy {unknown[0]!r}; known: {', '.join(sorted(HITRATE_KERNELS))}")
    rest = [n for n in names if n not in ("lru", "belady")]
    return ["lru", *dict.fromkeys(rest), "belady"]


def parse_anatomy(text: str | None) -> tuple[str, str] | None:
    """``"quillchain,s3fifo"`` -> ``("quillchain", "s3fifo")``; ValueError unless two different known policies."""
    from quillcache.hitrate import HITRATE_KERNELS

    if text is None:
        return None
    names = [s.strip() for s in text.split(",")]
    if len(names) != 2 or not all(names) or names[0] == names[1]:
        raise ValueError(f"--anatomy: {text!r} must name two different policies, e.g. quillchain,s3fifo")
    for n in names:
        if n not in HITRATE_KERNELS:
            raise ValueError(f"--anatomy: unknown policy {n!r}; known: {', '.join(sorted(HITRATE_KERNELS))}")
    return names[0], names[1]


def anatomy_frame(arrs, pair: tuple[str, str], caps: list[int | None], options: dict):
    """One row per finite capacity and non-empty (uses, previous use) cell of
    ``quillcache.hitrate.anatomy`` for the two policies of ``pair`` (a, b), with ``net`` = a_only - b_only.
    The columns are the same when there is no row (no finite capacity, or no block reference)."""
    from dataclasses import asdict, fields

    import pandas as pd

    from quillcache.hitrate import simulate
    from quillcache.hitrate.anatomy import AnatomyCell, anatomy

    a, b = pair
    records = []
    for cap in caps:
        if cap is None:  # unlimited: every policy keeps everything, nothing to tell apart
            continue
        ha = simulate(arrs, a, cap, **options.get(a, {})).hits_per_request
        hb = simulate(arrs, b, cap, **options.get(b, {})).hits_per_request
        for c in anatomy(arrs, ha, hb):
            records.append({"capacity_blocks": cap, "a": a, "b": b, **asdict(c), "net": c.a_only - c.b_only})
    columns = ["capacity_blocks", "a", "b", *(f.name for f in fields(AnatomyCell)), "net"]
    return pd.DataFrame.from_records(records, columns=columns)


def _print_anatomy(frame, pair: tuple[str, str], shares: dict[int, Share]) -> None:
    from rich.console import Console
    from rich.table import Table

    from quillcache.hitrate.anatomy import GAP_LABELS, USES_LABELS

    con = Console() if sys.stdout.isatty() else Console(width=160)
    caps = list(dict.fromkeys(frame["capacity_blocks"].tolist()))
    for col, labels, what in (("uses", USES_LABELS, "uses of the block in the trace"),
                              ("previous_use", GAP_LABELS, "requests since its previous use")):
        t = Table(title=f"anatomy: {pair[0]} vs {pair[1]}")
        t.add_column(what, no_wrap=True)
        for c in caps:
            t.add_column(_cap_label(c, shares), justify="right")
        for lb in labels:
            part = frame[frame[col] == lb]
            if not len(part) or not (part["a_only"].any() or part["b_only"].any()):
                continue
            t.add_row(lb, *(f"{int(part[part.capacity_blocks == c]['net'].sum()):+,}" for c in caps))
        con.print(t)
    con.print(f"cells: block references only {pair[0]} hits minus those only {pair[1]} hits, per capacity in blocks "
              f"(positive: {pair[0]} hits more there)", markup=False, highlight=False)


def with_bounds(df, arrs, block_tokens: int, flip_rates: Sequence[float] = ()):
    """``df`` (a ``sweep`` frame with lru and belady) plus one ``reuse_oracle``, one
    ``timing_oracle`` and one ``joint_label(f)`` row per flip rate ``f`` per capacity, their gap
    closed computed the same way (unlimited runs as the number of distinct blocks); ``sigma`` is in
    the timing and joint rows' ``sigma`` column (``flip_rate`` in the joint rows'), and both are left
    out when the trace gives no turn to measure it on. Each bound first runs once on a
    two-request trace, so its ``refs_per_s`` times the replay and never Numba's JIT or cache load
    (as the sweep's rows do). Returns (frame, note)."""
    import time

    import pandas as pd

    from quillcache.hitrate.arrays import arrays_from_lists
    from quillcache.hitrate.bounds import joint_oracle, reuse_oracle, timing_oracle
    from quillcache.hitrate.sweep import with_gap_closed
    from quillcache.hitrate.turns import robust_sigma, turn_gap_log_ratios

    ratios = turn_gap_log_ratios(arrs, block_tokens)
    sigma = robust_sigma(ratios)
    bounds = {"reuse_oracle": (lambda a, cap: reuse_oracle(a, cap), None, None)}
    if len(ratios) and sigma == sigma:
        sigma = round(sigma, 2)
        bounds["timing_oracle"] = (lambda a, cap: timing_oracle(a, cap, sigma), sigma, None)
        for rate in flip_rates:
            bounds[joint_label(rate)] = (lambda a, cap, _r=rate: joint_oracle(a, cap, sigma, _r), sigma, rate)
        note = (f"timing_oracle: sigma = {sigma:.2f}, the robust spread of log(next gap / previous gap) over "
                f"{len(ratios):,} turns of this trace"
                + ("; joint_oracle@F: the same error, and wrong about which blocks return for a share F of the "
                   "requests" if flip_rates else ""))
    else:
        note = ("timing_oracle" + (" and joint_oracle" if flip_rates else "")
                + ": left out, no request here has a previous turn that comes back to measure sigma on")
    tiny = arrays_from_lists([[1, 2], [1, 3]])
    records = []
    for name, (run_bound, sig, rate) in bounds.items():
        run_bound(tiny, 2)  # compile (or load from Numba's cache) here, so refs_per_s times the replay only
        for cap in dict.fromkeys(df["capacity_blocks"].tolist()):
            t0 = time.perf_counter()
            hits = int(run_bound(arrs, max(1, arrs.num_unique if pd.isna(cap) else int(cap))).sum())
            secs = time.perf_counter() - t0
            records.append({"policy": name, "capacity_blocks": cap,
                            "hit_rate": hits / arrs.num_refs if arrs.num_refs else 0.0, "hit_blocks": hits,
                            "total_blocks": arrs.num_refs,
                            "refs_per_s": arrs.num_refs / secs if secs > 0 else float("inf"),
                            "sigma": float("nan") if sig is None else sig,
                            "flip_rate": float("nan") if rate is None else rate})
    extra = pd.DataFrame.from_records(records)
    extra["capacity_blocks"] = extra["capacity_blocks"].astype("Int64")
    return with_gap_closed(pd.concat([df.drop(columns="gap_closed"), extra], ignore_index=True)), note


def _tidy_rows(df, trace: str, block_tokens: int, lines_skipped: int = 0, prefix_chained: bool = True) -> list:
    """Summary rows of ``df``: ``hit_rate``/``gap_closed``, or ``semi_online_hit_rate``/
    ``semi_online_gap_closed`` for a ``semi_online`` row (the hit-rate study's names; its window in
    ``window_requests``); on a trace that is not prefix-chained every row has ``prefix_chained = false``
    and each offline row's notes say it is a heuristic there."""
    import pandas as pd

    from quillcache.results import SummaryRow

    # first: the malformed lines --on-error skip left out of every figure below (a row only when there are)
    rows = [SummaryRow(metric="lines_skipped", subject="trace", value=float(lines_skipped), unit="count",
                       params={"trace": trace, "block_tokens": block_tokens})] if lines_skipped else []
    for r in df.itertuples(index=False):
        cap = None if pd.isna(r.capacity_blocks) else int(r.capacity_blocks)
        params = {"trace": trace, "block_tokens": block_tokens, **({} if cap is None else {"capacity_blocks": cap})}
        share = getattr(r, "capacity_share", float("nan"))
        if share == share:  # the capacity was given as a share of the distinct blocks
            params["cap_fraction"] = float(share)
        sigma = getattr(r, "sigma", float("nan"))
        if sigma == sigma:  # the timing (and joint) oracle's error
            params["sigma"] = float(sigma)
        flip = getattr(r, "flip_rate", float("nan"))
        if flip == flip:  # the joint oracle's share of requests wrong about which blocks return
            params["flip_rate"] = float(flip)
        window = getattr(r, "window_requests", pd.NA)
        if not pd.isna(window):  # a semi-online policy's window of queued requests
            params["window_requests"] = int(window)
        if not prefix_chained:
            params["prefix_chained"] = False
        cls = getattr(r, "policy_class", "online")
        prefix = "semi_online_" if cls == "semi_online" else ""
        notes = NOT_A_BOUND if cls == "offline" and not prefix_chained else ""
        rows.append(SummaryRow(metric=f"{prefix}hit_rate", subject=r.policy, value=float(r.hit_rate), unit="fraction",
                               notes=notes, params=params))
        if not pd.isna(r.gap_closed):
            rows.append(SummaryRow(metric=f"{prefix}gap_closed", subject=r.policy, value=float(r.gap_closed),
                                   unit="fraction of the LRU-to-Belady gap", params=params))
    return rows


RESULT_FILES = ("hitrate.csv", "summary.csv", "meta.json", "anchors.csv", "hitrate.parquet", "anatomy.csv")


def write_results(out: Path, df, trace: str, block_tokens: int, anatomy=None, lines_skipped: int = 0,
                  prefix_chained: bool = True) -> list[Path]:
    """Write the run's files under ``out`` as one set (``quillcache.cli.resultset``: staged in a
    temporary folder inside ``out``, renamed into place with Ctrl-C and the stop signals held off
    until all are, a file of ``RESULT_FILES`` this run does not produce removed) and return their
    paths (meta.json aside). An exception before the renames (OSError, Ctrl-C) leaves ``out`` as it
    was, folders made for this run removed again; a signal during the renames raises
    ``ResultsWritten`` once they are done. No other file in ``out`` is touched. ``prefix_chained``:
    whether Belady bounds the rows (``_tidy_rows``)."""
    from quillcache.results import write_summary

    def stage_files(stage: Path) -> dict[str, Path]:
        staged = {"hitrate.csv": stage / "hitrate.csv"}
        df.to_csv(staged["hitrate.csv"], index=False)
        summary = write_summary(out.resolve().name, _tidy_rows(df, trace, block_tokens, lines_skipped,
                                                               prefix_chained), stage, profile="custom")
        staged["summary.csv"], staged["meta.json"] = summary, summary.parent / "meta.json"
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            pass
        else:
            staged["hitrate.parquet"] = stage / "hitrate.parquet"
            df.to_parquet(staged["hitrate.parquet"], index=False)
        if anatomy is not None:
            staged["anatomy.csv"] = stage / "anatomy.csv"
            anatomy.to_csv(staged["anatomy.csv"], index=False)
        return staged

    written = write_result_set(out, RESULT_FILES, stage_files, prefix=".hitrate-")
    return [written[name] for name in ("hitrate.csv", "summary.csv", "hitrate.parquet", "anatomy.csv")
            if name in written]


LABELS = {"belady": " (offline bound)", "reuse_oracle": " (offline: which blocks return, not when)",
          "timing_oracle": " (offline: which, and roughly when)"}
NOT_A_BOUND = "heuristic: trace not prefix-chained, no bound"


def policy_class(pol: str) -> str:
    """``online``, ``semi_online`` (``quillcache.hitrate.SEMI_ONLINE``: sees the queued requests) or
    ``offline`` (Belady and every bound row: sees the whole future)."""
    from quillcache.hitrate import HITRATE_KERNELS, SEMI_ONLINE

    if pol in SEMI_ONLINE:
        return "semi_online"
    return "online" if pol in HITRATE_KERNELS and pol != "belady" else "offline"


def _label(pol: str, semi_online, prefix_chained: bool = True) -> str:
    if pol.startswith("joint_oracle@"):
        label = f" (offline: roughly when; which, wrong for {pol.split('@', 1)[1]} of requests)"
    else:
        label = LABELS.get(pol, " (semi-online)" if pol in semi_online else "")
    if prefix_chained or policy_class(pol) != "offline":
        return label
    return f" ({NOT_A_BOUND})" if pol == "belady" else f"{label[:-1]}; {NOT_A_BOUND})"


def _print_table(df, title: str, paths: list[Path], note: str, shares: dict[int, Share],
                 prefix_chained: bool = True) -> None:
    import pandas as pd
    from rich.console import Console
    from rich.table import Table

    from quillcache.hitrate import SEMI_ONLINE

    con = Console() if sys.stdout.isatty() else Console(width=160)  # a file or pipe: no wrapping at 80
    caps = list(dict.fromkeys(df["capacity_blocks"].tolist()))
    t = Table(title=title)
    t.add_column("policy", no_wrap=True)
    for c in caps:
        t.add_column(_cap_label(c, shares), justify="right")
    for pol, part in df.groupby("policy", sort=False):
        cells = []
        for c in caps:
            r = part[part["capacity_blocks"].isna()] if pd.isna(c) else part[part["capacity_blocks"] == c]
            hr, g = float(r["hit_rate"].iloc[0]), r["gap_closed"].iloc[0]
            cells.append(f"{hr:.4f}" + ("" if pd.isna(g) or pol in ("lru", "belady") else f" {g * 100:+.1f}%"))
        t.add_row(pol + _label(pol, SEMI_ONLINE, prefix_chained), *cells)
    con.print(t)
    con.print(("cells: block hit rate, then the share of the LRU-to-Belady gap closed at that capacity"
               if prefix_chained else "cells: block hit rate (no gap closed: the trace is not prefix-chained, so "
                                      "Belady bounds nothing)")
              + (" (columns: blocks, or share of the distinct blocks = blocks)" if shares else ""), markup=False)
    if note:
        con.print(note, markup=False, highlight=False)
    con.print("results: " + ", ".join(str(p) for p in paths), markup=False, highlight=False)


def _classify(df, prefix_chained: bool) -> None:
    """Add ``policy_class`` and ``label`` (the table's note, without parentheses) to every row, and
    ``window_requests`` (the kernel's default window) when a semi-online policy ran; on a trace that is
    not prefix-chained, ``gap_closed`` becomes NA in every row (Belady bounds nothing there)."""
    import pandas as pd

    from quillcache.hitrate import HITRATE_KERNELS, SEMI_ONLINE

    df["policy_class"] = [policy_class(p) for p in df["policy"]]
    df["label"] = [_label(p, SEMI_ONLINE, prefix_chained).strip()[1:-1] for p in df["policy"]]
    if df["policy_class"].eq("semi_online").any():
        df["window_requests"] = pd.array([HITRATE_KERNELS[p].options.get("window_requests", pd.NA) if c == "semi_online"
                                          else pd.NA for p, c in zip(df["policy"], df["policy_class"])], dtype="Int64")
    if not prefix_chained:
        df["gap_closed"] = pd.Series(pd.NA, index=df.index, dtype="Float64")


def _is_na(x) -> bool:
    import pandas as pd

    return x is None or bool(pd.isna(x))


def run(args: argparse.Namespace) -> int:
    from quillcache._checks import check_int
    from quillcache.cli.replay import _check_out, out_text_problem, request_lines
    from quillcache.cli.signals import describe, exit_status
    from quillcache.traces.loader import TraceError, load_trace_report

    try:
        problem = out_text_problem(args.out, f"{DEFAULT_OUT}/<trace stem>/")
        if problem:
            raise ValueError(problem)
        if args.limit is not None:
            check_int("--limit", args.limit, 1)
        cap_specs = parse_capacities(args.capacities)
        policies = _policies(args.policies)
        pair = parse_anatomy(args.anatomy)
        if args.bound_flip_rates is not None and not args.bounds:
            raise ValueError("--bound-flip-rates needs --bounds (it sets the joint-oracle rows that --bounds adds)")
        flip_rates = parse_flip_rates(DEFAULT_BOUND_FLIP_RATES if args.bound_flip_rates is None
                                      else args.bound_flip_rates)
    except ValueError as exc:
        return _fail(str(exc))
    trace = Path(args.trace)
    out = Path(args.out) if args.out else DEFAULT_OUT / trace.stem
    problem = _check_out(out, RESULT_FILES)
    if problem:
        return _fail(problem)
    try:
        requests, report = load_trace_report(trace, limit=args.limit, on_error=args.on_error)
    except TraceError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP while reading the trace
        print(f"quillcache hitrate: {describe(exc)} while reading {trace}; no results were written under {out}",
              file=sys.stderr)
        return exit_status(exc)
    if not requests:
        return _fail(f"{trace}: no requests to replay" + (f" ({report.num_skipped:,} malformed line(s) skipped, "
                                                          f"--on-error skip)" if report.skipped else ""))
    sizes = {q.block_tokens for q in requests}
    if len(sizes) > 1:
        return _fail(f"{trace}: lines use different block sizes {sorted(sizes)}; one trace needs one block size")
    block_tokens = sizes.pop()
    from quillcache.hitrate import HITRATE_KERNELS
    from quillcache.hitrate.arrays import arrays_from_requests, unchained_message
    from quillcache.hitrate.sweep import sweep

    arrs = arrays_from_requests(requests, block_tokens=block_tokens)
    if not arrs.num_refs:  # a hit rate of 0 / 0: refused, as replay refuses a trace it replays nothing of
        return _fail(f"{trace}: no block reference to replay (none of its {arrs.num_requests:,} request(s) has hash "
                     f"ids); nothing was written")
    chained = bool(arrs.prefix_chained)
    unchained = ""  # FILE:LINE: the first break, named by its lines
    if not chained:
        brk = arrs.chain_break
        unchained = unchained_message(trace, brk, request_lines(trace, report, max(brk.request, brk.first_request)))
    if not chained and not args.allow_unchained:
        return _fail(f"{unchained}; Belady is then no upper bound "
                     f"(it assumes a block's parent is referenced before it in every request, so it can keep a block "
                     f"whose prefix it dropped and other policies can beat it), nor is the gap closed meaningful; "
                     f"--allow-unchained runs it anyway, Belady as a heuristic and no gap closed")
    caps, shares = resolve_capacities(cap_specs, arrs.num_unique)
    options = {p: {"block_tokens": block_tokens} for p in {*policies, *(pair or ())}
               if "block_tokens" in HITRATE_KERNELS[p].options}
    show = not args.quiet and sys.stdout.isatty()
    if not args.quiet:
        print(f"quillcache hitrate: {len(requests):,} requests, {arrs.num_refs:,} block references from {trace.name}",
              file=sys.stderr, flush=True)
    try:
        if show:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.fields[cell]}"), TimeElapsedColumn(), transient=True) as bar:
                task = bar.add_task(f"replaying {trace.name}", total=len(policies) * len(caps), cell="")
                df = sweep(arrs, policies, caps, options=options,
                           progress=lambda p, c: bar.update(task, advance=1, cell=f"{p} @ {c or 'inf'}"))
        else:
            df = sweep(arrs, policies, caps, options=options)
        bounds_note = ""
        if args.bounds:
            df, bounds_note = with_bounds(df, arrs, block_tokens, flip_rates)
        anat = anatomy_frame(arrs, pair, caps, options) if pair else None
        df["capacity_share"] = [shares[int(c)].fraction if not _is_na(c) and int(c) in shares else float("nan")
                                for c in df["capacity_blocks"]]
        _classify(df, chained)
    except KeyboardInterrupt as exc:
        print(f"quillcache hitrate: {describe(exc)}; no results were written under {out}", file=sys.stderr)
        return exit_status(exc)
    paths, status = write_reported("hitrate", out, lambda: write_results(out, df, trace.stem, block_tokens, anat,
                                                                         report.num_skipped, chained))
    if status is not None:
        return status
    if not chained:  # stderr, --quiet or not: Belady is no bound in these files
        print(f"quillcache hitrate: --allow-unchained: belady is a heuristic and gap_closed is NA in every row; "
              f"{unchained}", file=sys.stderr)
    if report.skipped:  # stderr, --quiet or not: a result set missing part of its trace says so
        print(f"quillcache hitrate: {report.num_skipped:,} malformed trace line(s) skipped (--on-error skip; "
              f"the lines_skipped row of summary.csv)", file=sys.stderr)
    if not args.quiet:
        note = "\n".join(x for x in (report.summary() if report.skipped else "", bounds_note) if x)
        _print_table(df, f"quillcache hitrate: {trace.name}, {arrs.num_requests:,} requests, {arrs.num_refs:,} "
                         f"block references ({arrs.num_unique:,} distinct), {block_tokens}-token blocks", paths, note,
                     shares, chained)
        if anat is not None and len(anat):
            _print_anatomy(anat, pair, shares)
        elif anat is not None:
            print(f"anatomy: no finite capacity among {args.capacities!r}: nothing to compare (anatomy.csv holds "
                  f"only its header row)", flush=True)
    return 0
