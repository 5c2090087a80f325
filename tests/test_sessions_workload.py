import argparse
import itertools
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.traces.loader import load_trace, load_trace_report
from quillcache.cli import gen_trace as gen_cli
from quillcache.traces.sessions import SessionsConfig, generate, write_jsonl

SMALL = {"global_prompt_tokens": 64, "tenant_prompt_tokens": 40, "first_user_tokens_mean": 30.0,
         "turn_user_tokens_mean": 20.0, "output_tokens_mean": 25.0, "max_input_tokens": 2048}


@st.composite
def session_configs(draw):
    return SessionsConfig(
        num_sessions=draw(st.integers(1, 8)), seed=draw(st.integers(0, 2 ** 32)),
        block_tokens=draw(st.sampled_from([1, 4, 16, 64, 512])), num_tenants=draw(st.integers(1, 4)),
        num_global_prompts=draw(st.integers(1, 3)), global_prompt_tokens=draw(st.integers(0, 200)),
        global_prompt_fraction=draw(st.sampled_from([0.0, 0.5, 1.0])), prompts_per_tenant=draw(st.integers(1, 2)),
        tenant_prompt_tokens=draw(st.integers(0, 100)), mean_turns=draw(st.floats(1.0, 6.0)),
        max_turns=draw(st.integers(1, 8)), first_user_tokens_mean=draw(st.floats(1.0, 200.0)),
        turn_user_tokens_mean=draw(st.floats(1.0, 100.0)), output_tokens_mean=draw(st.floats(1.0, 100.0)),
        adapter_fraction=draw(st.sampled_from([0.0, 1.0])), think_time_median_s=draw(st.floats(0.001, 60.0)),
        session_rate_per_s=draw(st.floats(0.01, 100.0)), max_input_tokens=draw(st.integers(301, 1500)),
    )


def _check_structure(cfg, reqs):
    bt = cfg.block_tokens
    assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)
    parent: dict[int, int] = {}
    seen_max = -1
    by_session = defaultdict(list)
    for r in reqs:
        assert len(r.hash_ids) == -(-r.input_length // bt) and 0 < r.input_length <= cfg.max_input_tokens
        assert r.output_length >= 1 and r.block_tokens == bt
        for j, h in enumerate(r.hash_ids):  # prefix-chained: an id always has the same parent
            assert parent.setdefault(h, r.hash_ids[j - 1] if j else -1) == (r.hash_ids[j - 1] if j else -1)
            if h > seen_max:  # numbered from 0 in order of first use
                assert h == seen_max + 1
                seen_max = h
        by_session[r.session_id].append(r)
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(len(turns))) and len(turns) <= cfg.max_turns
        assert len({(t.tenant, t.model, t.tokenizer, t.adapter) for t in turns}) == 1
        for a, b in itertools.pairwise(turns):  # the next turn re-sends the whole conversation, then more
            assert b.input_length >= a.input_length + a.output_length + 1
            full = a.input_length // bt
            assert b.hash_ids[:full] == a.hash_ids[:full]
            if a.input_length % bt:  # a partial last block is not the full block the next turn puts there
                assert b.hash_ids[full] != a.hash_ids[full]


@given(session_configs())
def test_round_trip_generate_write_load(cfg):
    try:
        reqs = generate(cfg)
    except ValueError as e:  # every first prompt was over max_input_tokens: refused, never an empty trace
        assert "produced no request" in str(e) and "max_input_tokens" in str(e)
        return
    assert reqs and reqs == generate(cfg)  # deterministic
    _check_structure(cfg, reqs)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "s.jsonl"
        assert write_jsonl(reqs, p) == len(reqs)
        loaded, rep = load_trace_report(p)
    assert loaded == [r.to_trace_request() for r in reqs]
    assert rep.schemas == ("generated",) and rep.num_skipped == 0


def test_shared_system_prompts_share_blocks_and_sessions_do_not():
    cfg = SessionsConfig(num_sessions=300, seed=4, num_tenants=3, num_global_prompts=2, prompts_per_tenant=2,
                         **SMALL)
    reqs = generate(cfg)
    _check_structure(cfg, reqs)
    firsts = [r for r in reqs if r.turn == 0]
    # sessions begin with one of 2 global prompts or one of 3 x 2 tenant prompts (2 full blocks each), nothing else
    starts = {r.hash_ids[:2] for r in firsts}
    assert 6 <= len(starts) <= cfg.num_global_prompts + cfg.num_tenants * cfg.prompts_per_tenant
    assert len({r.hash_ids[2] for r in firsts if r.hash_ids[:2] in starts}) > len(starts)  # then they diverge
    # a global prompt is shared across tenants; user messages are private to their session
    tenants_of_first_block = defaultdict(set)
    for r in firsts:
        tenants_of_first_block[r.hash_ids[0]].add(r.tenant)
    assert max(len(t) for t in tenants_of_first_block.values()) == 3
    sessions_of_last_block = defaultdict(set)
    for r in reqs:
        sessions_of_last_block[r.hash_ids[-1]].add(r.session_id)
    assert all(len(s) == 1 for s in sessions_of_last_block.values())


