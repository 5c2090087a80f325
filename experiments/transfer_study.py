"""Transfer study: QuillCache's TCP transfer engine vs a raw socket pair and Mooncake's Transfer Engine.

Two processes over loopback, same run. For blocks of 64 KiB, 2 MiB and 32 MiB, batches of 1, 16
and 128 (the quick profile leaves out 128), READ and WRITE:

- ``raw socket pair`` (the ceiling): ``experiments.transfer_raw``, one connection, every header of a
  batch sent at once, data ``sendall`` from / ``recv_into`` a pre-touched buffer, the system's TCP
  congestion control (BBR on this machine).
- ``raw socket pair (cubic)`` (an extra reference): the same pair with the congestion control the
  engine asks for (``TcpConfig.congestion_control``, CUBIC), so the engine is also compared with a
  bare socket on equal TCP terms (``throughput_over_raw_cubic``). Mooncake's engine keeps the
  system's (it has no such setting).
- ``quillcache tcp``: ``TransferEngine("tcp")`` in this process against a
  ``quillcache.transfer.peer`` child process (authenticated, pipelined, range-checked); a single block
  through ``engine.read``/``write``, a batch through ``run_sync`` (first lane on the calling thread).
- ``Mooncake TE tcp``: the ``mooncake-transfer-engine`` wheel from PyPI in its own virtualenv
  (``experiments.transfer_mooncake``, recipe in REFERENCE §4); when it cannot run, the results say
  exactly why (``mooncake_available`` = 0 and the reason).

Placement: every cell runs "cross-core" (this process pinned to one CPU, both peers to another: like
two nodes); the 64 KiB single block also runs "same-core" (all on one CPU), where nothing overlaps and
each side's software cost shows. Requests of a batch go to consecutive block slots of a region of ``region_bytes`` (wrapping when
the batch is larger). Per cell and repetition every subject, Mooncake included, makes the same number of
calls (``_calls``: enough to move ``cell_bytes``, at least 3), timed as the wall time of its whole loop of
calls (raw.csv's ``seconds``); raw and quillcache alternate within each repetition, Mooncake runs its
repetitions right after. Reported:
throughput (GB/s = 1e9 B/s, median over repetitions, p10/p90), per-request latency p50/p99 (µs,
submit to that request's completion, or the whole call for a single block, pooled over the cell's
calls; Mooncake reports per batch call
— its Python API has no per-request completion time — so its latency rows say ``batch`` and their
baseline is the raw pair's per-batch time: each batch call's start to its last completion), and CPU
seconds per GB moved (user+system of both processes); per cell also QuillCache's speedup over
Mooncake and the raw pair's own rate over Mooncake (``ceiling_over_mooncake``: the most any engine on
the same sockets could reach). Acceptance (issue 13): 2 and 32 MiB READ in batches of 16 ≥ 0.8× raw;
every cell ≥ 2× Mooncake; 64 KiB READ p50 ≤ 2× the raw round trip.

Alignment: every buffer here (this process's region, the engine peer's, the raw server's) is
page-aligned (``quillcache.alloc.buffers``). In the 64 KiB single-block cells two more subjects,
``raw socket pair (region off the cache line)`` and ``quillcache tcp (region off the cache line)``,
move the same bytes to/from a client region that starts ``OFF_LINE_BYTES`` (16) past a page boundary:
where NumPy and ``malloc`` put a large array, so where every block of an unaligned buffer lies. Their
ratio to the aligned raw pair is what the kernel's socket copies pay off a cache line on this CPU.
"""

from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path

import numpy as np

from experiments.microbench import bench_main
from experiments.transfer_raw import READ, WRITE, RawClient, RawPeer
from quillcache.alloc.buffers import aligned_empty
from quillcache.results import Anchor, SummaryRow, spread, write_raw, write_summary
from quillcache.transfer import Op, Outcome, TcpConfig, TransferEngine, TransferRequest
from quillcache.transfer.peer import PeerProcess

