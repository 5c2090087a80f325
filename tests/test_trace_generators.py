"""The trace generators (sessions, collision, churn) and ``quillcache gen-trace``: every knob value they
accept gives a trace the loader reads back, every one they refuse gives a one-line message naming the
flag as typed (exit 2, nothing written), never a traceback."""

import json
import random
import re
from dataclasses import replace

import pytest

from quillcache.cli import gen_trace
from quillcache.traces import collision, sessions
from quillcache.traces.churn import residency_churn
from quillcache.traces.collision import CollisionConfig, CollisionRequest, read_jsonl
from quillcache.traces.loader import TraceError, TraceRequest, load_trace
from quillcache.traces.schemas import MAX_TIMESTAMP_MS
from quillcache.traces.sessions import SessionsConfig

SMALL = {"global_prompt_tokens": 64, "tenant_prompt_tokens": 32, "max_input_tokens": 2048}


def _gen(argv, tmp_path, capsys):
    """Run ``gen-trace argv --out tmp/x.jsonl``: (exit status, stderr, the output path)."""
    out = tmp_path / "x.jsonl"
    rc = gen_trace.main(argv + ["--out", str(out)])
    return rc, capsys.readouterr().err, out


def _refused(argv, tmp_path, capsys, flag):
    rc, err, out = _gen(argv, tmp_path, capsys)
    assert rc == 2, err
    assert err.startswith("quillcache gen-trace: ") and err.count("\n") == 1 and "Traceback" not in err
    assert flag in err
    fields = [f for f in gen_trace.FLAGS if re.search(rf"(?<![\w-]){f}\b", err)]
    assert not fields, f"config field(s) {fields} named instead of their flags: {err}"
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no trace, no temporary file
    return err


# --------------------------------------------------------------------------- F1, F2: knob bounds
@pytest.mark.parametrize("argv, flag", [
    (["--think-time-s", "1e308"], "--think-time-s=1e+308 must be <= 1000000000.0"),
    (["--session-rate", "1e-308"], "--session-rate=1e-308 must be >= 1e-09"),
    (["--mean-turns", "1.7e308"], "--mean-turns=1.7e+308 must be <= 2147483648"),
    (["--output-tokens", "1e12"], "--output-tokens=1000000000000.0 must be <= 2147483647"),
    (["--first-user-tokens", "1e300"], "--first-user-tokens"),
    (["--max-input-tokens", str(2**31)], "--max-input-tokens=2147483648 must be in [1, 2147483647]"),
])
def test_sessions_knobs_past_the_schema_limits_are_refused_with_the_flag(tmp_path, capsys, argv, flag):
    _refused(["sessions", "--sessions", "50"] + argv, tmp_path, capsys, flag)


def test_sessions_timestamps_past_the_schema_limit_are_refused_not_written(tmp_path, capsys):
    err = _refused(["sessions", "--sessions", "3", "--session-rate", "1e-9"], tmp_path, capsys, "--session-rate")
    assert f"past the trace schema's limit {MAX_TIMESTAMP_MS}" in err and "--think-time-s" in err
    with pytest.raises(ValueError, match=r"would have timestamp \d+, past the trace schema's limit"):
        sessions.generate(SessionsConfig(num_sessions=3, session_rate_per_s=1e-9, **SMALL))
    # a long think time inside one session, too
    with pytest.raises(ValueError, match="timestamp"):
        sessions.generate(SessionsConfig(num_sessions=20, think_time_median_s=1e9, mean_turns=8.0, **SMALL))


def test_collision_block_tokens_past_the_schema_limit_is_refused(tmp_path, capsys):
    _refused(["collision", "--requests", "5", "--block-tokens", "100000"], tmp_path, capsys,
             "--block-tokens=100000 must be in [1, 65536]")
    with pytest.raises(ValueError, match="2\\*\\*31 tokens"):
        CollisionConfig(block_size_tokens=65536, max_prompt_blocks=40000)
    with pytest.raises(ValueError, match="mean_interarrival_ms"):
        CollisionConfig(mean_interarrival_ms=1e308)
    with pytest.raises(ValueError, match="past the trace schema's limit"):
        collision.generate(CollisionConfig(num_requests=20, mean_interarrival_ms=1e11))
    rc, err, out = _gen(["collision", "--requests", "5", "--block-tokens", "65536"], tmp_path, capsys)
    assert rc == 0, err
    assert len(load_trace(out)) == 5  # the limit itself loads


