"""Cluster membership and leadership: the node registry and the master's leader election.

- ``descriptors``: what is published (``SegmentDescriptor``, ``RegionInfo``, ``LeaderInfo``, ``MembershipEvent``)
  and the key layout under one prefix.
- ``registry``: ``NodeRegistry`` with ``InMemoryRegistry`` ("memory", the embedded default) and
  ``EtcdRegistry`` ("etcd"), by name in ``NODE_REGISTRIES``.
- ``election``: ``LeaderElection`` (one leased key created under a ``create_revision == 0`` txn; epoch =
  its create revision; a warm-up of one TTL) and ``EpochFence``.
- ``client`` / ``lease`` / ``watch``: the etcd calls (over etcd's HTTP gateway with ``etcd3gw``), a
  kept-alive lease, a reconnecting watch. ``etcd``: ``EtcdProcess``, a real etcd for tests.
- ``tempdirs``: temporary directories that name the processes working in them, and the sweep of those
  they all left without removing (a SIGKILL runs no cleanup); ``EtcdProcess`` and
  ``quillcache.pool.cluster.LocalCluster`` use it.

Nothing here is imported by ``import quillcache.cluster``; import the submodule you need.
"""
