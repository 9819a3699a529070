"""The router's picking policy (`pdserve/router/picker.py`) over open-leg counts, in O(1).

`LoadIndex` keeps nodes in buckets by their count of open legs (the router's `inflight`),
so "a least-loaded node, ties at random" is one random pick from the lowest bucket instead
of a scan of all nodes (a simulation of 500 nodes picks millions of times).
"""

from __future__ import annotations


class LoadIndex:
    __slots__ = ("load", "buckets", "pos", "low")

    def __init__(self, n: int) -> None:
        self.load = [0] * n
        self.buckets: list[list[int]] = [list(range(n))]
        self.pos = list(range(n))  # index of each node inside its bucket
        self.low = 0  # lowest non-empty bucket

    def _move(self, node: int, new: int) -> None:
        old = self.load[node]
        bucket = self.buckets[old]
        last = bucket[-1]  # swap-remove
        bucket[self.pos[node]] = last
        self.pos[last] = self.pos[node]
        bucket.pop()
        while len(self.buckets) <= new:
            self.buckets.append([])
        self.pos[node] = len(self.buckets[new])
        self.buckets[new].append(node)
        self.load[node] = new
        if new < self.low:
            self.low = new
        while not self.buckets[self.low]:
            self.low += 1

    def add(self, node: int, delta: int) -> None:
        self._move(node, self.load[node] + delta)

    def least(self, r: int) -> int:
        """A least-loaded node; `r` (a random int) picks among ties."""
        bucket = self.buckets[self.low]
        return bucket[r % len(bucket)]


def pick_prefill(idx: LoadIndex, r: int, abs_threshold: int, rel_threshold: float) -> int:
    """`order_prefill`'s first choice for a prompt whose prefix hash is `r`: the rendezvous
    winner (uniform over nodes for unique prompts), unless it is busier than the least-loaded
    node by more than both thresholds."""
    preferred = r % len(idx.load)
    least = idx.least(r >> 20)
    mine, low = idx.load[preferred], idx.load[least]
    if mine - low > abs_threshold and mine > low * rel_threshold:
        return least
    return preferred
