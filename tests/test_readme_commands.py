"""Every ``quillcache`` command line in README.md's shell blocks parses as written, and the environment it sets
is accepted: a renamed flag, a choice the CLI no longer has, or a demo API key the gateway refuses (the README's
``sk-demo`` was shorter than the gateway's minimum) fails here instead of in a user's first minute.

Placeholders (``TRACE``, ``HOST``, ``PORT``, ``...``) are replaced by values of the right shape; shell
substitutions ``$(seq A B)`` are expanded. Commands are parsed, not run: running them is the CLI tests' job.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from quillcache.cli import COMMANDS, OneLineParser

README = Path(__file__).resolve().parents[1] / "README.md"
_PLACEHOLDERS = {"TRACE": "trace.jsonl", "tcp://127.0.0.1:PORT": "tcp://127.0.0.1:7100", "tcp://HOST:7100": "tcp://127.0.0.1:7100"}


def _shell_lines() -> list[tuple[int, str]]:
    lines, inside = [], False
    for no, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside and "quillcache " in line and not line.lstrip().startswith("make "):
            lines.append((no, line))
    return lines


def _words(line: str) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv after the ``quillcache`` program) of one README shell line."""
    line = re.sub(r"\$\(seq (\d+) (\d+)\)", lambda m: " ".join(map(str, range(int(m[1]), int(m[2]) + 1))), line)
    words = shlex.split(line, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words and words[0].endswith("quillcache"), f"not a quillcache command: {line!r}"
    return env, [_PLACEHOLDERS.get(w, w) for w in words[1:]]


def _parse(argv: list[str]) -> argparse.Namespace:
    """The CLI's own parser (``quillcache.cli.main``'s construction) for the command named in ``argv``."""
    ap = OneLineParser(prog="quillcache")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, command in COMMANDS.items():
        parser = sub.add_parser(name)
        if name == argv[0]:
            command.load().configure(parser)
    return ap.parse_args(argv)


LINES = _shell_lines()


def test_the_readme_has_the_command_lines_this_test_checks():
    commands = {_words(line)[1][0] for _, line in LINES}
    assert {"replay", "hitrate", "gen-trace", "cluster", "engine-sim", "gateway", "info", "hash", "master",
            "node"} <= commands


@pytest.mark.parametrize("no,line", LINES, ids=[f"README:{no}" for no, _ in LINES])
def test_a_readme_command_line_parses_as_written(no, line, capsys):
    env, argv = _words(line)
    try:
        args = _parse(argv)
    except SystemExit as exc:
        pytest.fail(f"README.md:{no}: {line.strip()!r} does not parse (exit {exc.code}): {capsys.readouterr().err}")
    assert args.command == argv[0]
    if "QUILLCACHE_GATEWAY_KEYS" in env:
        from quillcache.gateway.tenants import TenantTable

        table = TenantTable.from_env(env)  # raises ConfigError naming the entry when the gateway would refuse it
        assert len(table) >= 1


def test_gateway_help_states_what_a_key_must_be():
    from quillcache.gateway.tenants import MIN_KEY_CHARS

    parser = argparse.ArgumentParser()
    COMMANDS["gateway"].load().configure(parser)
    text = " ".join(parser.format_help().split())
    assert f"at least {MIN_KEY_CHARS} characters" in text and "QUILLCACHE_GATEWAY_KEYS=key=tenant" in text


DOCS = [README, README.parent / "traces" / "README.md", *sorted((README.parent / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(README.parent)))
def test_every_repository_path_a_doc_names_exists(doc):
    """A `quillcache/...`, `experiments/...`, `tests/...` or `traces/...` path written in backquotes exists
    (traces/README.md named two modules that had moved)."""
    root = README.parent
    named = set(re.findall(r"`((?:quillcache|experiments|tests|traces|notebooks|paper)/[\w./-]+\.(?:py|pyx|md|j2|ipynb))`",
                           doc.read_text()))
    assert named, f"{doc} names no repository path: the pattern above no longer matches how it writes them"
    missing = sorted(p for p in named if not (root / p).exists())
    assert not missing, f"{doc.relative_to(root)} names files that do not exist: {missing}"
