"""KV-cache quantization study: bytes per element, reconstruction error and kernel throughput of
``quillcache.kvquant``'s codecs.

(a) Gaussian and (b) key-like tensors (Gaussian plus 4 outlier channels x10, the same 4 channels
in every head), 4,096 tokens x 8 heads x 128 in float16: REFERENCE §12's setup. Per codec
configuration: relMSE (``sum((x' - x)**2) / sum(x**2)``), SNR (dB) and array bytes per element
(codes, scales, zero points). REFERENCE §12's relMSE table is kept as anchors (``anchors.csv``) and
each of our figures gets a ``relmse_vs_reference`` row (ours / the anchor; acceptance 1/1.5..1.5).

(c) Keys and values of the last layer of a small decoder (2 layers, d_model 512, 8 heads x 64,
RMSNorm, RoPE, GELU MLP) run forward here in NumPy with RANDOM weights (not a trained model) on
random token ids: per codec, the K and V relMSE and the relMSE of the causal softmax attention
output computed exactly (float64) over the dequantized K/V against full-precision K/V.

Throughput: the Numba CPU int8 (per token-head) quantize and dequantize kernels on a float32
4,096 x 8 x 128 tensor (16 MiB), writing into preallocated outputs, in GB/s (1e9 B/s) of each
kernel's INPUT bytes (quantize: the float32 tensor; dequantize: the int8 codes and float32
scales), against ``np.copyto`` of the same number of bytes into a preallocated buffer (one
thread), same run, interleaved; medians over repetitions (acceptance: each >= 0.5x). Measured
with one Numba thread (like the copy) and with all of them; dequantize is also counted in its
OUTPUT bytes (it writes 4x what it reads). The kernels alone (input checks excluded); fp8 and int4
rows, allocating their outputs, for information.
GPU rows say "not measured: no GPU" unless one is present.

Replay (issue 17 item 4): the conversation trace (``../shared/traces/conversation_trace.jsonl``,
loaded as ``experiments.replay_study`` loads it) replayed with the DRAM and SSD tiers in fp16 (no
codec), int8 and int4 (``ReplayConfig.kv_codec``) at EQUAL TIER BYTES: the replay study's small
host tiers (``replay_study.SMALL_TIERS``: 512 DRAM + 1,024 SSD blocks of 16-bit Llama-3-8B KV per
node, i.e. 32 GiB + 64 GiB), where the pool must evict; defaults of ``ReplayConfig`` otherwise
(4 engines, Dynamo router, LRU, accounted bytes). Per codec: block hit rate (and by tier), TTFT
p50/p90/p99, and bytes moved (fetched from DRAM / SSD / peers, offloaded GPU->DRAM, demoted
DRAM->SSD); fp16 is the baseline. Engine compute, links and the dequantize cost are the engine
model's (a stand-in; the dequantize at an assumed 70% of HBM bandwidth). Deterministic (seed 0),
so n = 1. Quick mode replays the first ``replay_study.QUICK_LIMIT`` requests.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from experiments.microbench import bench_main
from quillcache.kvquant import make_codec
from quillcache.kvquant import _cpu
from quillcache.results import Anchor, SummaryRow, spread, write_summary

NAME = "kvquant"
GB = 1e9
SHAPE = (4096, 8, 128)
FULL = dict(reps=15, calls=5, lm_tokens=1024, lm_layers=2, replay_limit=None)
QUICK = dict(reps=5, calls=2, lm_tokens=256, lm_layers=2, replay_limit=600)
COPY = "numpy copy (same bytes)"

# (subject, codec, options, kind): the codec configurations measured; `kind` picks KIVI's grouping.
CONFIGS = [
    ("int8 per token-head", "int8", {}, "key"),
    ("int8 per-tensor", "int8", {"granularity": "tensor"}, "key"),
    ("fp8 e4m3 per-tensor", "fp8_e4m3", {"granularity": "tensor"}, "key"),
    ("fp8 e4m3 per-head", "fp8_e4m3", {"granularity": "head"}, "key"),
    ("fp8 e4m3 scale 1.0", "fp8_e4m3", {"granularity": "tensor", "scale": 1.0}, "key"),
    ("int4 groups of 32 per-token", "int4", {"axis": "token"}, "value"),
    ("int4 groups of 32 per-channel", "int4", {"axis": "channel"}, "key"),
    ("int2 groups of 32 per-token", "int2", {"axis": "token"}, "value"),
    ("int2 groups of 32 per-channel", "int2", {"axis": "channel"}, "key"),
]
# REFERENCE §12, "measured here on synthetic data" (Gaussian / key-like).
REFERENCE_RELMSE = {
    "int8 per token-head": (4.2e-5, 3.1e-4),
    "int8 per-tensor": (1.5e-4, 2.3e-3),
    "fp8 e4m3 per-tensor": (7.0e-4, 7.0e-4),
    "int4 groups of 32 per-token": (6.1e-3, 1.2e-2),
    "int4 groups of 32 per-channel": (6.1e-3, 6.2e-3),
    "int2 groups of 32 per-channel": (0.155, 0.156),
}
# (c): KIVI's layout (keys per channel, values per token) for int4 / int2, with and without a window
LM_CONFIGS = [
    ("int8 per token-head", "int8", {}),
    ("fp8 e4m3 per-head", "fp8_e4m3", {"granularity": "head"}),
    ("int4 KIVI (K per-channel, V per-token)", "int4", {}),
    ("int2 KIVI (K per-channel, V per-token)", "int2", {}),
    ("int2 KIVI + 128-token window", "int2", {"window_tokens": 128}),
]
# the replay part: tier codecs compared at equal tier bytes, and what each row reports
REPLAY_CODECS = ("fp16", "int8", "int4")
REPLAY_METRICS = [("block_hit_rate", "fraction"), ("block_hit_rate_gpu", "fraction"),
                  ("block_hit_rate_dram", "fraction"), ("block_hit_rate_ssd", "fraction"),
                  ("block_hit_rate_peer", "fraction"), ("token_hit_rate", "fraction"), ("ttft_p50_s", "s"),
                  ("ttft_p90_s", "s"), ("ttft_p99_s", "s"), ("slo_attainment", "fraction"),
                  ("bytes_fetched_dram", "bytes"), ("bytes_fetched_ssd", "bytes"), ("bytes_fetched_peer", "bytes"),
                  ("bytes_offloaded_gpu_to_dram", "bytes"), ("bytes_dram_to_ssd", "bytes"),
                  ("bytes_ssd_to_dram", "bytes"), ("tier_block_bytes", "bytes"), ("dram_capacity_blocks", "count"),
                  ("ssd_capacity_blocks", "count")]
REF12 = "REFERENCE §12 (synthetic 4,096 x 8 x 128, measured in an earlier session)"


def synthetic(kind: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    if kind == "key_like":
        x[:, :, rng.choice(SHAPE[2], 4, replace=False)] *= np.float32(10.0)
    return x.astype(np.float16)


def rel_mse(approx: np.ndarray, exact: np.ndarray) -> float:
    a, e = approx.astype(np.float64), exact.astype(np.float64)
    return float(((a - e) ** 2).sum() / (e**2).sum())


def snr_db(rel: float) -> float:
    return -10.0 * math.log10(rel) if rel > 0 else math.inf


# ----------------------------------------------------------------------------- (c) a random-weight decoder


def _rms_norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + 1e-6)


def _rope(x: np.ndarray) -> np.ndarray:
    t, _, d = x.shape
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Exact causal softmax attention in float64: q, k, v (tokens, heads, head_dim) -> same shape."""
    q, k, v = (a.astype(np.float64).transpose(1, 0, 2) for a in (q, k, v))
    t, d = q.shape[1], q.shape[2]
    logits = q @ k.transpose(0, 2, 1) / math.sqrt(d)
    logits[:, np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ v).transpose(1, 0, 2)


