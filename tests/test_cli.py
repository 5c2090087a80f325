import os
import subprocess
import sys
from pathlib import Path

import pytest

from quillcache.cli import main
from quillcache.hashing.blocks import hash_blocks


def test_hash_command_matches_library(capsys):
    tokens = list(range(40))
    assert main(["hash", "--block-size", "16", *map(str, tokens)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    want = hash_blocks(tokens, 16)
    assert [int(line.split("\t")[1], 16) for line in lines] == [int(h) for h in want]


def test_hash_command_refuses_bad_input(capsys):
    # user-input errors: one line on stderr naming the problem, exit status 2, no traceback
    assert main(["hash", "1", "x"]) == 2
    assert "token ids must be integers" in capsys.readouterr().err
    for bad in ("1_000", "\uff11", "-1", "+2", " 3"):  # int() would take the first two and the last two
        assert main(["hash", "1", bad]) == 2
        err = capsys.readouterr().err
        assert "token 1 is" in err and err.count("\n") == 1, (bad, err)
    assert main(["hash", "--block-size", "0", "1", "2"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_info_runs_as_module():
    out = subprocess.run([sys.executable, "-m", "quillcache", "info"], capture_output=True, text=True)
    assert "quillcache" in out.stdout
    assert out.returncode == 0, out.stdout + out.stderr


def test_hash_of_fewer_tokens_than_a_block_says_so(capsys):
    assert main(["hash", "1", "2", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3 token(s) make no full block of 16 tokens" in err


def test_gen_trace_refuses_more_tenants_than_requests(tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    assert main(["gen-trace", "collision", "--tenants", "100000", "--requests", "10", "--out", str(out)]) == 2
    assert "--tenants 100000 is more than --requests 10" in capsys.readouterr().err and not out.exists()
    assert main(["gen-trace", "sessions", "--sessions", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--sessions" in err and "SessionsConfig" not in err and "num_sessions" not in err


def test_info_and_other_commands_survive_a_compiled_core_that_does_not_load():
    code = ("import sys; sys.modules['quillcache.sketch._sketch'] = None\n"
            "from quillcache.cli import main\n"
            "print('info', main(['info'])); print('replay', main(['replay', 'x.jsonl']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "Traceback" not in res.stderr, res.stderr
    assert "quillcache.sketch._sketch: NOT AVAILABLE" in res.stdout and "quillcache.alloc._alloc: ok" in res.stdout
    assert "info 1" in res.stdout and "replay 1" in res.stdout
    assert "quillcache replay: unavailable (" in res.stderr


@pytest.mark.parametrize("core", ["quillcache.master._kernels", "quillcache.master._residency",
                                  "quillcache.transfer.backends._fastio"])
def test_info_checks_every_compiled_core(core):
    code = (f"import sys; sys.modules[{core!r}] = None\n"
            "from quillcache.cli import main\n"
            "sys.exit(main(['info']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 1 and f"{core}: NOT AVAILABLE" in res.stdout, res.stdout + res.stderr


def test_info_says_a_core_was_never_built_rather_than_a_misleading_import_error(tmp_path):
    # A copy of the package without its compiled files, as after `make clean`: the ART core's import
    # error reads "partially initialized module (circular import)"; info must say it is not built.
    import shutil

    import quillcache

    pkg = tmp_path / "quillcache"
    shutil.copytree(Path(quillcache.__file__).parent, pkg,
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    code = "import sys; from quillcache.cli import main; sys.exit(main(['info']))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    for core in ("alloc._alloc", "sketch._sketch", "art._art", "master._kernels", "master._residency",
                 "transfer.backends._fastio"):  # every _*.pyx setup.py builds
        assert f"quillcache.{core}: NOT AVAILABLE (not built: no compiled _" in res.stdout, res.stdout
    assert "circular import" not in res.stdout
    assert "quillcache.hashing._xxh3: ok" in res.stdout


def test_gen_trace_default_tenants_fit_a_small_trace_but_typed_ones_are_checked(tmp_path, capsys):
    # two sessions with the default 8 tenants is fine (the default is not a request for 8 tenants)
    assert main(["gen-trace", "sessions", "--sessions", "2", "--out", str(tmp_path / "s.jsonl")]) == 0
    assert main(["gen-trace", "sessions", "--sessions", "2", "--tenants", "8", "--out", str(tmp_path / "t.jsonl")]) == 2
    assert "--tenants 8 is more than --sessions 2" in capsys.readouterr().err