def test_every_accepted_sessions_config_gives_a_trace_the_loader_reads_back(tmp_path):
    """Knobs drawn (seeded) up to their limits: generate() either refuses with a ValueError naming the
    schema limit, or its trace is written and read back by load_trace to the same requests."""
    rng = random.Random(20240317)
    choices = {
        "session_rate_per_s": [1e-9, 1e-7, 1.0, 1e6], "think_time_median_s": [1e-6, 20.0, 1e6, 1e9],
        "think_time_sigma": [0.0, 1.0, 10.0], "mean_turns": [1.0, 4.0, 1e6, float(2**31)],
        "max_turns": [1, 8, 2**31], "output_tokens_mean": [1.0, 250.0, 1e9, 2**31 - 1],
        "length_sigma": [0.0, 0.8, 10.0], "first_user_tokens_mean": [1.0, 400.0, 1e5],
        "turn_user_tokens_mean": [1.0, 120.0, 2**31 - 1], "block_tokens": [1, 16, 65536],
    }
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(40):
        knobs = {k: rng.choice(v) for k, v in choices.items()}
        cfg = SessionsConfig(num_sessions=6, seed=case, **SMALL, **knobs)
        try:
            reqs = sessions.generate(cfg)
        except ValueError as exc:
            assert re.search(r"past the trace schema's limit|produced no request", str(exc)), (knobs, exc)
            outcomes["refused"] += 1
            continue
        path = tmp_path / f"s{case}.jsonl"
        assert sessions.write_jsonl(reqs, path) == len(reqs)
        assert load_trace(path) == [r.to_trace_request() for r in reqs], knobs
        outcomes["loaded"] += 1
    assert outcomes["loaded"] >= 10 and outcomes["refused"] >= 5, outcomes  # both paths exercised


@pytest.mark.parametrize("writer, bad", [
    (sessions.write_jsonl, "sessions"),
    (collision.write_jsonl, "collision"),
])
def test_write_jsonl_checks_every_line_with_the_loader_and_writes_nothing_on_a_bad_one(tmp_path, writer, bad):
    if bad == "sessions":
        good = sessions.generate(SessionsConfig(num_requests=3, **SMALL))
    else:
        good = collision.generate(CollisionConfig(num_requests=3))
    path = tmp_path / "t.jsonl"
    for records, match in (
            ([good[0], replace(good[1], timestamp=MAX_TIMESTAMP_MS + 1), good[2]], "request 1: field 'timestamp'"),
            ([good[0], replace(good[1], output_length=2**31), good[2]], "request 1: field 'output_length'"),
            ([good[0], replace(good[1], block_tokens=100_000), good[2]], "request 1: field 'block_tokens'"),
            ([replace(good[0], timestamp=good[2].timestamp + 1), good[1], good[2]], "request 1: timestamp")):
        with pytest.raises(TraceError, match=match):
            writer(records, path)
        assert not path.exists()
    assert writer(good, path) == 3 and len(load_trace(path)) == 3


# --------------------------------------------------------------------------- F3: adversarial, one tenant
def test_adversarial_mix_needs_two_tenants(tmp_path, capsys):
    _refused(["collision", "--mix", "adversarial", "--tenants", "1", "--requests", "10"], tmp_path, capsys,
             "--tenants=1: --mix='adversarial' needs >= 2 tenants")
    with pytest.raises(ValueError, match="num_tenants=1: mix='adversarial' needs >= 2 tenants"):
        CollisionConfig(mix="adversarial", num_tenants=1)
    reqs = collision.generate(CollisionConfig(mix="adversarial", num_tenants=2, num_requests=60))
    cross = [r for r in reqs if r.intent == "cross-tenant"]
    assert cross and {r.tenant for r in reqs} == {"tenant-00", "tenant-01"}
    assert len(collision.generate(CollisionConfig(mix="realistic", num_tenants=1, num_requests=20))) == 20


