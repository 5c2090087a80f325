"""``quillcache replay TRACE``: the command-line front of :func:`quillcache.harness.replay`.

Longer than 600 lines because one command's whole contract lives here: its flags and their checks, the trace's
refusals named by file and line, the ``--cluster`` pool's lifetime, signals, and the result set's writing; each
part is small and they share the parsed arguments.

Bad input (a missing or malformed trace, non-monotonic timestamps, an unknown policy, router,
model or GPU, a capacity <= 0, a DRAM capacity above ``MAX_DRAM_BLOCKS`` blocks, any other count
or size above ``MAX_COUNT``, an empty ``--out``) prints ONE line ``quillcache replay: error: ...`` on stderr and
exits with status 2; nothing is written. ``--out`` is checked to be writable before any work, the trace
before the replay starts (``check_replayable``; a ``--cluster`` pool is not started for it): hash ids that
are not prefix-chained (the rule and words ``hitrate`` refuses by) and a request no engine could serve (its
prompt's or its output's KV larger than an engine's GPU, or its decode past ``MAX_SIMULATED_S``) are named
``FILE:LINE: ...``, the line the request came from.
Results go under ``--out`` (default ``results/replay/<trace stem>/``): ``requests.csv`` (one row
per request), ``replay.csv`` (the summary, one wide row), ``summary.csv`` + ``meta.json`` (the
project's results schema: ``quillcache.results.read_summary`` reads it) and ``.parquet`` twins
when pyarrow is importable (``pool.csv`` too with ``--cluster``). A run replaces that set as a
whole (``write_results``, ``quillcache.cli.resultset``): staged in a temporary folder inside
``--out``, renamed into place, a file of the set this run does not produce (an earlier ``--cluster``
run's ``pool.csv``) removed; a failed write leaves the previous set as it was. Ctrl-C stops with
exit status 130 and writes nothing (one during the renames takes effect once this run's set is in
place); SIGTERM and SIGHUP do the same with exit status 128 + the signal, and with ``--cluster``
every node and master process is stopped and the pool's temporary folder removed first.
With ``--on-error skip``, what was not replayed (``SKIP_COLUMNS``: malformed lines, requests larger than
an engine's GPU KV, requests with an empty prompt) is a column of ``replay.csv``, a row of ``summary.csv``
and one line on stderr, ``--quiet`` or not; a run that replays no request at all is an error (exit 2,
nothing written).
"""

from __future__ import annotations

import argparse
import csv
import errno
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from quillcache.cli.argtypes import MAX_COUNT
from quillcache.cli.resultset import write_reported, write_result_set

__all__ = ["MAX_DRAM_BLOCKS", "RESULT_FILES", "SKIP_COLUMNS", "configure", "run", "write_results"]

# --capacity-blocks, per node: far above any trace's distinct blocks, and small enough that setting up
# the DRAM tier (linear in its bytes, also when it only accounts) stays quick; the other capacities
# (the SSD and GPU tiers cost nothing per block, a byte budget is split in 16 TiB segments) stop at
# MAX_COUNT, the int64-safe bound every count flag has
MAX_DRAM_BLOCKS = 2**32
DEFAULT_OUT = Path("results") / "replay"
# every file a replay writes under --out (a run replaces them as one set; write_results)
RESULT_FILES = ("requests.csv", "replay.csv", "pool.csv", "summary.csv", "meta.json", "anchors.csv",
                "requests.parquet", "replay.parquet")
# what a run did not replay, written as columns of replay.csv and rows of summary.csv (0 when nothing was)
SKIP_COLUMNS = ("lines_skipped", "requests_skipped_oversize", "requests_skipped_empty")

