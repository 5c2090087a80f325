"""Safety study: unsafe reuse of a naive content-hash cache vs QuillCache's identity guard.

For each mix of the collision workload (``quillcache.traces.collision``: ``realistic`` and
``adversarial``) the request stream is replayed ONCE through, side by side:

- the naive content-hash cache (``quillcache.identity.naive_cache``, LMCache/SGLang-style keys on token
  content only, LRU at the pool's capacity): every hit block is audited against the identity that
  wrote it (``identity.reuse_reason``; a hit on a registered public block counts against the
  writer's public scope) -> unsafe share of hits by category;
- QuillCache's planner with the guard ON (the real ``Planner`` over a real residency index, 8
  workers, Dynamo cost router) and the SAME planner with the guard OFF, both planning every request
  against the same index state; every block either plan would reuse is audited through
  ``identity.audit_reuse`` (the independent reason-building path) -> unsafe reuses served.
  Only the guarded plan is executed.

Engine stand-in (stated): an engine's GPU KV and host-DRAM offload are simulated as per-worker LRU
sets (``GPU_BLOCKS`` and ``DRAM_BLOCKS`` blocks); an executed plan's blocks become GPU-resident on the
chosen worker, GPU evictions demote to that worker's DRAM, DRAM evictions drop. Every residency
change is a real ``put``/``remove`` on the index.

Guard overhead (same run, after the replay, against the final index): each of the last
``timing_requests`` requests is planned by the guard-on and the guard-off planner back to back
(alternating which goes first), ``reps`` repetitions with GC off; overhead = the median over
repetitions of the paired ratio (mean plan time on / off) - 1, p10/p90 in the notes. The figures
themselves are in ``results/safety/summary.csv`` and the report, never here.

Writes ``results/safety/summary.csv``, ``by_category.csv``, ``timing.csv``, ``mixes.csv`` and
``anchors.csv`` (the seed's reported figures, kept apart from the same-run baselines);
:func:`plot` draws ``paper/figures/safety.png`` from the results files only. Every summary row names
the residency index backend (``index_kind``); a run on any backend but the default ``DEFAULT_INDEX``
(``index_kind=``, the CLI's ``--index``) is marked profile ``custom``, never as the study's full run.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quillcache.hashing.blocks import as_token_array, hash_blocks
from quillcache.identity.scope import (
    PUBLIC_TENANT,
    UNSAFE_REASONS,
    IdentityRegistry,
    ReuseReason,
    SharingPolicy,
    audit_reuse,
    reuse_reason,
)
from quillcache.index import open_index
from quillcache.index.keys import ReplicaKey, ResidencyEntry
from quillcache.identity.naive_cache import NaiveContentCache
from quillcache.planner import Planner, PlannerConfig, PlanRequest
from quillcache.results import Anchor, SummaryRow, print_table, spread, write_raw, write_summary
from quillcache.types import CacheTier, Identity
from quillcache.traces.collision import (
    CollisionConfig,
    CollisionRequest,
    generate,
    tokens_for,
)

STUDY = "safety"
SEED = 20250105
BLOCK_TOKENS = 16
N_WORKERS = 8
GPU_BLOCKS = 4096  # per worker (the engine stand-in's GPU KV capacity)
DRAM_BLOCKS = 16384  # per worker host-DRAM offload
DEFAULT_INDEX = "art"  # the residency index backend of the study's quick and full runs
FULL = dict(requests={"realistic": 50_000, "adversarial": 100_000}, timing_requests=4000, reps=11)
QUICK = dict(requests={"realistic": 1000, "adversarial": 1500}, timing_requests=200, reps=3)
SEED_REPORTED = {"naive_unsafe_share_pct": 96.8, "overhead_pct": {"realistic": 1.7, "adversarial": 47.8}}
CATEGORIES = [r.value for r in UNSAFE_REASONS if r is not ReuseReason.UNKNOWN_IDENTITY]


class EngineSim:
    """Stand-in for the engines' own KV memory: per-worker GPU LRU demoting to host-DRAM LRU.
    Every change is written to the residency index."""

    def __init__(self, index, workers: list[str], gpu_blocks: int, dram_blocks: int) -> None:
        self.index = index
        self.gpu = {w: OrderedDict() for w in workers}
        self.dram = {w: OrderedDict() for w in workers}
        self.gpu_blocks, self.dram_blocks = gpu_blocks, dram_blocks

    def commit(self, entries: list[ResidencyEntry]) -> None:
        puts: list[ResidencyEntry] = []
        removes: list[ReplicaKey] = []
        for e in entries:
            key = (e.block_hash, e.identity)
            g, d = self.gpu[e.node], self.dram[e.node]
            if key in g:
                g.move_to_end(key)
                continue
            g[key] = e.size_bytes
            puts.append(e)
            if d.pop(key, None) is not None:  # promoted: the bytes moved up
                removes.append(ReplicaKey(e.block_hash, e.node, CacheTier.DRAM, e.identity))
            if len(g) > self.gpu_blocks:
                (h, ident), size = g.popitem(last=False)
                removes.append(ReplicaKey(h, e.node, CacheTier.GPU, ident))
                d[(h, ident)] = size
                puts.append(ResidencyEntry(h, e.node, CacheTier.DRAM, ident, 1, 0, size))
                if len(d) > self.dram_blocks:
                    (h2, i2), _ = d.popitem(last=False)
                    removes.append(ReplicaKey(h2, e.node, CacheTier.DRAM, i2))
        if removes:
            self.index.remove(removes)
        if puts:
            self.index.put(puts)


@dataclass
class MixResult:
    mix: str
    requests: int = 0
    prompt_blocks: int = 0
    naive_hit_blocks: int = 0
    naive_unsafe: Counter = field(default_factory=Counter)
    naive_unsafe_requests: int = 0
    on_reused: int = 0
    on_unsafe: Counter = field(default_factory=Counter)
    off_reused: int = 0
    off_unsafe: Counter = field(default_factory=Counter)
    public_shared_blocks: int = 0
    timing: list[tuple[int, str, float]] = field(default_factory=list)  # (rep, guard, us/plan)
    replay_s: float = 0.0
    index_kind: str = DEFAULT_INDEX  # the residency index backend replayed on

    @property
    def naive_unsafe_blocks(self) -> int:
        return sum(self.naive_unsafe.values())


def public_policy(requests: list[CollisionRequest]) -> SharingPolicy:
    """The operator's registration list: every public system prompt seen in the trace, registered
    with its tokens (public blocks are written only by requests whose tokens are these)."""
    prefixes = sorted({r.hash_ids[: r.public_prefix_blocks] for r in requests if r.public_prefix_blocks})
    policy = SharingPolicy()
    for ids in prefixes:
        policy = policy.with_public_prompt(tokens_for(ids, BLOCK_TOKENS, len(ids) * BLOCK_TOKENS), BLOCK_TOKENS)
    return policy


def replay(mix: str, n_requests: int, timing_requests: int, reps: int, index_kind: str = DEFAULT_INDEX) -> MixResult:
    reqs = generate(CollisionConfig(mix=mix, num_requests=n_requests, seed=SEED, block_size_tokens=BLOCK_TOKENS))
    policy = public_policy(reqs)
    registry = IdentityRegistry(policy)
    workers = [f"engine-{i}" for i in range(N_WORKERS)]
    index = open_index(index_kind)
    on = Planner(index, workers, registry=registry, config=PlannerConfig(block_size_tokens=BLOCK_TOKENS, seed=SEED))
    off = on.with_guard(False)
    engine = EngineSim(index, workers, GPU_BLOCKS, DRAM_BLOCKS)
    naive = NaiveContentCache(BLOCK_TOKENS, capacity_blocks=N_WORKERS * (GPU_BLOCKS + DRAM_BLOCKS))
    res = MixResult(mix, index_kind=index_kind)
    idents: dict[tuple, Identity] = {}
    naive_reason: dict[tuple[Identity, bytes, bool], ReuseReason] = {}
    plan_reason: dict[tuple[Identity, bytes, bool], ReuseReason] = {}
    public = policy.public_blocks
    tail: list[PlanRequest] = []
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        key = (r.tenant, r.model, r.tokenizer, r.adapter, r.kv_dtype)
        ident = idents.get(key)
        if ident is None:
            ident = idents[key] = r.identity()
        scope = on.scope(ident)
        tokens = as_token_array(r.tokens())
        hashes = hash_blocks(tokens, BLOCK_TOKENS)
        preq = PlanRequest(scope, hashes, r.input_length, r.output_length, tokens)
        res.requests += 1
        res.prompt_blocks += len(hashes)
        # naive content-hash cache: audit every hit against its writer
        hits = naive.lookup(hashes)
        if hits:
            res.naive_hit_blocks += hits
            bad = 0
            for h, w in zip(hashes[:hits].tolist(), naive.writers(hashes, hits)):
                is_pub = h in public
                rk = (ident, w, is_pub)
                reason = naive_reason.get(rk)
                if reason is None:
                    writer = registry.identity_of(w)
                    assert writer is not None
                    cand = writer.with_tenant(PUBLIC_TENANT) if is_pub else writer
                    reason = naive_reason[rk] = reuse_reason(ident, cand, h, policy)[0]
                if not reason.safe:
                    res.naive_unsafe[reason.value] += 1
                    bad += 1
            res.naive_unsafe_requests += bad > 0
        naive.insert(hashes, scope.digest)
        # the same planner with and without the guard, on the same index state
        if i & 1:
            p_off, p_on = off.plan(preq), on.plan(preq)
        else:
            p_on, p_off = on.plan(preq), off.plan(preq)
        if p_on.reused_blocks:  # the independent audit path, on every block the guarded plan reuses
            for v in audit_reuse(ident, p_on.reused_entries(), registry=registry):
                if not v.safe:
                    res.on_unsafe[v.reason.value] += 1
                elif v.reason is ReuseReason.SHARED_PUBLIC:
                    res.public_shared_blocks += 1
        k = p_off.reused_blocks
        if k:  # guard off: categorise each reused block by its replica's identity (memoised reasons)
            digests = p_off.located.keys["identity"][p_off.source_rows[:k]].tolist()
            for h, d in zip(hashes[:k].tolist(), digests):
                rk = (ident, d, h in public)
                reason = plan_reason.get(rk)
                if reason is None:
                    reason = plan_reason[rk] = audit_reuse(ident, [(h, d)], registry=registry)[0].reason
                if not reason.safe:
                    res.off_unsafe[reason.value] += 1
        res.on_reused += p_on.reused_blocks
        res.off_reused += p_off.reused_blocks
        engine.commit(on.resident_entries(p_on))
        if i >= n_requests - timing_requests:
            tail.append(preq)
    res.replay_s = time.perf_counter() - t0
    # guard overhead: same planner, guard on vs off, same requests, same final index; each request
    # is planned by both back to back (alternating which goes first) so drifts of a shared machine
    # hit both alike
    clock = time.perf_counter_ns
    for rep in range(reps):
        tot = {"on": 0, "off": 0}
        gc.collect()
        gc.disable()
        try:
            for j, preq in enumerate(tail):
                first, second = (("on", on), ("off", off)) if (j + rep) & 1 == 0 else (("off", off), ("on", on))
                t0 = clock()
                first[1].plan(preq)
                t1 = clock()
                second[1].plan(preq)
                t2 = clock()
                tot[first[0]] += t1 - t0
                tot[second[0]] += t2 - t1
        finally:
            gc.enable()
        for name in ("on", "off"):
            res.timing.append((rep, name, tot[name] / len(tail) / 1e3))
    index.close()
    return res


def _pct(a: float, b: float) -> float:
    return 100.0 * a / b if b else 0.0


def summarize(results: list[MixResult]) -> list[SummaryRow]:
    rows: list[SummaryRow] = []
    for m in results:
        mix = {"mix": m.mix, "requests": m.requests, "index_kind": m.index_kind}
        rows.append(SummaryRow(
            metric="naive_unsafe_share", subject="naive content-hash cache",
            value=_pct(m.naive_unsafe_blocks, m.naive_hit_blocks), unit="% of hit blocks", n=m.naive_hit_blocks,
            notes=f"{m.naive_unsafe_blocks} of {m.naive_hit_blocks} hit blocks unsafe; "
                  f"{m.naive_unsafe_requests} of {m.requests} requests got at least one unsafe block",
            params={**mix, "category": "all"}))
        for c in CATEGORIES:
            rows.append(SummaryRow(metric="naive_unsafe_share", subject="naive content-hash cache",
                                   value=_pct(m.naive_unsafe[c], m.naive_hit_blocks), unit="% of hit blocks",
                                   n=m.naive_hit_blocks,
                                   notes=f"{m.naive_unsafe[c]} of {m.naive_hit_blocks} hit blocks",
                                   params={**mix, "category": c}))
        rows.append(SummaryRow(
            metric="unsafe_reuses_served", subject="QuillCache guard on", value=sum(m.on_unsafe.values()),
            unit="blocks", baseline="same planner, guard off", baseline_value=sum(m.off_unsafe.values()),
            n=m.requests,
            notes="every reused block audited by audit_reuse; guard off by category: "
                  + ", ".join(f"{c} {m.off_unsafe[c]}" for c in CATEGORIES), params=mix))
        safe_naive = m.naive_hit_blocks - m.naive_unsafe_blocks
        rows.append(SummaryRow(
            metric="safe_reuse_share", subject="QuillCache guard on",
            value=_pct(m.on_reused, m.prompt_blocks), unit="% of prompt blocks",
            baseline="naive cache, safe hits only", baseline_value=_pct(safe_naive, m.prompt_blocks),
            n=m.prompt_blocks,
            notes=f"guard on reused {m.on_reused} blocks ({m.public_shared_blocks} shared-public); guard off reused "
                  f"{m.off_reused}; naive hit {m.naive_hit_blocks} ({safe_naive} safe)", params=mix))
        on = [us for _, g, us in m.timing if g == "on"]
        off = [us for _, g, us in m.timing if g == "off"]
        ratios = [a / b for a, b in zip(on, off)]
        s_on, s_off, s_r = spread(on), spread(off), spread(ratios)
        rows.append(SummaryRow.from_spread(
            s_on, metric="plan_time", subject="guard on", unit="us/plan", baseline="guard off",
            baseline_value=s_off["median"], n=len(on),
            notes=f"guard off p10 {s_off['p10']:.2f} p90 {s_off['p90']:.2f}", params=mix))
        # paired: both planners timed on the same requests in every repetition
        rows.append(SummaryRow(
            metric="guard_overhead", subject="QuillCache guard", value=100.0 * (s_r["median"] - 1.0),
            unit="% of plan time", p10=100.0 * (s_r["p10"] - 1.0), p90=100.0 * (s_r["p90"] - 1.0), n=len(on),
            notes=f"median over {len(on)} repetitions of the paired guard-on/guard-off plan-time ratio, minus 1",
            params=mix))
    return rows


def anchors() -> list[Anchor]:
    """The seed's reported figures for this study: comparison points, never same-run baselines."""
    out = [Anchor(metric="naive_unsafe_share", subject="naive content-hash cache",
                  value=SEED_REPORTED["naive_unsafe_share_pct"], unit="% of hit blocks",
                  source="the seed (its collision workload)", params={"category": "all"})]
    for mix, pct in SEED_REPORTED["overhead_pct"].items():
        out.append(Anchor(metric="guard_overhead", subject="the seed's guard", value=pct, unit="% of plan time",
                          source="the seed", params={"mix": mix}))
    return out


