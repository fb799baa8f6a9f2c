"""Which replica answers a request, as plain data (router.py applies it inside Ray Serve's request router).

A request's blocks are named by their route ids (engine/blocks/encode.py `route_id`: namespace and tokens). A replica
holds what it last reported (its memory tier, polled by Ray Serve) plus what this router sent it since (reports lag
by a poll period). The replica holding most of the request's blocks answers, unless it is busier than the least
loaded one by more than `slack` requests; without a holder, the least loaded answers. Blocks in any order count
the same: unlike a prefix cache's, a replica's blocks serve any request that names them."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Hashable, Iterable

# `ragkv serve --router`: rank_replicas, rank_by_home, rank_by_balance, each in turn
ROUTERS = ("affinity", "home", "balance", "round-robin")
BALANCE_WEIGHT = 0.5  # `balance`: blocks a replica would have to add count 1 each, its excess working set this much
BALANCE_WINDOW = 32   # `balance`: a replica's working set is the blocks of the last this many requests it was sent


def rank_replicas(blocks: Iterable[str], holdings: dict[Hashable, set[str]], loads: dict[Hashable, int],
                  slack: int) -> list[list[Hashable]]:
    """Replicas in ranks, most preferred first: [the best holders among the replicas within `slack` requests of
    the least loaded one; while one is idle, among the idle ones only: an idle replica never waits while another
    queues], then the rest from least to most loaded (Ray tries the next rank when a rank's replicas are full)."""
    replicas = sorted(loads, key=lambda r: (loads[r], str(r)))
    if not replicas:
        return []
    wanted = set(blocks)
    least = loads[replicas[0]]
    room = slack if least > 0 else 0
    score = {r: len(wanted & holdings.get(r, set())) for r in replicas if loads[r] <= least + room}
    best = max(score.values(), default=0)
    if best == 0:  # nobody holds any: the least loaded, one of them chosen by the blocks themselves
        first = [r for r in replicas if loads[r] == least]
        if wanted:  # (rendezvous hashing) a new passage set goes where its next request will look for it
            first = [max(first, key=lambda r: _weight(min(wanted), r))]
    else:
        first = [r for r in replicas if score.get(r) == best]
    return [first, [r for r in replicas if r not in first]] if len(first) < len(replicas) else [first]


def rank_by_home(blocks: Iterable[str], loads: dict[Hashable, int], slack: int) -> list[list[Hashable]]:
    """The `home` policy: replicas in ranks, most preferred first. Each block has a home replica (rendezvous
    hashing: the highest hash of block and replica), a request the home of most of its blocks (ties: its first
    block's hash order), so the blocks are partitioned: each replica's memory holds its share of the working set,
    not copies of the hot sets (with `affinity`'s idle-first rule both replicas came to hold the hot sets and the hit
    rate fell to 0.76 of one server's where a replica's memory held half the working set). A home busier than the
    least loaded replica by more than `slack` requests (bounded load) passes the request to the next replica in the
    request's own hash order: a set spills to the same second replica each time, never to all."""
    replicas = sorted(loads, key=lambda r: (loads[r], str(r)))
    if not replicas:
        return []
    wanted = sorted(set(blocks))
    least = loads[replicas[0]]
    if not wanted:  # nothing to be near: any least loaded replica
        first = [r for r in replicas if loads[r] == least]
        return [first, [r for r in replicas if r not in first]] if len(first) < len(replicas) else [first]
    votes: dict[Hashable, int] = {}
    for b in wanted:
        home = max(replicas, key=lambda r: _weight(b, r))
        votes[home] = votes.get(home, 0) + 1
    order = sorted(replicas, key=lambda r: (-votes.get(r, 0), -_weight(wanted[0], r)))
    first = next(r for r in order if loads[r] <= least + slack)  # the least loaded one always qualifies
    return [[first], [r for r in replicas if r != first]] if len(replicas) > 1 else [[first]]


def rank_by_balance(blocks: Iterable[str], holdings: dict[Hashable, set[str]], working: dict[Hashable, int],
                    loads: dict[Hashable, int], slack: int, weight: float = BALANCE_WEIGHT) -> list[list[Hashable]]:
    """The `balance` policy: replicas in ranks, most preferred first. Among the replicas within `slack` requests of
    the least loaded one, the request goes to the one with the lowest cost: the request's blocks it does not hold
    (each would be computed and stored there) plus `weight` x how far its working set (distinct blocks of its recent
    requests) exceeds the replicas' mean; ties by the blocks' hash order. Where each replica's memory holds only a
    share of the working set, what matters is that the shares stay equal and copies few: `home`'s hashing put the
    Zipf law's hot sets on one replica by chance (71 / 9 requests, 0.87 of one server's hit rate), `affinity` copies
    the hot sets to every idle replica; in a simulation of the bench's workload (docs/results/replicas) this cost
    kept 0.92-0.97 of the single server's hit rate over three seeds where `home` kept 0.87-0.94."""
    replicas = sorted(loads, key=lambda r: (loads[r], str(r)))
    if not replicas:
        return []
    wanted = sorted(set(blocks))
    least = loads[replicas[0]]
    within = [r for r in replicas if loads[r] <= least + slack]
    mean = sum(working.get(r, 0) for r in replicas) / len(replicas)

    def cost(r):
        missing = len([b for b in wanted if b not in holdings.get(r, ())])
        return (missing + weight * max(0.0, working.get(r, 0) - mean), -_weight(wanted[0], r) if wanted else 0)
    first = min(within, key=cost)
    return [[first], [r for r in replicas if r != first]] if len(replicas) > 1 else [[first]]


class WorkingSets:
    """The blocks of the last `window` requests sent to each replica: its working set's size, and blocks it holds
    before its next report says so."""

    def __init__(self, window: int = BALANCE_WINDOW):
        self.window = window
        self._recent: dict[Hashable, deque[frozenset[str]]] = {}

    def add(self, replica: Hashable, blocks: Iterable[str]) -> None:
        self._recent.setdefault(replica, deque(maxlen=self.window)).append(frozenset(blocks))

    def of(self, replica: Hashable) -> set[str]:
        return set().union(*self._recent.get(replica, ()))

    def size(self, replica: Hashable) -> int:
        return len(self.of(replica))

    def forget(self, replica: Hashable) -> None:
        self._recent.pop(replica, None)


def _weight(block: str, replica: Hashable) -> int:
    return int.from_bytes(hashlib.blake2b(f"{block}|{replica}".encode(), digest_size=8).digest(), "big")


class SentBlocks:
    """The blocks this router sent each replica lately (bounded, oldest forgotten first): what it holds before its
    next report says so."""

    def __init__(self, per_replica: int = 8192):
        self.per_replica = per_replica
        self._sent: dict[Hashable, OrderedDict[str, None]] = {}

    def add(self, replica: Hashable, blocks: Iterable[str]) -> None:
        sent = self._sent.setdefault(replica, OrderedDict())
        for b in blocks:
            sent[b] = None
            sent.move_to_end(b)
        while len(sent) > self.per_replica:
            sent.popitem(last=False)

    def of(self, replica: Hashable) -> set[str]:
        return set(self._sent.get(replica, ()))

    def forget(self, replica: Hashable) -> None:
        """A replica died: a restarted one holds nothing."""
        self._sent.pop(replica, None)


class InFlight:
    """Requests sent to each replica and not yet finished, by request id. Ray Serve may report a request finished
    before it reports it routed (its done-callback is registered before the replica accepts the request): a count
    that ignored the order would leak one busy request per such race and push all traffic off that replica."""

    def __init__(self, remember: int = 4096):
        self.remember = remember
        self._open: dict[Hashable, set[str]] = {}
        self._finished_first: OrderedDict[str, None] = OrderedDict()  # finished, not (yet) routed: never counted

    def routed(self, replica: Hashable, request: str) -> None:
        if request in self._finished_first:
            del self._finished_first[request]
            return
        self._open.setdefault(replica, set()).add(request)

    def finished(self, replica: Hashable, request: str) -> None:
        open_ = self._open.get(replica, set())
        if request in open_:
            open_.discard(request)
            return
        self._finished_first[request] = None  # (or rejected by the replica: then routed never comes; bounded)
        while len(self._finished_first) > self.remember:
            self._finished_first.popitem(last=False)

    def load(self, replica: Hashable) -> int:
        return len(self._open.get(replica, ()))

    def forget(self, replica: Hashable) -> None:
        self._open.pop(replica, None)