def tiny_decoder_kv(tokens: int, layers: int, seed: int = 1, d_model: int = 512, heads: int = 8,
                    vocab: int = 4096) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, k, v) of the last layer, float16 (tokens, heads, d_model // heads); RANDOM weights."""
    rng = np.random.default_rng(seed)
    hd = d_model // heads
    w = lambda *s: rng.standard_normal(s) / math.sqrt(s[0])  # noqa: E731
    h = rng.standard_normal((vocab, d_model))[rng.integers(0, vocab, tokens)]
    for layer in range(layers):
        a = _rms_norm(h)
        q = _rope((a @ w(d_model, d_model)).reshape(tokens, heads, hd))
        k = _rope((a @ w(d_model, d_model)).reshape(tokens, heads, hd))
        v = (a @ w(d_model, d_model)).reshape(tokens, heads, hd)
        if layer == layers - 1:
            return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)
        h = h + attention(q, k, v).reshape(tokens, d_model) @ w(d_model, d_model)
        m = _rms_norm(h) @ w(d_model, 4 * d_model)
        h = h + (0.5 * m * (1 + np.tanh(0.7978845608 * (m + 0.044715 * m**3)))) @ w(4 * d_model, d_model)
    raise AssertionError("layers must be >= 1")


# ----------------------------------------------------------------------------- throughput


