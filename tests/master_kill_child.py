"""Child process of the SIGKILL test: a put/get workload on a MasterService with a data dir.

Usage: ``python master_kill_child.py DATA_DIR SEED START``. Prints (flushed) ``READY`` once
recovered, ``ACK <key> <seg:off,...>`` after every acknowledged put_end, ``INFLIGHT <key>`` for a
put it will never end, and ``REMOVING <key>`` before every remove. It runs until killed; the small
snapshot interval makes kills land in snapshots, log rotations and log appends alike."""

import random
import sys

from quillcache.master import MasterConfig, MasterService, PutRequest, ReplicaConfig, SegmentDescriptor, SegmentExistsError


def main() -> None:
    data_dir, seed, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    cfg = MasterConfig(alignment_bytes=4096, snapshot_every_records=50, snapshot_growth=0.0,
                       restart_budget_s=0.0)  # 1 unit per object
    svc = MasterService(cfg, data_dir=data_dir)
    for seg, node in enumerate("abc"):
        try:
            svc.mount_segment(SegmentDescriptor(node_id=node, segment_id=seg, capacity_bytes=1 << 30))  # never full: no eviction
        except SegmentExistsError:
            pass
    print("READY", flush=True)
    i = start
    while True:
        keys = [f"obj-{i + j}" for j in range(rng.randint(1, 8))]
        i += len(keys)
        res = svc.batch_put_start([PutRequest(key=k, size_bytes=rng.randint(1, 4096),
                                              config=ReplicaConfig(replica_num=rng.randint(1, 3))) for k in keys])
        ok = [(k, r) for k, r in zip(keys, res) if not isinstance(r, Exception)]
        if rng.random() < 0.2 and ok:  # leave one put in flight: it must never become readable
            print(f"INFLIGHT {ok[-1][0]}", flush=True)
            ok = ok[:-1]
        ends = svc.batch_put_end([k for k, _ in ok])
        for (k, r), e in zip(ok, ends):
            if e is None:
                reps = ",".join(f"{d.segment_id}:{d.offset_bytes}" for d in r.replicas)
                print(f"ACK {k} {reps}", flush=True)
        svc.get_replicas([k for k, _ in ok])
        if rng.random() < 0.1 and ok:
            k = ok[0][0]
            print(f"REMOVING {k}", flush=True)  # from here on the object may be gone
            svc.batch_remove([k], force=True)


if __name__ == "__main__":
    main()
