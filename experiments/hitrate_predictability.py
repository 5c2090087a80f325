"""How well can an online policy tell which requests' blocks will be referenced again?

The information bounds of the hit-rate study (``quillcache.hitrate.bounds``) say how much of the
LRU-to-Belady gap knowing *which* blocks return is worth, and how that falls as the knowledge gets
wrong about a share of the requests. This module measures where predictors built from what is
known when a request arrives actually sit.

Label of request ``r``: its last full block (the last block, or the one before it when the
prompt ends in a partial block) is referenced again later in the trace - a later request extends
this prompt (the conversation gets another turn, or the prompt is shared). Only requests whose last
full block is new (first seen in this request) are labelled: for the others (a prompt that is all
shared system prompt, an exact repeat) the label would say nothing about the request.

Features of request ``r``, all known at its arrival (``FEATURES``; its own output length is not):
- ``turns_seen``: blocks of its known prefix on which an earlier request ended (QuillChain's turn
  count), ``prompt_blocks``, ``known_blocks`` (leading blocks seen before), ``new_blocks``;
- ``log_gap``: log(1 + requests since the previous request that ended on the deepest block of its
  known prefix on which one ended - its *parent*, the previous turn), 0 when there is none;
- ``input_tokens``; ``tail_fill``: the share of its last block its prompt fills (0 when the prompt
  ends on a block boundary);
- from the parent, -1 when there is none: ``log_gap_ms`` (log(1 + milliseconds since it arrived)),
  ``new_tokens`` (prompt tokens beyond the parent's prompt and output: the user's new turn, which
  may be negative when the conversation was cut) and ``prev_output_tokens``.

Scores: each feature alone (AUC taken in the better direction) and a logistic regression on all of
them (standardised, L2-regularised, Newton's method), trained on one half of the trace and scored
on the other, both ways; its accuracy is at the threshold that is best on the scored half itself,
an optimistic figure. AUC is the rank statistic (ties count one half).

Learned and online (``gbm_scores``): gradient-boosted trees (LightGBM) on the same features,
retrained every ``GBM_CHUNK`` requests on the requests before, and scoring the next chunk, so a
score never uses a later request's features. Two ways to label the training requests:

- ``"online"``: what a cache knows when it retrains at request ``s``: request ``r`` came back if
  a request before ``s`` referenced its last full block again; requests more recent than the 90th
  percentile of the return distances (in requests) seen so far are left out, as not yet known
  (the percentile is taken from the returns seen before ``s``, so it too uses only the past).
  Scores made this way are online: truncating the trace after any request leaves every earlier
  score unchanged (tested).
- ``"every past label"``: every earlier labelled request with its true label, even one whose
  return lies after ``s`` - more than any online policy can know: an optimistic setting, so its
  figures are not an online policy's.

The trees' settings (``GBM_ROUNDS`` rounds at learning rate 0.05, 15 leaves, LightGBM's defaults
otherwise) were set once and not tuned on any trace; the labels and features are the same as the
logistic regression's.

``quillcache.hitrate.predicted_reuse.predicted_reuse_lru`` replays a model's bits (score above a
threshold; before the first model every bit is set, which is LRU) so its accuracy can be read as
hits: the study reports every threshold of ``GBM_THRESHOLDS`` and the best of them in hindsight
(an optimistic figure, labelled so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from quillcache.hitrate.arrays import TraceArrays
from quillcache.hitrate.turns import last_full_positions
from quillcache.traces.loader import MOONCAKE_BLOCK_TOKENS

FEATURES = ("turns_seen", "prompt_blocks", "known_blocks", "new_blocks", "log_gap", "input_tokens", "tail_fill",
            "log_gap_ms", "new_tokens", "prev_output_tokens")
GBM_CHUNK = 500  # requests scored by one model; it is retrained on everything before them
GBM_MIN_TRAIN = 1000  # labelled requests a first model needs (before it, no score: every bit set)
GBM_RETURN_QUANTILE = 0.9  # online labels: requests younger than this quantile of the return distances seen are left out
GBM_ROUNDS = 200
GBM_PARAMS = {"objective": "binary", "learning_rate": 0.05, "num_leaves": 15, "deterministic": True,
              "force_row_wise": True, "num_threads": 1, "verbose": -1}  # LightGBM's defaults otherwise
GBM_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
LABEL_MODES = ("online", "every past label")
GBM_SUBJECTS = {m: f"gradient-boosted trees ({m})" for m in LABEL_MODES}


@dataclass(frozen=True)
class Predictability:
    subject: str  # a feature name, or "logistic (all features)"
    auc: float
    accuracy: float  # at the best threshold on the scored half (optimistic)
    base_rate: float  # share of labelled requests whose blocks come back
    n: int  # labelled requests scored


def reuse_labels(arrs: TraceArrays, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """int8[R]: 1 when the request's last full block is referenced again, 0 when not, -1 when it
    is not labelled (no full block, or its last full block was seen before)."""
    pos = last_full_positions(arrs, block_tokens)
    n = arrs.num_refs
    first = np.zeros(arrs.num_refs, np.bool_)  # the block's first reference
    first[np.unique(arrs.blocks, return_index=True)[1]] = True
    out = np.full(arrs.num_requests, -1, np.int8)
    has = pos >= 0
    has[has] = first[pos[has]]
    out[has] = (arrs.next_use[pos[has]] < n).astype(np.int8)
    return out


def request_features(arrs: TraceArrays, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """float64[R, len(FEATURES)]: each request's features at its arrival (module docstring)."""
    off, blocks = arrs.req_offsets.tolist(), arrs.blocks.tolist()
    pos = last_full_positions(arrs, block_tokens).tolist()
    ts, isl, osl = arrs.timestamps_ms.tolist(), arrs.input_tokens.tolist(), arrs.output_tokens.tolist()
    seen = np.zeros(arrs.num_unique, np.bool_)
    ended_at = np.full(arrs.num_unique, -1, np.int64)  # the latest request that ended on the block
    out = np.zeros((arrs.num_requests, len(FEATURES)), np.float64)
    for r in range(arrs.num_requests):
        keys = blocks[off[r]:off[r + 1]]
        known = turns = 0
        latest = -1
        for b in keys:
            if not seen[b]:
                break
            known += 1
            if ended_at[b] >= 0:
                turns += 1
                latest = int(ended_at[b])
        gap = math.log1p(r - latest) if latest >= 0 else 0.0
        tail = (isl[r] % block_tokens) / block_tokens
        if latest >= 0:
            parent = (math.log1p(ts[r] - ts[latest]), isl[r] - isl[latest] - osl[latest], osl[latest])
        else:
            parent = (-1.0, -1.0, -1.0)
        out[r] = (turns, len(keys), known, len(keys) - known, gap, isl[r], tail, *parent)
        for b in keys:
            seen[b] = True
        if pos[r] >= 0:
            ended_at[blocks[pos[r]]] = r
    return out


