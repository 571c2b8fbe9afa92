"""A NumPy reference model of the buffers, for the stateful tests.

Written from the documented behaviour, never from the implementation, in pieces that combine
the way a buffer does (storage + a sampling rule + a view of what a sample returns):

- `History`: every step ever added to a ring of `rows` rows that holds the newest `length`
    steps of each row, leaf by leaf, by absolute step.
- Rules, which say which windows `(row, absolute start)` may be sampled now:
    `UniformRule` (held, complete, starting at a multiple of `period`) and `EpisodeRule`
    (`never_cross` / `pad`, with the pad mask).
- Views: `History.window` (a window's data, zero past what was added), `n_step` (an n-step
    transition's reward, bootstrap discount and number of steps).
- `Priorities`: the priority of each valid window under the prioritised buffers' documented
    rules (enter at the largest priority set so far, keep it while valid, updates of windows
    that are not valid now dropped).
- `ClusteredReference`: the items each cluster of a clustered buffer holds and, prioritised,
    their priorities (a `Priorities` keyed by item) and the documented sampling law.

A new combination (prioritised n-step transitions, episode-aware items) is a new pairing of
these: e.g. `Priorities` refreshed from an `EpisodeRule` of `sequence_length=1`.

`flat_index` / `window_of` are the one place that knows how `Sample.indices` and
`Sample.steps` name a window.
"""

import collections
import dataclasses
from collections.abc import Callable, Mapping

import numpy as np


Window = tuple[int, int]  # (row, absolute start step)

ROW_TAG = 100_000


def tags(rows: int, start: int, n: int) -> np.ndarray:
    """`(rows, n)` int32 values unique per (row, absolute step): `row * 100_000 + step`."""
    steps = np.arange(start, start + n)
    return (np.arange(rows)[:, None] * ROW_TAG + steps[None, :]).astype(np.int32)


def flat_index(window: Window, length: int) -> int:
    """`Sample.indices` of a window: `row * max_length + slot`, the slot of its start."""
    row, start = window
    return row * length + start % length


def window_of(index: int, step: int, length: int) -> Window:
    """The window a sample names by `indices[i]` and `steps[i]`; asserts the two agree."""
    row, slot = divmod(int(index), length)
    start = int(step)
    assert slot == start % length, f"index {index} (slot {slot}) does not hold step {start}"
    return row, start


class History:
    """Every step ever added, per row, by absolute step: `leaves[name]` is
    `(rows, total, *leaf)`. The ring holds the newest `length` steps of each row."""

    def __init__(self, rows: int, length: int):
        self.rows, self.length = rows, length
        self.leaves: dict[str, np.ndarray] = {}
        self.total = 0

    @property
    def fill(self) -> int:
        """Steps held per row."""
        return min(self.total, self.length)

    @property
    def oldest(self) -> int:
        """The absolute step of the oldest step held."""
        return self.total - self.fill

    def add(self, steps: Mapping[str, np.ndarray]) -> None:
        """Append `T` steps to every row: each leaf `(rows, T, *leaf)`."""
        sizes = {np.shape(v)[1] for v in steps.values()}
        assert len(sizes) == 1
        for name, value in steps.items():
            value = np.asarray(value)
            old = self.leaves.get(name, value[:, :0])
            self.leaves[name] = np.concatenate([old, value], axis=1)
        self.total += sizes.pop()

    def window(self, name: str, row: int, start: int, n: int) -> np.ndarray:
        """Leaf `name` at steps `start .. start + n - 1` of `row`, zero past the last step
        added."""
        values = self.leaves[name][row, start : start + n]
        pad = [(0, n - values.shape[0])] + [(0, 0)] * (values.ndim - 1)
        return np.pad(values, pad)

    def at(self, name: str, row: int, step: int) -> np.ndarray:
        return self.leaves[name][row, step]


def aligned_starts(history: History, sequence_length: int, period: int) -> list[int]:
    """Starts of the windows the counters allow, the same in every row: held, complete, at a
    multiple of `period`."""
    last = history.total - sequence_length
    return [t for t in range(history.oldest, last + 1) if t % period == 0]


def can_sample(history: History, sequence_length: int, period: int, min_length: int) -> bool:
    """`can_sample()` of every ring buffer: a function of the counters only."""
    return history.fill >= min_length and bool(aligned_starts(history, sequence_length, period))


@dataclasses.dataclass(frozen=True)
class UniformRule:
    """The windows of the uniform and prioritised buffers: every aligned held window."""

    sequence_length: int
    period: int = 1

    def valid(self, history: History) -> set[Window]:
        starts = aligned_starts(history, self.sequence_length, self.period)
        return {(r, t) for r in range(history.rows) for t in starts}

    def mask(self, history: History, window: Window) -> np.ndarray:
        return np.ones(self.sequence_length, bool)