def _time(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _throughput_rows(cfg: dict) -> list[SummaryRow]:
    import numba

    rng = np.random.default_rng(5)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    q8 = np.empty(SHAPE, np.int8)
    s8 = np.empty(SHAPE[:2], np.float32)
    out = np.empty(SHAPE, np.float32)
    _cpu.int8_quantize_into(x, q8, s8)
    c8, sf = _cpu.fp8_quantize(x, True, None)
    int8_in = q8.nbytes + s8.nbytes
    cases = [  # (subject, kernel, bytes counted, what they are, copy bytes, acceptance row)
        ("numba int8 quantize", lambda: _cpu.int8_quantize_into(x, q8, s8), x.nbytes, "input", x.nbytes, True),
        ("numba int8 dequantize", lambda: _cpu.int8_dequantize_into(q8, s8, out), int8_in, "input", int8_in, True),
        ("numba int8 dequantize", lambda: _cpu.int8_dequantize_into(q8, s8, out), out.nbytes, "output", out.nbytes,
         False),
        ("numba fp8 e4m3 quantize (per-head)", lambda: _cpu.fp8_quantize(x, True, None), x.nbytes, "input",
         x.nbytes, False),
        ("numba fp8 e4m3 dequantize", lambda: _cpu.fp8_dequantize(c8, sf), c8.nbytes + sf.nbytes, "input",
         c8.nbytes + sf.nbytes, False),
        ("numba int4 quantize (per-channel, packed)",
         lambda: _cpu.pack_bits(_cpu.asym_quantize(x, 4, 32, 1)[0], 4), x.nbytes, "input", x.nbytes, False),
    ]
    rows = []
    all_threads = numba.config.NUMBA_NUM_THREADS
    try:
        for threads in sorted({1, all_threads}):
            numba.set_num_threads(threads)
            for subject, fn, nbytes, counted, copy_bytes, accept in cases:
                if threads != 1 and not accept:
                    continue
                src = np.ones(copy_bytes, np.uint8)
                dst = np.empty_like(src)
                copy = lambda: np.copyto(dst, src)  # noqa: E731
                fn(), copy()  # JIT and page warm-up, untimed
                ours, base = [], []
                for rep in range(cfg["reps"]):
                    for f, acc in ((fn, ours), (copy, base)) if rep % 2 == 0 else ((copy, base), (fn, ours)):
                        acc.append(nbytes / _time(f, cfg["calls"]) / GB)
                o, b = spread(ours), spread(base)
                alloc = "" if "int8" in subject else "; allocates its outputs (API-level kernel call)"
                rows.append(SummaryRow.from_spread(
                    o, metric="throughput", subject=subject, unit="GB/s", baseline=COPY, baseline_value=b["median"],
                    n=len(ours), params={"bytes_counted": counted, "counted_bytes": int(nbytes), "threads": threads,
                                         "device": "cpu"},
                    notes=f"GB/s of the kernel's {counted} bytes against np.copyto of as many bytes (single-threaded); "
                          f"float32 {SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]}; {cfg['calls']} calls per repetition{alloc}"))
    finally:
        numba.set_num_threads(all_threads)
    return rows


def _gpu_status() -> str:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "not measured: no GPU (cupy is not installed; the `gpu` extra)"
    try:
        from numba import cuda

        if not cuda.is_available():
            return "not measured: no GPU"
    except Exception as e:  # noqa: BLE001 - any driver failure means no GPU here
        return f"not measured: no GPU ({type(e).__name__})"
    return "not measured: a GPU is present but this study's GPU timing is not implemented yet"


# ----------------------------------------------------------------------------- the study


def anchors() -> list[Anchor]:
    return [Anchor(metric="relmse", subject=subject, value=v, unit="ratio", source=REF12,
                   params={"data": data, "tokens": SHAPE[0], "heads": SHAPE[1], "head_dim": SHAPE[2]})
            for subject, pair in REFERENCE_RELMSE.items() for data, v in zip(("gaussian", "key_like"), pair)]


def _synthetic_rows() -> list[SummaryRow]:
    rows = []
    for data in ("gaussian", "key_like"):
        x = synthetic(data)
        for subject, codec_name, opts, kind in CONFIGS:
            codec = make_codec(codec_name, **opts)
            q = codec.quantize(x, kind=kind)
            rel = rel_mse(codec.dequantize(q), x)
            params = {"data": data, "tokens": SHAPE[0], "heads": SHAPE[1], "head_dim": SHAPE[2]}
            rows.append(SummaryRow(metric="relmse", subject=subject, value=rel, unit="ratio", params=params,
                                   notes="sum((x'-x)^2)/sum(x^2), float16 input"))
            rows.append(SummaryRow(metric="snr_db", subject=subject, value=snr_db(rel), unit="dB", params=params))
            rows.append(SummaryRow(metric="bytes_per_element", subject=subject, value=q.nbytes / x.size,
                                   unit="B", params=params,
                                   notes=f"codes + scales + zero points; float16 = 2 B ({2 * x.size / q.nbytes:.2f}x smaller)"))
            ref = REFERENCE_RELMSE.get(subject)
            if ref is not None:
                anchor = ref[0 if data == "gaussian" else 1]
                rows.append(SummaryRow(metric="relmse_vs_reference", subject=subject, value=rel / anchor, unit="x",
                                       params=params, notes=f"ours / REFERENCE §12's {anchor:g}; acceptance "
                                                            f"within 1.5x either way"))
    return rows


def _lm_rows(cfg: dict) -> list[SummaryRow]:
    q, k, v = tiny_decoder_kv(cfg["lm_tokens"], cfg["lm_layers"])
    exact = attention(q, k, v)
    params = {"data": "random_weight_decoder", "tokens": int(k.shape[0]), "heads": int(k.shape[1]),
              "head_dim": int(k.shape[2])}
    note = (f"last layer of a {cfg['lm_layers']}-layer NumPy decoder with RANDOM weights (not a trained model), "
            f"{k.shape[0]} random tokens")
    rows = []
    for subject, codec_name, opts in LM_CONFIGS:
        codec = make_codec(codec_name, **opts)
        kq_, vq = codec.quantize(k, kind="key"), codec.quantize(v, kind="value")
        k2, v2 = codec.dequantize(kq_), codec.dequantize(vq)
        out = attention(q, k2, v2)
        for metric, value in (("k_relmse", rel_mse(k2, k)), ("v_relmse", rel_mse(v2, v)),
                              ("attention_relmse", rel_mse(out, exact))):
            rows.append(SummaryRow(metric=metric, subject=subject, value=value, unit="ratio", params=params,
                                   notes=note))
        rows.append(SummaryRow(metric="attention_snr_db", subject=subject, value=snr_db(rel_mse(out, exact)),
                               unit="dB", params=params, notes=note))
    return rows


def _replay_rows(cfg: dict, trace: str | None = None) -> list[SummaryRow]:
    """fp16 vs int8 vs int4 host tiers at equal tier bytes on the conversation trace (docstring)."""
    from experiments.replay_study import SMALL_TIERS
    from quillcache.harness import ReplayConfig, replay
    from quillcache.traces.loader import default_trace_path, load_trace

    reqs = load_trace(trace or default_trace_path(), limit=cfg["replay_limit"])
    got: dict[str, dict] = {}
    for codec in REPLAY_CODECS:
        t0 = time.perf_counter()
        d = replay(reqs, ReplayConfig(kv_codec=codec, **SMALL_TIERS)).summary.as_dict()
        d["wall_s"] = time.perf_counter() - t0
        got[codec] = d
        print(f"  replay {codec:<5} {len(reqs)} requests: block hit rate {d['block_hit_rate']:.4f}, TTFT p50 "
              f"{d['ttft_p50_s']:.3f} s, p99 {d['ttft_p99_s']:.3f} s ({d['wall_s']:.1f} s)", flush=True)
    base = got["fp16"]
    rows = []
    for codec, d in got.items():
        params = {"part": "replay", "requests": len(reqs), "engines": int(d["engines"]),
                  "dram_capacity_bytes": int(d["dram_capacity_bytes"]),
                  "ssd_capacity_bytes": int(d["ssd_capacity_bytes"]), "account_bytes": bool(d["account_bytes"])}
        note = (f"conversation trace, {len(reqs)} requests; equal tier bytes (replay_study.SMALL_TIERS of 16-bit "
                f"blocks); deterministic replay (seed 0); engine model (a stand-in); wall {d['wall_s']:.1f} s")
        for m, unit in REPLAY_METRICS:
            rows.append(SummaryRow(metric=f"replay_{m}", subject=codec, value=float(d[m]), unit=unit, n=1,
                                   baseline="" if codec == "fp16" else "fp16",
                                   baseline_value=math.nan if codec == "fp16" else float(base[m]),
                                   params=params, notes=note))
    return rows


def run(quick: bool = False, results_root: str | None = None, trace: str | None = None) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    rows = _synthetic_rows() + _lm_rows(cfg) + _throughput_rows(cfg) + _replay_rows(cfg, trace)
    gpu = _gpu_status()
    rows.append(SummaryRow(metric="gpu_measured", subject="numba.cuda kernels", value=0.0, unit="bool", notes=gpu))
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", started_at=t_start,
                  anchors=anchors())
    print(f"{'subject':<34} {'data':<10} {'relMSE':>10} {'ref':>9} {'ratio':>6} {'B/elem':>7}")
    for r in rows:
        if r.metric == "relmse":
            ref = REFERENCE_RELMSE.get(r.subject)
            a = ref[0 if r.params["data"] == "gaussian" else 1] if ref else math.nan
            bpe = next(x.value for x in rows if x.metric == "bytes_per_element" and x.subject == r.subject
                       and x.params == r.params)
            print(f"{r.subject:<34} {r.params['data']:<10} {r.value:10.3g} {a:9.3g} {r.value / a:6.2f} {bpe:7.3f}")
    for r in rows:
        if r.metric == "attention_relmse":
            print(f"attention relMSE {r.subject:<42} {r.value:.3g}")
        if r.metric == "throughput":
            print(f"{r.subject:<44} {r.params['bytes_counted']:<6} threads={r.params['threads']} {r.value:7.2f} GB/s "
                  f"vs copy {r.baseline_value:7.2f} ({r.ratio:.2f}x)")
    print(gpu)
    for r in rows:
        if r.metric in ("replay_block_hit_rate", "replay_ttft_p50_s", "replay_ttft_p99_s"):
            vs = "" if math.isnan(r.baseline_value) else f" (fp16 {r.baseline_value:.4f})"
            print(f"{r.metric:<24} {r.subject:<5} {r.value:.4f}{vs}")
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """``kvquant.png``: relMSE per codec (log scale), Gaussian and key-like, with REFERENCE's anchors."""
    from experiments.plotstyle import BASELINE, OURS, figure, save, style_axes
    from quillcache.results import read_anchors, read_summary

    df = read_summary(NAME, results_root)
    anc = read_anchors(NAME, results_root)
    fig, axes = figure(9.0, 3.8, ncols=2, sharey=True)
    subjects = [c[0] for c in CONFIGS]
    for ax, data in zip(axes, ("gaussian", "key_like")):
        part = df[(df["metric"] == "relmse") & (df["data"] == data)].set_index("subject")
        y = np.arange(len(subjects))
        ax.barh(y, [float(part.loc[s, "value"]) for s in subjects], color=OURS, label="measured")
        a = anc[anc["data"] == data].set_index("subject") if len(anc) else None
        ay = [(i, float(a.loc[s, "value"])) for i, s in enumerate(subjects) if a is not None and s in a.index]
        ax.scatter([v for _, v in ay], [i for i, _ in ay], marker="|", s=200, color=BASELINE, zorder=3,
                   label="REFERENCE §12 anchor")
        ax.set_xscale("log")
        ax.set_yticks(y)
        ax.set_yticklabels(subjects, fontsize=7)
        style_axes(ax, xlabel="relMSE (log)", title=f"{data.replace('_', '-')} 4,096 x 8 x 128")
    axes[0].legend(loc="lower right", fontsize=7)
    return save(fig, Path(out_dir) / "kvquant.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