def return_requests(arrs: TraceArrays, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """int64[R]: the request that next references request ``r``'s last full block, ``R`` when none
    does (or ``r`` has no full block)."""
    pos = last_full_positions(arrs, block_tokens)
    req_of = np.repeat(np.arange(arrs.num_requests, dtype=np.int64), np.diff(arrs.req_offsets))
    out = np.full(arrs.num_requests, arrs.num_requests, np.int64)
    has = pos >= 0
    nu = arrs.next_use[pos[has]]
    back = nu < arrs.num_refs
    idx = np.flatnonzero(has)[back]
    out[idx] = req_of[nu[back]]
    return out


def training_set(labels: np.ndarray, returns: np.ndarray, s: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(indices, labels) of the requests a model retrained at request ``s`` learns from, under
    label ``mode`` (module docstring); nothing at or after ``s`` is read in ``"online"`` mode."""
    idx = np.flatnonzero(labels[:s] >= 0)
    if mode == "every past label":
        return idx, labels[idx].astype(bool)
    if mode != "online":
        raise ValueError(f"label mode must be one of {LABEL_MODES}, got {mode!r}")
    back = returns[idx] < s  # came back before s: known
    if not back.any():
        return idx[:0], np.zeros(0, np.bool_)
    horizon = float(np.quantile(returns[idx][back] - idx[back], GBM_RETURN_QUANTILE))
    old = idx <= s - horizon
    return idx[old], back[old]


def gbm_scores(arrs: TraceArrays, mode: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0,
               chunk: int = GBM_CHUNK, min_train: int = GBM_MIN_TRAIN) -> np.ndarray:
    """float64[R]: each request's predicted probability that its blocks come back, from LightGBM
    retrained every ``chunk`` requests on the earlier ones labelled under ``mode``; NaN before the
    first model (fewer than ``min_train`` training requests, or one class only)."""
    import lightgbm as lgb

    x = request_features(arrs, block_tokens)
    labels = reuse_labels(arrs, block_tokens)
    returns = return_requests(arrs, block_tokens)
    out = np.full(arrs.num_requests, np.nan)
    for s in range(0, arrs.num_requests, chunk):
        idx, y = training_set(labels, returns, s, mode)
        if len(idx) < min_train or y.all() or not y.any():
            continue
        model = lgb.train(dict(GBM_PARAMS, seed=seed), lgb.Dataset(x[idx], y.astype(np.float64)),
                          num_boost_round=GBM_ROUNDS)
        out[s:s + chunk] = model.predict(x[s:s + chunk])
    return out


def predicted_bits(scores: np.ndarray, threshold: float) -> np.ndarray:
    """bool[R]: score above ``threshold``; set where there is no score yet (LRU's behaviour)."""
    return np.where(np.isnan(scores), True, scores > threshold)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative) + half the ties (NaN if one
    class is empty)."""
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels).astype(bool)
    npos, nneg = int(labels.sum()), int((~labels).sum())
    if npos == 0 or nneg == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), np.float64)
    s = scores[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[labels].sum() - npos * (npos + 1) / 2.0) / (npos * nneg))


def _threshold_counts(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For "the top k scores are positive", k = 0..n: true and false positives, and a mask of the k
    that fall between distinct scores (the thresholds ``score > t`` can make)."""
    labels = np.asarray(labels).astype(bool)
    order = np.argsort(-np.asarray(scores, np.float64), kind="mergesort")
    s, y = np.asarray(scores, np.float64)[order], labels[order]
    tp = np.concatenate(([0], np.cumsum(y)))
    fp = np.concatenate(([0], np.cumsum(~y)))
    cut = np.concatenate(([True], s[1:] != s[:-1], [True]))
    return tp, fp, cut


def best_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """The best accuracy of ``score > t`` over every threshold ``t`` (predicting all 0 or all 1
    included)."""
    n = len(labels)
    if not n:
        return math.nan
    tp, fp, cut = _threshold_counts(scores, labels)
    correct = tp + (n - int(tp[-1]) - fp)
    return float(correct[cut].max() / n)


def best_balanced_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """The best balanced accuracy ``(TPR + TNR) / 2`` of ``score > t`` over every threshold ``t``
    (all 0 or all 1 included, which score 0.5); NaN if one class is empty. One minus it is the error
    rate, the same on both classes, of the per-request flips of ``quillcache.hitrate.bounds`` that
    this predictor matches (a heuristic match where its errors are not symmetric)."""
    tp, fp, cut = _threshold_counts(scores, labels)
    npos, nneg = int(tp[-1]), int(fp[-1])
    if npos == 0 or nneg == 0:
        return math.nan
    bal = (tp / npos + (nneg - fp) / nneg) / 2.0
    return float(bal[cut].max())


def logistic_fit(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, iters: int = 30) -> np.ndarray:
    """Weights (bias last) of an L2-regularised logistic regression by Newton's method."""
    xb = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros(xb.shape[1])
    reg = l2 * np.eye(xb.shape[1])
    reg[-1, -1] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(xb @ w, -30, 30)))
        grad = xb.T @ (p - y) + reg @ w
        hess = (xb * (p * (1 - p))[:, None]).T @ xb + reg
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return w


