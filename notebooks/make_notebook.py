"""Write ``notebooks/analysis.ipynb`` (its cells, unexecuted): one section per registered study.

``make notebook`` runs this, then executes the notebook in place with nbclient against
``results/`` so the committed notebook shows its outputs; ``make test`` executes a copy
(``tests/test_notebook.py``) so a broken cell fails CI. Edit the cells here, not in the .ipynb.

Every cell runs against any results root without raising for a study that is absent or has no
``meta.json`` (``read_meta`` returns None for results written before metadata was recorded): the
setup table marks such a run, and a study's table and figure cells print that it has no results
(and the make target that produces them) instead (``guarded``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''\
import atexit, shutil, sys, tempfile
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
sys.path.insert(0, str(ROOT))  # the experiments package (figures) lives beside quillcache

import pandas as pd
from IPython.display import Image, display

import quillcache
from quillcache.results import list_studies, read_anchors, read_meta, read_raw, read_summary
from experiments.studies import STUDIES

RESULTS = str(ROOT / "results")
FIGURES = Path(tempfile.mkdtemp(prefix="qc-notebook-"))  # figures redrawn here, never over paper/figures
atexit.register(shutil.rmtree, FIGURES, ignore_errors=True)  # figures shown are embedded: the folder goes
pd.set_option("display.width", 160, "display.max_columns", 20, "display.precision", 4)


def have(study: str) -> bool:
    """True when the study has results under RESULTS; otherwise say so (and how to produce them)."""
    if study in list_studies(RESULTS):
        return True
    print(f"{study}: no results under {RESULTS}; `make {STUDIES[study].make_target}` produces them")
    return False


def show_figure(study: str) -> None:
    """Redraw the study's figure from results/ (the same code as `make figures`) and show it."""
    if not have(study):
        return
    out = STUDIES[study].load().plot(RESULTS, FIGURES)
    paths = out if isinstance(out, (list, tuple)) else [out]
    if not paths:
        print(f"{study}: these results draw no figure")
    for path in paths:
        display(Image(filename=str(path), width=760))


def run_row(study: str) -> dict:
    meta = read_meta(study, RESULTS)  # None: results written before run metadata was recorded
    return {"study": study, **(vars(meta) if meta is not None else {"profile": "(no meta.json)"})}


absent = [s for s in STUDIES.names() if s not in list_studies(RESULTS)]
if absent:
    print("registered studies with no results under", RESULTS + ":", ", ".join(absent))
pd.DataFrame([run_row(s) for s in list_studies(RESULTS)],
             columns=["study", "profile", "git_commit", "git_dirty", "cpu_model", "cpu_count", "date_utc",
                      "wall_s"]).set_index("study")
'''


def guarded(study: str, code: str) -> str:
    """``code`` run only when ``study`` has results (``have`` prints why not otherwise); the cell's
    last expression, which a notebook would show, is shown with ``display``."""
    tree = ast.parse(code)
    lines = code.splitlines()
    last = tree.body[-1]
    is_display = (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                  and isinstance(last.value.func, ast.Name) and last.value.func.id == "display")
    if isinstance(last, ast.Expr) and not is_display:
        first, end = last.lineno - 1, last.end_lineno - 1  # ast offsets count UTF-8 bytes
        b0, b1 = lines[first].encode(), lines[end].encode()
        if first == end:
            lines[first] = (b0[:last.col_offset] + b"display(" + b0[last.col_offset:last.end_col_offset] + b")"
                            + b0[last.end_col_offset:]).decode()
        else:
            lines[first] = (b0[:last.col_offset] + b"display(" + b0[last.col_offset:]).decode()
            lines[end] = (b1[:last.end_col_offset] + b")" + b1[last.end_col_offset:]).decode()
    return f'if have("{study}"):\n' + "\n".join("    " + line if line.strip() else line for line in lines)


# (study, the section's text, its table cell as written; wrapped by ``guarded`` below)
SECTIONS: list[tuple[str, str, str]] = [
    ("microbench_hashing", "Block hashing: M blocks/s per form and block size (baseline: a per-block `xxhash` loop).",
     '''df = read_summary("microbench_hashing", RESULTS)
