"""Planner throughput: plans/s for 64-block prompts over 8 workers, one core, no I/O.

Setup (parameters at the top): ``n_requests`` prompts of exactly ``BLOCKS`` full 16-token blocks,
built from shared system prompts (8-48 blocks) plus per-request user blocks, under 4 tenants of one
model. The residency index is populated so lookups do real work: each request's leading blocks are
resident on 1-3 of the 8 workers in GPU or DRAM under its own identity, plus a replica of its
system prompt under ANOTHER tenant's identity (the guard has to drop it). Two scenarios:
``typical`` (``n_requests / 2`` system prompts: ~4 replicas per block located) and ``hot`` (32 hot
system prompts shared by everyone: ~20 replicas per block, every worker holds them under every
tenant). The brief's bar (20,000 plans/s) is about the typical scenario.

Subjects, each over the same requests in the same run, interleaved round by round (``REPS``
rounds, median quoted, p10/p90 in the notes):
- ``Planner.plan`` on the ART index (the default backend; DESIGN) and on the flat map;
- ``Planner.plan_batch`` (one index lookup per ``BATCH`` requests) on the ART index;
- ``index.locate_arrays`` alone (the lookup's share of a plan);
- baseline: ``ReferencePlanner.plan`` - the straightforward per-block Python planner
  (``index.locate`` objects, Python loops; same decisions), on each index.
Timings are wall-clock of one thread; this machine is shared, so the thread's CPU time is recorded
in the raw CSV as well. Index population and request hashing are outside every timer.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np

from experiments.microbench import bench_main
from quillcache.identity.scope import IdentityRegistry, make_identity
from quillcache.index import ResidencyEntry, open_index
from quillcache.planner import Planner, PlannerConfig, ReferencePlanner
from quillcache.results import SummaryRow, spread, write_raw, write_summary
from quillcache.types import CacheTier

NAME = "microbench_planner"
BLOCKS = 64
BS = 16
N_WORKERS = 8
HOT_SYSTEM = 32
TARGET_PLANS_S = 20_000  # the brief's bar
BATCH = 32
SEED = 7
FULL = dict(n_requests=1024, reps=7)
QUICK = dict(n_requests=96, reps=3)


def build(n_requests: int, kind: str, n_system: int, seed: int = SEED):
    """Index, planners and requests (all outside the timers)."""
    rng = np.random.default_rng(seed)
    workers = [f"engine-{i}" for i in range(N_WORKERS)]
    registry = IdentityRegistry()
    tenants = [make_identity(model="llama-3-8b", tokenizer="llama3", tenant=f"tenant-{t}") for t in range(4)]
    index = open_index(kind)
    planner = Planner(index, workers, registry=registry, config=PlannerConfig(block_size_tokens=BS, seed=seed))
    systems = [rng.integers(0, 128_000, int(rng.integers(8, 49)) * BS) for _ in range(n_system)]
    requests = []
    entries: list[ResidencyEntry] = []
    for i in range(n_requests):
        ident = tenants[i % len(tenants)]
        sysp = systems[int(rng.integers(0, n_system))]
        user = rng.integers(0, 128_000, BLOCKS * BS - len(sysp))
        req = planner.request(ident, np.concatenate([sysp, user]), output_tokens=int(rng.integers(16, 512)))
        assert req.num_blocks == BLOCKS
        requests.append(req)
        hashes = req.block_hashes.tolist()
        for _ in range(int(rng.integers(1, 4))):  # own replicas on 1-3 workers
            w = workers[int(rng.integers(0, N_WORKERS))]
            tier = CacheTier.GPU if rng.random() < 0.7 else CacheTier.DRAM
            upto = int(rng.integers(len(sysp) // BS, BLOCKS + 1))
            entries += [ResidencyEntry(h, w, tier, req.scope.digest, 0, 0, 1 << 21) for h in hashes[:upto]]
        other = tenants[(i + 1) % len(tenants)]  # a foreign scope holding the same prefix
        w = workers[int(rng.integers(0, N_WORKERS))]
        entries += [ResidencyEntry(h, w, CacheTier.GPU, registry.scope(other).digest, 0, 0, 1 << 21)
                    for h in hashes[: len(sysp) // BS]]
    index.put(entries)
    reference = ReferencePlanner(index, workers, registry=registry, config=PlannerConfig(block_size_tokens=BS, seed=seed))
    return index, planner, reference, requests


def _timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    gc.collect()
    gc.disable()
    try:
        w0, c0 = time.perf_counter(), time.thread_time()
        n = fn()
        return time.perf_counter() - w0, time.thread_time() - c0, n
    finally:
        gc.enable()


def _scenario(name: str, n: int, reps: int, n_system: int) -> tuple[list[SummaryRow], list[tuple]]:
    art_ix, art_p, art_ref, reqs = build(n, "art", n_system)
    flat_ix, flat_p, flat_ref, _ = build(n, "flat", n_system)
    rows_per_plan = float(np.mean([len(art_ix.locate_arrays(r.block_hashes).keys) for r in reqs]))
    ref_reqs = reqs[: max(32, n // 8)]  # the slow baseline plans a subset (rates are per plan)

    def plans(planner, rs) -> Callable[[], int]:
        def go() -> int:
            for r in rs:
                planner.plan(r)
            return len(rs)
        return go

    def batched(planner) -> Callable[[], int]:
        def go() -> int:
            for i in range(0, len(reqs), BATCH):
                planner.plan_batch(reqs[i:i + BATCH])
            return len(reqs)
        return go

    def locate(ix) -> Callable[[], int]:
        def go() -> int:
            for r in reqs:
                ix.locate_arrays(r.block_hashes)
            return len(reqs)
        return go

    subjects: list[tuple[str, Callable[[], int]]] = [
        ("Planner.plan [art]", plans(art_p, reqs)),
        ("Planner.plan [flat]", plans(flat_p, reqs)),
        (f"Planner.plan_batch({BATCH}) [art]", batched(art_p)),
        ("index.locate_arrays only [art]", locate(art_ix)),
        ("index.locate_arrays only [flat]", locate(flat_ix)),
        ("ReferencePlanner.plan [art]", plans(art_ref, ref_reqs)),
        ("ReferencePlanner.plan [flat]", plans(flat_ref, ref_reqs)),
    ]
    for _, fn in subjects:  # warm up (JIT caches, index pages)
        fn()
    raw = []
    rates: dict[str, list[float]] = {s: [] for s, _ in subjects}
    for rep in range(reps):
        for subject, fn in subjects:
            wall, cpu, count = _timed(fn)
            rates[subject].append(count / wall)
            raw.append((name, rep, subject, count, f"{wall:.6f}", f"{cpu:.6f}", f"{count / wall:.1f}"))

    def row(subject: str, baseline: str, note: str = "") -> SummaryRow:
        s = spread(rates[subject])
        b = spread(rates[baseline])["median"]
        bare, index = subject[:-1].rsplit(" [", 1)  # "Planner.plan [art]" -> subject + index column
        return SummaryRow.from_spread(s, metric="plans_per_s", subject=bare, unit="plans/s", baseline=baseline,
                                      baseline_value=b, n=reps,
                                      notes=f"{rows_per_plan:.0f} located replicas per plan; {note}".rstrip("; "),
                                      params={"scenario": name, "backend": index, "blocks_per_plan": 64, "workers": 8})

    target = f"brief's bar {TARGET_PLANS_S} plans/s"
    rows = [
        row("Planner.plan [art]", "ReferencePlanner.plan [art]", target),
        row("Planner.plan [flat]", "ReferencePlanner.plan [flat]", target),
        row(f"Planner.plan_batch({BATCH}) [art]", "ReferencePlanner.plan [art]", target),
        row("Planner.plan [art]", "Planner.plan [flat]", "same planner, index backends compared"),
        row("index.locate_arrays only [art]", "Planner.plan [art]", "lookup alone vs the whole plan"),
        row("index.locate_arrays only [flat]", "Planner.plan [flat]", "lookup alone vs the whole plan"),
    ]
    print(f"[{name}: {rows_per_plan:.0f} located replicas per 64-block plan]")
    print(f"{'subject':36s} {'plans/s':>10s} {'p10':>9s} {'p90':>9s}  {'vs baseline':28s} {'ratio':>7s}")
    for r in rows:
        s = spread(rates[f"{r.subject} [{r.params['backend']}]"])
        print(f"{r.subject:36s} {r.value:10.0f} {s['p10']:9.0f} {s['p90']:9.0f}  {r.baseline:28s} {r.ratio:7.2f}")
    for ix in (art_ix, flat_ix):
        ix.close()
    return rows, raw


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    t_start = time.monotonic()
    p = QUICK if quick else FULL
    n, reps = p["n_requests"], p["reps"]
    rows, raw = [], []
    for name, n_system in (("typical", max(2, n // 2)), ("hot", HOT_SYSTEM)):
        r, w = _scenario(name, n, reps, n_system)
        rows += r
        raw += w
    write_raw(NAME, "raw.csv", ("scenario", "rep", "subject", "plans", "wall_s", "thread_cpu_s", "plans_per_s"), raw,
              root=results_root)
    write_summary(NAME, rows, root=results_root, profile="quick" if quick else "full", started_at=t_start)
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """The speed-up over the same-run baseline of every row that has one (log scale)."""
    from pathlib import Path

    from experiments.plotstyle import speedup_chart
    from quillcache.results import read_summary

    name = NAME
    return speedup_chart(read_summary(name, results_root), "Planner vs the plain-Python reference planner", Path(out_dir) / f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
