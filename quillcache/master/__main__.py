"""``python -m quillcache.master``: the master server process (see :mod:`quillcache.cli.master`)."""

import sys

from quillcache.cli import OneLineParser
from quillcache.cli.master import configure, run


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m quillcache.master", description="serve the QuillCache master")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