df.pivot(index="subject", columns="block_tokens", values="value") / 1e6'''),
    ("microbench_alloc", "Offset allocator: ns per operation, Cython vs the plain-Python reference.",
     '''df = read_summary("microbench_alloc", RESULTS)
df[df.baseline != ""][["metric", "value", "baseline_value", "ratio", "p10", "p90"]]'''),
    ("microbench_sketch", "Count-min sketch: keys/s against exact counting.",
     '''df = read_summary("microbench_sketch", RESULTS)
df[df.metric == "throughput"][["subject", "value", "baseline", "ratio"]]'''),
    ("microbench_planner", "Planner: plans/s by scenario and index backend.",
     '''df = read_summary("microbench_planner", RESULTS)
df[df.baseline.str.startswith("ReferencePlanner")].pivot_table(index=["scenario", "subject"], columns="backend",
                                                              values="value")'''),
    ("storage", "Residency index backends at the largest entry count: every metric, ART vs RocksDB, SortedDict and flat map.",
     '''df = read_summary("storage", RESULTS)
largest = df[df.entries == df.entries.max()].drop_duplicates(["metric", "subject"])
largest.pivot(index="metric", columns="subject", values="value")'''),
    ("store_dram", "DRAM tier: GB/s per operation and block size (the zero-copy `get` moves no bytes).",
     '''df = read_summary("store_dram", RESULTS)
df.pivot(index="operation", columns="block_bytes", values="value")'''),
    ("store_ssd", "SSD tier: durable MB/s against raw files of equal durability.",
     '''df = read_summary("store_ssd", RESULTS)
df.pivot(index="subject", columns="block_bytes", values="value")'''),
    ("crash", "Crash study: per scenario, crashes and what was lost (everything in the last columns must be 0).",
     '''df = read_summary("crash", RESULTS)
cols = ["crashes", "acknowledged_blocks_checked", "acknowledged_blocks_lost", "corrupt_bytes_served",
        "dangling_index_entries", "bitflips_injected", "bitflips_detected"]
df[df.metric.isin(cols)].pivot(index="subject", columns="metric", values="value")[cols]'''),
    ("recovery", "Recovery under damage: seconds per MiB scanned must stay flat as the log grows (linear recovery).",
     '''df = read_summary("recovery", RESULTS)
df[df.metric == "scan_s_per_mib"].pivot(index="subject", columns="file_bytes", values="value")'''),
    ("safety", "Safety: unsafe reuse of a naive content-hash cache vs the identity guard; the seed's figures are anchors.",
     '''df = read_summary("safety", RESULTS)
display(df[df.category.isna() | (df.category == "all")].pivot(index="mix", columns="metric", values="value"))
read_anchors("safety", RESULTS)'''),
    ("hitrate", 'Hit rate by policy and capacity on the conversation trace (NA = unlimited), the share of the LRU-to-Belady gap each closes, the generalisation table (median over seeds), cells QuillChain wins against LRU/SIEVE/S3-FIFO (and on held-out seeds and random session shapes, never used to choose a default), what the remaining losses are made of (net lost references by the uses of the block and the requests since its previous use), kernel speeds, and the information bounds (offline: the share of the gap a reuse oracle closes, exact and wrong about a share of requests; the timing oracle, which knows which blocks return and when only up to a factor; the joint oracle, wrong about both, and the error rate the online trees match) and how well arrival-time features predict reuse and the gap to the next turn, and how many blocks SIEVE evicted after sparing them (with none, SIEVE is in-cache LFU); `quillcache hitrate TRACE` prints such a table for any trace.',
     '''df = read_summary("hitrate", RESULTS)
hr = df[(df.metric == "hit_rate") & (df.trace == "conversation_trace")]
display(hr.pivot(index="subject", columns="capacity_blocks", values="value"))
gap = df[(df.metric == "gap_closed") & (df.trace == "conversation_trace")]
display(gap.pivot(index="subject", columns="capacity_blocks", values="value"))
gen = df[(df.metric == "gap_closed") & df.cap_fraction.notna()]
display(gen.pivot_table(index=["trace", "cap_fraction"], columns="subject", values="value"))
display(df[df.metric.isin(["cells_beaten", "cells_beaten_heldout", "cells_beaten_random", "cells_beaten_mixed", "cells_beaten_block16", "defaults_check",
                               "selector_headroom"])][["metric", "subject", "baseline", "value", "n", "notes"]])