def plot(results_root: str | Path | None = None, out_dir: str | Path = "paper/figures") -> Path:
    """``safety.png`` from the results only: (a) what a naive cache serves unsafely, by category;
    (b) unsafe reuses served with the guard off and on; (c) the guard's cost in plan time."""
    from experiments.plotstyle import BASELINE, OURS, PALETTE, figure, legend, save, style_axes
    from quillcache.results import read_anchors, read_summary

    s = read_summary(STUDY, results_root)
    anc = read_anchors(STUDY, results_root)
    mixes = list(dict.fromkeys(s["mix"]))
    fig, axes = figure(10.0, 3.6, 1, 3)
    ax = axes[0]
    share = s[(s["metric"] == "naive_unsafe_share") & (s["category"] != "all")]
    bottom = np.zeros(len(mixes))
    for c, colour in zip(CATEGORIES, PALETTE[2:]):
        vals = np.array([float(share[(share["mix"] == m) & (share["category"] == c)]["value"].sum()) for m in mixes])
        ax.bar(mixes, vals, bottom=bottom, label=c, color=colour)
        bottom += vals
    for x, v in enumerate(bottom):
        ax.annotate(f"{v:.1f}%", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 110)
    style_axes(ax, ylabel="% of the naive cache's hits", title="Naive cache: unsafe hits (lower is better)")
    legend(ax, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    ax = axes[1]
    served = s[s["metric"] == "unsafe_reuses_served"].set_index("mix")
    w = 0.38
    xs = np.arange(len(mixes))
    off = [float(served.loc[m, "baseline_value"]) for m in mixes]
    on = [float(served.loc[m, "value"]) for m in mixes]
    ax.bar(xs - w / 2, off, w, label="guard off (baseline)", color=BASELINE)
    ax.bar(xs + w / 2, on, w, label="guard on (ours)", color=OURS)
    for x, v in zip(xs + w / 2, on):
        ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels(mixes)
    style_axes(ax, ylabel="unsafe blocks served", title="Unsafe reuses served (lower is better)")
    legend(ax)
    ax = axes[2]
    ov = s[s["metric"] == "guard_overhead"].set_index("mix")
    vals = [float(ov.loc[m, "value"]) for m in mixes]
    err = np.array([[v - float(ov.loc[m, "p10"]) for m, v in zip(mixes, vals)],
                    [float(ov.loc[m, "p90"]) - v for m, v in zip(mixes, vals)]])
    ax.bar(xs, vals, 0.5, yerr=np.clip(err, 0, None), capsize=3, color=OURS, label="QuillCache (this run, p10-p90)")
    seed = anc[anc["metric"] == "guard_overhead"].set_index("mix") if len(anc) else None
    if seed is not None:
        ax.scatter(xs, [float(seed.loc[m, "value"]) if m in seed.index else np.nan for m in mixes], marker="D",
                   color="black", zorder=3, label="the seed, reported (anchor)")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(xs)
    ax.set_xticklabels(mixes)
    style_axes(ax, ylabel="% of plan time", title="Guard overhead (lower is better)")
    legend(ax, loc="upper left")
    return save(fig, Path(out_dir) / "safety.png")


def run(quick: bool = False, results_root: str | None = None, index_kind: str = DEFAULT_INDEX) -> list[SummaryRow]:
    t_start = time.monotonic()
    p = QUICK if quick else FULL
    results = []
    for mix, n in p["requests"].items():
        r = replay(mix, n, min(p["timing_requests"], n), p["reps"], index_kind)
        results.append(r)
        print(f"[safety] {mix}: {r.requests} requests replayed in {r.replay_s:.1f} s; naive unsafe "
              f"{r.naive_unsafe_blocks}/{r.naive_hit_blocks} hit blocks; served unsafe: guard on "
              f"{sum(r.on_unsafe.values())}, guard off {sum(r.off_unsafe.values())}", flush=True)
    rows = summarize(results)
    cat_rows = []
    for m in results:
        for c in CATEGORIES:
            cat_rows.append((m.mix, "naive", c, m.naive_unsafe[c], f"{_pct(m.naive_unsafe[c], m.naive_hit_blocks):.4f}"))
            cat_rows.append((m.mix, "guard-off", c, m.off_unsafe[c], ""))
            cat_rows.append((m.mix, "guard-on", c, m.on_unsafe[c], ""))
    write_raw(STUDY, "by_category.csv", ("mix", "cache", "category", "blocks", "share_of_naive_hits_pct"), cat_rows,
              root=results_root)
    write_raw(STUDY, "timing.csv", ("mix", "rep", "guard", "us_per_plan"),
              [(m.mix, rep, g, f"{us:.4f}") for m in results for rep, g, us in m.timing], root=results_root)
    write_raw(STUDY, "mixes.csv", ("mix", "requests", "prompt_blocks", "naive_hit_blocks", "naive_unsafe_blocks",
                                   "on_reused", "off_reused", "public_shared_blocks", "replay_s"),
              [(m.mix, m.requests, m.prompt_blocks, m.naive_hit_blocks, m.naive_unsafe_blocks, m.on_reused,
                m.off_reused, m.public_shared_blocks, f"{m.replay_s:.2f}") for m in results], root=results_root)
    profile = "custom" if index_kind != DEFAULT_INDEX else "quick" if quick else "full"
    path = write_summary(STUDY, rows, root=results_root, profile=profile, anchors=anchors(), started_at=t_start)
    print_table(rows, title="safety")
    print(f"[safety] wrote {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small configuration (< 30 s; the smoke test)")
    ap.add_argument("--results-root", default=None, help="results directory (default: results/)")
    ap.add_argument("--index", default=DEFAULT_INDEX,
                    help=f"residency index backend (default: {DEFAULT_INDEX}; any other marks the run custom)")
    args = ap.parse_args(argv)
    from quillcache.index import INDEX_BACKENDS
    if args.index not in INDEX_BACKENDS:  # refused before the workload is generated
        ap.error(f"--index {args.index!r}: unknown index backend; registered: {sorted(INDEX_BACKENDS)}")
    run(quick=args.quick, results_root=args.results_root, index_kind=args.index)


if __name__ == "__main__":
    main()
