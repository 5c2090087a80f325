"""The gateway study: its workload rendering and metric parsing, and its quick profile end to end (real
stand-in engines, the real gateway and, when the ``gateway-baselines`` extra is installed, sglang-router on
127.0.0.1). Nothing here asserts speed: the acceptance figures are computed by the study and reported."""

from __future__ import annotations

import csv
import random

import pytest

from experiments import gateway_study as gs
from experiments.gateway_fronts import FRONT_KINDS, missing
from experiments.gateway_load import (EngineCounters, metric_sum, render_prompt, render_workload)
from quillcache.traces.sessions import SessionsConfig, generate


def test_rendered_prompts_share_exactly_the_blocks_the_trace_shares():
    reqs = generate(SessionsConfig(num_requests=120, seed=3))
    texts = [render_prompt(r.hash_ids, r.input_length, r.block_tokens) for r in reqs]
    assert [len(t) for t in texts] == [r.input_length for r in reqs]  # one byte = one stand-in token
    rng = random.Random(5)
    checked = 0
    for _ in range(400):
        a, b = rng.sample(range(len(reqs)), 2)
        ha, hb = reqs[a].hash_ids, reqs[b].hash_ids
        k = 0
        while k < min(len(ha), len(hb)) and ha[k] == hb[k]:
            k += 1
        full = min(k * 16, len(texts[a]), len(texts[b]))
        assert texts[a][:full] == texts[b][:full], (a, b, k)
        if k < min(len(ha), len(hb)) and (k + 1) * 16 <= min(len(texts[a]), len(texts[b])):
            # the first differing block differs in its text (a collision would merge two prefixes)
            assert texts[a][k * 16:(k + 1) * 16] != texts[b][k * 16:(k + 1) * 16], (a, b, k)
            checked += 1
    assert checked > 50


def test_render_workload_maps_adapters_to_model_names_and_caps_output():
    reqs, desc = render_workload(80, seed=2, max_output_tokens=7)
    assert desc["requests"] == len(reqs) == 80
    assert all(1 <= r.max_tokens <= 7 for r in reqs)
    assert {r.model for r in reqs} <= {gs.BASE_MODEL, *desc["adapters"]}
    assert "quillcache gen-trace sessions --requests 80 --seed 2" in desc["cli"]


def test_render_prompt_refuses_lengths_the_blocks_cannot_hold():
    with pytest.raises(ValueError, match="cannot hold"):
        render_prompt((1, 2), 40, 16)


def test_metric_sum_adds_every_labelled_sample_and_ignores_lookalikes():
    text = "\n".join([
        "# HELP vllm:prefix_cache_hits_total hits",
        'vllm:prefix_cache_hits_total{model_name="m"} 30.0',
        'vllm:prefix_cache_hits_total{model_name="lora"} 2.5',
        "vllm:prefix_cache_hits_created 1.7e9",
        'vllm:prefix_cache_queries_total{model_name="m"} 100.0',
    ])
    assert metric_sum(text, "vllm:prefix_cache_hits_total") == 32.5
    assert metric_sum(text, "vllm:prefix_cache_queries_total") == 100.0
    before = EngineCounters(10.0, 40.0, {"a": (10.0, 40.0)})
    after = EngineCounters(32.5, 100.0, {"a": (32.5, 100.0)})
    d = after.minus(before)
    assert d.hit_rate == pytest.approx(22.5 / 60.0) and d.per_engine["a"] == (22.5, 60.0)


def test_a_front_whose_package_is_missing_is_named_with_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == FRONT_KINDS["sglang-router"]
                        else real(name, *a))
    assert "gateway-baselines" in missing("sglang-router")
    assert missing("gateway") is None and missing("direct") is None


def test_hit_rate_ceiling_counts_earlier_full_blocks_of_the_same_scope_only():
    from experiments.gateway_load import StudyRequest

    a, b, c = "a" * 16, "b" * 16, "c" * 16
    cell = [StudyRequest("t1", "m", a + b + "x", 1),  # 33 tokens, nothing before it
            StudyRequest("t1", "m", a + b + c + "y", 1),  # a, b reused: 32 of 49
            StudyRequest("t2", "m", a + b + "x", 1),  # another tenant: nothing
            StudyRequest("t1", "lora", a + "z", 1),  # another model: nothing
            StudyRequest("t1", "m", a + b + c, 1)]  # 48 tokens: at most 2 blocks (the last token is recomputed)
    assert gs.hit_rate_ceiling(cell) == pytest.approx((32 + 32) / (33 + 49 + 33 + 17 + 48))
    assert gs.hit_rate_ceiling([]) != gs.hit_rate_ceiling([])  # nan: no tokens


