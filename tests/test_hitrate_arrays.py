"""``quillcache.hitrate.arrays`` on hash ids across the trace schema's whole range ``[0, 2**64)``:
ids only name blocks, so relabelling them one-to-one must change nothing in the dense arrays or
in any replay, and an id outside the range is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from quillcache.hitrate import simulate
from quillcache.hitrate.arrays import arrays_from_lists, load_arrays

BIG = {0: 2**63, 1: 2**64 - 1, 2: 2**63 - 1, 3: 2**63 + 1, 4: 0, 5: 2**64 - 2}  # small id -> id near the top


def small_lists() -> list[list[int]]:
    return [[0, 1, 2], [0, 1, 3], [4], [0, 1, 2, 5], [], [3, 5, 4, 1]]


def big_lists() -> list[list[int]]:
    return [[BIG[x] for x in h] for h in small_lists()]


def same_arrays(a, b) -> None:
    assert a.num_unique == b.num_unique
    for f in ("req_offsets", "blocks", "next_use", "conv_ids", "timestamps_ms", "input_tokens", "output_tokens"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def test_ids_at_and_above_2_63_build_the_same_arrays_as_small_ids() -> None:
    big, small = arrays_from_lists(big_lists()), arrays_from_lists(small_lists())
    same_arrays(big, small)
    assert big.num_unique == 6 and big.blocks[:3].tolist() == [0, 1, 2]
    for policy in ("lru", "quillchain", "belady"):
        for cap in (1, 2, 4, None):
            assert np.array_equal(simulate(big, policy, cap).hits_per_request,
                                  simulate(small, policy, cap).hits_per_request), (policy, cap)
    sub = big.subset(np.array([3, 5]))  # re-densifying a sub-trace goes through the same path
    same_arrays(sub, small.subset(np.array([3, 5])))


def test_load_arrays_reads_ids_up_to_2_64_minus_1(tmp_path: Path) -> None:
    def write(name: str, lists: list[list[int]]) -> Path:
        p = tmp_path / name
        p.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 512 * len(h), "output_length": 5,
                                         "hash_ids": h}) + "\n" for i, h in enumerate(lists)), encoding="utf-8")
        return p

    same_arrays(load_arrays(write("big.jsonl", big_lists())), load_arrays(write("small.jsonl", small_lists())))


@pytest.mark.parametrize("lists, needle", [
    ([[0, 1], [2, -1]], "hash ids must be non-negative, got -1 (request 1, position 1)"),
    ([[2**64]], "hash ids must be below 2**64, got 18446744073709551616 (request 0, position 0)"),
    ([[5, 2**63], [2**70, 3]], "hash ids must be below 2**64, got 1180591620717411303424 (request 1, position 0)"),
])
def test_ids_outside_the_schema_range_are_refused_naming_the_id(lists: list[list[int]], needle: str) -> None:
    with pytest.raises(ValueError) as err:
        arrays_from_lists(lists)
    assert str(err.value) == needle
