import csv
import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from quillcache.hashing.blocks import hash_blocks
from quillcache.identity.scope import IdentityRegistry, reuse_reason
from quillcache.identity.naive_cache import NaiveContentCache
from quillcache.results import SUMMARY_COLUMNS
from quillcache.traces.loader import TraceError, load_trace
from quillcache.traces.collision import (
    CollisionConfig,
    generate,
    read_jsonl,
    tokens_for,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parent.parent


def test_generation_is_deterministic_from_the_seed():
    a = generate(CollisionConfig(mix="realistic", num_requests=300, seed=3))
    assert a == generate(CollisionConfig(mix="realistic", num_requests=300, seed=3))
    assert a != generate(CollisionConfig(mix="realistic", num_requests=300, seed=4))
    assert len(a) == 300 and all(r.timestamp <= s.timestamp for r, s in itertools.pairwise(a))


def test_records_are_consistent_and_identities_valid():
    for mix in ("realistic", "adversarial"):
        for r in generate(CollisionConfig(mix=mix, num_requests=400, seed=1)):
            assert len(r.hash_ids) == -(-r.input_length // r.block_tokens)
            assert 1 <= r.num_full_blocks <= 64 and r.public_prefix_blocks <= r.num_full_blocks
            ident = r.identity()
            assert ident.layout.block_size_tokens == 16 and ident.tenant == r.tenant
            assert len(r.tokens()) == r.input_length and r.tokens().max() < 128_256


def test_tokens_follow_block_ids():
    a = tokens_for([5, 6, 7], 16, 40)
    b = tokens_for([5, 6, 9], 16, 48)
    assert a.dtype == np.uint32 and len(a) == 40
    assert (a[:32] == b[:32]).all() and not (a[32:40] == b[32:40]).all()
    with pytest.raises(ValueError, match="cannot cover"):
        tokens_for([1, 2], 16, 40)


def _replay_naive(reqs):
    """Content-only cache over the stream; (hit blocks, reasons of the hits) audited against writers."""
    reg = IdentityRegistry()
    cache = NaiveContentCache(16)
    hits, reasons = 0, Counter()
    for r in reqs:
        ident = r.identity()
        reg.register(ident)
        h = hash_blocks(r.tokens(), 16)
        n = cache.lookup(h)
        hits += n
        for hh, w in zip(h[:n].tolist(), cache.writers(h, n)):
            reasons[reuse_reason(ident, reg.identity_of(w), hh)[0].value] += 1
        cache.insert(h, ident.digest())
    return hits, reasons


def test_adversarial_every_hit_is_a_collision_of_each_kind():
    reqs = generate(CollisionConfig(mix="adversarial", num_requests=600, seed=2))
    hits, reasons = _replay_naive(reqs)
    assert hits > 0 and "same-scope" not in reasons
    assert set(reasons) == {"cross-tenant", "cross-adapter", "cross-model", "cross-tokenizer", "layout-mismatch"}
    assert Counter(r.intent for r in reqs)["fresh"] == pytest.approx(100, abs=10)


def test_realistic_mostly_same_identity_reuse():
    reqs = generate(CollisionConfig(mix="realistic", num_requests=1500, seed=2))
    hits, reasons = _replay_naive(reqs)
    assert reasons["same-scope"] > 0.5 * hits  # mostly own reuse ...
    assert sum(v for k, v in reasons.items() if k != "same-scope") > 0  # ... but collisions happen


def test_jsonl_round_trip_and_mooncake_compatibility(tmp_path):
    reqs = generate(CollisionConfig(mix="realistic", num_requests=50, seed=5))
    path = tmp_path / "t.jsonl"
    assert write_jsonl(reqs, path) == 50
    assert read_jsonl(path) == reqs
    mooncake = load_trace(path, block_tokens=16)  # the first four fields are the Mooncake schema
    assert [m.hash_ids for m in mooncake] == [r.hash_ids for r in reqs]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "tenant"}), "missing field"),
        (lambda d: json.dumps({**d, "tenant": "evil tenant/../"}), "field 'tenant' = 'evil tenant/../' is malformed"),
        (lambda d: json.dumps({**d, "tenant": ""}), "malformed identity"),  # the schema's "not given": no identity
        (lambda d: json.dumps({**d, "hash_ids": d["hash_ids"][:-1]}), "hash_ids"),
        (lambda d: json.dumps({**d, "input_length": -3}), "input_length"),
        (lambda d: json.dumps({**d, "intent": "whatever"}), "intent"),
        (lambda d: json.dumps([1, 2]), "JSON object"),
    ],
)
def test_malformed_lines_are_refused_with_their_line_number(tmp_path, mutate, message):
    reqs = generate(CollisionConfig(mix="adversarial", num_requests=3, seed=0))
    path = tmp_path / "t.jsonl"
    write_jsonl(reqs, path)
    lines = path.read_text().splitlines()
    lines[1] = mutate(json.loads(lines[1]))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=f":2: .*{message}"):
        read_jsonl(path)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="mix"):
        CollisionConfig(mix="chaotic")
    with pytest.raises(ValueError, match="num_requests"):
        CollisionConfig(num_requests=0)
    with pytest.raises(TypeError):
        generate({"mix": "realistic"})


def test_generate_script(tmp_path):
    out = tmp_path / "adv.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "traces" / "generate_collision.py"), "--mix", "adversarial",
                          "--requests", "40", "--out", str(out)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert len(read_jsonl(out)) == 40
    bad = subprocess.run([sys.executable, str(ROOT / "traces" / "generate_collision.py"), "--mix", "adversarial",
                          "--requests", "0", "--out", str(out)], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "num_requests" in bad.stderr


# ---- smoke tests: the safety study and the planner benchmark in quick mode ------------------------
def _summary(path: Path) -> list[dict]:
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    assert rows and tuple(rows[0])[:len(SUMMARY_COLUMNS)] == SUMMARY_COLUMNS
    return rows


def test_safety_study_quick(tmp_path):
    from experiments import safety_study

    rows = safety_study.run(quick=True, results_root=str(tmp_path))
    got = {(r.metric, r.params["mix"], r.params.get("category")): r for r in rows}
    for mix in ("realistic", "adversarial"):
        served = got[("unsafe_reuses_served", mix, None)]
        assert served.value == 0 and served.n > 0
    assert got[("unsafe_reuses_served", "adversarial", None)].baseline_value > 0
    assert got[("naive_unsafe_share", "adversarial", "all")].value == 100.0
    # registered public prompts are written public by the requests that carry their tokens, and reused
    mixes = (tmp_path / "safety" / "mixes.csv").read_text().splitlines()
    col = mixes[0].split(",").index("public_shared_blocks")
    assert [int(line.split(",")[col]) > 0 for line in mixes[1:] if line.startswith("realistic,")] == [True], mixes
    # the seed's reported figures are anchors, never a same-run baseline
    assert all(r.baseline in ("", "guard off", "same planner, guard off", "naive cache, safe hits only")
               for r in rows)
    anchors = (tmp_path / "safety" / "anchors.csv").read_text()
    assert "the seed" in anchors and "47.8" in anchors
    _summary(tmp_path / "safety" / "summary.csv")
    assert safety_study.plot(str(tmp_path), tmp_path / "figures").stat().st_size > 0
