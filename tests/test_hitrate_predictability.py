"""The predictability measures of the hit-rate study: AUC and best accuracy equal their
brute-force definitions, the logistic fit finds a planted signal, features, labels, returns and
training sets of a hand-made trace are what the module docstring says, and the learned scores
with online labels use only the past."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.hitrate_predictability import (
    FEATURES,
    GBM_SUBJECTS,
    LABEL_MODES,
    auc,
    best_accuracy,
    best_balanced_accuracy,
    gbm_scores,
    logistic_scores,
    predictability,
    predicted_bits,
    request_features,
    return_requests,
    reuse_labels,
    training_set,
)
from quillcache.hitrate.arrays import arrays_from_lists, load_arrays


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
    if len(pos) and len(neg):
        want_bal = max((float((pos > t).mean()) + float((neg <= t).mean())) / 2 for t in thresholds)
        assert math.isclose(best_balanced_accuracy(s, y), want_bal)
    else:
        assert math.isnan(best_balanced_accuracy(s, y))


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
    arrs = arrays_from_lists(lists, input_tokens=isl, timestamps_ms=[0, 100, 1000, 1500, 2000],
                             output_tokens=[300, 0, 200, 0, 0])
    # dense ids in first-seen order: s=0 a=1 b=2 tail=3 c=4 d=5 e=6
    assert reuse_labels(arrs).tolist() == [1, 0, 1, 0, 0]  # a and c come back; b, d, e do not
    f = dict(zip(FEATURES, request_features(arrs).T))
    assert f["known_blocks"].tolist() == [0, 1, 2, 3, 1]
    assert f["new_blocks"].tolist() == [2, 2, 1, 1, 1]
    assert f["prompt_blocks"].tolist() == [2, 3, 3, 4, 2]
    assert f["turns_seen"].tolist() == [0, 0, 1, 2, 0]  # request 0 ended on a, request 2 on c
    assert np.allclose(f["log_gap"], [0, 0, math.log1p(2), math.log1p(1), 0])
    # the parent (the request that ended on the deepest ended-on block of the known prefix): 0 for
    # request 2, 2 for request 3, none for the others (-1)
    assert f["input_tokens"].tolist() == isl
    assert np.allclose(f["tail_fill"], [0, 100 / 512, 0, 0, 0])
    assert np.allclose(f["log_gap_ms"], [-1, -1, math.log1p(1000), math.log1p(500), -1])
    assert f["new_tokens"].tolist() == [-1, -1, 1536 - 1024 - 300, 2048 - 1536 - 200, -1]
    assert f["prev_output_tokens"].tolist() == [-1, -1, 300, 200, -1]
    rows = predictability(arrs)
    assert [r.subject for r in rows] == [*FEATURES, "logistic (all features)"]
    assert all(r.n == 5 and math.isclose(r.base_rate, 0.4) for r in rows)
    # where each request's last full block comes back (5: never), and what a model retrained at
    # request s learns from: online, only returns seen before s, and only requests older than the
    # 90th percentile of those returns' distances; with every past label, all of them
    assert return_requests(arrs).tolist() == [2, 5, 3, 5, 5]
    labels, returns = reuse_labels(arrs), return_requests(arrs)
    idx, y = training_set(labels, returns, 3, "online")  # only request 0's return (distance 2) is known
    assert idx.tolist() == [0, 1] and y.tolist() == [True, False]
    idx, y = training_set(labels, returns, 4, "online")  # distances 2 and 1: horizon 1.9
    assert idx.tolist() == [0, 1, 2] and y.tolist() == [True, False, True]
    idx, y = training_set(labels, returns, 3, "every past label")
    assert idx.tolist() == [0, 1, 2] and y.tolist() == [True, False, True]  # request 2's return is after 3
    assert training_set(labels, returns, 2, "online")[0].tolist() == []  # no return seen yet
    with pytest.raises(ValueError, match="label mode"):
        training_set(labels, returns, 3, "hindsight")
    scores = np.array([math.nan, 0.2, 0.7, math.nan, 0.5])
    assert predicted_bits(scores, 0.5).tolist() == [True, False, True, True, False]  # no score: LRU's bit
    rows = predictability(arrs, gbm={"online": scores})
    assert rows[-1].subject == GBM_SUBJECTS["online"] and rows[-1].n == 3  # scored where it has a score
    assert math.isclose(rows[-1].auc, 1.0)  # requests 1, 2, 4 with labels 0, 1, 0: 0.7 ranks first


def test_online_scores_use_only_the_past_and_every_past_label_does_not(trace_path):
    """A score made with online labels never changes when the trace is cut after its request; the
    scores that learn every past label do (they read returns that lie after the cut), which is why
    they are reported as an upper bound, never as an online policy."""
    full = load_arrays(trace_path, limit=2400)
    cut = load_arrays(trace_path, limit=1600)
    kw = {"chunk": 200, "min_train": 300}
    online_full, online_cut = gbm_scores(full, "online", **kw), gbm_scores(cut, "online", **kw)
    assert (~np.isnan(online_cut)).sum() >= 400  # models were trained before the cut
    assert np.array_equal(online_full[:1600], online_cut, equal_nan=True)
    every_full, every_cut = gbm_scores(full, "every past label", **kw), gbm_scores(cut, "every past label", **kw)
    assert not np.array_equal(every_full[:1600], every_cut, equal_nan=True)
    assert set(GBM_SUBJECTS) == set(LABEL_MODES)

