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

Features of request ``r``, all known at its arrival (``FEATURES``):
- ``turns_seen``: blocks of its known prefix on which an earlier request ended (QuillChain's turn
  count), ``prompt_blocks``, ``known_blocks`` (leading blocks seen before), ``new_blocks``;
- ``log_gap``: log(1 + requests since the previous request that ended on the deepest block of its
  known prefix on which one ended), 0 when there is none.

Scores: each feature alone (AUC taken in the better direction) and a logistic regression on all of
them (standardised, L2-regularised, Newton's method), trained on one half of the trace and scored
on the other, both ways; its accuracy is at the threshold that is best on the scored half itself,
an optimistic figure. AUC is the rank statistic (ties count one half).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from quillcache.hitrate.arrays import TraceArrays
from quillcache.hitrate.turns import last_full_positions
from quillcache.traces.loader import MOONCAKE_BLOCK_TOKENS

FEATURES = ("turns_seen", "prompt_blocks", "known_blocks", "new_blocks", "log_gap")


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
                latest = ended_at[b]
        gap = math.log1p(r - latest) if latest >= 0 else 0.0
        out[r] = (turns, len(keys), known, len(keys) - known, gap)
        for b in keys:
            seen[b] = True
        if pos[r] >= 0:
            ended_at[blocks[pos[r]]] = r
    return out


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


def best_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """The best accuracy of ``score > t`` over every threshold ``t`` (predicting all 0 or all 1
    included)."""
    labels = np.asarray(labels).astype(bool)
    order = np.argsort(-np.asarray(scores, np.float64), kind="mergesort")
    s, y = np.asarray(scores, np.float64)[order], labels[order]
    tp = np.concatenate(([0], np.cumsum(y)))  # predicting the top k positive
    fp = np.concatenate(([0], np.cumsum(~y)))
    correct = tp + (len(y) - int(y.sum()) - fp)
    cut = np.concatenate(([True], s[1:] != s[:-1], [True]))  # only between distinct scores
    return float(correct[cut].max() / len(y)) if len(y) else math.nan


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


def predictability(arrs: TraceArrays, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[Predictability]:
    """Each feature alone, then the two-fold logistic regression on all of them."""
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
    return out
