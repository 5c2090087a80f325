"""Bad input gets ONE clear line naming what was wrong (the flag as typed, the file and entry, the environment
variable) and exit status 2, before anything starts, and nothing is damaged: one test per defect of the CLI
messages review (short transfer secret, sizes not a multiple of 4096, a file where a directory is needed, short
gateway API keys, a missing gateway tokenizer, NaN / too-deep request JSON, ``hash`` flags, an ``--out`` where no
file can be created, ``--heartbeat-s`` bounds, ``--help`` gaps, and the shared write-outcome handler).

Everything runs in this process (the parser, or ``main`` with the expensive part replaced by a stub that fails
the test if reached), so the file takes a few seconds; nothing listens on a port or starts a process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from types import SimpleNamespace

import pytest

from quillcache.cli import OneLineParser, main

SECRET_ENV = "QUILLCACHE_TRANSFER_SECRET"
GOOD_SECRET = "0123456789abcdef-test"
MASTER = "tcp://127.0.0.1:1"  # nothing is ever sent there: every case is refused before PoolNode


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err[:-1]


def _usage_error(argv: list[str], capsys) -> str:
    """``main(argv)`` must refuse at parse time (argparse's SystemExit 2); its one line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2, argv
    return _one_line(capsys.readouterr().err)


class _Reached(Exception):
    """Raised by a stub standing in for the work a refused command must never reach."""


@pytest.fixture
def node_stub(monkeypatch):
    """``quillcache node`` without a node: PoolNode raises ``_Reached`` (``run`` reports it, exit 1), and the
    signal handlers and log setup ``run`` installs after its checks are not installed in this process."""
    import logging

    import quillcache.pool.node

    calls = []

    def pool_node(*args, **kwargs):
        calls.append(kwargs)
        raise _Reached("PoolNode was constructed")

    monkeypatch.setattr(quillcache.pool.node, "PoolNode", pool_node)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    monkeypatch.setenv(SECRET_ENV, GOOD_SECRET)
    return calls


@pytest.fixture
def no_start(node_stub, monkeypatch):
    """``node_stub``, and ``cluster up`` never starts a process either (should a refusal regress to acceptance)."""
    from quillcache.pool.cluster import LocalCluster

    def never(self):
        raise AssertionError("LocalCluster.start was called")

    monkeypatch.setattr(LocalCluster, "start", never)
    return node_stub


# ================================================================ 1. the transfer secret, checked at start-up


@pytest.mark.parametrize("secret, want", [
    ("short", f"quillcache node: {SECRET_ENV} is 5 byte(s); the pool's transfer secret must be at least 16 bytes"),
    ("x" * 15, f"quillcache node: {SECRET_ENV} is 15 byte(s); "),
    ("\udcff" * 20, f"quillcache node: {SECRET_ENV} is not valid UTF-8"),  # undecodable bytes in the environment
    (None, f"quillcache node: set {SECRET_ENV} (the pool's shared transfer secret, at least 16 bytes"),
])
def test_node_refuses_a_short_or_missing_secret_before_any_work(node_stub, monkeypatch, capsys, secret, want):
    if secret is None:
        monkeypatch.delenv(SECRET_ENV)
    else:
        monkeypatch.setenv(SECRET_ENV, secret)
    # was: "quillcache node: cannot start: ValueError: secret must be at least 16 bytes, got 5", exit 1
    assert main(["node", "--master", MASTER, "--dram", "16MiB"]) == 2
    assert _one_line(capsys.readouterr().err).startswith(want)
    assert not node_stub  # refused before the DRAM is mapped or anything listens


def test_node_counts_the_secret_in_bytes_as_the_transfer_backend_does(node_stub, monkeypatch, capsys):
    monkeypatch.setenv(SECRET_ENV, "\u00e9" * 8)  # 8 characters, 16 UTF-8 bytes: enough
    assert main(["node", "--master", MASTER, "--dram", "16MiB"]) == 1
    assert "PoolNode was constructed" in capsys.readouterr().err and len(node_stub) == 1


# ================================================================ 2. size flags: a multiple of 4096, never rounded


SIZE_FLAGS = [(["node", "--master", MASTER], "--dram"), (["node", "--master", MASTER, "--dram", "16MiB"], "--ssd-size"),
              (["cluster", "up"], "--dram")]


@pytest.mark.parametrize("prefix, flag", SIZE_FLAGS)
@pytest.mark.parametrize("value, bytes_", [("4097", "4097"), ("1MB", "1000000"), ("0.3MiB", "314572.8"),
                                           ("4096.5", "4096.5"), ("6KiB", "6144")])
def test_size_flags_refuse_a_size_that_is_not_a_multiple_of_4096(no_start, prefix, flag, value, bytes_, capsys):
    line = _usage_error([*prefix, flag, value], capsys)  # was: accepted, rounded down to a multiple of 4096
    assert f"argument {flag}: {value!r} is {bytes_} bytes, not a multiple of 4096" in line, line


@pytest.mark.parametrize("prefix, flag", SIZE_FLAGS)
def test_size_flags_refuse_an_absurd_size_in_one_line(no_start, prefix, flag, capsys):
    line = _usage_error([*prefix, flag, "9" * 400], capsys)  # was: an OverflowError traceback
    assert f"argument {flag}: '99999999999999999999...(400 characters)' is above the maximum of" in line, line


def test_size_flags_still_take_whole_pages_and_their_defaults_are_pages():
    from quillcache.cli import argtypes, cluster, node

    for text, want in [("4096", 4096), ("16MiB", 16 << 20), ("1.5MiB", 3 << 19), ("8KiB", 8192), ("1GiB", 1 << 30),
                       ("4096KB", 4_096_000), ("4TB", 4 * 10**12)]:
        assert argtypes.size_arg(text) == want and want % 4096 == 0, text
    np = OneLineParser(prog="quillcache node")
    node.configure(np)
    assert np.parse_args(["--master", MASTER, "--dram", "1.5MiB"]).dram == 3 << 19
    cp = OneLineParser(prog="quillcache cluster")
    cluster.configure(cp)
    assert cp.parse_args(["up"]).dram % argtypes.SIZE_MULTIPLE_BYTES == 0
    assert argtypes.parse_size("2MB") == 2_000_000  # parse_size itself (not a flag) is unchanged


# ================================================================ 3. a file where a directory is needed


def test_node_refuses_an_ssd_that_is_a_file_and_leaves_the_file(node_stub, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"precious")
    # was: "quillcache node: cannot start: FileExistsError: [Errno 17] File exists: ...", exit 1
    assert main(["node", "--master", MASTER, "--dram", "16MiB", "--ssd", str(a_file)]) == 2
    assert _one_line(capsys.readouterr().err) == f"quillcache node: --ssd {a_file} is a file, not a directory"
    assert main(["node", "--master", MASTER, "--dram", "16MiB", "--ssd", str(a_file / "sub")]) == 2
    assert _one_line(capsys.readouterr().err) == (f"quillcache node: --ssd {a_file / 'sub'} cannot be created: "
                                                  f"{a_file} is a file, not a directory")
    assert main(["node", "--master", MASTER, "--dram", "16MiB", "--ssd", ""]) == 2
    assert _one_line(capsys.readouterr().err) == "quillcache node: --ssd '' is empty: it must name a directory"
    assert a_file.read_bytes() == b"precious" and not node_stub
    missing = tmp_path / "new" / "ssd"  # a missing one is still made, as the node always did
    assert main(["node", "--master", MASTER, "--dram", "16MiB", "--ssd", str(missing)]) == 1
    assert missing.is_dir() and node_stub[0]["ssd_dir"] == str(missing)
    capsys.readouterr()


def test_cluster_up_refuses_a_dir_that_is_a_file_before_starting_anything(no_start, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"precious")
    # was: "quillcache cluster up: [Errno 17] File exists: ...", exit 1
    assert main(["cluster", "up", "--nodes", "1", "--dir", str(a_file)]) == 2
    assert _one_line(capsys.readouterr().err) == f"quillcache cluster up: --dir {a_file} is a file, not a directory"
    assert a_file.read_bytes() == b"precious"


# ================================================================ 4. gateway API keys: file and entry named


@pytest.fixture
def gateway_serve(monkeypatch, tmp_path):
    """``serve`` replaced by a stub recording its calls (a refused gateway must never get there); a key file."""
    import quillcache.gateway.server

    calls = []
    monkeypatch.setattr(quillcache.gateway.server, "serve", lambda *a, **kw: calls.append(kw) or 0)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-long-enough", "tenant": "acme"}]}))
    return calls, str(keys)


def test_gateway_names_the_key_file_and_entry_of_a_short_key(gateway_serve, tmp_path, monkeypatch, capsys):
    keys = tmp_path / "keys_short.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-long-enough", "tenant": "acme"},
                                         {"key": "abc", "tenant": "beta"}]}))
    # was: "quillcache gateway: API keys must be strings of at least 8 characters without whitespace"
    assert main(["gateway", "--engines", "http://127.0.0.1:1", "--keys", str(keys)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line == (f"quillcache gateway: key file {keys} keys[1]: API keys must be strings of at least 8 "
                    f"characters without whitespace, got 3 character(s)")
    keys.write_text(json.dumps({"keys": [{"key": "has a space", "tenant": "acme"}]}))
    assert main(["gateway", "--engines", "http://127.0.0.1:1", "--keys", str(keys)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"key file {keys} keys[0]: " in line and "got one with whitespace" in line and "has a space" not in line
    monkeypatch.setenv("QUILLCACHE_GATEWAY_KEYS", "sk-long-enough=acme,abc=beta")
    assert main(["gateway", "--engines", "http://127.0.0.1:1"]) == 2
    assert _one_line(capsys.readouterr().err).startswith(
        "quillcache gateway: QUILLCACHE_GATEWAY_KEYS entry 1: API keys must be strings of at least 8 characters")
    assert not gateway_serve[0]


# ================================================================ 5. gateway tokenizer / chat template


def test_gateway_refuses_a_missing_tokenizer_with_exit_2(gateway_serve, tmp_path, capsys):
    calls, keys = gateway_serve
    base = ["gateway", "--engines", "http://127.0.0.1:1", "--keys", keys]
    # was: "quillcache gateway: TokenizerError: no tokenizer.json at '/nonexistent.json'", exit 1
    assert main([*base, "--tokenizer", "/nonexistent.json"]) == 2
    assert _one_line(capsys.readouterr().err) == \
        "quillcache gateway: --tokenizer: no tokenizer.json at '/nonexistent.json'"
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"engines": [{"url": "http://127.0.0.1:1"}], "tokenizer": "/nope/tokenizer.json"}))
    assert main(["gateway", "--config", str(conf), "--keys", keys]) == 2
    assert _one_line(capsys.readouterr().err) == \
        f"quillcache gateway: config {conf}: tokenizer: no tokenizer.json at '/nope/tokenizer.json'"
    conf.write_text(json.dumps({"engines": [{"url": "http://127.0.0.1:1"}], "chat_template": "/nope/tc.json"}))
    assert main(["gateway", "--config", str(conf), "--keys", keys]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"quillcache gateway: config {conf}: chat_template: ")
    assert not calls
    assert main([*base, "--tokenizer", "bytes"]) == 0 and len(calls) == 1  # a good one still serves
    # ... with what it checked: loaded once, not again by the gateway
    from quillcache.textproc import ByteTokenizer, ChatMLTemplate
    assert isinstance(calls[0]["tokenizer"], ByteTokenizer) and isinstance(calls[0]["template"], ChatMLTemplate)


def test_engine_sim_serves_the_tokenizer_and_template_it_checked(monkeypatch, capsys):
    import quillcache.enginesim.server
    from quillcache.textproc import ByteTokenizer, ChatMLTemplate

    calls = []
    monkeypatch.setattr(quillcache.enginesim.server, "serve", lambda *a, **kw: calls.append(kw) or 0)
    assert main(["engine-sim", "--tokenizer", "/nope/tokenizer.json"]) == 2 and not calls
    assert "/nope/tokenizer.json" in _one_line(capsys.readouterr().err)
    assert main(["engine-sim"]) == 0 and len(calls) == 1
    assert isinstance(calls[0]["tokenizer"], ByteTokenizer) and isinstance(calls[0]["chat_template"], ChatMLTemplate)


# ================================================================ 6. gateway request JSON: depth and NaN


def _read_body(raw: bytes, max_depth: int = 64):
    """``Gateway._read_body`` on ``raw`` (the real method; a stand-in request and config)."""
    from quillcache.gateway.app import Gateway

    class Req:
        headers = {"content-length": str(len(raw))}

        async def stream(self):
            yield raw

    gw = SimpleNamespace(config=SimpleNamespace(limits=SimpleNamespace(max_body_bytes=1 << 24,
                                                                       max_json_depth=max_depth)))
    return asyncio.run(Gateway._read_body(gw, Req()))


@pytest.mark.parametrize("raw, want", [
    (b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "request body is nested too deeply"),
    (b'{"model": "m", "prompt": "hi", "temperature": NaN}', "request body is not valid JSON: NaN is not a JSON value"),
    (b'{"model": "m", "temperature": Infinity}', "request body is not valid JSON: Infinity is not a JSON value"),
    (b'{"model": "m", "temperature": -Infinity}', "request body is not valid JSON: -Infinity is not a JSON value"),
    (b'{"model": "m", "x": [1, NaN]}', "request body is not valid JSON: NaN is not a JSON value"),
    (b"{not json", "request body is not valid JSON: Expecting property name"),
])
def test_gateway_says_what_is_wrong_with_a_request_body(raw, want):
    from quillcache.gateway.app import GatewayError

    # was: the deep body "request body is not valid JSON (UTF-8)", and NaN / Infinity accepted
    with pytest.raises(GatewayError) as e:
        _read_body(raw)
    assert e.value.status == 400 and str(e.value).startswith(want), str(e.value)


def test_gateway_still_parses_what_json_loads_parses():
    body = {"model": "m", "prompt": "h\u00e9", "temperature": 0.5, "n": [1e308, -0.0, None]}
    text = json.dumps(body)
    for raw in (text.encode(), text.encode("utf-16"), b"\xef\xbb\xbf" + text.encode()):  # as json.loads takes them
        assert _read_body(raw) == body


# ================================================================ 7. hash flags named as typed


def test_hash_names_the_block_size_flag_before_reading_stdin(monkeypatch, capsys):
    class NoStdin:
        def read(self):
            raise AssertionError("stdin was read before the flags were checked")

    monkeypatch.setattr("sys.stdin", NoStdin())
    for value in ("0", "65537", "-3"):
        assert main(["hash", "--block-size", value]) == 2  # was: "block_size=0 must be in [1, 65536]"
        assert _one_line(capsys.readouterr().err) == \
            f"quillcache hash: --block-size: block_size={value} must be in [1, 65536] (tokens per block)"


@pytest.mark.parametrize("flag", ["--namespace", "--lora"])
def test_hash_names_a_flag_that_is_not_utf8(flag, capsys):
    tokens = [str(i) for i in range(16)]
    # was: "quillcache hash: 'utf-8' codec can't encode characters in position 0-1: surrogates not allowed"
    assert main(["hash", flag, "\udcff\udcfe", *tokens]) == 2  # the bytes ff fe, as Python hands them over
    assert _one_line(capsys.readouterr().err) == \
        f"quillcache hash: {flag} b'\\xff\\xfe' is not valid UTF-8 (it is hashed as UTF-8 text)"
    assert main(["hash", flag, "caf\u00e9", *tokens]) == 0
    capsys.readouterr()


# ================================================================ 8. --out where no file can be created


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize("command", ["replay", "hitrate"])
def test_out_in_a_folder_that_takes_no_file_says_so(command, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [1, 2]}) + "\n")
    assert main([command, str(trace), "--out", "/proc/quillcache-test-out", "--quiet"]) == 2
    line = _one_line(capsys.readouterr().err)
    # was: "--out /proc/x: cannot write in /proc (No such file or directory)", though /proc exists
    assert line == (f"quillcache {command}: error: --out /proc/quillcache-test-out: a temporary file cannot be "
                    f"created in /proc (No such file or directory)"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


# ================================================================ 9. --heartbeat-s bounds at parse time


@pytest.mark.parametrize("value", ["1e300", "86401", "0", "nan", "inf"])
def test_node_refuses_a_heartbeat_out_of_range_at_parse_time(node_stub, value, capsys):
    # was: "quillcache node: cannot start: ValueError: heartbeat_s=1e+300 must be in (0.0, 86400.0]", exit 1
    line = _usage_error(["node", "--master", MASTER, "--dram", "16MiB", "--heartbeat-s", value], capsys)
    assert f"argument --heartbeat-s: {value!r} is not in (0, 86400]" in line and not node_stub


@pytest.mark.parametrize("value", ["localhost", "tcp://h:0", "tcp://h:70000", "http://h:1", ""])
def test_node_refuses_a_malformed_master_address_at_parse_time(node_stub, value, capsys):
    # was: accepted, and the node failed connecting (exit 1); cluster status already checked its --master
    line = _usage_error(["node", "--master", value, "--dram", "16MiB"], capsys)
    assert f"argument --master: {value!r} is not an address" in line and not node_stub


def test_node_heartbeat_bounds_are_pool_nodes():
    from quillcache.cli import node
    from quillcache.pool.node import MAX_HEARTBEAT_S

    p = OneLineParser(prog="quillcache node")
    node.configure(p)
    assert p.parse_args(["--master", MASTER, "--dram", "16MiB", "--heartbeat-s", repr(MAX_HEARTBEAT_S)]).heartbeat_s \
        == MAX_HEARTBEAT_S


def test_cluster_up_refuses_ttls_the_master_would_refuse(no_start, capsys):
    for flag in ("--client-ttl-s", "--lease-ttl-s"):  # was: accepted, then the master refused them (exit 1)
        line = _usage_error(["cluster", "up", flag, "1e300"], capsys)
        assert f"argument {flag}: '1e300' is not in (0, 86400]" in line, line


# ================================================================ 10. --help


def _help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # unwrapped


def test_help_says_what_0_means_and_what_a_user_must_set(capsys):
    master = _help_of(["master"], capsys)
    for flag, name in (("--lease-ttl-s", "lease_ttl_s"), ("--client-ttl-s", "client_ttl_s")):
        text = master.split(f"{flag} {flag[2:].upper().replace('-', '_')}")[-1]
        assert "0 is refused (exit 2)" in text.split("--")[0] and f"(default 10: MasterConfig.{name})" in text, flag
    node = _help_of(["node"], capsys)
    assert f"{SECRET_ENV} is required" in node and "at least 16 bytes" in node and "a multiple of 4096 bytes" in node
    up = _help_of(["cluster", "up"], capsys)
    assert "Start a master and N `quillcache node` processes" in up and "in (0, 86400] (default 3)" in up
    status = _help_of(["cluster", "status"], capsys)
    assert "Ask the master at ADDR for its pool" in status and "(default 5)" in status


# ================================================================ 11. one handler of write_results' outcomes


def test_write_reported_turns_each_outcome_into_one_line_and_a_status(tmp_path, capsys):
    from quillcache.cli.resultset import ResultsWritten, write_reported

    out = tmp_path / "out"
    assert write_reported("x", out, lambda: ["a"]) == (["a"], None)
    assert capsys.readouterr().err == ""

    def raising(exc):
        def write():
            raise exc
        return write

    cases = [(ResultsWritten([out / "a"], signal.SIGTERM), 143,
              f"quillcache x: stopped by SIGTERM; the results were written under {out} first"),
             (KeyboardInterrupt(), 130, f"quillcache x: interrupted; the files under {out} are as they were"),
             (OSError(28, "No space left on device"), 2,
              f"quillcache x: error: cannot write results under {out}: No space left on device")]
    for exc, status, want in cases:
        assert write_reported("x", out, raising(exc)) == (None, status)
        assert _one_line(capsys.readouterr().err) == want


@pytest.mark.parametrize("command", ["replay", "hitrate"])
def test_replay_and_hitrate_report_a_failed_write_through_it(command, tmp_path, monkeypatch, capsys):
    import importlib

    from quillcache.cli import resultset

    module = importlib.import_module(f"quillcache.cli.{command}")
    seen = []
    real = resultset.write_reported
    monkeypatch.setattr(module, "write_reported", lambda *a: seen.append(a[0]) or real(*a), raising=True)

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "write_results", full)
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [1, 2]}) + "\n")
    fewer = ["--policies", "lru", "--capacities", "2"] if command == "hitrate" else []  # fewer kernels to compile
    assert main([command, str(trace), "--out", str(tmp_path / "out"), "--quiet", *fewer]) == 2
    assert _one_line(capsys.readouterr().err) == \
        f"quillcache {command}: error: cannot write results under {tmp_path / 'out'}: No space left on device"
    assert seen == [command]


