"""``quillcache hitrate`` end to end in a subprocess: the table and result files on success, one
clear line and nothing written on bad input (the rules of ``quillcache replay``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")


def line(ts: int, ids: list[int], isl: int | None = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": isl if isl is not None else 512 * len(ids),
                       "output_length": 20, "hash_ids": ids})


def write(tmp: Path, lines: list[str], name: str = "trace.jsonl") -> Path:
    p = tmp / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def good_lines() -> list[str]:
    return [line(0, [0, 1, 2]), line(100, [0, 1, 2, 3], isl=1900), line(200, [0, 4], isl=700),
            line(5000, [0, 1, 2, 3, 5]), line(6000, [0, 4, 6]), line(7000, [0, 1, 2, 3, 5, 7])]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quillcache", "hitrate", *args], capture_output=True, text=True,
                          check=False, timeout=300)


def test_table_and_files_match_simulate(tmp_path: Path) -> None:
    from quillcache.hitrate import simulate
    from quillcache.hitrate.arrays import load_arrays
    from quillcache.results import read_summary

    trace = write(tmp_path, good_lines())
    out = tmp_path / "out"
    p = cli(str(trace), "--policies", "quillchain,sieve", "--capacities", "2,4,inf", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    for name in ("lru", "quillchain", "sieve", "belady (offline bound)", "unlimited"):
        assert name in p.stdout
    df = pd.read_csv(out / "hitrate.csv")
    assert list(df["policy"].unique()) == ["lru", "quillchain", "sieve", "belady"]  # lru and belady always run
    arrs = load_arrays(trace)
    for r in df.itertuples():
        cap = None if pd.isna(r.capacity_blocks) else int(r.capacity_blocks)
        assert r.hit_blocks == simulate(arrs, r.policy, cap).hit_blocks, (r.policy, cap)
    at2 = df[df.capacity_blocks == 2].set_index("policy")
    lru, bel = at2.loc["lru", "hit_rate"], at2.loc["belady", "hit_rate"]
    if bel > lru:
        assert at2.loc["sieve", "gap_closed"] == pytest.approx((at2.loc["sieve", "hit_rate"] - lru) / (bel - lru))
    tidy = read_summary("out", tmp_path)
    assert set(tidy["metric"]) == {"hit_rate", "gap_closed"} and set(tidy["profile"]) == {"custom"}


def test_bounds_add_the_reuse_and_timing_oracle_rows(tmp_path: Path) -> None:
    from quillcache.hitrate.arrays import load_arrays
    from quillcache.hitrate.bounds import joint_oracle, reuse_oracle, timing_oracle
    from quillcache.hitrate.turns import robust_sigma, turn_gap_log_ratios
    from quillcache.results import read_summary

    trace = write(tmp_path, good_lines())
    out = tmp_path / "out"
    p = cli(str(trace), "--policies", "sieve", "--capacities", "2,inf", "--bounds", "--bound-flip-rates", "0.1,25%",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "reuse_oracle (offline: which blocks return, not when)" in p.stdout
    df = pd.read_csv(out / "hitrate.csv")
    assert list(df["policy"].unique()) == ["lru", "sieve", "belady", "reuse_oracle", "timing_oracle",
                                           "joint_oracle@10%", "joint_oracle@25%"]
    arrs = load_arrays(trace)
    sigma = round(robust_sigma(turn_gap_log_ratios(arrs)), 2)  # one turn comes back here: its spread is 0
    assert "timing_oracle (offline: which, and roughly when)" in p.stdout
    assert f"timing_oracle: sigma = {sigma:.2f}" in p.stdout
    timing = df[df.policy == "timing_oracle"]
    noisy = df.policy.isin(["timing_oracle", "joint_oracle@10%", "joint_oracle@25%"])
    assert (df[noisy]["sigma"] == sigma).all() and df[~noisy]["sigma"].isna().all()
    for r in timing.itertuples():
        cap = arrs.num_unique if pd.isna(r.capacity_blocks) else int(r.capacity_blocks)
        assert r.hit_blocks == int(timing_oracle(arrs, cap, sigma).sum())
    for name, rate in (("joint_oracle@10%", 0.1), ("joint_oracle@25%", 0.25)):
        rows = df[df.policy == name]
        assert (rows["flip_rate"] == rate).all() and len(rows) == 2
        for r in rows.itertuples():
            cap = arrs.num_unique if pd.isna(r.capacity_blocks) else int(r.capacity_blocks)
            assert r.hit_blocks == int(joint_oracle(arrs, cap, sigma, rate).sum())
    assert df[~df.policy.str.startswith("joint_oracle")]["flip_rate"].isna().all()
    tidy = read_summary("out", tmp_path)
    assert set(tidy[tidy.subject == "joint_oracle@25%"]["flip_rate"]) == {0.25}
    oracle = df[df.policy == "reuse_oracle"].set_index(df[df.policy == "reuse_oracle"].capacity_blocks.fillna(-1))
    assert oracle.loc[2, "hit_blocks"] == int(reuse_oracle(arrs, 2).sum())
    unlimited = df[df.capacity_blocks.isna()].set_index("policy")
    assert unlimited.loc["reuse_oracle", "hit_blocks"] == unlimited.loc["lru", "hit_blocks"]  # every reuse fits
    at2 = df[df.capacity_blocks == 2].set_index("policy")
    lru, bel = at2.loc["lru", "hit_rate"], at2.loc["belady", "hit_rate"]
    if bel > lru:
        assert at2.loc["reuse_oracle", "gap_closed"] == pytest.approx((at2.loc["reuse_oracle", "hit_rate"] - lru)
                                                                      / (bel - lru))


def test_bounds_leave_the_timing_oracle_out_without_turns_and_say_so(tmp_path: Path) -> None:
    trace = write(tmp_path, [line(0, [0, 1]), line(10, [2, 3]), line(20, [0, 1])])  # no turn comes back after a previous one
    out = tmp_path / "out"
    p = cli(str(trace), "--capacities", "1,inf", "--policies", "lru", "--bounds", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "timing_oracle and joint_oracle: left out" in p.stdout
    assert list(pd.read_csv(out / "hitrate.csv")["policy"].unique()) == ["lru", "belady", "reuse_oracle"]


def test_anatomy_compares_two_policies_reference_by_reference(tmp_path: Path) -> None:
    from quillcache.hitrate import simulate
    from quillcache.hitrate.arrays import load_arrays

    trace = write(tmp_path, good_lines())
    out = tmp_path / "out"
    p = cli(str(trace), "--policies", "sieve", "--capacities", "2,4,inf", "--anatomy", "quillchain,sieve",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "anatomy: quillchain vs sieve" in p.stdout and "anatomy.csv" in p.stdout
    anat = pd.read_csv(out / "anatomy.csv")
    assert set(anat["capacity_blocks"]) == {2, 4}  # unlimited: nothing to tell apart
    arrs = load_arrays(trace)
    for cap, part in anat.groupby("capacity_blocks"):
        assert part["references"].sum() == arrs.num_refs
        assert part["a_hits"].sum() == simulate(arrs, "quillchain", int(cap)).hit_blocks
        assert part["b_hits"].sum() == simulate(arrs, "sieve", int(cap)).hit_blocks
        assert (part["net"] == part["a_only"] - part["b_only"]).all()


def test_capacities_as_shares_of_the_distinct_blocks(tmp_path: Path) -> None:
    """``N%`` resolves against the trace's distinct blocks by the study's rule (at least one block);
    a share and a block count that resolve alike run once; the table and the files say which share
    each capacity came from."""
    from quillcache.hitrate import simulate
    from quillcache.hitrate.arrays import load_arrays
    from quillcache.results import read_summary

    trace = write(tmp_path, good_lines())
    arrs = load_arrays(trace)  # 8 distinct blocks
    out = tmp_path / "out"
    p = cli(str(trace), "--policies", "sieve", "--capacities", "1%,25%,50%,4,inf", "--anatomy", "lru,sieve",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    want = {0.01: max(1, int(arrs.num_unique * 0.01)), 0.25: int(arrs.num_unique * 0.25),
            0.5: int(arrs.num_unique * 0.5)}
    assert want == {0.01: 1, 0.25: 2, 0.5: 4}  # the trace was made for these numbers
    assert "1% = 1" in p.stdout and "25% = 2" in p.stdout and "50% = 4" in p.stdout and "unlimited" in p.stdout
    assert f"({arrs.num_unique:,} distinct)" in p.stdout
    df = pd.read_csv(out / "hitrate.csv")
    assert sorted(df["capacity_blocks"].dropna().astype(int).unique()) == [1, 2, 4]  # 50% and 4 ran once
    for r in df.itertuples():
        cap = None if pd.isna(r.capacity_blocks) else int(r.capacity_blocks)
        assert r.hit_blocks == simulate(arrs, r.policy, cap).hit_blocks, (r.policy, cap)
        share = {1: 0.01, 2: 0.25, 4: 0.5}.get(cap)
        assert (pd.isna(r.capacity_share) if share is None else r.capacity_share == share), (cap, r.capacity_share)
    tidy = read_summary("out", tmp_path)
    fr = tidy.dropna(subset=["cap_fraction"])
    assert set(zip(fr["capacity_blocks"].astype(int), fr["cap_fraction"])) == {(1, 0.01), (2, 0.25), (4, 0.5)}
    assert set(pd.read_csv(out / "anatomy.csv")["capacity_blocks"]) == {1, 2, 4}


def test_parse_and_resolve_capacities() -> None:
    from quillcache.cli.hitrate import Share, parse_capacities, resolve_capacities

    specs = parse_capacities("10k, 0.5%,.5%,100%,inf,2M")
    assert specs == [10_000, Share(0.005, "0.5%"), Share(0.005, ".5%"), Share(1.0, "100%"), None, 2_000_000]
    caps, shares = resolve_capacities(specs, 1_000)
    assert caps == [10_000, 5, 1_000, None, 2_000_000]
    assert shares == {5: Share(0.005, "0.5%"), 1_000: Share(1.0, "100%")}  # the first share of a count wins
    assert resolve_capacities([Share(0.01, "1%")], 3) == ([1], {1: Share(0.01, "1%")})  # never below one block


def test_generated_trace_block_size_is_read_from_its_lines(tmp_path: Path) -> None:
    trace = tmp_path / "s.jsonl"
    g = subprocess.run([sys.executable, "-m", "quillcache", "gen-trace", "sessions", "--out", str(trace),
                        "--sessions", "40", "--seed", "3"], capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, g.stderr
    p = cli(str(trace), "--policies", "quillchain", "--capacities", "50,inf", "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    assert "16-token blocks" in p.stdout


def test_help_has_examples() -> None:
    p = cli("--help")
    assert p.returncode == 0 and "examples:" in p.stdout and "--capacities" in p.stdout


def test_skipped_lines_are_reported(tmp_path: Path) -> None:
    lines = good_lines()
    lines.insert(2, "{not json")
    p = cli(str(write(tmp_path, lines)), "--on-error", "skip", "--capacities", "3", "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    assert "line 3" in p.stdout


@pytest.mark.parametrize("case, args, needle", [
    ("missing", ["{tmp}/nope.jsonl"], "does not exist"),
    ("malformed", ["{bad}"], ":2:"),
    ("unsorted", ["{unsorted}"], "sorted by timestamp"),
    ("policy", ["{good}", "--policies", "lru,mru"], "--policies: unknown policy 'mru'"),
    ("no policy", ["{good}", "--policies", ","], "--policies: no policy named"),
    ("capacity zero", ["{good}", "--capacities", "10,0"], "--capacities: '0' must be >= 1 block"),
    ("capacity text", ["{good}", "--capacities", "10,lots"], "--capacities: 'lots' is not a block count"),
    ("capacity negative", ["{good}", "--capacities", "-5"], "--capacities: '-5' is not a block count"),
    ("share zero", ["{good}", "--capacities", "10,0%"], "--capacities: '0%' must be a share in (0%, 100%]"),
    ("share over", ["{good}", "--capacities", "150%"], "--capacities: '150%' must be a share in (0%, 100%]"),
    ("share text", ["{good}", "--capacities", "x%"], "--capacities: 'x%' is not a share of the distinct blocks"),
    ("capacity huge", ["{good}", "--capacities", "10,9999999999999999999"],
     "--capacities: '9999999999999999999' is too large (at most 4,611,686,018,427,387,904 blocks; use inf for "
     "unlimited)"),
    ("capacity huge M", ["{good}", "--capacities", "99999999999999999999M"],
     "--capacities: '99999999999999999999M' is too large (at most"),
    ("capacity just over", ["{good}", "--capacities", f"{2**62 + 1}"], f"--capacities: '{2**62 + 1}' is too large"),
    ("limit", ["{good}", "--limit", "0"], "--limit=0 must be >= 1"),
    ("anatomy one", ["{good}", "--anatomy", "lru"], "--anatomy: 'lru' must name two different policies"),
    ("anatomy same", ["{good}", "--anatomy", "lru, lru"], "must name two different policies"),
    ("anatomy unknown", ["{good}", "--anatomy", "lru,mru"], "--anatomy: unknown policy 'mru'"),
    ("flip text", ["{good}", "--bounds", "--bound-flip-rates", "5%,some"],
     "--bound-flip-rates: 'some' is not a share of requests"),
    ("flip one", ["{good}", "--bounds", "--bound-flip-rates", "1"],
     "--bound-flip-rates: '1' must be a share in [0%, 100%)"),
    ("flip empty", ["{good}", "--bounds", "--bound-flip-rates", ""], "--bound-flip-rates: '' is not a share"),
    ("flip negative", ["{good}", "--bounds", "--bound-flip-rates=-2%"], "--bound-flip-rates: '-2%' must be a share"),
    ("flip nan", ["{good}", "--bounds", "--bound-flip-rates", "nan"], "--bound-flip-rates: 'nan' must be a share"),
    ("flip without bounds", ["{good}", "--bound-flip-rates", "5%"], "--bound-flip-rates needs --bounds"),
])
def test_bad_input_is_one_clear_line(tmp_path: Path, case: str, args: list[str], needle: str) -> None:
    paths = {
        "tmp": str(tmp_path),
        "good": str(write(tmp_path, good_lines(), "good.jsonl")),
        "bad": str(write(tmp_path, [good_lines()[0], '{"timestamp": 1, "input_length": "x"}'], "bad.jsonl")),
        "unsorted": str(write(tmp_path, [line(100, [0]), line(50, [0, 1])], "unsorted.jsonl")),
    }
    out = tmp_path / "out"
    p = cli(*[a.format(**paths) for a in args], "--out", str(out))
    assert p.returncode == 2, (case, p.stderr)
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and needle in errors[0], p.stderr
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    assert not out.exists()  # nothing written on refused input


def test_an_unwritable_out_is_refused_before_the_work(tmp_path: Path) -> None:
    trace = write(tmp_path, good_lines())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = cli(str(trace), "--out", str(blocker / "sub"))
    assert p.returncode == 2 and "is a file, not a folder" in p.stderr and "Traceback" not in p.stderr


def test_capacity_bound_is_inclusive_and_sweep_refuses_what_int64_cannot_hold() -> None:
    from quillcache.cli.hitrate import MAX_CAPACITY_BLOCKS, parse_capacities
    from quillcache.hitrate.arrays import arrays_from_lists
    from quillcache.hitrate.sweep import sweep

    assert parse_capacities(f"{MAX_CAPACITY_BLOCKS},4611686018427387k") == [MAX_CAPACITY_BLOCKS, 4611686018427387000]
    with pytest.raises(ValueError, match="too large"):
        parse_capacities(f"{MAX_CAPACITY_BLOCKS + 1}")
    arrs = arrays_from_lists([[1, 2], [1, 3]])
    df = sweep(arrs, ["lru"], [MAX_CAPACITY_BLOCKS, None])
    assert df["capacity_blocks"].tolist()[0] == MAX_CAPACITY_BLOCKS  # behaves as unlimited, labelled as given
    assert df["hit_blocks"].tolist() == [1, 1]
    with pytest.raises(ValueError, match=r"capacity_blocks=9223372036854775808 must be"):
        sweep(arrs, ["lru"], [2, 2**63])


def test_hash_ids_at_and_above_2_63_replay_like_small_ids(tmp_path: Path) -> None:
    from quillcache.hitrate import simulate
    from quillcache.hitrate.arrays import load_arrays

    big = {0: 2**63, 1: 2**64 - 1, 2: 2**63 + 7, 3: 5, 4: 2**64 - 2, 5: 2**63 - 1, 6: 0, 7: 2**63 + 1}
    small_trace = write(tmp_path, good_lines(), "small.jsonl")
    big_lines = []
    for ln in good_lines():
        d = json.loads(ln)
        d["hash_ids"] = [big[x] for x in d["hash_ids"]]
        big_lines.append(json.dumps(d))
    trace = write(tmp_path, big_lines, "big.jsonl")
    out = tmp_path / "out"
    p = cli(str(trace), "--policies", "quillchain", "--capacities", "2,4,inf", "--bounds", "--anatomy", "lru,belady",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "quillchain" in p.stdout
    df = pd.read_csv(out / "hitrate.csv")
    small = load_arrays(small_trace)
    assert f"({small.num_unique:,} distinct)" in p.stdout
    for r in df[df.policy.isin(["lru", "quillchain", "belady"])].itertuples():
        cap = None if pd.isna(r.capacity_blocks) else int(r.capacity_blocks)
        assert r.hit_blocks == simulate(small, r.policy, cap).hit_blocks, (r.policy, cap)
    assert set(pd.read_csv(out / "anatomy.csv")["capacity_blocks"]) == {2, 4}


def test_out_must_name_a_folder(tmp_path: Path) -> None:
    trace = write(tmp_path, good_lines())
    p = subprocess.run([sys.executable, "-m", "quillcache", "hitrate", str(trace), "--out", "", "--capacities", "2"],
                       capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "--out '' names no folder" in errors[0] and "Traceback" not in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["trace.jsonl"]  # no results/hitrate_cli/trace/


def test_a_rerun_replaces_the_whole_result_set(tmp_path: Path) -> None:
    """A second run into the same --out leaves no file of the first that it did not write itself
    (anatomy.csv, a parquet twin), no temporary folder, and every other file there untouched."""
    trace = write(tmp_path, good_lines())
    out = tmp_path / "out"
    p = cli(str(trace), "--capacities", "1,2", "--policies", "fifo", "--anatomy", "lru,fifo", "--out", str(out),
            "--quiet")
    assert p.returncode == 0 and (out / "anatomy.csv").is_file(), p.stderr
    (out / "hitrate.parquet").write_text("stale")  # as an earlier run with pyarrow would leave it
    (out / "notes.txt").write_text("mine")
    p = cli(str(trace), "--capacities", "1", "--policies", "fifo", "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    assert not (out / "anatomy.csv").exists()
    assert not (out / "hitrate.parquet").exists() or (out / "hitrate.parquet").read_bytes() != b"stale"
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(x.name for x in out.iterdir() if x.name not in ("hitrate.parquet",)) == [
        "hitrate.csv", "meta.json", "notes.txt", "summary.csv"]
    assert pd.read_csv(out / "hitrate.csv")["capacity_blocks"].tolist() == [1, 1, 1]  # lru, fifo, belady


def test_a_failed_write_leaves_the_previous_results_as_they_were(tmp_path: Path) -> None:
    trace = write(tmp_path, good_lines())
    out = tmp_path / "out"
    assert cli(str(trace), "--capacities", "1,2", "--out", str(out), "--quiet").returncode == 0
    before = {x.name: x.read_bytes() for x in out.iterdir()}
    (out / "anatomy.csv").mkdir()  # the new anatomy.csv cannot go there
    p = cli(str(trace), "--capacities", "4", "--anatomy", "lru,fifo", "--out", str(out), "--quiet")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "anatomy.csv is a folder, not a file" in errors[0], p.stderr
    assert {x.name: x.read_bytes() for x in out.iterdir() if x.is_file()} == before
    assert sorted(x.name for x in out.iterdir() if x.is_dir()) == ["anatomy.csv"]  # no temporary folder left


def _one_row(hit_rate: float):
    return pd.DataFrame({"policy": ["lru"], "capacity_blocks": pd.array([2], dtype="Int64"), "hit_rate": [hit_rate],
                         "hit_blocks": [1], "total_blocks": [2], "refs_per_s": [1.0],
                         "gap_closed": pd.array([pd.NA], dtype="Float64")})


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("exc, needle", [
    (KeyboardInterrupt(), None),
    (OSError(28, "No space left on device"), "No space left on device (the files there are as they were)"),
])
def test_an_interrupted_or_failed_write_leaves_out_as_it_was(tmp_path: Path, fresh: bool, exc: BaseException,
                                                              needle: str | None) -> None:
    """Ctrl-C or an OSError while the files are being written: --out holds what it held before
    (nothing, a folder made for the run removed again, when it did not exist)."""
    from quillcache.cli.hitrate import write_results

    out = tmp_path / "a" / "out"
    if not fresh:
        write_results(out, _one_row(0.5), "t", 512)
    before = {x.name: x.read_bytes() for x in out.iterdir()} if not fresh else None

    class Failing:
        def to_csv(self, *a, **k):
            raise exc

    with pytest.raises(type(exc), match=needle and re.escape(needle)):
        write_results(out, _one_row(0.75), "t", 512, Failing())
    if fresh:
        assert not (tmp_path / "a").exists()
    else:
        assert {x.name: x.read_bytes() for x in out.iterdir()} == before


def test_ctrl_c_while_the_files_are_renamed_takes_effect_once_all_are(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    import os
    import signal

    from quillcache.cli import hitrate

    out = tmp_path / "out"
    hitrate.write_results(out, _one_row(0.5), "t", 512, pd.DataFrame({"x": [1]}))
    real = os.replace

    def replace(src, dst):
        if Path(dst) == out / "hitrate.csv":  # the first rename into --out: Ctrl-C arrives now
            os.kill(os.getpid(), signal.SIGINT)
        return real(src, dst)

    monkeypatch.setattr(hitrate.os, "replace", replace)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(hitrate.ResultsWritten):
        hitrate.write_results(out, _one_row(0.75), "t", 512)
    assert pd.read_csv(out / "hitrate.csv")["hit_rate"].tolist() == [0.75]
    assert not (out / "anatomy.csv").exists()  # the stale one went too: the whole set is the new one
    assert sorted(x.name for x in out.iterdir()) == ["hitrate.csv", "meta.json", "summary.csv"]
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C works as before again


def test_anatomy_on_a_trace_without_block_references_says_so(tmp_path: Path) -> None:
    trace = write(tmp_path, [line(0, [], isl=0)])
    out = tmp_path / "out"
    p = cli(str(trace), "--anatomy", "quillchain,lru", "--capacities", "1,50%,inf", "--out", str(out))
    assert p.returncode == 2, p.stderr  # refused as replay refuses it (CLI review /tmp/s37/cli L2)
    assert "no block reference to replay" in p.stderr and "nothing was written" in p.stderr
    assert not out.exists() or not any(out.iterdir())
    p = cli(str(write(tmp_path, good_lines(), "g.jsonl")), "--anatomy", "quillchain,lru", "--capacities", "inf",
            "--out", str(out))
    assert p.returncode == 0 and "anatomy: no finite capacity among 'inf': nothing to compare" in p.stdout
    assert len(pd.read_csv(out / "anatomy.csv")) == 0


def test_bound_kernels_are_warmed_up_before_they_are_timed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The first call of each bound is on a separate tiny trace, so the timed calls on the real
    trace never include Numba's compile or cache load."""
    import quillcache.hitrate.bounds as bounds
    from quillcache.cli.hitrate import with_bounds
    from quillcache.hitrate.arrays import load_arrays
    from quillcache.hitrate.sweep import sweep

    arrs = load_arrays(write(tmp_path, good_lines()))
    calls: list[tuple[str, object]] = []
    names = ("reuse_oracle", "timing_oracle", "joint_oracle")
    for name in names:
        real = getattr(bounds, name)
        monkeypatch.setattr(bounds, name, lambda a, *rest, _n=name, _f=real: calls.append((_n, a)) or _f(a, *rest))
    df, _ = with_bounds(sweep(arrs, ["lru", "belady"], [2, None]), arrs, 512, [0.1])
    assert set(df["policy"]) == {"lru", "belady", "reuse_oracle", "timing_oracle", "joint_oracle@10%"}
    for name in names:
        seen = [a for n, a in calls if n == name]
        assert len(seen) == 3 and seen[0] is not arrs and seen[0].num_requests == 2, name  # warm-up, then 2 caps
        assert all(a is arrs for a in seen[1:]), name


def test_flip_rates_are_one_share_however_written() -> None:
    from quillcache.cli.hitrate import joint_label, parse_flip_rates

    assert parse_flip_rates("0.7%, 0.007,10%,0.1") == [0.007, 0.1]  # 0.7% is 0.006999... before rounding
    assert [joint_label(r) for r in parse_flip_rates("0.7%,99.9999999%,0")] == [
        "joint_oracle@0.7%", "joint_oracle@99.9999999%", "joint_oracle@0%"]
    assert parse_flip_rates("none") == parse_flip_rates(" None ") == []