anat = df[df.metric == "loss_anatomy"]  # where QuillChain still loses: net lost references by bucket
display(anat[["uses", "previous_use", "value", "n", "notes"]])
display(df[df.metric == "replay_refs_per_s"].pivot_table(index="subject", columns="baseline", values="value"))
info = df[(df.metric == "information_bound_gap_closed") & (df.subject == "reuse_oracle")]  # offline: which blocks return, not when
display(info.pivot_table(index="flip_rate", columns="capacity_blocks", values="value"))
timing = df[(df.metric == "information_bound_gap_closed") & (df.subject == "timing_oracle")]  # which exactly, when up to exp(sigma Z)
display(timing.pivot_table(index="sigma", columns="capacity_blocks", values="value"))
display(df[df.metric == "timing_predictability_sigma"][["subject", "value", "n", "notes"]])
joint = df[(df.metric == "information_bound_gap_closed") & (df.subject == "joint_oracle")]  # which wrong about a share of requests, when as the same-gap predictor
display(joint.pivot_table(index="flip_rate", columns="capacity_blocks", values="value"))
display(df[df.metric == "reuse_predictor_matched_flip_rate"][["subject", "value", "n", "notes"]])  # the error rate the online trees match
pred = df[df.metric.str.startswith("reuse_predictability")]  # how well arrival-time features predict reuse
display(pred.pivot_table(index="subject", columns="metric", values="value"))
learned = read_raw("hitrate", "learned_reuse", RESULTS)  # the trees' bits as hits, every threshold
display(learned.pivot_table(index=["label_mode", "threshold"], columns="capacity_blocks", values="gap_closed"))
if Path(RESULTS, "hitrate", "sieve_spared.csv").exists():  # SIEVE evictions of blocks it had spared (with none, SIEVE is in-cache LFU)
    display(read_raw("hitrate", "sieve_spared", RESULTS))
read_anchors("hitrate", RESULTS)'''),
    ("replay", "Router study: TTFT, goodput and hit rate per routing/policy cell (engine compute is the engine model, a stand-in).",
     '''df = read_summary("replay", RESULTS)
df.pivot_table(index=["tiers", "subject"], columns="metric", values="value")'''),
    ("transfer", "Transfer engine: GB/s per op, block size and batch (cross-core), QuillCache's TCP engine against a raw socket pair and Mooncake's Transfer Engine in the same run; then the 64 KiB single-block p50 latency (us) in both placements.",
     '''df = read_summary("transfer", RESULTS)
gb = df[(df.metric == "throughput") & (df.placement == "cross_core")]
display(gb.pivot_table(index=["op", "block_bytes", "batch"], columns="subject", values="value"))
lat = df[(df.metric == "latency_p50") & (df.block_bytes == 65536) & (df.batch == 1)]
lat.pivot_table(index=["placement", "op"], columns="subject", values="value")'''),
    ("master", "Master service: metadata objects/s per subject, operation, batch and batch API (per-object results or columns; Mooncake's master, its own client calls, in the same run), the batched-throughput acceptance rows, restart seconds by objects and state (the largest log tail the snapshot cadence allows included), and the SIGKILL study's counts (lost must be 0).",
     '''df = read_summary("master", RESULTS)
ops = df[df.metric == "ops_per_s"]
ops = ops.assign(api=ops["api"].fillna("Mooncake's own") if "api" in ops else "objects")
display(ops.pivot_table(index=["op", "batch", "api"], columns="subject", values="value").round(0))
if "accept_batched_vs_mooncake" in set(df.metric):
    display(df[df.metric == "accept_batched_vs_mooncake"][["subject", "op", "api", "value", "holds", "notes"]])
display(df[df.metric == "restart_s"].pivot_table(index=["objects"], columns=["start", "state"], values="value"))
rpc = df[(df.metric == "ops_per_s") & df.subject.isin(["quillcache rpc", "quillcache rpc (zmq)"])]
display(rpc.pivot_table(index=["op", "batch"], columns="transport", values="value"))
df[df.metric.isin(["kills", "acknowledged_objects", "objects_checked", "objects_lost", "half_finished_visible",
                   "failover_s", "failover_objects_lost", "failover_available"])][["metric", "value", "notes"]]'''),
    ("kvquant", "KV quantization: relMSE and bytes per element per codec on REFERENCE §12's synthetic tensors (anchors: its table), attention-output error on a random-weight decoder, and the Numba int8 kernels' GB/s against a NumPy copy.",
     '''df = read_summary("kvquant", RESULTS)
