"""Crash-study child: writes blocks through a real SsdTier and an on-disk ART index until killed.

``python -m experiments.crash_child TIER_DIR INDEX_DIR LAYOUT SEED FIRST_KEY``

Protocol on stdout (one line each, flushed at once; the parent SIGKILLs this process at a random
moment and keeps every line that reached the pipe):

- ``R`` once the tier and index are open (the parent starts its kill timer then);
- ``A <block_hash> <size>`` after ``put``/``put_many`` returned: the block is acknowledged durable;
- ``D <block_hash>`` BEFORE a delete starts (index entry removed + flushed, then tier delete),
  so from then on the block may or may not exist — but if it does it must be bit-exact.

Block content is derived from the key alone (:func:`experiments.crash_workload.block_content`),
so anyone can check it.
Order of operations: bytes durable, then the index entry; on delete, index entry first.
"""

from __future__ import annotations

import random
import sys

from experiments.crash_workload import NODE, block_content, block_key
from quillcache.index import ResidencyEntry, open_index
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

CAPACITY_BYTES = 48 << 20
SLAB_BYTES = 8 << 20


def open_tier(tier_dir: str, layout: str | None = None) -> SsdTier:
    kw = {"layout": layout} if layout else {}
    return SsdTier(tier_dir, capacity_bytes=CAPACITY_BYTES, slab_bytes=SLAB_BYTES, log_rotate_bytes=256 << 10, **kw)


def main(argv: list[str]) -> None:
    tier_dir, index_dir, layout, seed, first = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    rng = random.Random(seed)
    tier = open_tier(tier_dir, layout)
    index = open_index("art", index_dir)
    out = sys.stdout
    out.write("R\n")
    out.flush()
    nxt = first
    live = list(tier.keys())
    while True:
        r = rng.random()
        if r < 0.2 and live or tier.used_bytes > 0.7 * tier.capacity_bytes:
            key = live.pop(rng.randrange(len(live)))
            out.write(f"D {key.block_hash}\n")
            out.flush()
            index.remove([ResidencyEntry(key.block_hash, NODE, CacheTier.SSD, key.identity, 0, 0, 0).key])
            index.flush()
            tier.delete(key)
            continue
        n = 1 if r < 0.75 else rng.randint(2, 6)
        batch = []
        for _ in range(n):
            key = block_key(nxt)
            nxt += 1
            batch.append((key, block_content(key, rng.choice((4096, rng.randint(1, 300_000))))))
        if n == 1:
            tier.put(*batch[0])
        else:
            tier.put_many(batch)
        out.write("".join(f"A {k.block_hash} {len(d)}\n" for k, d in batch))
        out.flush()
        entries = []
        for k, _ in batch:
            seg, off, size = tier.location_of(k)
            entries.append(ResidencyEntry(k.block_hash, NODE, CacheTier.SSD, k.identity, seg, off, size))
        index.put(entries)
        if rng.random() < 0.3:
            index.flush()
        live.extend(k for k, _ in batch)


if __name__ == "__main__":
    main(sys.argv[1:])