# --------------------------------------------------------------------------- F4: no request at all
@pytest.mark.parametrize("size", [["--sessions", "50"], ["--requests", "50"]])
def test_no_request_is_refused_in_both_size_modes(tmp_path, capsys, size):
    err = _refused(["sessions", *size, "--first-user-tokens", "1e6"], tmp_path, capsys, "--first-user-tokens")
    assert "sessions produced no request: every first prompt exceeds --max-input-tokens=32768" in err
    with pytest.raises(ValueError, match="^50 sessions produced no request"):
        sessions.generate(SessionsConfig(num_sessions=50, first_user_tokens_mean=1e6))


# --------------------------------------------------------------------------- L4: flags as typed
@pytest.mark.parametrize("argv, flag", [
    (["sessions", "--think-time-s", "0"], "--think-time-s=0.0 must be > 0.0"),
    (["sessions", "--tenant-prompts", "0"], "--tenant-prompts=0 must be >= 1"),
    (["sessions", "--global-prompts", "0"], "--global-prompts=0 must be >= 1"),
    (["sessions", "--seed", "-1"], "--seed=-1 must be >= 0"),
    (["sessions", "--max-input-tokens", "0"], "--max-input-tokens=0"),
    (["sessions", "--first-user-tokens", "0"], "--first-user-tokens=0.0 must be > 0.0"),
    (["sessions", "--turn-user-tokens", "0"], "--turn-user-tokens=0.0 must be > 0.0"),
    (["sessions", "--output-tokens", "0"], "--output-tokens=0.0 must be > 0.0"),
    (["sessions", "--global-prompt-tokens", "-1"], "--global-prompt-tokens=-1"),
    (["sessions", "--tenant-prompt-tokens", "-1"], "--tenant-prompt-tokens=-1"),
    (["sessions", "--global-prompt-fraction", "2"], "--global-prompt-fraction=2.0"),
    (["sessions", "--adapter-fraction", "2"], "--adapter-fraction=2.0"),
    (["sessions", "--tenant-skew", "11"], "--tenant-skew=11.0"),
    (["sessions", "--max-turns", "0"], "--max-turns=0"),
    (["sessions", "--block-tokens", "0"], "--block-tokens=0"),
    (["sessions", "--kv-dtype", "fp99"], "--kv-dtype='fp99'"),
    (["sessions", "--global-prompt-tokens", "40000"],
     "--global-prompt-tokens + --tenant-prompt-tokens = 40512 leaves no room under --max-input-tokens=32768"),
    (["collision", "--seed", "-3"], "--seed=-3 must be >= 0"),
    (["collision", "--block-tokens", "0"], "--block-tokens=0"),
    (["collision", "--mix", "bogus"], "--mix='bogus'"),
])
def test_every_refused_knob_is_named_by_its_flag(tmp_path, capsys, argv, flag):
    _refused(argv, tmp_path, capsys, flag)


def test_flags_map_covers_every_option_of_the_parser():
    """Every option's config field is in FLAGS and maps back to that option (so no refusal can name
    a field the user never typed)."""
    import argparse
    ap = argparse.ArgumentParser()
    gen_trace.configure(ap)
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    options = {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}
    options -= {"-h", "--help", "--out"}
    assert options == set(gen_trace.FLAGS.values())


# --------------------------------------------------------------------------- L1: one parser
def _collision_file(tmp_path, mutate=None, raw=None):
    reqs = collision.generate(CollisionConfig(mix="adversarial", num_requests=3, seed=0))
    path = tmp_path / "c.jsonl"
    collision.write_jsonl(reqs, path)
    lines = path.read_bytes().splitlines()
    if mutate is not None:
        lines[1] = json.dumps(mutate(json.loads(lines[1]))).encode()
    if raw is not None:
        lines[1] = raw(lines[1])
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, reqs