@pytest.mark.parametrize("dram_bytes", [4097, 1_000_000, 0, 4096.0, True, "8MiB"])
def test_local_cluster_refuses_dram_a_node_would_refuse(dram_bytes):
    """``LocalCluster`` hands ``dram_bytes`` to ``quillcache node --dram``, which takes whole pages only: refused
    in the constructor, before any process starts (was: a node start failure after the master had started)."""
    from quillcache.pool.cluster import LocalCluster

    with pytest.raises(ValueError, match=r"dram_bytes must be an int multiple of 4096"):
        LocalCluster(1, dram_bytes=dram_bytes)
    assert LocalCluster(1, dram_bytes=8 << 20).dram_bytes == 8 << 20


def test_cluster_up_stopped_as_its_line_goes_out_is_a_normal_stop(monkeypatch, capsys):
    """A stop signal handled while ``cluster up`` prints its JSON line (a reader that stops the cluster as soon as it
    sees the line: the fresh-clone CI run under load hit this window) ends it with 0 and stops every child, as one
    while it serves does (was: exit 129 and "stopped by SIGHUP", as if start-up had been interrupted)."""
    import signal

    from quillcache.cli.signals import Terminated
    from quillcache.pool.cluster import LocalCluster

    closed = []
    monkeypatch.setattr(LocalCluster, "start", lambda self: None)
    monkeypatch.setattr(LocalCluster, "close", lambda self: closed.append(True))
    monkeypatch.setattr(LocalCluster, "master_address", "tcp://127.0.0.1:1", raising=False)
    monkeypatch.setattr(LocalCluster, "base_dir", "/nonexistent", raising=False)

    class SignalAtFlush:
        def write(self, text):
            return len(text)

        def flush(self):
            raise Terminated(signal.SIGHUP)

    monkeypatch.setattr("sys.stdout", SignalAtFlush())
    assert main(["cluster", "up", "--nodes", "1", "--dram", "16MiB"]) == 0
    assert closed == [True]


def test_a_value_that_starts_with_a_dash_is_explained(capsys):
    """argparse reads ``--bound-flip-rates -1%`` as a flag with no value; the message says how to pass it."""
    with pytest.raises(SystemExit) as info:
        main(["hitrate", "trace.jsonl", "--bounds", "--bound-flip-rates", "-1%"])
    assert info.value.code == 2
    line = _one_line(capsys.readouterr().err)
    assert "--bound-flip-rates: expected one argument" in line and "--option=-VALUE" in line
