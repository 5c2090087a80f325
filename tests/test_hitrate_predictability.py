"""The predictability measures of the hit-rate study: AUC and best accuracy equal their
brute-force definitions, the logistic fit finds a planted signal, and features and labels of a
hand-made trace are what the module docstring says."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.hitrate_predictability import (
    FEATURES,
    auc,
    best_accuracy,
    logistic_scores,
    predictability,
    request_features,
    reuse_labels,
)
from quillcache.hitrate.arrays import arrays_from_lists


@given(data=st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=40))
@settings(max_examples=200)
def test_auc_and_best_accuracy_equal_brute_force(data):
    s = np.array([d[0] for d in data], float)
    y = np.array([d[1] for d in data])
    pos, neg = s[y], s[~y]
    if len(pos) and len(neg):
        want = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))
        assert math.isclose(auc(s, y), want)
    else:
        assert math.isnan(auc(s, y))
    thresholds = [-math.inf, *sorted(set(s))]
    want_acc = max(float(((s > t) == y).mean()) for t in thresholds)
    assert math.isclose(best_accuracy(s, y), want_acc)


def test_logistic_finds_a_planted_signal_and_ignores_noise():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4000, 3))
    y = rng.random(4000) < 1 / (1 + np.exp(-(2.0 * x[:, 0] - 1.0)))
    sc = logistic_scores(x[:2000], y[:2000], x[2000:])
    assert auc(sc, y[2000:]) > 0.85
    assert auc(logistic_scores(x[:2000, 1:], y[:2000], x[2000:, 1:]), y[2000:]) < 0.6  # the noise columns


def test_features_and_labels_of_a_hand_made_trace():
    # 0: s a | 1: s b (partial tail 9) | 2: s a c (a's conversation's next turn) | 3: s a c d | 4: s e
    lists = [[0, 1], [0, 2, 9], [0, 1, 3], [0, 1, 3, 4], [0, 5]]
    isl = [1024, 2 * 512 + 100, 1536, 2048, 1024]
    arrs = arrays_from_lists(lists, input_tokens=isl)
    # dense ids in first-seen order: s=0 a=1 b=2 tail=3 c=4 d=5 e=6
    assert reuse_labels(arrs).tolist() == [1, 0, 1, 0, 0]  # a and c come back; b, d, e do not
    f = dict(zip(FEATURES, request_features(arrs).T))
    assert f["known_blocks"].tolist() == [0, 1, 2, 3, 1]
    assert f["new_blocks"].tolist() == [2, 2, 1, 1, 1]
    assert f["prompt_blocks"].tolist() == [2, 3, 3, 4, 2]
    assert f["turns_seen"].tolist() == [0, 0, 1, 2, 0]  # request 0 ended on a, request 2 on c
    assert np.allclose(f["log_gap"], [0, 0, math.log1p(2), math.log1p(1), 0])
    rows = predictability(arrs)
    assert [r.subject for r in rows] == [*FEATURES, "logistic (all features)"]
    assert all(r.n == 5 and math.isclose(r.base_rate, 0.4) for r in rows)

