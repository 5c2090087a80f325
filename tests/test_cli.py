import subprocess
import sys

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
    assert main(["hash", "--block-size", "0", "1", "2"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_info_runs_as_module():
    out = subprocess.run([sys.executable, "-m", "quillcache", "info"], capture_output=True, text=True)
    assert "quillcache" in out.stdout
    assert out.returncode == 0, out.stdout + out.stderr
