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
    """The items of a `ClusteredBuffer`: every item ever routed to a cluster, in the order
    `add` takes them (time-major, rows in order within a step); each cluster holds its newest
    `capacity`."""

    def __init__(self, num_clusters: int, capacity: int, weights: tuple[float, ...] | None):
        self.capacity = capacity
        self.weights = weights or (1.0,) * num_clusters
        self.routed: list[collections.deque] = [
            collections.deque(maxlen=capacity) for _ in range(num_clusters)
        ]
        self.any_added = False

    def add(self, items: list[tuple[int, int]]) -> None:
        """`items`: `(cluster, id)` in the order `add` takes them."""
        for cluster, item in items:
            self.routed[cluster].append(item)
        self.any_added = True

    def sizes(self) -> list[int]:
        return [len(d) for d in self.routed]

    def drawable(self) -> list[int]:
        """The clusters a sample may draw from: holding items, of positive weight."""
        return [c for c, d in enumerate(self.routed) if d and self.weights[c] > 0]
