"""Write a collision trace (Mooncake-format JSONL with identity fields; schema in traces/README.md).

    python traces/generate_collision.py --mix realistic|adversarial --requests N --out FILE [--seed S]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from quillcache.traces.collision import MIXES, CollisionConfig, generate, write_jsonl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", required=True, choices=MIXES)
    ap.add_argument("--requests", required=True, type=int, help="number of requests (>= 1)")
    ap.add_argument("--out", required=True, help="output .jsonl path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    args = ap.parse_args(argv)
    try:
        cfg = CollisionConfig(mix=args.mix, num_requests=args.requests, seed=args.seed,
                              block_size_tokens=args.block_tokens)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    n = write_jsonl(generate(cfg), args.out)
    print(f"wrote {n} {args.mix} requests to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