def test_request_mode_is_the_first_requests_of_the_session_mode():
    part = generate(SessionsConfig(num_requests=400, seed=9, **SMALL))
    assert len(part) == 400
    whole = generate(SessionsConfig(num_sessions=max(r.session_id for r in part) + 50, seed=9, **SMALL))
    assert whole[:400] == part
    assert generate(SessionsConfig(num_requests=400, seed=10, **SMALL)) != part


def test_turn_and_length_limits():
    one = generate(SessionsConfig(num_sessions=50, mean_turns=1.0, **SMALL))
    assert {r.turn for r in one} == {0} and len(one) == 50
    capped = generate(SessionsConfig(num_sessions=50, mean_turns=30.0, max_turns=3, **SMALL))
    assert max(r.turn for r in capped) == 2
    short = generate(SessionsConfig(num_sessions=50, mean_turns=30.0, **{**SMALL, "max_input_tokens": 400}))
    assert max(r.input_length for r in short) <= 400
    many = generate(SessionsConfig(num_sessions=2000, mean_turns=4.0, **SMALL))
    assert sum(r.turn == 0 for r in many) == 2000  # every session has its first turn
    assert 3.6 < len(many) / 2000 < 4.4  # geometric turns, mean 4


@pytest.mark.parametrize("kwargs, match", [
    ({"num_sessions": 0}, "num_sessions=0"),
    ({"num_requests": 0}, "num_requests=0"),
    ({"block_tokens": True}, "block_tokens must be an integer, got bool True"),
    ({"mean_turns": 0.5}, "mean_turns=0.5"),
    ({"think_time_median_s": float("nan")}, "think_time_median_s=nan"),
    ({"global_prompt_fraction": 1.5}, "global_prompt_fraction=1.5"),
    ({"kv_dtype": "fp99"}, "fp99"),
    ({"models": (("bad model", "x"),)}, "bad model"),
    ({"max_input_tokens": 100, "global_prompt_tokens": 64, "tenant_prompt_tokens": 40}, "leaves no room"),
])
def test_config_validation_names_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SessionsConfig(**kwargs)
    with pytest.raises(TypeError, match="SessionsConfig"):
        generate({"num_sessions": 1})


# --------------------------------------------------------------------------- gen-trace CLI
def _cli(argv):
    ap = argparse.ArgumentParser(prog="quillcache gen-trace")
    gen_cli.configure(ap)
    return gen_cli.run(ap.parse_args(argv))


def test_gen_trace_sessions_and_collision(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert _cli(["sessions", "--out", str(out), "--requests", "120", "--seed", "2", "--tenants", "3",
                 "--global-prompt-tokens", "64", "--tenant-prompt-tokens", "32"]) == 0
    assert "wrote 120 requests" in capsys.readouterr().out
    reqs = load_trace(out)
    assert len(reqs) == 120 and {r.tenant for r in reqs} <= {"tenant-00", "tenant-01", "tenant-02"}
    cfg = SessionsConfig(num_requests=120, seed=2, num_tenants=3, global_prompt_tokens=64, tenant_prompt_tokens=32)
    assert reqs == [r.to_trace_request() for r in generate(cfg)]
    col = tmp_path / "c.jsonl"
    assert _cli(["collision", "--out", str(col), "--requests", "50", "--mix", "adversarial"]) == 0
    assert len(load_trace(col)) == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "s.jsonl"]  # no temporary files left


@pytest.mark.parametrize("argv, match", [
    (["sessions", "--sessions", "0"], "--sessions=0 must be >= 1"),
    (["sessions", "--kv-dtype", "fp99"], "fp99"),
    (["sessions", "--mean-turns", "0"], ": --mean-turns=0.0 must be >= 1.0"),
    (["collision", "--mix", "bogus"], "mix='bogus'"),
    (["collision", "--requests", "-5"], "--requests=-5 must be >= 1"),
])
def test_gen_trace_bad_parameters_exit_2_with_a_message(tmp_path, capsys, argv, match):
    out = tmp_path / "x.jsonl"
    assert _cli(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quillcache gen-trace: ") and match in err and "Traceback" not in err
    assert "Config." not in err and "num_" not in err and "mean_turns" not in err  # the flags typed, not fields
    assert not out.exists()


def test_gen_trace_unwritable_out(tmp_path, capsys):
    assert _cli(["sessions", "--sessions", "2", "--out", str(tmp_path / "no" / "x.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert _cli(["sessions", "--sessions", "2", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:  # argparse: a usage error, status 2
        _cli(["sessions", "--sessions", "2", "--requests", "3", "--out", "x"])
    assert ei.value.code == 2