EPILOG = """\
examples:
  # replay the Mooncake conversation trace with every default (4 Llama-3-8B engines on H100,
  # Dynamo cost router, LRU tiers); results land in results/replay/conversation_trace/
  quillcache replay ../shared/traces/conversation_trace.jsonl

  # the first 2,000 requests, round-robin routing, QuillHD eviction, 2,000 DRAM blocks per node
  quillcache replay trace.jsonl --limit 2000 --router round_robin --policy quillhd --capacity-blocks 2000

  # int8 KV in the DRAM and SSD tiers (the GPU keeps 16-bit KV) at the same tier BYTES as fp16:
  # the byte budget is --capacity-blocks 16-bit blocks, which now hold ~1.9x as many int8 blocks
  quillcache replay trace.jsonl --kv-codec int8 --capacity-blocks 512 --ssd-capacity-blocks 1024

  # the same replay over a real pool: a master and 3 `quillcache node` processes on loopback; every
  # offload and peer DRAM/SSD fetch moves --block-bytes of real bytes through PooledStore (verified)
  quillcache replay ../shared/traces/conversation_trace.jsonl --cluster 3 --limit 2000

  # skip malformed lines instead of stopping, write elsewhere, no progress bar
  quillcache replay trace.jsonl --on-error skip --out /tmp/replay --quiet

  # read the results in Python
  python -c "import pandas as pd; print(pd.read_csv('results/replay/conversation_trace/replay.csv').T)"

what it measures: block and token hit rates by tier (GPU of the chosen engine, its DRAM, its SSD,
a peer node), TTFT p50/p99, goodput under the TTFT SLO, bytes moved per tier, queueing. Engine
compute is an engine MODEL (cited FLOP/bandwidth figures), everything else is the real router,
planner, identity guard, residency index and store tiers. With --account-bytes (the default for
traces whose blocks do not fit in RAM) the DRAM/SSD tiers allocate offsets without payloads.
--kv-codec quantizes every block leaving a GPU for DRAM/SSD (quillcache.kvquant); tier capacity is a
byte budget (--dram-capacity-bytes / --ssd-capacity-bytes, else the --capacity-blocks /
--ssd-capacity-blocks of 16-bit blocks), bytes moved are the quantized bytes, and the engine model
charges a dequantize per block fetched from a host tier (an assumed 70% of HBM bandwidth).
--cluster N starts a master and N node processes (127.0.0.1) and mirrors the replay's host tiers into
that pool: each offloaded block is one pool object of --block-bytes deterministic pseudo-random bytes
(the model's KV block scaled down so the trace fits this machine), each peer DRAM/SSD fetch reads it
back over the transfer engine and compares it byte for byte. The replay's decisions and summary are
the same as without --cluster; the table adds the bytes moved, the measured time and the engine
model's prediction for the same bytes, and misses/corrupt (0 unless the pool lost data).
"""


def configure(p: argparse.ArgumentParser) -> None:
    from quillcache.harness.config import REPLAY_POLICIES, ReplayConfig
    from quillcache.planner.profiles import GPUS, MODELS
    from quillcache.routing import ROUTERS
    from quillcache.store.tier_codec import TIER_CODECS

    d = ReplayConfig()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("trace", help="a JSON-Lines trace (Mooncake format or the project's generated schemas)")
    p.add_argument("--policy", default=d.policy, help=f"eviction policy of every tier: {', '.join(REPLAY_POLICIES)} "
                                                      f"(default {d.policy})")
    p.add_argument("--capacity-blocks", type=int, default=None,
                   help=f"DRAM capacity per node, in blocks (default {d.dram_capacity_blocks}; not with "
                        f"--dram-capacity-bytes)")
    p.add_argument("--ssd-capacity-blocks", type=int, default=None,
                   help=f"SSD capacity per node, in blocks; 0 = no SSD tier (default {d.ssd_capacity_blocks}; not "
                        f"with --ssd-capacity-bytes)")
    p.add_argument("--dram-capacity-bytes", type=int, default=None,
                   help="DRAM byte budget per node (default: --capacity-blocks 16-bit blocks; not with "
                        "--capacity-blocks)")
    p.add_argument("--ssd-capacity-bytes", type=int, default=None,
                   help="SSD byte budget per node; 0 = no SSD tier (default: --ssd-capacity-blocks 16-bit blocks; "
                        "not with --ssd-capacity-blocks)")
    p.add_argument("--kv-codec", default=d.kv_codec,
                   help=f"codec of the DRAM and SSD tiers: {', '.join(TIER_CODECS)} (default {d.kv_codec}: none)")
    p.add_argument("--gpu-capacity-blocks", type=int, default=None,
                   help="GPU KV capacity per engine, in blocks (default: from the engine model)")
    p.add_argument("--router", default=d.router, help=f"router: {', '.join(sorted(ROUTERS))} (default {d.router})")
    p.add_argument("--engines", type=int, default=d.engines, help=f"engines (nodes) (default {d.engines})")
    p.add_argument("--out", default=None, help=f"results directory (default {DEFAULT_OUT}/<trace stem>/)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="a malformed trace line, or a request larger than an engine's GPU KV capacity: stop "
                        "naming it (default) or skip it (counted on stderr, also with --quiet, and in replay.csv "
                        "and summary.csv; replaying no request at all is an error)")
    p.add_argument("--slo-ttft-s", type=float, default=d.ttft_slo_s,
                   help=f"TTFT SLO in seconds for goodput (default {d.ttft_slo_s})")
    p.add_argument("--model", default=d.model, help=f"model profile: {', '.join(sorted(MODELS))} (default {d.model})")
    p.add_argument("--gpu", default=d.gpu, help=f"GPU profile: {', '.join(sorted(GPUS))} (default {d.gpu})")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="divide arrival times by this (2 = twice the request rate) (default 1)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--account-bytes", dest="account_bytes", action="store_const", const=True, default=None,
                   help="DRAM/SSD tiers account offsets without payloads (default: when the blocks do not fit in RAM)")
    g.add_argument("--real-bytes", dest="account_bytes", action="store_const", const=False,
                   help="DRAM/SSD tiers hold real bytes (SSD in a temporary directory)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of every random choice (default {d.seed})")
    from quillcache.harness.cluster_pool import DEFAULT_BLOCK_BYTES, MAX_BLOCK_BYTES, MAX_CLUSTER_NODES

    p.add_argument("--cluster", type=int, default=None, metavar="N",
                   help=f"move the offloaded and peer-fetched blocks' bytes through a real pool of N node "
                        f"processes (1..{MAX_CLUSTER_NODES}; default: accounting only)")
    p.add_argument("--block-bytes", type=int, default=None, metavar="B",
                   help=f"with --cluster: bytes of one block in the pool (1..{MAX_BLOCK_BYTES}; default "
                        f"{DEFAULT_BLOCK_BYTES} = a 64 MiB Llama-3-8B block scaled 1/4096, so --limit 2000 needs "
                        f"about 1 GiB of node DRAM)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table (the files are still written)")