def test_paired_differences_match_seeds_and_feed_the_acceptance_rows():
    per_seed = {(gs.GATEWAY.name, 32.0): [0.66, 0.63, 0.67], (gs.SGLANG.name, 32.0): [0.65, 0.66, 0.66],
                (gs.GATEWAY_X2.name, 32.0): [0.66, 0.64, 0.66], (gs.GATEWAY_DYN.name, 32.0): [0.5]}
    rows = gs._paired(per_seed, [32.0])
    by = {(r.subject, r.baseline): r for r in rows}
    g = by[(gs.GATEWAY.name, gs.SGLANG.name)]
    assert g.n == 3 and g.value == pytest.approx(1.0) and g.p10 == pytest.approx(-3.0)  # +1, -3, +1 points
    assert by[(gs.GATEWAY_DYN.name, gs.SGLANG.name)].n == 1  # only the seeds both ran
    assert by[(gs.GATEWAY_X2.name, gs.GATEWAY.name)].value == pytest.approx(0.0)
    routing = [gs.SummaryRow(metric="hit_rate", subject=gs.GATEWAY.name, value=0.65, unit="fraction",
                             params={"part": "routing", "rate_per_s": 32.0})]
    acc = {r.metric + r.subject: r for r in gs._acceptance(routing + rows)}
    ours = acc["accept_hit_rate_vs_sglang_points" + gs.GATEWAY.name]
    assert ours.value == pytest.approx(1.0) and ours.params["holds"] and ours.params["seeds"] == 3
    assert not acc["accept_hit_rate_vs_sglang_points" + gs.GATEWAY_DYN.name].params["holds"]
    assert acc["accept_two_replicas_points" + gs.GATEWAY_X2.name].params["holds"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_profile_end_to_end(tmp_path):
    rows = gs.run(quick=True, results_root=str(tmp_path))
    by = {(r.metric, r.subject): r for r in rows}
    fronts = [f for f in gs.QUICK_FRONTS if missing(f.kind) is None]
    for f in gs.QUICK_FRONTS:  # a front that cannot run here is skipped with its reason, never silently
        if missing(f.kind):
            assert "gateway-baselines" in by[("skipped", f.name)].notes
    for f in fronts:
        hr = by[("hit_rate", f.name)]
        assert 0.0 <= hr.value <= 1.0 and "0 failed" in hr.notes, (f.name, hr.notes)
    for metric in ("added_ttft_p50_ms", "headers_ms", "throughput_rps"):
        assert (metric, gs.GATEWAY.name) in by
    assert {r.metric for r in rows} >= {"accept_added_ttft_p50_ms", "accept_streams_throughput_ratio",
                                         "accept_headers_ms", "accept_two_replicas_points",
                                         "hit_rate_paired_diff_points", "hit_rate_ceiling"}
    ceiling = next(r for r in rows if r.metric == "hit_rate_ceiling")
    assert 0.0 < ceiling.value < 1.0
    # the gateway's attribution outcomes, read from its own /metrics: shares of the engines' stored blocks
    refused, unattributed = (by[(m, gs.GATEWAY.name)].value
                             for m in ("stored_blocks_refused_ambiguous", "stored_blocks_unattributed"))
    assert 0.0 <= refused <= unattributed < 1.0
    resolved, never = (by[(m, gs.GATEWAY.name)].value
                       for m in ("stored_blocks_resolved", "stored_blocks_never_attributed"))
    assert 0.0 <= resolved <= unattributed and never == pytest.approx(unattributed - resolved)  # one seed: exact
    # every request succeeded, and the engines' own counters agree with what their usage chunks told the
    # client (the hit rate is read from /metrics before and after each cell; nothing else used the engines)
    with open(tmp_path / "gateway" / "routing_requests.csv") as fh:
        raw = list(csv.DictReader(fh))
    assert raw and all(r["status"] == "200" and not r["error"] for r in raw)
    for f in fronts:
        mine = [r for r in raw if r["front"] == f.name]
        client = sum(int(r["cached_tokens"]) for r in mine) / sum(int(r["prompt_tokens"]) for r in mine)
        assert by[("hit_rate", f.name)].value == pytest.approx(client, abs=1e-9), f.name
    # the gateway's decision header names an engine, and its cached tokens never exceed the prompt
    gw = [r for r in raw if r["front"] == gs.GATEWAY.name]
    assert {r["worker"] for r in gw} <= {f"e{i}" for i in range(gs.ENGINES)} and all(r["worker"] for r in gw)
    assert gs.plot(str(tmp_path), str(tmp_path / "figures")).stat().st_size > 0