display(df[df.metric.isin(["relmse", "relmse_vs_reference", "bytes_per_element"])].pivot_table(
    index=["data", "subject"], columns="metric", values="value"))
display(df[df.metric.str.endswith("relmse") & (df.data == "random_weight_decoder")].pivot_table(
    index="subject", columns="metric", values="value"))
display(df[df.metric == "throughput"][["subject", "bytes_counted", "threads", "value", "baseline_value", "ratio"]])
read_anchors("kvquant", RESULTS)'''),
    ("cluster", "Pool of nodes (a master and node processes on loopback): failure trials (corrupt, lost and stale must be 0), remote vs local get latency by block size, the 2 MiB remote get against a raw socket transfer plus one master RPC, throughput by nodes, and pooled vs per-node hit rate (the Mooncake paper's ratio is an anchor).",
     '''df = read_summary("cluster", RESULTS)
display(df[df.metric == "get_latency_s"].pivot_table(index="block_bytes", columns=["where", "quantile"], values="value"))
display(df[df.metric.isin(["raw_socket_read_s", "master_rpc_s", "remote_get_p50_s"])][["metric", "value", "baseline_value", "ratio"]])
display(df[df.metric == "throughput_gb_per_s"].pivot_table(index="nodes", columns="op", values="value"))
display(df[df.metric.isin(["block_hit_rate", "lru_model_hit_rate"])].pivot_table(index="capacity_blocks_per_node", columns="subject", values="value"))
df[df.subject == "PooledStore on 3 node processes"][["metric", "value", "notes"]]'''),
    ("gateway", "Gateway study: front-added TTFT and headers at a fixed stand-in TTFT, throughput and CPU per request at 100 streams against direct, and per request rate the engines' prefix-cache hit rate and client TTFT behind each front (four stand-in engines; sglang-router and vllm-router from PyPI in the same run).",
     '''df = read_summary("gateway", RESULTS)
display(df[df.part.isin(["overhead_light", "overhead_streams", "headers_slow"])].pivot_table(index="subject", columns="metric", values="value"))
display(df[df.part == "routing"].pivot_table(index=["rate_per_s", "subject"], columns="metric", values="value"))
display(df[df.metric.isin(["hit_rate_paired_diff_points", "hit_rate_ceiling"])][["metric", "subject", "baseline", "rate_per_s", "value", "p10", "p90", "notes"]])
df[df.metric.str.startswith("accept_")][["metric", "subject", "value", "unit", "rate_per_s", "holds", "notes"]]'''),
]


# each table cell as the notebook runs it
SECTIONS = [(study, text, guarded(study, code)) for study, text, code in SECTIONS]


def build() -> nbformat.NotebookNode:
    cells = [new_markdown_cell(
        "# QuillCache results\n\n"
        "Every study's results, loaded through the researcher API (`quillcache.results`: `list_studies`, "
        "`read_summary`, `read_raw`, `read_anchors`, `read_meta`), one table and the study's own figure each. "
        "Parameters are typed columns (`capacity_blocks`, `entries`, `block_bytes`, ...), so filter and sort "
        "on them directly. Regenerate the results with `make experiments` (quick) or "
        "`make experiments PROFILE=full`; this notebook only reads `results/`."),
        new_code_cell(SETUP)]
    for study, text, code in SECTIONS:
        cells.append(new_markdown_cell(f"## {study}\n\n{text}"))
        cells.append(new_code_cell(code))
        cells.append(new_code_cell(f'show_figure("{study}")'))
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--execute", action="store_true", help="run it in place (nbclient) so it shows its outputs")
    args = ap.parse_args(argv)
    path = HERE / "analysis.ipynb"
    nb = build()
    if args.execute:
        from nbclient import NotebookClient

        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(nb, path)
    print(f"wrote {path.relative_to(HERE.parent)}" + (" (executed)" if args.execute else ""))


if __name__ == "__main__":
    main()
