"""Hit-rate study: every policy on the Mooncake conversation trace, pooled vs local caches, a
generalisation table over generated traces of other shapes, and replay throughput against
libCacheSim.

Cells (each writes rows into ``results/hitrate/summary.csv`` and raw CSVs beside it):
1. hit rate at 1k, 10k, 30k, 50k, 100k blocks and unlimited, for every policy in
   ``quillcache.hitrate.HITRATE_POLICIES`` (baseline: LRU at the same capacity), and for every
   policy but LRU and Belady the share of the LRU->Belady gap it closes (acceptance of issue 18
   for ``quillchain``, ours: >= 50% at 1k and 10k blocks, said in the row's notes).
2. pooled vs local (Mooncake FAST'25 §4: a global pool over 10 prefill nodes vs a cache per node):
   3M and 50M tokens of capacity, 512-token blocks (5,859 and 97,656 blocks). Local = 10 engines
   with a tenth of the capacity each; requests are spread either round-robin (request i goes to
   engine i mod 10) or by conversation affinity (engine = dense id of the request's second block
   mod 10; on this trace every request starts with the same system-prompt block, so the second
   block names the conversation). Local hit rate = all engines' hits / all blocks.
3. generalisation: ``GEN_SHAPES`` - seven ``quillcache gen-trace sessions`` shapes (base, long
   sessions, single turn, heavily shared prompts, high arrival rate, slow think time, tool-using
   agents; 512-token blocks, several seeds; ``gen_agent`` was added after QuillChain's defaults were
   fixed and never chose one) - and ``synthetic_conversation_trace`` (geometric turn counts with mean
   3, log-normal think times with a 60 s median and no floor, 8 shared system prompts of Zipf
   popularity), each at 1/3/10/30% of its distinct blocks, every policy: the gap closed (median
   over seeds) per shape, capacity and policy, and for quillchain and quillhd the share of
   (trace, seed, capacity) cells in which each beats LRU, SIEVE and S3-FIFO (notes list the
   cells it does not); and ``defaults_check``: QuillChain's defaults against alternatives
   (``DEFAULT_ALTERNATIVES``) on the same cells, which is how its defaults are justified;
   ``selector_headroom``: on the same cells, how many the challenger, each of its rules alone and a
   per-cell choice between them in hindsight win against the best of LRU, SIEVE and S3-FIFO (are
   the losses left the selector's or the rules'?); and
   ``cells_beaten_heldout`` (raw ``heldout.csv``): the same count on every shape at seeds that were
   never used to choose a default (``heldout_seeds``); and ``cells_beaten_random`` (raw
   ``random_shapes.csv``, knobs ``random_shape_knobs.csv``): the same count on ``random_shapes``
   session shapes with every knob of the generator drawn at once from ``RANDOM_SHAPE_SPACE``
   (none used to choose a default); ``cells_beaten_block16`` (raw ``block16.csv``): the same count
   on every shape cut into 16-token blocks (vLLM's default; every other generated trace here has
   512-token blocks, as Mooncake's), with QuillChain and QuillHD told the block size;
   ``cells_beaten_mixed`` (raw ``mixed.csv``): the same count on ``MIX_SHAPES``, traces in which
   several workloads share one cache (``mixed_arrays``: chat with agents, long chats with
   classification calls on long shared prompts, every shape at once) and the classification part
   alone, at ``mix_seeds``; each count's
   notes say in how many cells the baseline already equals Belady (nobody can beat it there); and ``loss_anatomy`` (raw ``loss_anatomy.csv``): in
   every cell of the table, the held-out seeds and the random shapes where QuillChain does not beat
   the best of LRU, SIEVE and S3-FIFO although that baseline is below Belady, the references the
   baseline hits and QuillChain misses (and the reverse), by the block's uses in the whole trace
   and the requests since its previous use (``quillcache.hitrate.anatomy``): what the remaining
   losses are made of; and ``sieve_spared`` (raw ``sieve_spared.csv``): on the conversation trace
   at every finite capacity and in every cell of the table, how many of SIEVE's evictions removed a
   block it had spared (hit since its insert; ``quillcache.hitrate.spared``) and SIEVE's and LFU's
   hit rates: with no such eviction the two are the same policy, which is why they so often tie.
4. replay throughput (block references/s, median of >= 5 repetitions, p10/p90 in the notes) of
   every kernel at 10k blocks, against, in the same run: libCacheSim's LRU (``libcachesim`` from
   PyPI) on the same reference stream written in its oracleGeneral binary format - imported here
   if installed, else run by the interpreter named in $QUILLCACHE_LIBCACHESIM_PYTHON - and the
   plain-Python OrderedDict LRU (always). Acceptance: >= 1,000,000 refs/s.
5. semi-online, apart from every online figure (metrics ``semi_online_*``): lookahead-W LRU, which
   sees the W requests queued at the engine (W = 1, 8, 64), on the conversation trace.
6. information bounds, offline and apart from every online figure (metrics ``information_bound_*``,
   raw ``information_bounds.csv``): ``quillcache.hitrate.bounds.reuse_oracle`` knows whether each
   referenced block will be referenced again, never when, at every finite capacity; and, at the
   acceptance capacities, the same oracle inverting whole requests at ``INFO_FLIP_RATES`` (a
   reuse predictor that is wrong about that share of requests; median over the seeds). What part
   of the LRU-to-Belady gap is *which* blocks come back, and how accurate an online predictor of
   that would have to be; beside it (``experiments.hitrate_predictability``, metrics
   ``reuse_predictability_*``, raw ``predictability.csv``) how well what is known at a request's
   arrival predicts whether its blocks come back: AUC and best accuracy of each feature, of a
   two-fold logistic regression on all of them, and of gradient-boosted trees (LightGBM) retrained
   on the past as the trace goes, with the labels an online cache has and with every past label;
   and what the trees' bits are worth as hits (metrics ``learned_reuse_*``, raw
   ``learned_reuse.csv``: ``quillcache.hitrate.predicted_reuse.predicted_reuse_lru`` at the
   acceptance capacities, every threshold raw, the best in hindsight summarised). The other half, *when*: ``timing_oracle`` (Belady
   that knows which blocks return exactly, and when only up to a log-normal factor per request) at
   the acceptance capacities for ``INFO_TIMING_SIGMAS`` and for the sigma measured for "the
   conversation comes back after the same gap as last time" (metric
   ``timing_predictability_sigma``; raw ``timing_bounds.csv``). Both halves together: the joint
   oracle (``joint_oracle``: *when* as wrong as that measured sigma, *which* wrong about
   ``INFO_FLIP_RATES`` of the requests and about the share matching the online trees' best balanced
   accuracy; raw ``joint_bounds.csv``) at the acceptance capacities: what a policy that commits to
   predictors that good could close.

Figures (``plot`` reads only the raw CSVs): ``paper/figures/hitrate.png`` (hit rate vs capacity
per policy, Belady dashed as the bound, the reuse oracle dotted), ``paper/figures/hitrate_pooled.png`` and
``paper/figures/hitrate_generalisation.png`` (gap closed per generated shape and capacity) and
``paper/figures/hitrate_random.png`` (its distribution over the random shapes).
Quick mode (smoke test) uses the first 2,500 requests, fewer capacities, 120 sessions per shape,
one seed and 2 repetitions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.hitrate_predictability import (
    GBM_CHUNK,
    GBM_SUBJECTS,
    GBM_THRESHOLDS,
    LABEL_MODES,
    best_balanced_accuracy,
    gbm_scores,
    predictability,
    predicted_bits,
    reuse_labels,
)
from quillcache.hitrate import HITRATE_POLICIES, SEMI_ONLINE, simulate
from quillcache.hitrate.anatomy import GAP_LABELS, USES_LABELS, anatomy
from quillcache.hitrate.arrays import TraceArrays, arrays_from_lists, load_arrays
from quillcache.hitrate.spared import sieve_spared_evictions
from quillcache.hitrate.turns import robust_sigma, turn_gap_log_ratios
from quillcache.results import Anchor, SummaryRow, print_table, spread, write_raw, write_summary
from quillcache.traces.loader import MOONCAKE_BLOCK_TOKENS, default_trace_path

NAME = "hitrate"
POLICY_ORDER = ["lru", "lfu", "fifo", "s3fifo", "sieve", "arc", "2q", "lengthaware", "tinylfu", "lhd", "lrb", "quillhd",
                "quillchain", "belady"]
FULL = {"caps": [1000, 10000, 30000, 50000, 100000, None], "limit": None, "reps": 5, "synth_conversations": 6000,
        "gen_sessions": 1000, "gen_seeds": (1, 2, 3), "heldout_seeds": (4, 5, 6), "flip_seeds": (0, 1, 2),
        "random_shapes": 40, "random_seed": 2, "block16_sessions": 200, "block16_seeds": (4, 5), "gbm": {},
        "mix_seeds": (11, 12, 13)}
QUICK = {"caps": [1000, 10000, None], "limit": 2500, "reps": 2, "synth_conversations": 300,
         "gen_sessions": 120, "gen_seeds": (1,), "heldout_seeds": (2,), "flip_seeds": (0,),
         "random_shapes": 2, "random_seed": 2, "block16_sessions": 15, "block16_seeds": (2,), "mix_seeds": (3,),
         "gbm": {"chunk": 250, "min_train": 300}}  # the quick trace is too short for the full profile's first model
OURS = "quillchain"
ACCEPT_GAP = 0.5  # issue 18: >= 50% of the LRU->Belady gap at 1k and 10k blocks on the conversation trace
ACCEPT_GAP_CAPS = (1000, 10000)
GEN_FRACTIONS = (0.01, 0.03, 0.10, 0.30)  # generalisation capacities: shares of a trace's distinct blocks
GEN_BASELINES = ("lru", "sieve", "s3fifo")
# QuillChain's defaults and the alternatives they are checked against (cell 3, "defaults_check")
DEFAULT_ALTERNATIVES: dict[str, dict] = {
    "defaults": {}, "admit=off": {"admit": False}, "shared_rate=off": {"shared_rate": False},
    "second_chance=off": {"second_chance": False}, "cap_period=off": {"cap_period": False},
    "start_rule=hd": {"start_rule": "hd"},
    "mode=adaptive": {"mode": "adaptive"}, "mode=hd": {"mode": "hd"},
    "mode=lru": {"mode": "lru"}, "period=1024": {"period": 1024}, "period=4096": {"period": 4096},
    "period=16384": {"period": 16384}, "decay=0.5": {"decay": 0.5}, "che_mult=2": {"che_mult": 2.0},
    "quantile=0.99": {"quantile": 0.99},
}
INFO_FLIP_RATES = (0.05, 0.1, 0.2, 0.3)  # cell 6: share of requests whose reuse bits the noisy oracle inverts
INFO_TIMING_SIGMAS = (0.5, 1.0, 2.0)  # cell 6: the timing oracle's log-normal error (plus the measured one)
SEMI_ONLINE_WINDOWS = (1, 8, 64)  # lookahead windows in requests (cell 5, semi-online, reported apart)
POOL_TOKENS = [3_000_000, 50_000_000]
N_ENGINES = 10
PAPER_POOL_GAIN = 2.22
ACCEPT_REFS_S = 1_000_000
LCS_ENV = "QUILLCACHE_LIBCACHESIM_PYTHON"
SYNTH_LABEL = "synthetic_sessions"


def cap_label(cap: int | None) -> str:
    return "inf" if cap is None else f"{cap // 1000}k" if cap % 1000 == 0 else str(cap)


# ---------------------------------------------------------------- synthetic second trace


def synthetic_conversation_trace(n_conversations: int, seed: int = 7, duration_s: float = 3600.0,
                                 mean_turns: float = 3.0, think_median_s: float = 60.0, think_sigma: float = 1.2,
                                 n_prompts: int = 8, msg_median_tokens: float = 1500.0,
                                 block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> TraceArrays:
    """Multi-turn chat sessions as a Mooncake-style trace. Each conversation picks a system prompt
    (Zipf(1.2) over ``n_prompts``, 1-8 full blocks each, shared), starts at a uniform time, has a
    geometric number of turns (mean ``mean_turns``) separated by log-normal think times (median
    ``think_median_s``, no floor); turn t's input = everything so far + a new user message
    (log-normal, median ``msg_median_tokens``, sigma 1.2); output is log-normal (median 400 tokens). Only full blocks keep their ids across turns; a partial last
    block gets a fresh id every turn (its content changes), as with real chained block hashes."""
    rng = np.random.default_rng(seed)
    prompt_blocks = rng.integers(1, 9, n_prompts)
    zipf_w = 1.0 / np.arange(1, n_prompts + 1) ** 1.2
    zipf_w /= zipf_w.sum()
    next_id = int(prompt_blocks.sum())
    prompt_ids = np.split(np.arange(next_id), np.cumsum(prompt_blocks)[:-1])
    reqs: list[tuple[float, int, int, list[int]]] = []
    for _ in range(n_conversations):
        pr = int(rng.choice(n_prompts, p=zipf_w))
        full_ids = [int(x) for x in prompt_ids[pr]]
        tokens = len(full_ids) * block_tokens
        t = float(rng.uniform(0, duration_s))
        turns = int(rng.geometric(1.0 / mean_turns))
        for turn in range(turns):
            tokens += int(rng.lognormal(math.log(msg_median_tokens), 1.2)) + 1
            n_full = tokens // block_tokens
            while len(full_ids) < n_full:
                full_ids.append(next_id)
                next_id += 1
            ids = list(full_ids)
            if tokens % block_tokens:
                ids.append(next_id)
                next_id += 1
            out = int(rng.lognormal(math.log(400), 0.7)) + 1
            reqs.append((t, tokens, out, ids))
            tokens += out
            t += float(rng.lognormal(math.log(think_median_s), think_sigma))
    reqs.sort(key=lambda q: q[0])
    return arrays_from_lists([q[3] for q in reqs], timestamps_ms=[int(q[0] * 1000) for q in reqs],
                             input_tokens=[q[1] for q in reqs], output_tokens=[q[2] for q in reqs],
                             block_tokens=block_tokens)


# ---------------------------------------------------------------- generated traces of other shapes

# ``quillcache gen-trace sessions`` shapes (quillcache.traces.sessions.SessionsConfig fields), all at
# 512-token blocks with Mooncake-like long prompts (token sizes x8 of the generator's defaults);
# each differs from "base" in one or two knobs: session length, prompt sharing, arrival rate, think time
# (gen_agent in several: it is the shape of an agent loop, not one knob turned)
GEN_BASE = {"block_tokens": 512, "global_prompt_tokens": 8192, "tenant_prompt_tokens": 4096,
            "first_user_tokens_mean": 3200.0, "turn_user_tokens_mean": 960.0, "output_tokens_mean": 2000.0,
            "max_input_tokens": 131072}
GEN_SHAPES: dict[str, dict] = {
    "gen_base": {},
    "gen_long_sessions": {"mean_turns": 12.0, "max_turns": 64, "think_time_median_s": 60.0},
    "gen_single_turn": {"mean_turns": 1.3},
    "gen_shared_prompts": {"global_prompt_fraction": 0.95, "global_prompt_tokens": 32768, "num_tenants": 32,
                           "tenant_prompt_tokens": 16384},
    "gen_high_rate": {"session_rate_per_s": 6.0, "think_time_median_s": 8.0},
    "gen_slow_think": {"think_time_median_s": 240.0, "think_time_sigma": 1.5, "session_rate_per_s": 0.5},
    # tool-using agents: many long tool-definition prompts, several fast steps a session, each step
    # appending a tool result (long) after a short tool call (the answer)
    "gen_agent": {"num_tenants": 32, "prompts_per_tenant": 4, "tenant_prompt_tokens": 12288,
                  "global_prompt_fraction": 0.2, "mean_turns": 6.0, "think_time_median_s": 4.0,
                  "turn_user_tokens_mean": 2400.0, "output_tokens_mean": 300.0, "session_rate_per_s": 2.0},
}


def generated_trace(shape: str, seed: int, num_sessions: int) -> TraceArrays:
    """The ``GEN_SHAPES[shape]`` session trace (``quillcache.traces.sessions``) as arrays."""
    return session_arrays(num_sessions=num_sessions, seed=seed, **{**GEN_BASE, **GEN_SHAPES[shape]})


def session_arrays(**config) -> TraceArrays:
    """A ``quillcache.traces.sessions`` trace of ``SessionsConfig(**config)`` as arrays."""
    from quillcache.traces.sessions import SessionsConfig, generate

    cfg = SessionsConfig(**config)
    reqs = generate(cfg)
    return arrays_from_lists([q.hash_ids for q in reqs], timestamps_ms=[q.timestamp for q in reqs],
                             input_tokens=[q.input_length for q in reqs], output_tokens=[q.output_length for q in reqs],
                             block_tokens=cfg.block_tokens)


# ---------------------------------------------------------------- cells


def hit_rate_table(arrs: TraceArrays, caps: list[int | None], policies: list[str],
                   options: dict[str, dict] | None = None) -> dict[tuple[str, int | None], float]:
    """Hit rate per (policy, capacity); ``options`` gives kernel options per policy (e.g. block_tokens)."""
    assert arrs.prefix_chained, f"Belady bounds nothing on a trace that is not prefix-chained: {arrs.chain_break}"
    options = options or {}
    out = {}
    for pol in policies:
        for cap in caps:
            out[(pol, cap)] = simulate(arrs, pol, cap, **options.get(pol, {})).hit_rate
    return out


def split_engines(arrs: TraceArrays, how: str) -> list[TraceArrays]:
    r = arrs.num_requests
    if how == "round_robin":
        engine = np.arange(r) % N_ENGINES
    elif how == "affinity":
        engine = np.maximum(arrs.conv_ids.astype(np.int64), 0) % N_ENGINES
    else:
        raise ValueError(f"unknown routing {how!r}")
    return [arrs.subset(np.flatnonzero(engine == e)) for e in range(N_ENGINES)]


def pooled_vs_local(arrs: TraceArrays, policies: list[str]) -> list[tuple]:
    """Rows (policy, tokens, routing, pooled_hit_rate, local_hit_rate)."""
    out = []
    parts = {how: split_engines(arrs, how) for how in ("round_robin", "affinity")}
    for tokens in POOL_TOKENS:
        blocks = tokens // MOONCAKE_BLOCK_TOKENS
        for pol in policies:
            pooled = simulate(arrs, pol, blocks).hit_rate
            for how, engines in parts.items():
                hit = sum(simulate(e, pol, max(1, blocks // N_ENGINES)).hit_blocks for e in engines if e.num_refs)
                out.append((pol, tokens, how, pooled, hit / arrs.num_refs))
    return out


def python_lru(arrs: TraceArrays, cap: int) -> int:
    """The plain-Python OrderedDict LRU (prefix-aware), the baseline of the throughput cell."""
    off = arrs.req_offsets.tolist()
    blocks = arrs.blocks.tolist()
    c: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in range(len(off) - 1):
        s, e = off[r], off[r + 1]
        for p in range(s, e):
            if blocks[p] in c:
                hits += 1
            else:
                break
        for p in range(s, e):
            b = blocks[p]
            if b in c:
                c.move_to_end(b)
            else:
                if len(c) >= cap:
                    c.popitem(last=False)
                c[b] = None
    return hits


def write_oracle_general(arrs: TraceArrays, path: Path) -> None:
    """libCacheSim's oracleGeneral binary: packed {u32 time_s, u64 obj_id, u32 size, i64 next_vtime}."""
    dt = np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
    rec = np.zeros(arrs.num_refs, dt)
    rec["t"] = np.repeat(arrs.timestamps_ms // 1000, np.diff(arrs.req_offsets))
    rec["id"] = arrs.blocks.astype(np.uint64) + 1
    rec["size"] = 1
    rec["next"] = np.where(arrs.next_use < arrs.num_refs, arrs.next_use, -1)
    rec.tofile(path)


_LCS_SCRIPT = """
import json, sys, time
import libcachesim as lcs
path, cap, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
for _ in range(reps):
    reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = lcs.LRU(cache_size=cap)
    t0 = time.perf_counter()
    mr, _bmr = cache.process_trace(reader)
    out.append([time.perf_counter() - t0, mr])
print(json.dumps({"version": getattr(lcs, "__version__", "?"), "runs": out}))
"""


def libcachesim_lru(arrs: TraceArrays, cap: int, reps: int) -> tuple[list[tuple[float, float]], str]:
    """[(elapsed_s, miss_ratio)] per repetition and a note on how it ran; [] and the reason if it
    cannot run here."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.oracleGeneral.bin"
        write_oracle_general(arrs, path)
        pythons = []
        try:
            import libcachesim  # noqa: F401
            pythons.append(sys.executable)
        except ImportError:
            pass
        if os.environ.get(LCS_ENV):
            pythons.append(os.environ[LCS_ENV])
        if not pythons:
            return [], (f"libcachesim is not importable here and ${LCS_ENV} is unset "
                        "(pip install libcachesim into a separate venv and point the variable at its python)")
        try:
            res = subprocess.run([pythons[0], "-c", _LCS_SCRIPT, str(path), str(cap), str(reps)],
                                 capture_output=True, text=True, timeout=300, check=True)
            data = json.loads(res.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
            return [], f"libcachesim run failed: {exc}"
        return [(float(a), float(b)) for a, b in data["runs"]], f"libcachesim {data['version']} ({'this interpreter' if pythons[0] == sys.executable else '$' + LCS_ENV})"


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------- generalisation


def generalisation_traces(cfg: dict) -> list[tuple[str, int, TraceArrays]]:
    """(label, seed, arrays) of every generated shape x seed, then the synthetic sessions trace."""
    out = [(shape, seed, generated_trace(shape, seed, cfg["gen_sessions"])) for shape in GEN_SHAPES
           for seed in cfg["gen_seeds"]]
    out.append((SYNTH_LABEL, 7, synthetic_conversation_trace(cfg["synth_conversations"])))
    return out


BLOCK16_TOKENS = 16  # vLLM's default KV block size


def block16_traces(cfg: dict) -> list[tuple[str, int, TraceArrays]]:
    """Every ``GEN_SHAPES`` shape at ``BLOCK16_TOKENS``-token blocks (``block16_seeds``,
    ``block16_sessions`` sessions each): the same sessions cut into blocks 32 times smaller, as an
    engine with small KV blocks sees them. The full profile uses the held-out seeds 4 and 5: no
    default was chosen on them (QuillChain's ``period_refs`` rule was checked at seeds 1 and 2)."""
    return [(shape, seed, session_arrays(num_sessions=cfg["block16_sessions"], seed=seed,
                                         **{**GEN_BASE, **GEN_SHAPES[shape], "block_tokens": BLOCK16_TOKENS}))
            for shape in GEN_SHAPES for seed in cfg["block16_seeds"]]


def heldout_traces(cfg: dict) -> list[tuple[str, int, TraceArrays]]:
    """(label, seed, arrays) of every generated shape at the held-out seeds: traces made the same
    way as the generalisation table's but never looked at when QuillChain's defaults were chosen."""
    return [(shape, seed, generated_trace(shape, seed, cfg["gen_sessions"])) for shape in GEN_SHAPES
            for seed in cfg["heldout_seeds"]]


# cell 3, mixed shapes: one cache serving several workloads at once. A part is a GEN_SHAPES shape or a MIX_PARTS
# entry; every part spans the same time (``mixed_arrays``)
MIX_PARTS: dict[str, dict] = {
    # classification-style calls: single requests on a few long shared instruction prompts, a few answer tokens
    # (the shape of the shared-prompt requests of Mooncake's published traces)
    "classify": {"num_tenants": 4, "prompts_per_tenant": 2, "tenant_prompt_tokens": 6144,
                 "global_prompt_fraction": 0.0, "mean_turns": 1.2, "first_user_tokens_mean": 1500.0,
                 "output_tokens_mean": 20.0, "session_rate_per_s": 6.0},
}
MIX_SHAPES: dict[str, tuple[str, ...]] = {
    "mix_chat_agent": ("gen_base", "gen_agent"),
    "mix_chat_classify": ("gen_long_sessions", "classify"),
    "mix_every_shape": (*GEN_SHAPES, "classify"),
    "classify_alone": ("classify",),  # the new part by itself: no other workload to learn from
}


def mix_part(name: str) -> dict:
    """The SessionsConfig knobs of one part of a mixed trace (``GEN_BASE`` under them)."""
    return {**GEN_BASE, **(GEN_SHAPES[name] if name in GEN_SHAPES else MIX_PARTS[name])}


def mixed_arrays(parts: Sequence[str], seed: int, num_sessions: int) -> TraceArrays:
    """The parts' session traces as one, merged by arrival time. Every part spans the same time:
    part ``i`` gets ``num_sessions * rate_i / sum(rates)`` sessions (at least 1), ``rate_i`` its
    session arrival rate. Each part keeps its own block ids (a part's ids are shifted past the
    previous parts'), so parts share no block; requests with equal timestamps keep part order."""
    from quillcache.traces.sessions import SessionsConfig, generate

    knobs = [mix_part(p) for p in parts]
    rates = [SessionsConfig(**k).session_rate_per_s for k in knobs]
    merged: list[tuple[int, int, list[int], int, int]] = []
    shift = 0
    for i, (k, rate) in enumerate(zip(knobs, rates)):
        n = max(1, round(num_sessions * rate / sum(rates)))
        reqs = generate(SessionsConfig(**{**k, "num_sessions": n, "seed": seed}))
        top = -1
        for q in reqs:
            ids = [h + shift for h in q.hash_ids]
            top = max(top, *ids) if ids else top
            merged.append((q.timestamp, i, ids, q.input_length, q.output_length))
        shift = max(shift, top + 1)
    merged.sort(key=lambda m: (m[0], m[1]))
    return arrays_from_lists([m[2] for m in merged], timestamps_ms=[m[0] for m in merged],
                             input_tokens=[m[3] for m in merged], output_tokens=[m[4] for m in merged],
                             block_tokens=GEN_BASE["block_tokens"])


def mixed_traces(cfg: dict) -> list[tuple[str, int, TraceArrays]]:
    """(label, seed, arrays) of every ``MIX_SHAPES`` mix at ``mix_seeds`` (``gen_sessions`` sessions
    per part on average), none used to choose a QuillChain default."""
    return [(mix, seed, mixed_arrays(parts, seed, cfg["gen_sessions"] * len(parts)))
            for mix, parts in MIX_SHAPES.items() for seed in cfg["mix_seeds"]]


# cell 3, random shapes: session shapes drawn at random, every knob at once, from these ranges (log-uniform where a
# knob spans orders of magnitude); the rest as GEN_BASE, at most 64 turns a session
RANDOM_SHAPE_SPACE: dict[str, tuple] = {
    "mean_turns": ("log", 1.0, 16.0), "think_time_median_s": ("log", 2.0, 600.0),
    "think_time_sigma": ("uniform", 0.3, 2.0), "session_rate_per_s": ("log", 0.2, 8.0),
    "global_prompt_fraction": ("uniform", 0.0, 1.0), "num_tenants": ("int", 1, 64),
    "tenant_prompt_tokens": ("choice", 0, 1024, 4096, 8192, 16384), "prompts_per_tenant": ("int", 1, 5),
    "turn_user_tokens_mean": ("log", 100.0, 4000.0), "output_tokens_mean": ("log", 50.0, 3000.0),
}


def random_shape(rng: np.random.Generator) -> dict:
    """One draw of every ``RANDOM_SHAPE_SPACE`` knob (SessionsConfig fields)."""
    out: dict = {}
    for name, (kind, *args) in RANDOM_SHAPE_SPACE.items():
        if kind == "log":
            out[name] = float(np.exp(rng.uniform(np.log(args[0]), np.log(args[1]))))
        elif kind == "uniform":
            out[name] = float(rng.uniform(args[0], args[1]))
        elif kind == "int":
            out[name] = int(rng.integers(args[0], args[1] + 1))
        else:
            out[name] = int(rng.choice(args))
    return out


def random_shape_traces(cfg: dict) -> list[tuple[str, int, TraceArrays, dict]]:
    """(label, seed, arrays, knobs) of ``cfg["random_shapes"]`` shapes drawn by ``random_shape``
    from ``numpy.random.default_rng(cfg["random_seed"])``; shape ``i`` is generated with seed
    ``1000 + i``. None of them was used to choose a QuillChain default."""
    rng = np.random.default_rng(cfg["random_seed"])
    out = []
    for i in range(cfg["random_shapes"]):
        knobs = random_shape(rng)
        arrs = session_arrays(num_sessions=cfg["gen_sessions"], seed=1000 + i, **{**GEN_BASE, "max_turns": 64, **knobs})
        out.append((f"random_{i:02d}", 1000 + i, arrs, knobs))
    return out


def generalisation(policies: list[str], traces: list[tuple[str, int, TraceArrays]],
                   options: dict[str, dict] | None = None) -> list[tuple]:
    """Raw rows (trace, seed, policy, cap_fraction, capacity_blocks, hit_rate, gap_closed)."""
    out = []
    for label, seed, arrs in traces:
        caps = [max(1, int(arrs.num_unique * f)) for f in GEN_FRACTIONS]
        tab = hit_rate_table(arrs, caps, policies, options)
        for f, cap in zip(GEN_FRACTIONS, caps):
            lru, bel = tab[("lru", cap)], tab[("belady", cap)]
            for pol in policies:
                gap = (tab[(pol, cap)] - lru) / (bel - lru) if bel - lru > 1e-12 else math.nan
                out.append((label, seed, pol, f, cap, tab[(pol, cap)], gap))
    return out


def defaults_check(traces: list[tuple[str, int, TraceArrays]]) -> tuple[list[tuple], list[SummaryRow]]:
    """QuillChain's defaults against each alternative of ``DEFAULT_ALTERNATIVES`` on the
    generalisation traces (every shape and seed, every capacity fraction): raw rows (trace, seed,
    cap_fraction, alternative, gap_closed) and one summary row per alternative: the median gap
    closed, and in its notes the cells where it is better / worse than the defaults by more than
    one point of the gap. This is how the defaults in ``quillcache.policies.quillchain`` are justified."""
    raw = []
    for label, seed, arrs in traces:
        for f in GEN_FRACTIONS:
            cap = max(1, int(arrs.num_unique * f))
            lru, bel = simulate(arrs, "lru", cap).hit_rate, simulate(arrs, "belady", cap).hit_rate
            if bel - lru <= 1e-12:
                continue
            for alt, kw in DEFAULT_ALTERNATIVES.items():
                raw.append((label, seed, f, alt, (simulate(arrs, OURS, cap, **kw).hit_rate - lru) / (bel - lru)))
    base = {(t, sd, f): g for t, sd, f, alt, g in raw if alt == "defaults"}
    rows = []
    for alt in DEFAULT_ALTERNATIVES:
        mine = [(t, sd, f, g) for t, sd, f, a, g in raw if a == alt]
        better = sum(g > base[(t, sd, f)] + 0.01 for t, sd, f, g in mine)
        worse = sum(g < base[(t, sd, f)] - 0.01 for t, sd, f, g in mine)
        rows.append(SummaryRow(metric="defaults_check", subject=f"{OURS} {alt}",
                               value=float(np.median([g for *_, g in mine])), unit="fraction of the LRU-to-Belady gap",
                               baseline=f"{OURS} defaults", baseline_value=float(np.median(list(base.values()))),
                               n=len(mine), notes=f"better in {better}, worse in {worse} of {len(mine)} cells "
                                                  f"(by > 1 point of the gap)", params={"trace": "generalisation"}))
    return raw, rows


SELECTOR_RULES = {"hd rule only": "mode=hd", "lru rule only": "mode=lru"}  # defaults_check's fixed-rule alternatives


def selector_headroom(raw_gen: list[tuple], raw_defaults: list[tuple]) -> list[SummaryRow]:
    """Whether QuillChain's remaining losses on the table belong to its rule selector or to its two
    rules: on the cells of ``defaults_check`` (those with room between LRU and Belady), the number
    of cells in which each of these beats the best of ``GEN_BASELINES``: the challenger (the
    defaults), each rule alone (``SELECTOR_RULES``), the better of the two fixed rules chosen per
    cell in hindsight, and the best of all three chosen per cell in hindsight. No online selector
    between the two rules can be relied on to beat a hindsight choice of the better fixed rule; if
    the challenger wins as many cells as that choice, the cells left are the rules' to win."""
    best: dict[tuple[str, int, float], float] = {}  # the best baseline's gap closed (LRU's is 0)
    for label, seed, pol, f, _cap, _hr, gap in raw_gen:
        if pol in GEN_BASELINES and not math.isnan(gap):
            best[(label, seed, f)] = max(best.get((label, seed, f), 0.0), gap)
    gaps: dict[tuple[str, int, float], dict[str, float]] = {}
    for label, seed, f, alt, gap in raw_defaults:
        gaps.setdefault((label, seed, f), {})[alt] = gap
    wanted = ("defaults", *SELECTOR_RULES.values())
    cells = {c: v for c, v in gaps.items() if c in best and all(a in v for a in wanted)}
    fixed = list(SELECTOR_RULES.values())
    choices = {f"{OURS} challenger": lambda v: v["defaults"],
               **{f"{OURS} {name}": (lambda v, a=alt: v[a]) for name, alt in SELECTOR_RULES.items()},
               "hindsight: better fixed rule per cell": lambda v: max(v[a] for a in fixed),
               "hindsight: best of challenger and fixed rules per cell": lambda v: max(v[a] for a in wanted)}
    rows = []
    for subject, pick in choices.items():
        won = sum(pick(v) > best[c] for c, v in cells.items())
        rows.append(SummaryRow(metric="selector_headroom", subject=subject, value=float(won), unit="cells",
                               baseline="best of lru, sieve, s3fifo", n=len(cells),
                               notes=f"beats the best of {', '.join(GEN_BASELINES)} in {won} of {len(cells)} cells"
                                     + (" (a choice in hindsight, not an online policy)"
                                        if subject.startswith("hindsight") else ""),
                               params={"trace": "generalisation"}))
    return rows


def loss_anatomy(sets: dict[str, tuple[list[tuple[str, int, TraceArrays]], list[tuple]]]
                 ) -> tuple[list[tuple], list[SummaryRow]]:
    """For every cell of every set (name -> (traces, raw rows as ``generalisation`` returns)) where
    QuillChain's hit rate is not above the best of ``GEN_BASELINES`` although that baseline is below
    Belady: ``quillcache.hitrate.anatomy`` of QuillChain against that baseline. Raw rows (set, trace,
    seed, cap_fraction, baseline, uses, previous_use, references, ours_only, baseline_only); summary
    rows ``loss_anatomy``: per uses bucket and per previous-use bucket, the share of the net lost
    references (baseline_only - ours_only, summed over the lost cells)."""
    raw_out: list[tuple] = []
    for name, (traces, raw) in sets.items():
        by_cell: dict[tuple[str, int, float], dict[str, tuple[int, float]]] = {}
        for label, seed, pol, f, cap, hr, _gap in raw:
            by_cell.setdefault((label, seed, f), {})[pol] = (cap, hr)
        arrays = {(label, seed): arrs for label, seed, arrs in traces}
        for (label, seed, f), v in sorted(by_cell.items()):
            best = max(GEN_BASELINES, key=lambda b: v[b][1])
            cap, best_hr = v[best]
            if v[OURS][1] > best_hr or best_hr >= v["belady"][1] - 1e-12:
                continue
            arrs = arrays[(label, seed)]
            ours_hits = simulate(arrs, OURS, cap).hits_per_request
            for c in anatomy(arrs, ours_hits, simulate(arrs, best, cap).hits_per_request):
                raw_out.append((name, label, seed, f, best, c.uses, c.previous_use, c.references, c.a_only, c.b_only))
    rows: list[SummaryRow] = []
    cells = {(r[0], r[1], r[2], r[3]) for r in raw_out}
    net = sum(r[9] - r[8] for r in raw_out)
    for col, labels in ((5, USES_LABELS), (6, GAP_LABELS)):
        for lb in labels:
            mine = [r for r in raw_out if r[col] == lb]
            if not any(r[8] or r[9] for r in mine):  # e.g. first references: never a hit of anyone
                continue
            lost = sum(r[9] - r[8] for r in mine)
            rows.append(SummaryRow(metric="loss_anatomy", subject=OURS, value=lost / net if net > 0 else math.nan,
                                   unit="fraction of the net lost references", baseline="best of lru, sieve, s3fifo",
                                   n=len(cells), notes=f"{lost} of {net} net lost references over {len(cells)} lost "
                                                       f"cells ({sum(r[9] for r in mine)} hit by the baseline only, "
                                                       f"{sum(r[8] for r in mine)} by {OURS} only)",
                                   params={"trace": "generalisation, all sets",
                                           ("uses" if col == 5 else "previous_use"): lb}))
    return raw_out, rows


def sieve_spared(arrs: TraceArrays, label: str, caps: list[int | None], table: dict,
                 gen_traces: list[tuple[str, int, TraceArrays]], raw_gen: list[tuple]
                 ) -> tuple[list[tuple], list[SummaryRow]]:
    """SIEVE's evictions of blocks it had spared (``quillcache.hitrate.spared``) on the conversation
    trace at every finite capacity (set ``trace``) and in every cell of the generalisation table (set
    ``table``). Raw rows (set, trace, seed, cap_fraction, capacity_blocks, evictions, spared_evictions,
    first_spared_request, sieve_hit_rate, lfu_hit_rate, spared_resident, spared_idle_median_requests);
    summary rows ``sieve_spared_evictions``, ``sieve_spared_resident`` and ``sieve_spared_idle_requests``
    per conversation capacity and ``sieve_lfu_agreement`` over the table's cells."""
    raw: list[tuple] = []
    for cap in caps:
        if cap is not None:
            sp = sieve_spared_evictions(arrs, cap)
            raw.append(("trace", label, "", "", cap, sp.evictions, sp.spared, sp.first_spared_request,
                        table[("sieve", cap)], table[("lfu", cap)], sp.spared_resident,
                        sp.spared_idle_median_requests))
    by_cell: dict[tuple[str, int, float], dict[str, tuple[int, float]]] = {}
    for tr, seed, pol, f, cap, hr, _gap in raw_gen:
        if pol in ("sieve", "lfu"):
            by_cell.setdefault((tr, seed, f), {})[pol] = (cap, hr)
    arrays = {(tr, seed): a for tr, seed, a in gen_traces}
    for (tr, seed, f), v in sorted(by_cell.items()):
        cap = v["sieve"][0]
        sp = sieve_spared_evictions(arrays[(tr, seed)], cap)
        raw.append(("table", tr, seed, f, cap, sp.evictions, sp.spared, sp.first_spared_request,
                    v["sieve"][1], v["lfu"][1], sp.spared_resident, sp.spared_idle_median_requests))
    rows: list[SummaryRow] = []
    for _set, tr, _seed, _f, cap, ev, spared, first, s_hr, l_hr, resident, idle in raw:
        if _set != "trace":
            continue
        p = {"trace": tr, "capacity_blocks": cap}
        rows.append(SummaryRow(metric="sieve_spared_resident", subject="sieve", value=resident / cap,
                               unit="fraction of the capacity", n=resident,
                               notes=f"after the last request, {resident} of {cap} cached blocks are spared "
                                     f"(hit since their insert), last hit a median {idle:g} requests earlier, "
                                     f"of {arrs.num_requests}", params=p))
        rows.append(SummaryRow(metric="sieve_spared_idle_requests", subject="sieve", value=idle, unit="requests",
                               n=resident, notes="median requests since the last hit of the spared blocks cached "
                                                 "after the last request", params=p))
        rows.append(SummaryRow(metric="sieve_spared_evictions", subject="sieve", value=spared / ev if ev else 0.0,
                               unit="fraction of SIEVE's evictions", n=ev,
                               notes=f"{spared} of {ev} evictions removed a block hit since its insert"
                                     f"{'' if first < 0 else f' (first in request {first})'}; "
                                     f"hit rate sieve={s_hr:.4f} lfu={l_hr:.4f}",
                               params=p))
    cells = [r for r in raw if r[0] == "table"]
    if cells:
        same = [r for r in cells if r[8] == r[9]]
        unspared = [r for r in cells if r[6] == 0]
        differ_spared = [r for r in cells if r[8] != r[9] and r[6] > 0]
        rows.append(SummaryRow(metric="sieve_lfu_agreement", subject="sieve", value=len(same) / len(cells),
                               unit="fraction of cells with SIEVE's hit rate equal to LFU's", n=len(cells),
                               baseline="lfu",
                               notes=f"SIEVE's hit rate equals LFU's in {len(same)} of {len(cells)} cells; "
                                     f"{sum(r[8] == r[9] for r in unspared)} of the {len(unspared)} cells with no "
                                     "spared eviction are among them"
                                     + (f", and {len(differ_spared)} of the {len(cells) - len(same)} cells where "
                                        "they differ had spared evictions" if len(same) < len(cells) else ""),
                               params={"trace": "generalisation"}))
    return raw, rows


def generalisation_rows(raw: list[tuple], policies: list[str]) -> list[SummaryRow]:
    """Per trace shape, capacity fraction and policy: the gap closed (median over seeds, p10/p90);
    per policy of ours: the share of (trace, seed, capacity) cells where it beats each baseline."""
    rows: list[SummaryRow] = []
    cells: dict[tuple[str, float], dict[int, dict[str, float]]] = {}
    for label, seed, pol, f, _cap, hr, _gap in raw:
        cells.setdefault((label, f), {}).setdefault(seed, {})[pol] = hr
    for (label, f), by_seed in cells.items():
        for pol in policies:
            if pol in ("lru", "belady"):
                continue
            gaps = [(v[pol] - v["lru"]) / (v["belady"] - v["lru"]) for v in by_seed.values()
                    if v["belady"] - v["lru"] > 1e-12]
            if not gaps:
                continue
            sp = spread(gaps)
            rows.append(SummaryRow.from_spread(sp, metric="gap_closed", subject=pol,
                                               unit="fraction of the LRU-to-Belady gap", n=len(gaps),
                                               notes=f"median over {len(gaps)} seed(s)",
                                               params={"trace": label, "cap_fraction": f}))
    return rows + cells_beaten_rows(raw, policies)


def cells_beaten_rows(raw: list[tuple], policies: list[str], metric: str = "cells_beaten",
                      trace: str = "generalisation") -> list[SummaryRow]:
    """Per policy of ours and baseline of ``GEN_BASELINES``: the share of (trace, seed, capacity)
    cells of ``raw`` (rows as ``generalisation`` returns) where ours has the strictly higher hit
    rate; the notes name the (trace, capacity) of every cell it does not win."""
    cells: dict[tuple[str, int, float], dict[str, float]] = {}
    for label, seed, pol, f, _cap, hr, _gap in raw:
        cells.setdefault((label, seed, f), {})[pol] = hr
    rows = []
    for ours in (OURS, "quillhd"):
        if ours not in policies:
            continue
        for base in GEN_BASELINES:
            won = [v[ours] > v[base] for v in cells.values()]
            lost = sorted({(label, f) for (label, _seed, f), v in cells.items() if v[ours] <= v[base]})
            no_room = sum(v[base] >= v["belady"] - 1e-12 for v in cells.values() if "belady" in v)
            rows.append(SummaryRow(metric=metric, subject=ours, value=sum(won) / len(won), unit="fraction",
                                   baseline=base, n=len(won),
                                   notes=("beats it in every cell" if not lost else
                                          "not beaten in: " + ", ".join(f"{lb} {f:.0%}" for lb, f in lost))
                                   + (f"; in {no_room} cell(s) {base} already equals Belady (no room to beat it)"
                                      if no_room else ""),
                                   params={"trace": trace}))
    return rows


# ---------------------------------------------------------------- run


def trace_label(trace: str | os.PathLike | None) -> str:
    """The name rows carry for a trace: its file stem (the shared default is 'conversation_trace')."""
    return Path(trace if trace is not None else default_trace_path()).stem


def run(quick: bool = False, results_root: str | None = None, trace: str | os.PathLike | None = None) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    label = trace_label(trace)
    arrs = load_arrays(trace if trace is not None else default_trace_path(), limit=cfg["limit"])
    policies = [p for p in POLICY_ORDER if p in HITRATE_POLICIES]
    caps = cfg["caps"]
    rows: list[SummaryRow] = []
    raw_hr: list[tuple] = []
    size = f"{arrs.num_requests} requests, {arrs.num_refs} block references"

    def cap_params(cap: int | None) -> dict:  # unlimited: no capacity_blocks (NA in the frame)
        return {} if cap is None else {"capacity_blocks": cap}

    # 1. hit rate per policy and capacity, and the share of the LRU->Belady gap each closes
    table = hit_rate_table(arrs, caps, policies)
    for (pol, cap), hr in table.items():
        raw_hr.append((label, pol, "" if cap is None else cap, hr))
    for cap in caps:
        lru, bel = table[("lru", cap)], table[("belady", cap)]
        for pol in policies:
            rows.append(SummaryRow(metric="hit_rate", subject=pol, value=table[(pol, cap)], unit="fraction",
                                   baseline="lru", baseline_value=lru, notes=size,
                                   params={"trace": label, **cap_params(cap)}))
        gap = bel - lru
        for pol in policies:
            if pol in ("lru", "belady") or cap is None:
                continue
            closed = (table[(pol, cap)] - lru) / gap if gap > 1e-12 else math.nan
            note = f"lru={lru:.4f} {pol}={table[(pol, cap)]:.4f} belady={bel:.4f}"
            if pol == OURS and cap in ACCEPT_GAP_CAPS:
                note += f"; {'meets' if closed >= ACCEPT_GAP else 'BELOW'} the {ACCEPT_GAP:.0%} acceptance bar"
            rows.append(SummaryRow(metric="gap_closed", subject=pol, value=closed,
                                   unit="fraction of the LRU-to-Belady gap", notes=note,
                                   params={"trace": label, **cap_params(cap)}))

    # 2. pooled vs local
    pool_pols = ["lru", OURS, "belady"]
    raw_pool = pooled_vs_local(arrs, pool_pols)
    for pol, tokens, how, pooled, local in raw_pool:
        rows.append(SummaryRow(metric="pooled_hit_rate", subject=pol, value=pooled, unit="fraction",
                               baseline=f"{pol}, {N_ENGINES} local caches", baseline_value=local,
                               notes=f"{N_ENGINES} engines x {tokens // MOONCAKE_BLOCK_TOKENS // N_ENGINES} blocks "
                                     f"vs one pool of {tokens // MOONCAKE_BLOCK_TOKENS}",
                               params={"trace": label, "capacity_tokens": tokens,
                                       "capacity_blocks": tokens // MOONCAKE_BLOCK_TOKENS,
                                       "engines": N_ENGINES, "routing": how}))

    # 3. generalisation: generated traces of other shapes (several seeds) and the synthetic trace,
    #    capacities as fractions of each trace's distinct blocks
    gen_traces = generalisation_traces(cfg)
    raw_gen = generalisation(policies, gen_traces)
    rows += generalisation_rows(raw_gen, policies)
    raw_defaults, default_rows = defaults_check(gen_traces)
    rows += default_rows
    rows += selector_headroom(raw_gen, raw_defaults)
    # 3a. held out: the same shapes at seeds never used to choose a default
    held_policies = [p for p in policies if p in (*GEN_BASELINES, OURS, "quillhd", "belady")]
    held_traces = heldout_traces(cfg)
    raw_held = generalisation(held_policies, held_traces)
    rows += cells_beaten_rows(raw_held, held_policies, metric="cells_beaten_heldout",
                              trace="generalisation, held-out seeds")
    # 3a. random shapes: every knob of the generator drawn at once (cell 3 of the docstring)
    rand = random_shape_traces(cfg)
    raw_rand = generalisation(held_policies, [(label, seed, arrs) for label, seed, arrs, _ in rand])
    rows += cells_beaten_rows(raw_rand, held_policies, metric="cells_beaten_random",
                              trace="generalisation, random shapes")
    # 3a. mixed shapes: several workloads sharing one cache
    raw_mix = generalisation(held_policies, mixed_traces(cfg))
    rows += cells_beaten_rows(raw_mix, held_policies, metric="cells_beaten_mixed",
                              trace="generalisation, mixed shapes")
    # 3a. 16-token blocks: the same shapes as an engine with small KV blocks sees them
    b16_traces = block16_traces(cfg)
    raw_b16 = generalisation(held_policies, b16_traces,
                             {p: {"block_tokens": BLOCK16_TOKENS} for p in (OURS, "quillhd") if p in held_policies})
    rows += cells_beaten_rows(raw_b16, held_policies, metric="cells_beaten_block16",
                              trace=f"generalisation, {BLOCK16_TOKENS}-token blocks")
    rand_knobs = [(label, seed, *knobs.values()) for label, seed, _, knobs in rand]
    raw_anatomy, anatomy_rows = loss_anatomy({
        "table": (gen_traces, raw_gen), "heldout": (held_traces, raw_held),
        "random": ([(label, seed, arrs) for label, seed, arrs, _ in rand], raw_rand)})
    rows += anatomy_rows
    raw_spared, spared_rows = sieve_spared(arrs, label, caps, table, gen_traces, raw_gen)
    rows += spared_rows

    # 3b. semi-online (cell 5 of the docstring; separate metrics, never beside the online rows): lookahead-W LRU sees the
    #    W requests queued at the engine
    for w in SEMI_ONLINE_WINDOWS:
        for cap in caps:
            if cap is None:
                continue
            hr = simulate(arrs, "lookahead", cap, window_requests=w).hit_rate
            lru, bel = table[("lru", cap)], table[("belady", cap)]
            p = {"trace": label, "capacity_blocks": cap, "window_requests": w}
            rows.append(SummaryRow(metric="semi_online_hit_rate", subject="lookahead", value=hr, unit="fraction",
                                   baseline="lru", baseline_value=lru, notes=f"sees the next {w} queued requests",
                                   params=p))
            rows.append(SummaryRow(metric="semi_online_gap_closed", subject="lookahead",
                                   value=(hr - lru) / (bel - lru) if bel - lru > 1e-12 else math.nan,
                                   unit="fraction of the LRU-to-Belady gap", notes=f"W = {w} requests", params=p))

    # 3c. information bounds (cell 6 of the docstring; offline, separate metrics, never beside the online rows)
    raw_info, info_rows = information_bounds(arrs, label, caps, table, cfg["flip_seeds"])
    rows += info_rows
    gap_ratios = turn_gap_log_ratios(arrs)  # "the same gap as last time": the timing and joint bounds' sigma
    raw_timing, timing_rows = timing_bounds(arrs, label, table, cfg["flip_seeds"], gap_ratios)
    rows += timing_rows
    gbm = {mode: gbm_scores(arrs, mode, **cfg["gbm"]) for mode in LABEL_MODES}
    raw_learned, learned_rows = learned_reuse(arrs, label, table, gbm, cfg["gbm"].get("chunk", GBM_CHUNK))
    rows += learned_rows
    raw_joint, joint_rows = joint_bounds(arrs, label, table, cfg["flip_seeds"], gap_ratios, gbm["online"])
    rows += joint_rows
    raw_pred = []
    for pr in predictability(arrs, gbm=gbm):
        raw_pred.append((label, pr.subject, pr.auc, pr.accuracy, pr.base_rate, pr.n))
        p = {"trace": label}
        rows.append(SummaryRow(metric="reuse_predictability_auc", subject=pr.subject, value=pr.auc, unit="AUC",
                               n=pr.n, notes=f"{pr.n} requests whose last full block is new; "
                                             f"{pr.base_rate:.1%} of them come back", params=p))
        rows.append(SummaryRow(metric="reuse_predictability_accuracy", subject=pr.subject, value=pr.accuracy,
                               unit="fraction", baseline="always 'does not come back'",
                               baseline_value=1.0 - pr.base_rate, n=pr.n,
                               notes="at the threshold best on the scored requests (optimistic)", params=p))

    # 4. throughput at 10k blocks
    tcap = 10000
    reps = cfg["reps"]
    raw_tp: list[tuple] = []
    base_s = timed(lambda: python_lru(arrs, tcap), reps)
    raw_tp += [("python_ordereddict_lru", i, s, arrs.num_refs / s) for i, s in enumerate(base_s)]
    base_rate = arrs.num_refs / spread(base_s)["median"]
    lcs_runs, lcs_note = libcachesim_lru(arrs, tcap, reps)
    raw_tp += [("libcachesim_lru", i, s, arrs.num_refs / s) for i, (s, _mr) in enumerate(lcs_runs)]
    lcs_rate = arrs.num_refs / spread([s for s, _ in lcs_runs])["median"] if lcs_runs else math.nan
    if lcs_runs:
        lcs_hit = 1.0 - lcs_runs[0][1]
        ours_lru = simulate(arrs, "lru", tcap).hit_rate
        lcs_note += f"; its LRU hit ratio {lcs_hit:.4f} vs ours {ours_lru:.4f} (same content: LRU hits are prefix hits)"
    tp_params = {"trace": label, "capacity_blocks": tcap}
    for pol in policies + sorted(SEMI_ONLINE):
        secs = [simulate(arrs, pol, tcap).elapsed_s for _ in range(reps)]  # kernel time only (JIT warmed inside)
        raw_tp += [(f"kernel_{pol}", i, s, arrs.num_refs / s) for i, s in enumerate(secs)]
        sp = spread([arrs.num_refs / s for s in secs])
        note = f"{'meets' if sp['median'] >= ACCEPT_REFS_S else 'BELOW'} the 1M refs/s bar"
        if lcs_runs:
            rows.append(SummaryRow.from_spread(sp, metric="replay_refs_per_s", subject=f"kernel_{pol}",
                                               unit="refs/s", baseline="libcachesim_lru", baseline_value=lcs_rate,
                                               n=reps, notes=note + f"; {lcs_note}", params=tp_params))
        rows.append(SummaryRow.from_spread(sp, metric="replay_refs_per_s", subject=f"kernel_{pol}", unit="refs/s",
                                           baseline="python_ordereddict_lru", baseline_value=base_rate, n=reps,
                                           notes=note + ("" if lcs_runs else f"; {lcs_note}"), params=tp_params))

    anchors = [Anchor(metric="pooled_gain", subject="Mooncake global pool vs local caches", value=PAPER_POOL_GAIN,
                      unit="x", source="Mooncake (FAST '25) section 4",
                      notes="hit-rate gain of one pool over per-node caches on its conversation trace")]
    write_raw(NAME, "hit_rates.csv", ["trace", "policy", "capacity_blocks", "hit_rate"], raw_hr, results_root)
    write_raw(NAME, "pooled.csv", ["policy", "capacity_tokens", "routing", "pooled_hit_rate", "local_hit_rate"],
              raw_pool, results_root)
    write_raw(NAME, "generalisation.csv", ["trace", "seed", "policy", "cap_fraction", "capacity_blocks", "hit_rate",
                                          "gap_closed"], raw_gen, results_root)
    write_raw(NAME, "heldout.csv", ["trace", "seed", "policy", "cap_fraction", "capacity_blocks", "hit_rate",
                                    "gap_closed"], raw_held, results_root)
    write_raw(NAME, "defaults_check.csv", ["trace", "seed", "cap_fraction", "alternative", "gap_closed"], raw_defaults,
              results_root)
    write_raw(NAME, "random_shapes.csv", ["trace", "seed", "policy", "cap_fraction", "capacity_blocks", "hit_rate",
                                          "gap_closed"], raw_rand, results_root)
    write_raw(NAME, "loss_anatomy.csv", ["set", "trace", "seed", "cap_fraction", "baseline", "uses", "previous_use",
                                         "references", "ours_only", "baseline_only"], raw_anatomy, results_root)
    write_raw(NAME, "sieve_spared.csv", ["set", "trace", "seed", "cap_fraction", "capacity_blocks", "evictions",
                                         "spared_evictions", "first_spared_request", "sieve_hit_rate", "lfu_hit_rate",
                                         "spared_resident", "spared_idle_median_requests"],
              raw_spared, results_root)
    write_raw(NAME, "mixed.csv", ["trace", "seed", "policy", "cap_fraction", "capacity_blocks", "hit_rate",
                                  "gap_closed"], raw_mix, results_root)
    write_raw(NAME, "block16.csv", ["trace", "seed", "policy", "cap_fraction", "capacity_blocks", "hit_rate",
                                    "gap_closed"], raw_b16, results_root)
    write_raw(NAME, "random_shape_knobs.csv", ["trace", "seed", *RANDOM_SHAPE_SPACE], rand_knobs, results_root)
    write_raw(NAME, "timing_bounds.csv", ["trace", "capacity_blocks", "sigma", "seed", "hit_rate"], raw_timing,
              results_root)
    write_raw(NAME, "joint_bounds.csv", ["trace", "capacity_blocks", "sigma", "flip_rate", "seed", "hit_rate"],
              raw_joint, results_root)
    write_raw(NAME, "information_bounds.csv", ["trace", "capacity_blocks", "flip_rate", "seed", "hit_rate"], raw_info,
              results_root)
    write_raw(NAME, "learned_reuse.csv", ["trace", "label_mode", "capacity_blocks", "threshold", "hit_rate",
                                          "gap_closed"], raw_learned, results_root)
    write_raw(NAME, "predictability.csv", ["trace", "subject", "auc", "accuracy", "base_rate", "n"], raw_pred,
              results_root)
    write_raw(NAME, "throughput.csv", ["subject", "rep", "elapsed_s", "refs_per_s"], raw_tp, results_root)
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", anchors=anchors,
                  started_at=t_start)
    print_table(rows, title="hitrate")
    print(f"[hitrate] {len(rows)} rows in {time.monotonic() - t_start:.1f} s")
    return rows


def information_bounds(arrs: TraceArrays, label: str, caps: list[int | None], table: dict, seeds: tuple[int, ...]
                       ) -> tuple[list[tuple], list[SummaryRow]]:
    """Cell 6: the reuse oracle (exact at every finite capacity; noisy at the acceptance
    capacities), as raw rows and summary rows with the share of the LRU-to-Belady gap."""
    from quillcache.hitrate.bounds import reuse_oracle

    raw: list[tuple] = []
    rows: list[SummaryRow] = []
    for cap in caps:
        if cap is None:
            continue
        lru, bel = table[("lru", cap)], table[("belady", cap)]
        rates = [0.0] + (list(INFO_FLIP_RATES) if cap in ACCEPT_GAP_CAPS else [])
        for flip in rates:
            hrs = []
            for seed in seeds if flip > 0 else seeds[:1]:
                hr = int(reuse_oracle(arrs, cap, flip, seed).sum()) / arrs.num_refs
                raw.append((label, cap, flip, seed, hr))
                hrs.append(hr)
            sp = spread(hrs)
            p = {"trace": label, "capacity_blocks": cap, "flip_rate": flip}
            what = ("knows whether each block is referenced again, never when" if flip == 0 else
                    f"the same, wrong about {flip:.0%} of requests (median of {len(hrs)} seeds)")
            rows += bound_rows("reuse_oracle", sp, len(hrs), lru, bel, what, p)
    return raw, rows


def learned_reuse(arrs: TraceArrays, label: str, table: dict, gbm: dict[str, np.ndarray], chunk: int
                  ) -> tuple[list[tuple], list[SummaryRow]]:
    """Cell 6, beside the bounds: the learned reuse predictor's bits replayed
    (``predicted_reuse_lru``) at the acceptance capacities, every threshold as raw rows, the best
    threshold in hindsight as summary rows (optimistic, labelled so)."""
    from quillcache.hitrate.predicted_reuse import predicted_reuse_lru

    raw: list[tuple] = []
    rows: list[SummaryRow] = []
    for mode, scores in gbm.items():
        for cap in ACCEPT_GAP_CAPS:
            lru, bel = table[("lru", cap)], table[("belady", cap)]
            gap = bel - lru
            found = []
            for thr in GBM_THRESHOLDS:
                hr = int(predicted_reuse_lru(arrs, cap, predicted_bits(scores, thr)).sum()) / arrs.num_refs
                closed = (hr - lru) / gap if gap > 1e-12 else math.nan
                raw.append((label, mode, cap, thr, hr, closed))
                found.append((closed, thr, hr))
            closed, thr, hr = max(found, key=lambda f: (not math.isnan(f[0]), f[0]))
            p = {"trace": label, "capacity_blocks": cap, "threshold": thr, "label_mode": mode,
                 "retrain_every_requests": chunk}
            note = (f"bits of {GBM_SUBJECTS[mode]} replayed in two-list LRU; threshold {thr} best of "
                    f"{len(GBM_THRESHOLDS)} in hindsight (optimistic)")
            rows.append(SummaryRow(metric="learned_reuse_hit_rate", subject=GBM_SUBJECTS[mode], value=hr,
                                   unit="fraction", baseline="lru", baseline_value=lru, notes=note, params=p))
            rows.append(SummaryRow(metric="learned_reuse_gap_closed", subject=GBM_SUBJECTS[mode], value=closed,
                                   unit="fraction of the LRU-to-Belady gap",
                                   notes=f"lru={lru:.4f} learned={hr:.4f} belady={bel:.4f}", params=p))
    return raw, rows


def bound_rows(subject: str, sp: dict, n: int, lru: float, bel: float, what: str, params: dict) -> list[SummaryRow]:
    """An information bound's hit rate (median over seeds, against LRU) and its share of the
    LRU-to-Belady gap."""
    gap = bel - lru
    return [SummaryRow.from_spread(sp, metric="information_bound_hit_rate", subject=subject, unit="fraction",
                                   baseline="lru", baseline_value=lru, n=n, notes=f"offline: {what}", params=params),
            SummaryRow(metric="information_bound_gap_closed", subject=subject,
                       value=(sp["median"] - lru) / gap if gap > 1e-12 else math.nan,
                       unit="fraction of the LRU-to-Belady gap", n=n,
                       notes=f"lru={lru:.4f} oracle={sp['median']:.4f} belady={bel:.4f}", params=params)]


def timing_bounds(arrs: TraceArrays, label: str, table: dict, seeds: tuple[int, ...], ratios: np.ndarray
                  ) -> tuple[list[tuple], list[SummaryRow]]:
    """Cell 6, the other half: how wrong a simple predictor of *when* a conversation returns is
    (``ratios`` from ``turn_gap_log_ratios``: "after the same gap as last time", its robust sigma), and
    the timing oracle (knows *which* blocks return; *when* wrong by ``exp(sigma * Z)`` per request) at
    the acceptance capacities for ``INFO_TIMING_SIGMAS`` and that measured sigma; median over seeds."""
    from quillcache.hitrate.bounds import timing_oracle

    measured = robust_sigma(ratios)
    rows: list[SummaryRow] = []
    if len(ratios):
        q1, q2, q3 = np.percentile(ratios, [25, 50, 75])
        rows.append(SummaryRow(metric="timing_predictability_sigma", subject="same gap as the previous turn",
                               value=measured, unit="robust sigma of log(next gap / previous gap)", n=len(ratios),
                               notes=f"{len(ratios)} turns with a previous turn that come back; quartiles of the log "
                                     f"ratio {q1:.2f} / {q2:.2f} / {q3:.2f}", params={"trace": label}))
    sigmas = sorted(set(INFO_TIMING_SIGMAS) | ({round(measured, 2)} if math.isfinite(measured) else set()))
    raw: list[tuple] = []
    for cap in ACCEPT_GAP_CAPS:
        if ("lru", cap) not in table:
            continue
        lru, bel = table[("lru", cap)], table[("belady", cap)]
        for sigma in sigmas:
            hrs = []
            for seed in seeds:
                hr = int(timing_oracle(arrs, cap, sigma, seed).sum()) / arrs.num_refs
                raw.append((label, cap, sigma, seed, hr))
                hrs.append(hr)
            sp = spread(hrs)
            p = {"trace": label, "capacity_blocks": cap, "sigma": sigma}
            measured_note = "; sigma as measured for the same-gap predictor" if sigma == round(measured, 2) else ""
            what = (f"knows which blocks return; when, wrong by a factor exp({sigma:g} Z) per request (median of "
                    f"{len(hrs)} seeds){measured_note}")
            rows += bound_rows("timing_oracle", sp, len(hrs), lru, bel, what, p)
    return raw, rows


def joint_bounds(arrs: TraceArrays, label: str, table: dict, seeds: tuple[int, ...], ratios: np.ndarray,
                 online_scores: np.ndarray) -> tuple[list[tuple], list[SummaryRow]]:
    """Cell 6, both halves together: the joint oracle (``quillcache.hitrate.bounds.joint_oracle``)
    at the acceptance capacities, its *when* as wrong as the same-gap predictor (the robust sigma of
    ``ratios``, as in ``timing_bounds``) and its *which* right (the timing oracle that gives up on
    late returns) or wrong about ``INFO_FLIP_RATES`` of the requests and about the share that
    heuristically matches the online trees (one minus their best balanced accuracy on the requests
    they scored); median over seeds."""
    from quillcache.hitrate.bounds import joint_oracle

    raw: list[tuple] = []
    rows: list[SummaryRow] = []
    if not len(ratios):
        return raw, rows  # no turn comes back twice: no measured timing spread to use
    sigma = round(robust_sigma(ratios), 2)
    y = reuse_labels(arrs)
    keep = (y >= 0) & ~np.isnan(online_scores)
    matched = 1.0 - best_balanced_accuracy(online_scores[keep], y[keep]) if keep.any() else math.nan
    flips = sorted({0.0, *INFO_FLIP_RATES} | ({round(matched, 3)} if math.isfinite(matched) else set()))
    if math.isfinite(matched):
        rows.append(SummaryRow(metric="reuse_predictor_matched_flip_rate", subject=GBM_SUBJECTS["online"],
                               value=round(matched, 3), unit="share of requests", n=int(keep.sum()),
                               notes="one minus the best balanced accuracy of the online trees on the requests they "
                                     "scored: the per-request error rate of the bounds' flips this predictor matches",
                               params={"trace": label}))
    for cap in ACCEPT_GAP_CAPS:
        if ("lru", cap) not in table:
            continue
        lru, bel = table[("lru", cap)], table[("belady", cap)]
        for flip in flips:
            hrs = []
            for seed in seeds:
                hr = int(joint_oracle(arrs, cap, sigma, flip, seed).sum()) / arrs.num_refs
                raw.append((label, cap, sigma, flip, seed, hr))
                hrs.append(hr)
            sp = spread(hrs)
            p = {"trace": label, "capacity_blocks": cap, "sigma": sigma, "flip_rate": flip}
            match_note = ("; the share matching the online trees' best balanced accuracy"
                          if flip == round(matched, 3) else "")
            what = (f"which wrong about {flip:.1%} of requests{match_note}; when wrong by exp({sigma:g} Z) per "
                    f"request (the same-gap predictor's sigma); gives up on a belief two of its errors overdue "
                    f"(median of {len(hrs)} seeds)")
            rows += bound_rows("joint_oracle", sp, len(hrs), lru, bel, what, p)
    return raw, rows


# ---------------------------------------------------------------- figures


def plot(results_root: str | None = None, out_dir: str | os.PathLike = "paper/figures") -> list[Path]:
    """Three figures from the results only: hit rate vs capacity per policy on the default trace
    (Belady dashed as the bound, the reuse oracle dotted), pooled vs local caches, and the gap
    closed on the generated traces."""
    from experiments.plotstyle import BASELINE, BOUND, GREY, PALETTE, figure, legend, save, style_axes
    from experiments.plotstyle import OURS as OURS_COLOUR
    from quillcache.results import read_raw, read_summary

    out = Path(out_dir)
    hr = read_raw(NAME, "hit_rates", results_root)
    main_trace = trace_label(None)
    hr = hr[hr["trace"] == (main_trace if (hr["trace"] == main_trace).any() else hr["trace"].iloc[0])]
    finite = sorted(int(c) for c in hr["capacity_blocks"].dropna().unique())
    inf_x = (finite[-1] * 3) if finite else 1
    fig, ax = figure(9.0, 3.8)
    colours = itertools.cycle([PALETTE[2], PALETTE[3], PALETTE[4], PALETTE[5], GREY, PALETTE[7], PALETTE[1], PALETTE[6]])
    for pol in POLICY_ORDER:
        part = hr[hr["policy"] == pol]
        if part.empty:
            continue
        pts = sorted((int(c) if c == c else inf_x, float(h)) for c, h in zip(part["capacity_blocks"], part["hit_rate"]))
        style = ({"ls": "--", "color": BOUND, "lw": 1.8} if pol == "belady" else
                 {"lw": 2.6, "color": OURS_COLOUR} if pol == OURS else
                 {"lw": 1.8, "color": PALETTE[5]} if pol == "quillhd" else
                 {"lw": 1.8, "color": BASELINE} if pol == "lru" else {"lw": 1.1, "color": next(colours)})
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3.5,
                label=pol + (" (offline bound)" if pol == "belady" else " (ours)" if pol in (OURS, "quillhd") else ""),
                **style)
    info = read_raw(NAME, "information_bounds", results_root)
    info = info[(info["trace"] == hr["trace"].iloc[0]) & (info["flip_rate"] == 0.0)] if len(hr) else info.iloc[:0]
    if not info.empty:  # offline, like Belady: knows which blocks come back, not when
        pts = sorted((int(c), float(h)) for c, h in zip(info["capacity_blocks"], info["hit_rate"]))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=":", color=BOUND, lw=1.6, marker="s", ms=3,
                label="reuse oracle (offline: which blocks return, not when)")
    ax.set_xscale("log")
    ax.set_xticks(finite + [inf_x])
    ax.set_xticklabels([cap_label(c) for c in finite] + ["unlimited"])
    ax.minorticks_off()
    style_axes(ax, xlabel="cache capacity (512-token blocks, log scale)", ylabel="block hit rate",
               title=f"Hit rate vs capacity ({main_trace})")
    legend(ax, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)  # beside the axes, clear of lines
    p1 = save(fig, out / "hitrate.png")

    s = read_summary(NAME, results_root)
    pool = s[(s["metric"] == "pooled_hit_rate")]
    rr = pool[pool["routing"] == "round_robin"].sort_values(["capacity_tokens", "subject"])
    aff = pool[pool["routing"] == "affinity"].set_index(["capacity_tokens", "subject"])
    labels = [f"{p}\n{t // 1_000_000}M tok" for t, p in zip(rr["capacity_tokens"], rr["subject"])]
    fig, ax = figure(7.0, 3.4)
    xs = np.arange(len(rr))
    w = 0.27
    ax.bar(xs - w, rr["value"], w, label="one pooled cache", color=PALETTE[0])
    ax.bar(xs, [aff.loc[(t, p), "baseline_value"] for t, p in zip(rr["capacity_tokens"], rr["subject"])], w,
           label=f"{N_ENGINES} local caches, conversation affinity", color=PALETTE[2])
    ax.bar(xs + w, rr["baseline_value"], w, label=f"{N_ENGINES} local caches, round-robin", color=PALETTE[1])
    for x, v, r in zip(xs, rr["value"], rr["ratio"]):
        ax.annotate(f"{r:.2f}x", (x - w, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels)
    style_axes(ax, ylabel="block hit rate", title="Pooled vs local caches (label: pooled / round-robin)")
    ax.set_ylim(0, float(rr["value"].max()) * 1.35)
    legend(ax, loc="upper center", ncol=2)
    p2 = save(fig, out / "hitrate_pooled.png")

    gen = read_raw(NAME, "generalisation", results_root)
    shown = [p for p in ("sieve", "s3fifo", "arc", "lhd", "lrb", "quillhd", OURS) if p in set(gen["policy"])]
    traces = list(dict.fromkeys(gen["trace"]))
    fracs = sorted(gen["cap_fraction"].unique())
    med = gen.groupby(["trace", "cap_fraction", "policy"])["gap_closed"].median()
    fig, axes = figure(7.0, 1.2 + 1.0 * len(fracs), nrows=len(fracs), sharex=True)
    axes = np.atleast_1d(axes)
    w = 0.8 / max(len(shown), 1)
    xs = np.arange(len(traces))
    for ax, f in zip(axes, fracs):
        for i, pol in enumerate(shown):
            vals = [float(np.clip(med.get((t, f, pol), np.nan), -1.0, 1.0)) for t in traces]
            ax.bar(xs + (i - (len(shown) - 1) / 2) * w, vals, w, label=pol + (" (ours)" if pol == OURS else ""),
                   color=OURS_COLOUR if pol == OURS else PALETTE[(i + 1) % len(PALETTE)])
        ax.axhline(0, color=BOUND, lw=0.8)
        ax.set_ylim(-1.05, 1.05)
        style_axes(ax, ylabel=f"{f:.0%} cap.")
    axes[-1].set_xticks(xs)
    axes[-1].set_xticklabels([t.replace("gen_", "").replace("_", " ") for t in traces], fontsize=7)
    axes[0].set_title("Share of the LRU-to-Belady gap closed on generated traces (median over seeds; "
                      "clipped to [-1, 1]; 0 = LRU)", fontsize=8)
    legend(axes[0], ncol=4, fontsize=6)
    p3 = save(fig, out / "hitrate_generalisation.png")
    return [p1, p2, p3, *plot_random_shapes(results_root, out), *plot_learned_reuse(results_root, out),
            *plot_joint_bounds(results_root, out)]


def plot_joint_bounds(results_root: str | None, out: Path) -> list[Path]:
    """Share of the gap closed against how wrong the *which* predictor is, one panel per
    acceptance capacity: the joint oracle (when as wrong as the same-gap predictor) and the reuse
    oracle (no when at all), medians over seeds, beside QuillChain (online), the 50% target and the
    error rate that matches the online trees; [] when there are no joint rows."""
    from experiments.plotstyle import BASELINE, BOUND, GREY, PALETTE, figure, legend, save, style_axes
    from experiments.plotstyle import OURS as OURS_COLOUR
    from quillcache.results import read_raw, read_summary

    try:
        jb = read_raw(NAME, "joint_bounds", results_root)
        hr = read_raw(NAME, "hit_rates", results_root)
        info = read_raw(NAME, "information_bounds", results_root)
        summ = read_summary(NAME, results_root)
    except FileNotFoundError:
        return []
    if jb.empty:
        return []
    trace = jb["trace"].iloc[0]
    sigma = float(jb["sigma"].iloc[0])
    caps = sorted(int(c) for c in jb["capacity_blocks"].unique())
    hr = hr[hr["trace"] == trace].dropna(subset=["capacity_blocks"])
    rate = {(p, int(c)): float(h) for p, c, h in zip(hr["policy"], hr["capacity_blocks"], hr["hit_rate"])}
    matched = summ[(summ["metric"] == "reuse_predictor_matched_flip_rate") & (summ["trace"] == trace)]
    fig, axes = figure(7.0, 3.0, ncols=len(caps), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, cap in zip(axes, caps):
        lru, bel = rate[("lru", cap)], rate[("belady", cap)]

        def closed(frame):
            med = frame.groupby("flip_rate")["hit_rate"].median()
            return med.index.to_numpy(), np.clip((med.to_numpy() - lru) / (bel - lru), -1.0, 1.0)

        x, y = closed(jb[jb["capacity_blocks"] == cap])
        ax.plot(x, y, marker="o", ms=3, color=PALETTE[2], lw=1.8,
                label=f"joint oracle (offline: which, and when up to exp({sigma:g} Z); "
                      "a wrong request: its new blocks)")
        part = info[(info["trace"] == trace) & (info["capacity_blocks"] == cap)]
        if not part.empty:
            x, y = closed(part)
            ax.plot(x, y, marker="s", ms=3, color=BOUND, ls=":", lw=1.4,
                    label="reuse oracle (offline: which only; a wrong request: all its blocks)")
        if (OURS, cap) in rate:
            ax.axhline((rate[(OURS, cap)] - lru) / (bel - lru), color=OURS_COLOUR, lw=2.0, label=f"{OURS} (ours)")
        ax.axhline(0.5, color=GREY, ls="--", lw=1.0, label="the 50% target")
        ax.axhline(0.0, color=BASELINE, lw=0.8, label="lru")
        if not matched.empty:
            ax.axvline(float(matched["value"].iloc[0]), color=PALETTE[4], ls="-.", lw=1.0,
                       label="about as wrong as the online trees")
        ax.set_ylim(-1.05, 1.05)
        style_axes(ax, xlabel="requests the which-predictor gets wrong", ylabel="share of the gap closed",
                   title=f"{cap_label(cap)} blocks")
    legend(axes[0], loc="lower left", fontsize=6)
    fig.suptitle(f"How good online predictors must be to close the gap ({trace}; clipped to [-1, 1])", fontsize=8)
    return [save(fig, out / "hitrate_joint_bounds.png")]


def plot_learned_reuse(results_root: str | None, out: Path) -> list[Path]:
    """Share of the gap closed by the learned reuse predictor's bits against its threshold, one
    panel per acceptance capacity, beside QuillChain (online) and the exact reuse oracle
    (offline); [] when that cell has no rows."""
    from experiments.plotstyle import BASELINE, BOUND, PALETTE, figure, legend, save, style_axes
    from experiments.plotstyle import OURS as OURS_COLOUR
    from quillcache.results import read_raw

    try:
        lr = read_raw(NAME, "learned_reuse", results_root)
        hr = read_raw(NAME, "hit_rates", results_root)
        info = read_raw(NAME, "information_bounds", results_root)
    except FileNotFoundError:
        return []
    if lr.empty:
        return []
    trace = lr["trace"].iloc[0]
    caps = sorted(int(c) for c in lr["capacity_blocks"].unique())
    hr = hr[hr["trace"] == trace].dropna(subset=["capacity_blocks"])
    rate = {(p, int(c)): float(h) for p, c, h in zip(hr["policy"], hr["capacity_blocks"], hr["hit_rate"])}
    info = info[(info["trace"] == trace) & (info["flip_rate"] == 0.0)]
    oracle = {int(c): float(h) for c, h in zip(info["capacity_blocks"], info["hit_rate"])}
    fig, axes = figure(7.0, 3.0, ncols=len(caps), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, cap in zip(axes, caps):
        lru, bel = rate[("lru", cap)], rate[("belady", cap)]
        for i, mode in enumerate(LABEL_MODES):
            part = lr[(lr["capacity_blocks"] == cap) & (lr["label_mode"] == mode)].sort_values("threshold")
            ax.plot(part["threshold"], np.clip(part["gap_closed"], -1.0, 1.0), marker="o", ms=3,
                    color=PALETTE[2 + 2 * i], label=GBM_SUBJECTS[mode])
        if (OURS, cap) in rate:
            ax.axhline((rate[(OURS, cap)] - lru) / (bel - lru), color=OURS_COLOUR, lw=2.0, label=f"{OURS} (ours)")
        if cap in oracle:
            ax.axhline(min((oracle[cap] - lru) / (bel - lru), 1.0), color=BOUND, ls=":", lw=1.4,
                       label="reuse oracle (offline)")
        ax.axhline(0.0, color=BASELINE, lw=0.8, label="lru")
        ax.set_ylim(-1.05, 1.05)
        style_axes(ax, xlabel="threshold on the predicted probability", ylabel="share of the gap closed",
                   title=f"{cap_label(cap)} blocks")
    legend(axes[0], loc="lower left", fontsize=6)
    fig.suptitle(f"A learned reuse predictor's bits as hits ({trace}; clipped to [-1, 1])", fontsize=8)
    return [save(fig, out / "hitrate_learned_reuse.png")]


def plot_random_shapes(results_root: str | None, out: Path) -> list[Path]:
    """Box plots of the gap closed over the random session shapes (cell 3), per capacity
    fraction and policy (clipped to [-1, 1]; 0 = LRU, 1 = Belady); [] when that cell has no rows."""
    from experiments.plotstyle import BOUND, PALETTE, figure, save, style_axes
    from experiments.plotstyle import OURS as OURS_COLOUR
    from quillcache.results import read_raw

    try:
        rnd = read_raw(NAME, "random_shapes", results_root)
    except FileNotFoundError:
        return []
    rnd = rnd.dropna(subset=["gap_closed"])
    shown = [p for p in ("sieve", "s3fifo", "quillhd", OURS) if p in set(rnd["policy"])]
    fracs = sorted(rnd["cap_fraction"].unique())
    if rnd.empty or not shown:
        return []
    fig, ax = figure(7.0, 3.6)
    w = 0.8 / len(shown)
    for i, pol in enumerate(shown):
        data = [np.clip(rnd[(rnd["policy"] == pol) & (rnd["cap_fraction"] == f)]["gap_closed"].to_numpy(), -1.0, 1.0)
                for f in fracs]
        colour = OURS_COLOUR if pol == OURS else PALETTE[(i + 1) % len(PALETTE)]
        bp = ax.boxplot(data, positions=np.arange(len(fracs)) + (i - (len(shown) - 1) / 2) * w, widths=w * 0.85,
                        patch_artist=True, showfliers=True, flierprops={"markersize": 2},
                        medianprops={"color": BOUND, "lw": 1.2})
        for box in bp["boxes"]:
            box.set(facecolor=colour, alpha=0.7)
        ax.plot([], [], color=colour, lw=6, label=pol + (" (ours)" if pol == OURS else ""))
    ax.axhline(0, color=BOUND, lw=0.8)
    ax.set_xticks(np.arange(len(fracs)))
    ax.set_xticklabels([f"{f:.0%} of its blocks" for f in fracs])
    n = rnd["trace"].nunique()
    style_axes(ax, ylabel="share of the LRU-to-Belady gap",
               title=f"Gap closed on {n} random session shapes (clipped to [-1, 1]; 0 = LRU, 1 = Belady)")
    ax.set_ylim(-1.05, 1.05)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(shown), fontsize=7, frameon=False)
    return [save(fig, out / "hitrate_random.png")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small, fast configuration (smoke test)")
    ap.add_argument("--results-root", default=None, help="results directory (default: results/)")
    ap.add_argument("--trace", default=None, help="Mooncake-format trace (default: the shared conversation trace)")
    args = ap.parse_args(argv)
    run(quick=args.quick, results_root=args.results_root, trace=args.trace)


if __name__ == "__main__":
    main()