NAME = "transfer"
GB = 1e9
SIZES = (64 << 10, 2 << 20, 32 << 20)
FULL = dict(reps=5, cell_bytes=1 << 30, region_bytes=512 << 20, batches=(1, 16, 128), max_calls=4000)
QUICK = dict(reps=3, cell_bytes=64 << 20, region_bytes=128 << 20, batches=(1, 16), max_calls=300)
RAW, OURS, MOONCAKE = "raw socket pair", "quillcache tcp", "Mooncake TE tcp"
RAW_CUBIC = "raw socket pair (cubic)"  # extra reference: the raw pair with the engine's congestion control
RAW_OFF, OURS_OFF = f"{RAW} (region off the cache line)", f"{OURS} (region off the cache line)"
OFF_LINE_BYTES = 16  # where NumPy / malloc place a large array's first byte past a page boundary
ENGINE_CC = TcpConfig.congestion_control.split(",")[0]
SECRET = "transfer-study-shared-secret-0001"
OPS = {"read": (Op.READ, READ), "write": (Op.WRITE, WRITE)}


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _offsets(size: int, batch: int, region_bytes: int) -> list[int]:
    slots = max(1, region_bytes // size)
    return [(i % slots) * size for i in range(batch)]


def _calls(size: int, batch: int, cfg: dict) -> int:
    """Calls per repetition of a cell, the same for every subject (Mooncake's included: ``_mooncake``)."""
    return max(3, min(cfg["max_calls"], math.ceil(cfg["cell_bytes"] / (size * batch))))


def _batch_times(lat: list[float], batch: int) -> list[float]:
    """Each call's time from its start to its last completion, from the per-request samples of a cell (calls of
    ``batch`` requests, each call's samples together, as ``_raw_cell`` keeps them): what a latency per batch call
    is compared with. Empty when ``lat`` does not divide into calls of ``batch``."""
    if batch < 1 or len(lat) % batch:
        return []
    return [max(lat[i:i + batch]) for i in range(0, len(lat), batch)]


def _ours_cell(engine: TransferEngine, peer: PeerProcess, local, seg, op: Op, size: int, batch: int,
               calls: int, region_bytes: int) -> tuple[float, list[float], float]:
    offs = _offsets(size, batch, region_bytes)
    reqs = [TransferRequest(op, local.region_id, off, seg.segment_id, peer.region_id, off, size) for off in offs]
    lat: list[float] = []
    pc = time.perf_counter
    before_srv = sum(peer.ask("rusage").values())
    before = _cpu_s()
    t0 = pc()
    if batch == 1:  # the synchronous one-block call (engine.read / engine.write), timed whole like the raw pair
        call = engine.read if op is Op.READ else engine.write
        rid, sid, prid, off = local.region_id, seg.segment_id, peer.region_id, offs[0]
        for _ in range(calls):
            t = pc()
            call(rid, off, sid, prid, off, size, timeout_s=120.0)
            lat.append(pc() - t)
    for _ in range(calls if batch > 1 else 0):
        b = engine.run_sync(reqs, timeout_s=120.0)
        lat.extend(b.latencies_s())
        bad = [s for s in b.statuses() if s.outcome is not Outcome.COMPLETED]
        if bad:
            raise RuntimeError(f"quillcache tcp {op.name} {size}x{batch}: {bad[0]}")
    wall = pc() - t0
    cpu = _cpu_s() - before + sum(peer.ask("rusage").values()) - before_srv
    return wall, lat, cpu


def _raw_cell(client: RawClient, local: memoryview, op: int, size: int, batch: int, calls: int,
              region_bytes: int) -> tuple[float, list[float], float]:
    offs = _offsets(size, batch, region_bytes)
    lat: list[float] = []
    before_srv = sum(client.rusage())
    before = _cpu_s()
    pc = time.perf_counter
    t0 = pc()
    for _ in range(calls):
        lat.extend(client.batch(op, local, offs, size))
    wall = pc() - t0
    cpu = _cpu_s() - before + sum(client.rusage()) - before_srv
    return wall, lat, cpu


def anchors() -> list[Anchor]:
    """Figures reported elsewhere (REFERENCE §4, §8): comparison points, never same-run baselines."""
    ref8 = "REFERENCE §8 (measured on this machine kind in an earlier session; two processes, TCP loopback)"
    out = [Anchor(metric="throughput", subject="Mooncake Store get over TCP", value=v, unit="GB/s", source=ref8,
                  params={"op": "read", "block_bytes": b, "batch": 1})
           for b, v in ((64 << 10, 0.47), (2 << 20, 1.36), (32 << 20, 0.87))]
    out += [Anchor(metric="throughput", subject="raw loopback socket (earlier session)", value=4.3, unit="GB/s",
                   source=ref8, notes="4.3-4.6 GB/s; lower end kept"),
            Anchor(metric="throughput", subject="nixlbench over UCX TCP", value=0.59, unit="GB/s",
                   source="openucx/ucx#10854 via REFERENCE §8"),
            Anchor(metric="throughput", subject="Mooncake TE RDMA, 4x200 Gbps", value=87.0, unit="GB/s",
                   source="Mooncake paper via REFERENCE §4/§8"),
            Anchor(metric="throughput", subject="Mooncake TE RDMA, 8x400 Gbps", value=190.0, unit="GB/s",
                   source="Mooncake paper via REFERENCE §4/§8")]
    return out


def _mooncake(cfg: dict, size: int, batch: int, op: str, placement: str) -> dict:
    from experiments import transfer_mooncake as mk

    workdir = mk.default_workdir()
    avail = mk.prepare(workdir)
    if not avail.ok:
        return {"reason": avail.reason}
    client_cpus, server_cpus = PLACEMENTS[placement]
    return mk.run_mooncake(block_bytes=size, batch=batch, op=op, repeats=cfg["reps"], workdir=workdir,
                           timeout_s=900, bytes_per_repeat=cfg["cell_bytes"], max_calls_per_repeat=cfg["max_calls"],
                           calls_per_repeat=_calls(size, batch, cfg),
                           max_buffer_bytes=cfg["region_bytes"], client_cpus=_cpulist(client_cpus),
                           server_cpus=_cpulist(server_cpus))


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else math.nan


def _cpulist(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Pin every thread of process ``pid`` (threads it starts later inherit the set)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass


def _placements() -> dict[str, frozenset[int]]:
    """The placements this machine can run: cross-core needs two CPUs."""
    have = sorted(os.sched_getaffinity(0))
    out = {"same_core": (frozenset(have[:1]), frozenset(have[:1]))}
    if len(have) >= 2:
        out["cross_core"] = (frozenset(have[:1]), frozenset(have[1:2]))
    return out


PLACEMENTS = _placements()


def _cells(cfg: dict) -> list[tuple[str, str, int, int]]:
    """(placement, op, block bytes, batch): every cell cross-core; the 64 KiB single request also same-core."""
    main = "cross_core" if "cross_core" in PLACEMENTS else "same_core"
    cells = [(main, op, size, batch) for op in OPS for size in SIZES for batch in cfg["batches"]]
    if main != "same_core":
        cells += [("same_core", op, SIZES[0], 1) for op in OPS]
    return cells


def run(quick: bool = False, results_root: str | None = None, *, mooncake: bool = True) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    region_bytes = cfg["region_bytes"]
    rows: list[SummaryRow] = []
    raw_rows: list[tuple] = []
    table: list[tuple] = []
    mk_status: dict[str, str] = {}
    my_cpus = os.sched_getaffinity(0)
    local_np = aligned_empty(region_bytes, pretouch=True)  # pre-touched and page-aligned, like the peers' regions
    local_view = memoryview(local_np)
    off_np = aligned_empty(region_bytes + 64, pretouch=True)[OFF_LINE_BYTES:OFF_LINE_BYTES + region_bytes]
    off_view = memoryview(off_np)
    placement_now = None
    engine: TransferEngine | None = None
    raw: RawClient | None = None
    rawc: RawClient | None = None
    try:
        with PeerProcess(region_bytes, secret=SECRET, timeout_s=60) as peer, RawPeer(region_bytes) as raw_peer, \
                RawPeer(region_bytes, congestion_control=ENGINE_CC) as rawc_peer:
            for placement, op_name, size, batch in _cells(cfg):
                if placement != placement_now:  # a fresh engine and raw connection per placement, made pinned
                    if placement_now is not None:
                        raw.close()
                        rawc.close()
                        engine.close()
                    client_cpus, server_cpus = PLACEMENTS[placement]
                    os.sched_setaffinity(0, client_cpus)
                    pin_process(peer.pid, server_cpus)
                    pin_process(raw_peer.proc.pid, server_cpus)
                    pin_process(rawc_peer.proc.pid, server_cpus)
                    engine = TransferEngine("tcp", secret=SECRET)
                    raw = RawClient(raw_peer.port)
                    rawc = RawClient(rawc_peer.port, congestion_control=ENGINE_CC)
                    local = engine.register_region(local_np, name="study")
                    local_off = engine.register_region(off_np, name="study-off-line")
                    seg = engine.open_segment(peer.address)
                    placement_now = placement
                op, raw_op = OPS[op_name]
                calls = _calls(size, batch, cfg)
                moved = calls * batch * size
                # warm-up (untimed): connections, code paths, pages
                _ours_cell(engine, peer, local, seg, op, size, batch, 2, region_bytes)
                _raw_cell(raw, local_view, raw_op, size, batch, 2, region_bytes)
                _raw_cell(rawc, local_view, raw_op, size, batch, 2, region_bytes)
                subjects = (RAW, OURS, RAW_CUBIC) + ((RAW_OFF, OURS_OFF) if (size, batch) == (SIZES[0], 1) else ())
                if RAW_OFF in subjects:
                    _ours_cell(engine, peer, local_off, seg, op, size, batch, 2, region_bytes)
                    _raw_cell(raw, off_view, raw_op, size, batch, 2, region_bytes)
                res: dict[str, dict] = {s: {"gbps": [], "lat": [], "cpu": []} for s in subjects}
                for rep in range(cfg["reps"]):
                    for subject in (subjects if rep % 2 == 0 else subjects[::-1]):
                        if subject == RAW:
                            wall, lat, cpu = _raw_cell(raw, local_view, raw_op, size, batch, calls, region_bytes)
                        elif subject == RAW_CUBIC:
                            wall, lat, cpu = _raw_cell(rawc, local_view, raw_op, size, batch, calls, region_bytes)
                        elif subject == RAW_OFF:
                            wall, lat, cpu = _raw_cell(raw, off_view, raw_op, size, batch, calls, region_bytes)
                        elif subject == OURS_OFF:
                            wall, lat, cpu = _ours_cell(engine, peer, local_off, seg, op, size, batch, calls,
                                                        region_bytes)
                        else:
                            wall, lat, cpu = _ours_cell(engine, peer, local, seg, op, size, batch, calls,
                                                        region_bytes)
                        r = res[subject]
                        r["gbps"].append(moved / wall / GB)
                        r["lat"].extend(lat)
                        r["cpu"].append(cpu / (moved / GB))
                        raw_rows.append((placement, op_name, size, batch, subject, rep, calls, moved, f"{wall:.6f}",
                                         f"{cpu:.4f}"))
                mk = (_mooncake(cfg, size, batch, op_name, placement) if mooncake
                      else {"reason": "not run (mooncake=False)"})
                if mk.get("reason"):
                    mk_status[f"{placement}/{op_name}/{size}/{batch}"] = mk["reason"]
                else:
                    res[MOONCAKE] = {"gbps": mk["gbps"], "lat": mk["latency_s"], "cpu": mk["cpu_s_per_gb"],
                                     "unit": mk.get("latency_unit", "batch")}
                    mk_bytes = mk["bytes_per_repeat"]
                    for rep, (secs, c) in enumerate(zip(mk["seconds"], mk["cpu_s_per_gb"])):
                        raw_rows.append((placement, op_name, size, batch, MOONCAKE, rep, mk["calls_per_repeat"],
                                         mk_bytes, f"{secs:.6f}", f"{c * mk_bytes / GB:.4f}"))
                rows += _cell_rows(placement, op_name, size, batch, calls, moved, res)
                table.append((placement, op_name, size, batch,
                              {s: spread(v["gbps"])["median"] for s, v in res.items()},
                              {s: _pct(v["lat"], 50) * 1e6 for s, v in res.items()}))
            raw.close()
            rawc.close()
            engine.close()
    finally:
        os.sched_setaffinity(0, my_cpus)
    avail_reason = "; ".join(sorted(set(mk_status.values())))
    rows.append(SummaryRow(metric="mooncake_available", subject=MOONCAKE, value=float(not mk_status), unit="bool",
                           notes=(f"not measured: {avail_reason}" if mk_status else
                                  "mooncake-transfer-engine from PyPI, TCP transport, two processes")))
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", started_at=t_start,
                  anchors=anchors())
    write_raw(NAME, "raw.csv", ("placement", "op", "block_bytes", "batch", "subject", "rep", "calls", "bytes",
                                "seconds", "cpu_s"), raw_rows, results_root)
    print(f"{'placement':<10} {'op':<5} {'block':>7} {'batch':>5} "
          + " ".join(f"{s[:14]:>15}" for s in (RAW, OURS, MOONCAKE)) + "   p50 us raw/ours/mooncake"
          + "   raw (cubic) GB/s")
    for placement, op_name, size, batch, gb, p50 in table:
        print(f"{placement:<10} {op_name:<5} {_label(size):>7} {batch:>5} "
              + " ".join(f"{gb.get(s, math.nan):15.2f}" for s in (RAW, OURS, MOONCAKE))
              + f"   {p50.get(RAW, math.nan):.0f}/{p50.get(OURS, math.nan):.0f}/{p50.get(MOONCAKE, math.nan):.0f}"
              + f"   {gb.get(RAW_CUBIC, math.nan):.2f}")
    return rows


def _cell_rows(placement: str, op: str, size: int, batch: int, calls: int, moved: int, res: dict
               ) -> list[SummaryRow]:
    batch_latency = batch > 1
    params = {"placement": placement, "op": op, "block_bytes": size, "batch": batch}
    out: list[SummaryRow] = []
    raw_gb = spread(res[RAW]["gbps"])
    raw_lat = res[RAW]["lat"]
    raw_lat_by = {"request": raw_lat, "batch": _batch_times(raw_lat, batch)}  # the baseline in each latency unit
    raw_cpu = spread(res[RAW]["cpu"])
    notes = f"{calls} calls x {batch} requests x {_label(size)} per repetition ({moved / GB:.2f} GB)"
    for subject, r in res.items():
        base = {} if subject == RAW else {"baseline": RAW}
        gb = spread(r["gbps"])
        out.append(SummaryRow.from_spread(gb, metric="throughput", subject=subject, unit="GB/s", n=len(r["gbps"]),
                                          baseline_value=raw_gb["median"] if base else math.nan, notes=notes,
                                          params=params, **base))
        lat_unit = r.get("unit", "request")
        base_lat = raw_lat_by.get(lat_unit, []) if base else []  # like with like: per request, or per batch call
        lat_base = base if base_lat else {}
        for q in (50, 99):
            out.append(SummaryRow(metric=f"latency_p{q}", subject=subject, value=_pct(r["lat"], q) * 1e6, unit="us",
                                  n=len(r["lat"]), baseline_value=_pct(base_lat, q) * 1e6 if lat_base else math.nan,
                                  notes=f"per {lat_unit}" + ("; submit to completion within a batch"
                                                             if batch_latency and lat_unit == "request" else "")
                                  + ("; baseline: the raw pair's batch calls, start to last completion"
                                     if lat_base and lat_unit == "batch" and batch_latency else ""),
                                  params=params, **lat_base))
        cpu = spread(r["cpu"])
        out.append(SummaryRow.from_spread(cpu, metric="cpu_s_per_gb", subject=subject, unit="s/GB", n=len(r["cpu"]),
                                          baseline_value=raw_cpu["median"] if base else math.nan,
                                          notes="user+system CPU of both processes per GB moved", params=params,
                                          **base))
    if RAW_CUBIC in res:
        ours, rawc = spread(res[OURS]["gbps"])["median"], spread(res[RAW_CUBIC]["gbps"])["median"]
        out.append(SummaryRow(metric="throughput_over_raw_cubic", subject=OURS, value=ours / rawc, unit="x",
                              n=len(res[OURS]["gbps"]), baseline=RAW_CUBIC, baseline_value=rawc,
                              notes=f"median throughput {ours:.3f} vs {rawc:.3f} GB/s: the raw pair with the "
                                    f"engine's congestion control ({ENGINE_CC})", params=params))
    if MOONCAKE in res:
        ours, mk = spread(res[OURS]["gbps"])["median"], spread(res[MOONCAKE]["gbps"])["median"]
        out.append(SummaryRow(metric="speedup_over_mooncake", subject=OURS, value=ours / mk, unit="x",
                              n=len(res[OURS]["gbps"]), notes=f"median throughput {ours:.3f} vs {mk:.3f} GB/s",
                              params=params))
        raw = raw_gb["median"]
        out.append(SummaryRow(metric="ceiling_over_mooncake", subject=RAW, value=raw / mk, unit="x",
                              n=len(res[RAW]["gbps"]),
                              notes="the most any engine bounded by the raw socket pair could reach over Mooncake here",
                              params=params))
    return out


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """``transfer.png``: GB/s per block size and batch, READ and WRITE side by side, all subjects."""
    from experiments.plotstyle import BASELINE as BASE_COLOUR
    from experiments.plotstyle import OURS as OURS_COLOUR
    from experiments.plotstyle import PALETTE, figure, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(NAME, results_root)
    main = "cross_core" if (df["placement"] == "cross_core").any() else "same_core"
    df = df[(df["metric"] == "throughput") & (df["placement"] == main)]
    subjects = [(RAW, "raw socket pair (ceiling)", BASE_COLOUR), (OURS, "QuillCache TCP engine", OURS_COLOUR),
                (MOONCAKE, "Mooncake TE (TCP)", PALETTE[3])]
    fig, axes = figure(9.0, 3.6, ncols=2, sharey=True)
    for ax, op in zip(axes, ("read", "write")):
        part = df[df["op"] == op]
        cells = sorted({(int(b), int(n)) for b, n in zip(part["block_bytes"], part["batch"])})
        x = np.arange(len(cells))
        w = 0.8 / len(subjects)
        for i, (subject, label, colour) in enumerate(subjects):
            sub = part[part["subject"] == subject].set_index(["block_bytes", "batch"])
            vals = [float(sub.loc[c, "value"]) if c in sub.index else np.nan for c in cells]
            lo = [v - float(sub.loc[c, "p10"]) if c in sub.index else 0 for v, c in zip(vals, cells)]
            hi = [float(sub.loc[c, "p90"]) - v if c in sub.index else 0 for v, c in zip(vals, cells)]
            ax.bar(x + (i - 1) * w, vals, w, yerr=np.clip(np.nan_to_num([lo, hi]), 0, None), capsize=2, label=label,
                   color=colour)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{_label(b)}\nx{n}" for b, n in cells], fontsize=7)
        style_axes(ax, ylabel="GB/s (median, p10-p90)" if op == "read" else "",
                   title=f"{op.upper()} over loopback ({main.replace('_', '-')})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False)
    return save(fig, Path(out_dir) / "transfer.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
