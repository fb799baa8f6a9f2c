"""The cache-aware request router, on Ray Serve's request-router API (`ray.serve.request_router.RequestRouter`):
each request goes to the replica holding most of its blocks (policy.py), read from the replicas' routing stats
(`EngineReplica.record_routing_stats`) and from what this router sent them since; or, `home`, to the home replica
of most of its blocks (rendezvous hashing with bounded load: the working set partitioned over the replicas); or,
`balance`, to the replica that would add fewest blocks while keeping the replicas' working sets even.
`round-robin` is the baseline the benchmark compares them with."""

from __future__ import annotations

import itertools
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ragkv.serve.replicas.policy import (InFlight, SentBlocks, WorkingSets, rank_by_balance, rank_by_home,
                                         rank_replicas)

ROUTE_KWARG = "route_ids"  # the keyword argument the ingress passes the request's blocks in


class BlockAffinityRouter(RequestRouter):
    """Not FIFOMixin: a replica chosen for a request's blocks must answer that request, not the oldest waiting."""

    def initialize_state(self, policy: str = "affinity", slack: int = 4, remember: int = 8192, **kwargs):
        self._policy, self._slack = policy, slack
        self._sent = SentBlocks(remember)
        self._working = WorkingSets()  # `balance`: the blocks of each replica's recent requests
        self._ongoing = InFlight()  # requests this router sent each replica and not yet completed
        self._turn = itertools.count()

    def _load(self, replica: RunningReplica) -> int:
        # this router's own count by request id, not Ray's queue-length cache, whose probes and decrements can
        # arrive out of order with the requests they count: one stale "busy" keeps a replica out of the idle rank
        return self._ongoing.load(replica.replica_id)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        if self._policy == "round-robin":
            order = sorted(by_id, key=lambda i: i.unique_id)
            first = order[next(self._turn) % len(order)]
            return [[by_id[first]], [by_id[i] for i in order if i != first]]
        blocks = _blocks(pending_request)
        loads = {i: self._load(r) for i, r in by_id.items()}
        if self._policy == "home":
            return [[by_id[i] for i in rank] for rank in rank_by_home(blocks, loads, self._slack)]
        if self._policy == "balance":
            holdings = {i: set(r.routing_stats.get("blocks", ())) | self._working.of(i) for i, r in by_id.items()}
            working = {i: self._working.size(i) for i in by_id}
            ranks = rank_by_balance(blocks, holdings, working, loads, self._slack)
            return [[by_id[i] for i in rank] for rank in ranks]
        holdings = {i: set(r.routing_stats.get("blocks", ())) | self._sent.of(i) for i, r in by_id.items()}
        return [[by_id[i] for i in rank] for rank in rank_replicas(blocks, holdings, loads, self._slack)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._ongoing.routed(replica_id, pending_request.metadata.internal_request_id)
        self._sent.add(replica_id, _blocks(pending_request))
        self._working.add(replica_id, _blocks(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ongoing.finished(replica_id, internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.forget(replica_id)
        self._working.forget(replica_id)
        self._ongoing.forget(replica_id)


def _blocks(pending_request: Optional[PendingRequest]) -> list[str]:
    if pending_request is None:
        return []
    return list(pending_request.kwargs.get(ROUTE_KWARG) or ())