@pytest.mark.parametrize("mutate, raw, match", [
    (lambda d: {**d, "hash_ids": [2**70] + d["hash_ids"][1:]}, None, r"hash_ids\[0\] = 1180591620717411303424 is outside"),
    (lambda d: {**d, "output_length": 2**40}, None, "field 'output_length' = 1099511627776 is too large"),
    (lambda d: {**d, "timestamp": 10**15}, None, "field 'timestamp' = 1000000000000000 is too large"),
    (lambda d: {**d, "block_tokens": 100_000}, None, "field 'block_tokens' = 100000 is too large"),
    (None, lambda b: b.replace(b'"tenant":"', b'"tenant":"caf\xe9'), "not UTF-8 text"),
    (None, lambda b: b[:-1] + b',"timestamp":0}', "field 'timestamp' appears twice"),
])
def test_read_jsonl_refuses_what_the_loader_refuses(tmp_path, mutate, raw, match):
    path, _ = _collision_file(tmp_path, mutate, raw)
    with pytest.raises(TraceError, match=f":2: {match}"):
        load_trace(path)
    with pytest.raises(TraceError, match=f":2: {match}"):
        read_jsonl(path)


def test_read_jsonl_accepts_what_the_loader_accepts_and_shares_its_file_checks(tmp_path):
    path, reqs = _collision_file(tmp_path, raw=None)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))  # a BOM, CRLF lines
    assert read_jsonl(path) == reqs and len(load_trace(path)) == 3
    long_name = tmp_path / ("x" * 300 + ".jsonl")
    with pytest.raises(TraceError, match="cannot access trace file .*: File name too long"):
        read_jsonl(long_name)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="is empty"):
        read_jsonl(tmp_path / "blank.jsonl")


def test_collision_request_and_trace_request_read_the_same_values(tmp_path):
    path, reqs = _collision_file(tmp_path)
    loaded = load_trace(path)
    assert [TraceRequest(r.timestamp, r.input_length, r.output_length, r.hash_ids, tenant=r.tenant, model=r.model,
                         tokenizer=r.tokenizer, adapter=r.adapter, kv_dtype=r.kv_dtype, block_tokens=r.block_tokens)
            for r in read_jsonl(path)] == loaded
    assert isinstance(reqs[0], CollisionRequest)


# --------------------------------------------------------------------------- L7: churn parameters
@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_nodes": 0}, ValueError, "num_nodes=0 must be >= 1"),
    ({"num_tenants": 0}, ValueError, "num_tenants=0 must be >= 1"),
    ({"target_entries": -5}, ValueError, "target_entries=-5 must be >= 1"),
    ({"target_entries": 0}, ValueError, "target_entries=0 must be >= 1"),
    ({"dram_share": 1.5}, ValueError, "dram_share=1.5"),
    ({"churn_factor": float("nan")}, ValueError, "churn_factor=nan"),
    ({"block_bytes": 0}, ValueError, "block_bytes=0"),
    ({"seed": -1}, ValueError, "seed=-1"),
    ({"num_nodes": 2.0}, TypeError, "num_nodes must be an integer"),
    ({"trace": "t.jsonl"}, TypeError, "trace must be a list of TraceRequest"),
])
def test_residency_churn_checks_its_parameters(kwargs, error, match):
    trace = [TraceRequest(i, 1024, 1, (0, i + 1)) for i in range(20)]
    args = {"trace": trace, "target_entries": 10, **kwargs}
    with pytest.raises(error, match=re.escape(match)):
        residency_churn(args.pop("trace"), args.pop("target_entries"), **args)
    w = residency_churn(trace, 10, num_nodes=1, num_tenants=1)
    assert len(w.live) >= 10 and w.num_puts == sum(len(b.puts) for b in w.batches)