def _run(requests, cfg, args, progress=None):
    """The replay, over a ``LocalCluster`` when ``--cluster`` is given (stopped before returning)."""
    from quillcache.harness.replay import replay

    if args.cluster is None:
        return replay(requests, cfg, progress=progress)
    from quillcache.harness.cluster_pool import DEFAULT_BLOCK_BYTES, cluster_replay

    def started(plan, cluster) -> None:
        if not args.quiet:
            print(f"quillcache replay: pool of {plan.nodes} node processes ({plan.dram_bytes_per_node >> 20} MiB DRAM "
                  f"each) at master {cluster.master_address}, {plan.block_bytes:,} bytes per block",
                  file=sys.stderr, flush=True)

    block = args.block_bytes if args.block_bytes is not None else DEFAULT_BLOCK_BYTES
    result, _plan = cluster_replay(requests, cfg, nodes=args.cluster, block_bytes=block, progress=progress,
                                   on_start=started)
    return result


def _fail(msg: str) -> int:
    print(f"quillcache replay: error: {msg}", file=sys.stderr)
    return 2


def _write_csv(path: Path, rows: list[dict[str, object]], columns: list[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def _skips(result, lines_skipped: int) -> dict[str, int]:
    """``SKIP_COLUMNS``: the malformed lines the loader skipped and the requests the replay did not run."""
    return dict(zip(SKIP_COLUMNS, (lines_skipped, result.skipped_oversize, result.skipped_empty), strict=True))


def _skip_line(skips: dict[str, int]) -> str:
    """The one line saying what ``--on-error skip`` (or an empty prompt) left out, or "" when nothing was."""
    said = [f"{n:,} {what}" for n, what in zip(skips.values(), (
        "malformed trace line(s) skipped (--on-error skip)",
        "request(s) larger than an engine's GPU KV capacity skipped (--on-error skip)",
        "request(s) with an empty prompt not replayed"), strict=True) if n]
    return "; ".join(said)


def write_results(out: Path, result, lines_skipped: int = 0) -> list[Path]:
    """``requests.csv`` (one row per request), ``replay.csv`` (the summary as one wide row, then the
    ``SKIP_COLUMNS``; ``lines_skipped`` is the loader's count of malformed lines),
    ``pool.csv`` (with ``--cluster``) and ``summary.csv`` + ``meta.json`` in the project's results
    schema, so ``quillcache.results.read_summary`` reads it (+ Parquet twins when pyarrow imports),
    written as one set (``quillcache.cli.resultset``: staged, renamed into place with Ctrl-C and the
    stop signals held off until all are, a file of ``RESULT_FILES`` this run does not produce
    removed); returns the paths (meta.json aside)."""
    from quillcache.harness.metrics import RequestRow
    from quillcache.results import write_summary

    req_rows = [r.as_dict() for r in result.rows]
    summ = {**result.summary.as_dict(), **_skips(result, lines_skipped)}

    def stage_files(stage: Path) -> dict[str, Path]:
        staged = {"requests.csv": stage / "requests.csv", "replay.csv": stage / "replay.csv"}
        _write_csv(staged["requests.csv"], req_rows, RequestRow.columns())
        _write_csv(staged["replay.csv"], [summ], list(summ))
        if result.pool is not None and result.pool.real_bytes:
            pool = result.pool.as_dict()
            staged["pool.csv"] = stage / "pool.csv"
            _write_csv(staged["pool.csv"], [pool], list(pool))
        summary = write_summary(out.resolve().name, _tidy_rows(result, summ), stage, profile="custom")
        staged["summary.csv"], staged["meta.json"] = summary, summary.parent / "meta.json"
        try:
            import pandas as pd
            import pyarrow  # noqa: F401
        except ImportError:
            return staged
        for name, rows, cols in (("requests", req_rows, RequestRow.columns()), ("replay", [summ], list(summ))):
            staged[f"{name}.parquet"] = stage / f"{name}.parquet"
            pd.DataFrame(rows, columns=cols).to_parquet(staged[f"{name}.parquet"], index=False)
        return staged

    written = write_result_set(out, RESULT_FILES, stage_files, prefix=".replay-")
    return [path for name, path in written.items() if name != "meta.json"]


def _print_summary(result, paths: list[Path], load_note: str) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result.summary
    con = Console()
    t = Table(title=f"quillcache replay: {s.requests} requests, {s.engines} engines, router {s.router}, "
                    f"policy {s.policy}, KV codec {s.kv_codec}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    mib = 1 << 20

    def add(name: str, value: str) -> None:
        t.add_row(name, value)

    add("block hit rate (all tiers)", f"{s.block_hit_rate:.3f}")
    for tier in ("gpu", "dram", "ssd", "peer"):
        add(f"  from {tier.upper()}", f"{getattr(s, f'block_hit_rate_{tier}'):.3f}")
    add("token hit rate", f"{s.token_hit_rate:.3f}")
    add("TTFT p50 / p99 (s)", f"{s.ttft_p50_s:.3f} / {s.ttft_p99_s:.3f}")
    add("TTFT p90 (s)", f"{s.ttft_p90_s:.3f}")
    add(f"SLO attainment (TTFT <= {s.slo_ttft_s:g} s)", f"{s.slo_attainment:.3f}")
    add("goodput (req/s, tokens/s)", f"{s.goodput_rps:.3f}, {s.goodput_tokens_per_s:,.0f}")
    add("queue mean / p99 (s)", f"{s.queue_mean_s:.3f} / {s.queue_p99_s:.3f}")
    add("fetched DRAM / SSD / peer (MiB)",
        f"{s.bytes_fetched_dram / mib:,.0f} / {s.bytes_fetched_ssd / mib:,.0f} / {s.bytes_fetched_peer / mib:,.0f}")
    add("offloaded GPU->DRAM, DRAM->SSD (MiB)", f"{s.bytes_offloaded_gpu_to_dram / mib:,.0f}, {s.bytes_dram_to_ssd / mib:,.0f}")
    add("capacity GPU / DRAM / SSD (blocks)", f"{s.gpu_capacity_blocks} / {s.dram_capacity_blocks} / {s.ssd_capacity_blocks}")
    add("DRAM / SSD budget per node (MiB)", f"{s.dram_capacity_bytes / mib:,.0f} / {s.ssd_capacity_bytes / mib:,.0f}")
    codec = "none (16-bit)" if s.kv_codec == "fp16" else s.kv_codec
    add("KV codec of DRAM/SSD, bytes per block", f"{codec}, {s.tier_block_bytes:,}")
    add("block size (tokens), model, GPU", f"{s.block_tokens}, {s.model}, {s.gpu}")
    add("bytes", "accounted (no payloads)" if s.account_bytes else "real")
    add("simulated time / wall time (s)", f"{s.duration_s:,.1f} / {s.wall_s:,.1f}")
    pr = result.pool
    if pr is not None and pr.real_bytes:
        add(f"pool: {pr.nodes} node processes, bytes per block", f"{pr.block_bytes:,}")
        add("pool: blocks offloaded / dropped / fetched", f"{pr.blocks_offloaded:,} / {pr.blocks_dropped:,} / "
                                                          f"{pr.blocks_fetched:,}")
        add("pool: bytes written / read (MiB)", f"{pr.bytes_written / mib:,.1f} / {pr.bytes_read / mib:,.1f}")
        add("pool: measured offload / fetch (s)", f"{pr.measured_offload_s:.3f} / {pr.measured_fetch_s:.3f}")
        add("pool: of which transfer engine (s)", f"{pr.measured_transfer_s:.3f}")
        add("pool: engine model for the same bytes (s)", f"{pr.predicted_offload_s:.6f} / {pr.predicted_fetch_s:.6f}")
        add("pool: misses / fallbacks / corrupt", f"{pr.misses} / {pr.fallbacks} / {pr.corrupt}")
        add("pool: puts refused / removes refused", f"{pr.offload_failures} / {pr.drop_failures}")
    con.print(t)
    if load_note:
        con.print(load_note, markup=False, highlight=False)
    if result.skipped_empty:
        con.print(f"{result.skipped_empty} request(s) with an empty prompt were not replayed")
    con.print("results: " + ", ".join(str(p) for p in paths), markup=False, highlight=False)


# ReplayConfig field -> the flag a user typed, so config errors name the flag
FLAGS = {"dram_capacity_blocks": "--capacity-blocks", "ssd_capacity_blocks": "--ssd-capacity-blocks",
         "gpu_capacity_blocks": "--gpu-capacity-blocks", "engines": "--engines", "limit": "--limit",
         "ttft_slo_s": "--slo-ttft-s", "time_scale": "--time-scale", "seed": "--seed", "model": "--model",
         "gpu": "--gpu", "router": "--router", "policy": "--policy", "kv_codec": "--kv-codec",
         "dram_capacity_bytes": "--dram-capacity-bytes", "ssd_capacity_bytes": "--ssd-capacity-bytes"}


# ReplayConfig's "unknown NAME" messages -> the flag that gave the name
UNKNOWN_NAME_FLAGS = {"unknown model ": "--model", "unknown GPU ": "--gpu", "unknown router ": "--router",
                      "unknown policy ": "--policy"}


# the replay's messages about a value a flag gave, by how they start -> that flag
MESSAGE_FLAGS = {**UNKNOWN_NAME_FLAGS, "a DRAM capacity of ": "--dram-capacity-bytes",
                 "a SSD capacity of ": "--ssd-capacity-bytes"}


def _flagged(msg: str) -> str:
    """A ReplayConfig (or replay) message with its field names (``ttft_slo_s=...``, ``on_oversize='skip'``)
    replaced by the flags, and a message about one flag's value led by that flag (``--router: unknown router
    'x'; ...``, ``--dram-capacity-bytes: a DRAM capacity of 1 bytes holds no block ...``)."""
    for field, flag in FLAGS.items():
        msg = msg.replace(f"{field}=", f"{flag}=")
    msg = msg.replace("on_oversize='skip' (--on-error skip)", "--on-error skip")
    flag = next((f for prefix, f in MESSAGE_FLAGS.items() if msg.startswith(prefix)), None)
    return f"{flag}: {msg}" if flag else msg


def out_text_problem(text: str | None, default: str) -> str | None:
    """Why ``--out text`` names no folder (empty or blank), or None; ``default`` is what leaving
    ``--out`` out writes to, said in the message."""
    if text is not None and not text.strip():
        return f"--out {text!r} names no folder: name a results folder, or leave --out out for {default}"
    return None


def _check_out(out: Path, names: Sequence[str] = ()) -> str | None:
    """Why results could not be written under ``out``, or None: checked before any work, leaving
    nothing behind (a temporary file in the deepest existing folder; the results folder itself is
    made only when there are results to write). Refused, in one line: a path the system cannot look
    at (too long, no permission), a file or a dangling or looping symbolic link where a folder goes, a
    folder to be made whose name is longer than the file system takes, a folder where one of ``names``
    (the result files) goes, and a deepest existing folder that takes no new file."""
    try:
        return _out_problem(out, names)
    except OSError as exc:  # the last resort: whatever the system refused, said in one line
        return f"--out {out}: {exc.strerror or exc}"


# room for write_result_set's staging folder name (".replay-" or ".hitrate-" and mkdtemp's 8 characters)
_STAGE_NAME_BYTES = 32


def _out_problem(out: Path, names: Sequence[str]) -> str | None:
    missing = []  # the folders write_result_set will make, innermost first
    probe = out
    while True:
        try:
            os.lstat(probe)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP) or probe.parent == probe:
                return f"--out {out}: {exc.strerror or exc}"
            missing.append(probe)  # ENOTDIR, ELOOP: a component above is the problem, found on the way up
            probe = probe.parent
            continue
        if probe.is_symlink() and not probe.exists():  # stat() fails: the target is missing or loops
            try:
                os.stat(probe)
                what = "a symbolic link that cannot be followed"
            except OSError as exc:
                what = ("a symbolic link that loops" if exc.errno == errno.ELOOP
                        else "a symbolic link to nothing" if exc.errno == errno.ENOENT
                        else f"a symbolic link that cannot be followed ({exc.strerror or exc})")
            return f"--out {out}: {probe} is {what}, not a folder"
        break
    if not probe.is_dir():
        return f"--out {out}: {probe} is a file, not a folder"
    try:
        name_max = os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for d in missing:
        if len(os.fsencode(d.name)) > name_max:
            return (f"--out {out}: the folder name {d.name[:40]}... is {len(os.fsencode(d.name))} bytes, longer "
                    f"than the {name_max} the file system in {probe} takes")
    try:
        path_max = os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError):
        path_max = 4096
    # the longest path a run writes: OUT/<stage folder, a prefix and 8 random characters>/<result file>
    longest = len(os.fsencode(str(out))) + 1 + _STAGE_NAME_BYTES + 1 + max(map(len, names), default=0)
    if longest >= path_max:
        return f"--out {out}: the path is too long for its result files (the system takes paths of {path_max} bytes)"
    if not missing:
        for name in names:
            if (out / name).is_dir() and not (out / name).is_symlink():
                return f"--out {out}: result file {name} is a folder, not a file (the files there are as they were)"
    try:  # what access() says is not enough (root, read-only mounts, /proc): try a file there
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:  # the folder exists: the error is about the file (e.g. /proc answers ENOENT)
        return f"--out {out}: a temporary file cannot be created in {probe} ({exc.strerror or exc})"
    return None


def _tidy_rows(result, summ: dict | None = None) -> list:
    """The replay's measured figures in the results schema (``quillcache.results``): one row per
    metric (``summ``: the summary row as written to replay.csv, skip counts included), the
    configuration as typed parameter columns."""
    from quillcache.results import SummaryRow

    s = result.summary.as_dict() if summ is None else summ
    params = {k: s[k] for k in ("engines", "router", "policy", "model", "gpu", "account_bytes", "block_tokens",
                                "gpu_capacity_blocks", "dram_capacity_blocks", "ssd_capacity_blocks", "requests",
                                "kv_codec", "tier_block_bytes", "dram_capacity_bytes", "ssd_capacity_bytes")}
    units = {"_s": "s", "_rps": "req/s", "_per_s": "tokens/s", "rate": "fraction", "attainment": "fraction"}
    rows = []
    for k, v in s.items():
        if k in params or isinstance(v, (str, bool)) or k == "slo_ttft_s":
            continue
        unit = next((u for suffix, u in units.items() if k.endswith(suffix) or suffix in k), "")
        unit = "count" if k in SKIP_COLUMNS else "bytes" if k.startswith("bytes_") else unit or "count"
        rows.append(SummaryRow(metric=k, subject=f"{s['router']}/{s['policy']}", value=float(v), unit=unit,
                               params={**params, "slo_ttft_s": float(s["slo_ttft_s"])}))
    if result.pool is not None and result.pool.real_bytes:  # --cluster: what the real pool moved
        for k, v in result.pool.as_dict().items():
            if isinstance(v, (str, bool)) or k in ("nodes", "block_bytes", "replicas"):
                continue
            unit = "s" if k.endswith("_s") else "bytes" if k.startswith("bytes_") else "count"
            rows.append(SummaryRow(metric=f"pool_{k}", subject=f"{s['router']}/{s['policy']}", value=float(v),
                                   unit=unit, params={**params, "slo_ttft_s": float(s["slo_ttft_s"])}))
    return rows


def _clock_problem(requests: list, time_scale: float) -> str | None:
    """Why the trace, scaled, is longer than microsecond-exact simulated time, or None (the replay
    checks the same; said here with the flag's name before any work)."""
    from quillcache.harness.replay import MAX_SIMULATED_S

    if not requests:
        return None
    span_ms = requests[-1].timestamp_ms - requests[0].timestamp_ms  # sorted: first and last arrival
    span_s = span_ms / (1000.0 * time_scale)
    if span_s <= MAX_SIMULATED_S:
        return None
    return (f"--time-scale={time_scale:g}: the trace's {span_ms} ms from first to last arrival become {span_s:.3g} s "
            f"of simulated time, past {MAX_SIMULATED_S:.3g} s where times lose microsecond precision; raise "
            f"--time-scale")


def request_lines(trace: Path, report, upto: int) -> list[int]:
    """The 1-based file line of each of the first ``upto + 1`` requests ``load_trace_report`` returned
    with ``report``: the file's lines in order, less the blank ones and those it skipped. Re-reads the
    file (only to name a line in a message about a request); shorter when the file changed meanwhile."""
    import contextlib

    from quillcache.traces.loader import trace_lines

    skipped = {s.line for s in report.skipped}
    found: list[int] = []
    with contextlib.closing(trace_lines(trace)) as lines:
        for lineno, raw in lines:
            if raw.strip() and lineno not in skipped:
                found.append(lineno)
                if len(found) > upto:
                    break
    return found


def trace_problem(trace: Path, report, exc: ValueError) -> str:
    """``exc`` said about the trace: a request no engine could serve or a break in the prefix chain as
    ``FILE:LINE: what`` (the line a request came from, not its index), anything else as it is."""
    from quillcache.harness.replay import UNCHAINED_WHY, RequestTooLargeError, UnchainedTraceError
    from quillcache.hitrate.arrays import unchained_message

    if isinstance(exc, UnchainedTraceError):
        brk = exc.chain_break
        lines = request_lines(trace, report, max(brk.request, brk.first_request))
        return f"{unchained_message(trace, brk, lines)}; {UNCHAINED_WHY}"
    if isinstance(exc, RequestTooLargeError) and exc.request is not None:
        lines = request_lines(trace, report, exc.request)
        if exc.request < len(lines):
            return _flagged(f"{trace}:{lines[exc.request]}: {exc.reason}")
    return _flagged(str(exc))


def run(args: argparse.Namespace) -> int:
    from quillcache._checks import check_int
    from quillcache.cli.signals import describe, exit_status
    from quillcache.harness.cluster_pool import MAX_BLOCK_BYTES, MAX_CLUSTER_NODES
    from quillcache.harness.config import ReplayConfig
    from quillcache.pool.cluster import ClusterError
    from quillcache.store.tier_codec import check_tier_codec
    from quillcache.traces.loader import TraceError, load_trace_report

    d = ReplayConfig()
    for blocks, size in (("--capacity-blocks", "--dram-capacity-bytes"), ("--ssd-capacity-blocks",
                                                                         "--ssd-capacity-bytes")):
        given = [getattr(args, f[2:].replace("-", "_")) for f in (blocks, size)]
        if None not in given:  # the byte budget would win silently
            return _fail(f"{blocks} {given[0]} and {size} {given[1]} both size the same tier: give one of them")
    if args.capacity_blocks is None:
        args.capacity_blocks = d.dram_capacity_blocks
    if args.ssd_capacity_blocks is None:
        args.ssd_capacity_blocks = d.ssd_capacity_blocks
    for flag, v, lo, hi in (("--capacity-blocks", args.capacity_blocks, 1, MAX_DRAM_BLOCKS),
                            ("--ssd-capacity-blocks", args.ssd_capacity_blocks, 0, MAX_COUNT),
                            ("--gpu-capacity-blocks", args.gpu_capacity_blocks, 1, MAX_COUNT),
                            ("--engines", args.engines, 1, None), ("--limit", args.limit, 1, MAX_COUNT),
                            ("--dram-capacity-bytes", args.dram_capacity_bytes, 1, MAX_COUNT),
                            ("--ssd-capacity-bytes", args.ssd_capacity_bytes, 0, MAX_COUNT)):
        try:
            if v is not None:  # the low bound first: its message ("must be >= 1") is the familiar one
                check_int(flag, v, lo)
                check_int(flag, v, None, hi)
        except ValueError as exc:
            return _fail(str(exc))
    # (flag, value, low, high, low excluded): the same bounds as ReplayConfig, said with the flag's name
    for flag, v, lo, hi, lo_open in (("--slo-ttft-s", args.slo_ttft_s, 0.0, 1e6, True),
                                     ("--time-scale", args.time_scale, 1e-6, 1e6, False)):
        if not math.isfinite(v) or not (lo < v if lo_open else lo <= v) or v > hi:
            return _fail(f"{flag}={v!r} must be a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    problem = out_text_problem(args.out, f"{DEFAULT_OUT}/<trace stem>/")
    if problem:
        return _fail(problem)
    if args.block_bytes is not None and args.cluster is None:
        return _fail(f"--block-bytes={args.block_bytes} is the pool's block size: it needs --cluster N")
    try:
        if args.cluster is not None:
            check_int("--cluster", args.cluster, 1, MAX_CLUSTER_NODES)
        if args.block_bytes is not None:
            check_int("--block-bytes", args.block_bytes, 1, MAX_BLOCK_BYTES)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        check_tier_codec(args.kv_codec, "--kv-codec")
    except ValueError as exc:
        return _fail(str(exc))
    try:
        cfg = ReplayConfig(model=args.model, gpu=args.gpu, engines=args.engines, router=args.router,
                           policy=args.policy, gpu_capacity_blocks=args.gpu_capacity_blocks,
                           dram_capacity_blocks=args.capacity_blocks, ssd_capacity_blocks=args.ssd_capacity_blocks,
                           account_bytes=args.account_bytes, ttft_slo_s=args.slo_ttft_s, time_scale=args.time_scale,
                           seed=args.seed, limit=args.limit, on_oversize=args.on_error, kv_codec=args.kv_codec,
                           dram_capacity_bytes=args.dram_capacity_bytes, ssd_capacity_bytes=args.ssd_capacity_bytes)
    except (ValueError, TypeError) as exc:
        return _fail(_flagged(str(exc)))
    trace = Path(args.trace)
    out = Path(args.out) if args.out is not None else DEFAULT_OUT / trace.stem
    problem = _check_out(out, RESULT_FILES)
    if problem:
        return _fail(problem)
    try:
        requests, report = load_trace_report(trace, limit=args.limit, on_error=args.on_error)
    except TraceError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP while reading the trace
        print(f"quillcache replay: {describe(exc)} while reading {trace}; no results were written under {out}",
              file=sys.stderr)
        return exit_status(exc)
    if not requests:  # every line malformed and skipped: say so before the replay's own "no requests"
        return _fail(f"{trace}: no request to replay ({report.num_skipped:,} malformed line(s) skipped, "
                     f"--on-error skip); nothing was written")
    problem = _clock_problem(requests, args.time_scale)
    if problem:
        return _fail(problem)
    from quillcache.harness.replay import RequestTooLargeError, UnchainedTraceError, check_replayable

    try:  # before any work (a --cluster pool is not started for a trace the replay refuses)
        check_replayable(requests, cfg)
    except (RequestTooLargeError, UnchainedTraceError) as exc:
        return _fail(trace_problem(trace, report, exc))
    except (ValueError, TypeError) as exc:
        return _fail(_flagged(str(exc)))
    note = report.summary() if report.skipped else ""
    show = not args.quiet and sys.stdout.isatty()
    if not args.quiet:
        print(f"quillcache replay: {len(requests):,} requests from {trace.name}", file=sys.stderr, flush=True)
    try:
        if show:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TimeElapsedColumn,
            )

            with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), transient=True) as bar:
                task = bar.add_task(f"replaying {trace.name}", total=len(requests))
                result = _run(requests, cfg, args, progress=lambda done, total: bar.update(task, completed=done))
        else:
            result = _run(requests, cfg, args)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP: a --cluster pool is stopped by now
        print(f"quillcache replay: {describe(exc)}; no results were written under {out}", file=sys.stderr)
        return exit_status(exc)
    except (ValueError, TypeError) as exc:  # e.g. a model whose weights do not fit the GPU, a request too large
        return _fail(trace_problem(trace, report, exc))
    except ClusterError as exc:  # a node or the master did not start
        return _fail(f"--cluster {args.cluster}: the pool did not start: {str(exc).splitlines()[0]}")
    skips = _skips(result, report.num_skipped)
    if not result.summary.requests:
        return _fail(f"{trace}: no request was replayed ({_skip_line(skips)}); nothing was written")
    paths, status = write_reported("replay", out, lambda: write_results(out, result, report.num_skipped))
    if status is not None:
        return status
    if _skip_line(skips):  # stderr, --quiet or not: a result set missing part of its trace says so
        print(f"quillcache replay: {_skip_line(skips)} (counted in replay.csv and summary.csv)", file=sys.stderr)
    if not args.quiet:
        if result.skipped_oversize:
            note = (note + "; " if note else "") + (f"{result.skipped_oversize} request(s) larger than an engine's "
                                                    f"GPU KV capacity were skipped (--on-error skip)")
        _print_summary(result, paths, note)
    return 0
