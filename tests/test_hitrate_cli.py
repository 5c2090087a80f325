"""``quillcache hitrate`` end to end in a subprocess: the table and result files on success, one
clear line and nothing written on bad input (the rules of ``quillcache replay``)."""

from __future__ import annotations

import json
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
    from quillcache.hitrate.bounds import reuse_oracle, timing_oracle
    from quillcache.hitrate.turns import robust_sigma, turn_gap_log_ratios

    trace = write(tmp_path, good_lines())
    out = tmp_path / "out"
    p = cli(str(trace), "--policies", "sieve", "--capacities", "2,inf", "--bounds", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "reuse_oracle (offline: which blocks return, not when)" in p.stdout
    df = pd.read_csv(out / "hitrate.csv")
    assert list(df["policy"].unique()) == ["lru", "sieve", "belady", "reuse_oracle", "timing_oracle"]
    arrs = load_arrays(trace)
    sigma = round(robust_sigma(turn_gap_log_ratios(arrs)), 2)  # one turn comes back here: its spread is 0
    assert "timing_oracle (offline: which, and roughly when)" in p.stdout
    assert f"timing_oracle: sigma = {sigma:.2f}" in p.stdout
    timing = df[df.policy == "timing_oracle"]
    assert (timing["sigma"] == sigma).all() and df[df.policy != "timing_oracle"]["sigma"].isna().all()
    for r in timing.itertuples():
        cap = arrs.num_unique if pd.isna(r.capacity_blocks) else int(r.capacity_blocks)
        assert r.hit_blocks == int(timing_oracle(arrs, cap, sigma).sum())
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
    assert "timing_oracle: left out" in p.stdout
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
    ("limit", ["{good}", "--limit", "0"], "--limit=0 must be >= 1"),
    ("anatomy one", ["{good}", "--anatomy", "lru"], "--anatomy: 'lru' must name two different policies"),
    ("anatomy same", ["{good}", "--anatomy", "lru, lru"], "must name two different policies"),
    ("anatomy unknown", ["{good}", "--anatomy", "lru,mru"], "--anatomy: unknown policy 'mru'"),
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