@dataclasses.dataclass(frozen=True)
class EpisodeRule:
    """The windows of the episode-aware buffers. `ends(history)` is the `(rows, total)`
    episode-end flag of every step added.

    - `never_cross`: aligned, held, complete, and no episode end before its last step.
    - `pad`: aligned, held, and complete or cut by an episode end among its steps added
        (before its last step); the mask is true up to and including that end.
    """

    sequence_length: int
    period: int
    mode: str
    ends: Callable[[History], np.ndarray]

    def valid(self, history: History) -> set[Window]:
        if history.total == 0:
            return set()
        ends, s, total = self.ends(history), self.sequence_length, history.total
        out = set()
        for r in range(history.rows):
            for t in range(history.oldest, total):
                if t % self.period:
                    continue
                complete = t + s <= total
                cut = bool(ends[r, t : min(t + s - 1, total)].any())
                ok = (complete and not cut) if self.mode == "never_cross" else (complete or cut)
                if ok:
                    out.add((r, t))
        return out

    def mask(self, history: History, window: Window) -> np.ndarray:
        if self.mode == "never_cross":
            return np.ones(self.sequence_length, bool)
        row, start = window
        flags = self.ends(history)[row, start : start + self.sequence_length]
        flags = np.pad(flags, (0, self.sequence_length - flags.shape[0])).astype(int)
        return np.cumsum(flags) - flags == 0


def n_step(
    history: History,
    window: Window,
    n: int,
    discount: float,
    reward: str = "reward",
    terminated: str = "terminated",
    truncated: str | None = "truncated",
) -> tuple[int, float, float]:
    """`(steps, reward, bootstrap discount)` of the n-step transition from `window`'s start:
    rewards summed, discounted, up to and including the first step that ends an episode; the
    bootstrap is 0 after a termination, else `discount ** steps`."""
    row, start = window
    total, taken, bootstrap = 0.0, 0, None
    for k in range(n):
        total += discount**k * float(history.at(reward, row, start + k))
        taken += 1
        if history.at(terminated, row, start + k):
            bootstrap = 0.0
            break
        if truncated is not None and history.at(truncated, row, start + k):
            break
    return taken, total, discount**taken if bootstrap is None else bootstrap


class Priorities:
    """The priority of every valid window of a prioritised buffer.

    - `refresh(valid)` after every change of the valid set (an `add`): a window that became
        valid enters at the largest priority set so far (1 at first); a window that stays
        valid keeps its priority; a window that is no longer valid is forgotten.
    - `set(windows, priorities)`: applied to the windows valid now, dropped for the others;
        the largest applied priority raises the entry priority.
    - A window is drawn with probability `leaf / sum of leaves`, `leaf = p**alpha` (0 for
        `p = 0` at any alpha), in float32 as the buffer computes it.
    """

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.max_priority = np.float32(1.0)
        self.priority: dict[Window, np.float32] = {}

    def refresh(self, valid: set[Window]) -> None:
        self.priority = {w: self.priority.get(w, self.max_priority) for w in valid}

    def set(self, windows: list[Window], priorities: np.ndarray) -> None:
        for window, p in zip(windows, priorities, strict=True):
            if window in self.priority:
                self.priority[window] = np.float32(p)
                self.max_priority = max(self.max_priority, np.float32(p))

    def leaf(self, window: Window) -> float:
        p = self.priority.get(window, np.float32(0))
        return float(p ** np.float32(self.alpha)) if p > 0 else 0.0

    def total(self) -> float:
        return sum(self.leaf(w) for w in self.priority)

    def probability(self, window: Window) -> float:
        return self.leaf(window) / self.total()


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
            self.priorities.refresh(held)  # type: ignore[arg-type]  (ids, not windows)

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


class BufferReference:
    """A ring buffer as its pieces: a `History`, a window rule (`UniformRule` or
    `EpisodeRule`), `min_length_time_axis`, and `Priorities` when `alpha` is given (prioritised)."""

    def __init__(
        self,
        rows: int,
        length: int,
        rule: UniformRule | EpisodeRule,
        min_length: int | None = None,
        alpha: float | None = None,
    ):
        self.history = History(rows, length)
        self.rule = rule
        self.min_length_time_axis = rule.sequence_length if min_length is None else min_length
        self.priorities = None if alpha is None else Priorities(alpha)

    def add(self, steps: Mapping[str, np.ndarray]) -> None:
        self.history.add(steps)
        if self.priorities is not None:
            self.priorities.refresh(self.valid())

    def valid(self) -> set[Window]:
        return self.rule.valid(self.history)

    def ready(self) -> bool:
        """`can_sample()`: the counters only."""
        rule = self.rule
        return can_sample(
            self.history, rule.sequence_length, rule.period, self.min_length_time_axis
        )

    def refusal(self) -> str | None:
        """Why `sample` must raise now, or None: "too early" (`can_sample()` is false), "no
        window" (ready counters, but no window valid by an episode rule), "all zero" (every
        valid window has priority 0)."""
        if not self.ready():
            return "too early"
        if not self.valid():
            return "no window"
        if self.priorities is not None and self.priorities.total() == 0:
            return "all zero"
        return None
