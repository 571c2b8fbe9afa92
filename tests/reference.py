"""The NumPy reference model of the stateful tests.

The model of the ring buffers and the queue is public API, `equibuffer.testing` (`History`,
`UniformRule`, `EpisodeRule`, the views, `n_step`, `Priorities`, `BufferReference`,
`QueueReference`, `flat_index`, `window_of`): re-exported here. What only these tests need
stays here: `tags` (values unique per row and step) and `ClusteredReference`.
"""

import collections

import numpy as np

from equibuffer.testing import (
    BufferReference as BufferReference,
    EpisodeRule as EpisodeRule,
    flat_index as flat_index,
    History as History,
    ItemView as ItemView,
    n_step as n_step,
    NStepView as NStepView,
    PairView as PairView,
    Priorities as Priorities,
    QueueReference as QueueReference,
    UniformRule as UniformRule,
    window_of as window_of,
    WindowView as WindowView,
)


Window = tuple[int, int]  # (row, absolute start step)

ROW_TAG = 100_000


def tags(rows: int, start: int, n: int) -> np.ndarray:
    """`(rows, n)` int32 values unique per (row, absolute step): `row * 100_000 + step`."""
    steps = np.arange(start, start + n)
    return (np.arange(rows)[:, None] * ROW_TAG + steps[None, :]).astype(np.int32)


class ClusteredReference:
    """The items of a clustered buffer: every item ever routed to a cluster, in the order
    `add` takes them (time-major, rows in order within a step); each cluster holds its newest
    `capacity`. With `alpha` (a `PrioritisedClusteredBuffer`), `priorities` holds the priority
    of every item held (a `Priorities` keyed by item id), and `probability` is the documented
    law: a cluster by weight among those holding an item of positive priority, then an item
    in proportion to `p**alpha` inside it."""

    def __init__(
        self,
        num_clusters: int,
        capacity: int,
        weights: tuple[float, ...] | None,
        alpha: float | None = None,
    ):
        self.capacity = capacity
        self.weights = weights or (1.0,) * num_clusters
        self.routed: list[collections.deque] = [
            collections.deque(maxlen=capacity) for _ in range(num_clusters)
        ]
        self.arrived = [0] * num_clusters  # items ever routed to each cluster
        self.number: dict[int, int] = {}  # item id -> its place in its cluster's arrivals
        self.cluster_of: dict[int, int] = {}
        self.any_added = False
        self.priorities = None if alpha is None else Priorities(alpha)

    def add(self, items: list[tuple[int, int]]) -> None:
        """`items`: `(cluster, id)` in the order `add` takes them."""
        for cluster, item in items:
            self.routed[cluster].append(item)
            self.number[item] = self.arrived[cluster]
            self.cluster_of[item] = cluster
            self.arrived[cluster] += 1
        self.any_added = True
        if self.priorities is not None:
            held = {item for d in self.routed for item in d}
            self.priorities.refresh(held)  # item ids, not windows

    def sizes(self) -> list[int]:
        return [len(d) for d in self.routed]

    def drawable(self) -> list[int]:
        """The clusters a sample may draw from: holding items, of positive weight (and, with
        priorities, holding an item of positive priority)."""
        held = [c for c, d in enumerate(self.routed) if d and self.weights[c] > 0]
        if self.priorities is None:
            return held
        return [c for c in held if self.cluster_total(c) > 0]

    def cluster_total(self, cluster: int) -> float:
        assert self.priorities is not None
        return sum(self.priorities.leaf(item) for item in self.routed[cluster])  # type: ignore[arg-type]

    def refusal(self) -> str | None:
        """Why `sample` must raise now, or None: "nothing held" (no cluster of positive weight
        holds an item), "all zero" (every item they hold has priority 0)."""
        if not any(d and self.weights[c] > 0 for c, d in enumerate(self.routed)):
            return "nothing held"
        if not self.drawable():
            return "all zero"
        return None

    def within(self, item: int) -> float:
        """`P(i | c)`: the item's share of its cluster's `p**alpha`."""
        assert self.priorities is not None
        leaf = self.priorities.leaf(item)  # type: ignore[arg-type]
        return leaf / self.cluster_total(self.cluster_of[item])

    def probability(self, item: int) -> float:
        """`P(i)`: its cluster's share among the drawable clusters, times `within(item)`."""
        drawable = self.drawable()
        cluster = self.cluster_of[item]
        share = self.weights[cluster] / sum(self.weights[c] for c in drawable)
        return share * self.within(item) if cluster in drawable else 0.0