def logistic_scores(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray) -> np.ndarray:
    mu, sd = train_x.mean(axis=0), train_x.std(axis=0)
    sd[sd == 0] = 1.0
    w = logistic_fit((train_x - mu) / sd, train_y.astype(np.float64))
    return np.hstack([(test_x - mu) / sd, np.ones((len(test_x), 1))]) @ w


def predictability(arrs: TraceArrays, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                   gbm: dict[str, np.ndarray] | None = None) -> list[Predictability]:
    """Each feature alone, then the two-fold logistic regression on all of them, then each
    ``gbm_scores`` array of ``gbm`` (label mode -> scores), scored on the labelled requests it has
    a score for (its accuracy at the threshold best on them: optimistic)."""
    y_all = reuse_labels(arrs, block_tokens)
    keep = y_all >= 0
    x, y = request_features(arrs, block_tokens)[keep], y_all[keep].astype(bool)
    base = float(y.mean()) if len(y) else math.nan
    out = []
    for i, name in enumerate(FEATURES):
        a = auc(x[:, i], y)
        low = a < 0.5  # the feature predicts the other way (False for NaN)
        out.append(Predictability(name, 1.0 - a if low else a, best_accuracy(-x[:, i] if low else x[:, i], y), base,
                                  len(y)))
    half = len(y) // 2
    folds = [(slice(0, half), slice(half, len(y))), (slice(half, len(y)), slice(0, half))]
    aucs, accs = [], []
    for tr, te in folds:
        if y[tr].all() or not y[tr].any():
            continue
        sc = logistic_scores(x[tr], y[tr], x[te])
        aucs.append(auc(sc, y[te]))
        accs.append(best_accuracy(sc, y[te]))
    out.append(Predictability("logistic (all features)", float(np.mean(aucs)) if aucs else math.nan,
                              float(np.mean(accs)) if accs else math.nan, base, len(y)))
    for mode, scores in (gbm or {}).items():
        sc = np.asarray(scores, np.float64)[keep]
        has = ~np.isnan(sc)
        yy = y[has]
        if not len(yy):
            continue  # no model yet (too short a trace): no row rather than a NaN
        out.append(Predictability(GBM_SUBJECTS[mode], auc(sc[has], yy), best_accuracy(sc[has], yy),
                                  float(yy.mean()) if len(yy) else math.nan, len(yy)))
    return out
