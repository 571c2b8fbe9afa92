"""Stateful test of `ClusteredBuffer` and `PrioritisedClusteredBuffer`: random adds (items
routed to random clusters, some to an id out of range, which must raise and change nothing),
samples and (prioritised) priority updates of recent samples, some of whose items have been
overwritten since, against the NumPy reference of `tests/reference.py`: which items each
cluster holds, its size, which clusters a sample may draw from, the items drawn and their
numbers (`steps`), and for the prioritised buffer each draw's probability under the
documented law, its importance weight, the largest priority, and the errors when nothing can
be drawn.

Only the public API is used, and every buffer is built by `_make`.
"""

import dataclasses
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, precondition, rule

import equibuffer as eb

from .helpers import CountedMachine, stateful_settings
from .reference import ClusteredReference


EXAMPLE = {"id": jnp.int32(0), "cluster": jnp.int32(0), "v": jnp.zeros(2, jnp.float32)}


def _cluster_of(item):
    return item["cluster"]


@dataclasses.dataclass(frozen=True)
class Config:
    rows: int
    num_clusters: int
    capacity: int
    weights: tuple[float, ...] | None
    alpha: float | None = None  # a PrioritisedClusteredBuffer when given


def _make(c: Config) -> eb.AbstractClusteredBuffer:
    """The one place the clustered buffers are built."""
    kw: dict[str, Any] = dict(
        add_batch_size=c.rows,
        num_clusters=c.num_clusters,
        cluster_capacity=c.capacity,
        cluster_fn=_cluster_of,
        weights=c.weights,
    )
    if c.alpha is None:
        return eb.ClusteredBuffer(EXAMPLE, **kw)
    return eb.PrioritisedClusteredBuffer(EXAMPLE, alpha=c.alpha, **kw)


CONFIGS = [
    Config(2, 3, 4, None),
    Config(1, 1, 3, None),
    Config(3, 2, 2, (0.25, 0.75)),
    Config(2, 3, 5, (0.5, 0.0, 0.5)),  # a cluster never drawn: sampling may find nothing
    Config(1, 4, 1, (0.0, 0.0, 1.0, 0.0)),
    Config(2, 3, 4, None, alpha=1.0),
    Config(1, 2, 3, (0.25, 0.75), alpha=0.5),
    Config(3, 3, 2, (0.5, 0.0, 0.5), alpha=1.0),
    Config(2, 1, 5, None, alpha=0.0),
    Config(1, 1, 2, None, alpha=1.0),  # one small cluster: every priority 0 happens
]
ADD_STEPS = (3, None, 1, 7)  # None: one item per row, `(rows, *leaf)`
BATCH = 12
NOTHING = "no cluster of positive weight holds an item"
ALL_ZERO = "every item held in the clusters of positive weight has priority 0"
PRIORITIES = (0.0, 0.0, 0.5, 1.0, 3.0)
DROPPED = 8.0  # the priority of updates to items overwritten since (must be dropped)
OUT_OF_RANGE = r"outside \[0, num_clusters=[0-9]+\)"


@eb.filter_jit
def _add(buffer, batch):
    buffer = buffer.add(batch)
    return buffer, {
        "can_sample": buffer.can_sample(),
        "size": buffer.size(),
        "sizes": buffer.cluster_sizes(),
    }


@eb.filter_jit
def _sample(buffer, key):
    return buffer.sample(key, BATCH)


@eb.filter_jit
def _sample_prioritised(buffer, key, beta):
    return buffer.sample(key, BATCH, beta=beta)


@eb.filter_jit
def _set(buffer, sample, priorities):
    return buffer.set_priorities(sample, priorities), buffer.max_priority


@eb.filter_jit
def _set_by_index(buffer, indices, priorities, steps):
    return buffer.set_priorities(indices, priorities, steps=steps)


class ClusteredMachine(CountedMachine):
    """Random adds and samples of a `ClusteredBuffer`."""

    @initialize(config=st.sampled_from(CONFIGS), seed=st.integers(0, 2**32 - 1))
    def setup(self, config: Config, seed: int):
        self.c = config
        self.buffer = _make(config)
        self.ref = ClusteredReference(
            config.num_clusters, config.capacity, config.weights, config.alpha
        )
        self.samples: list[Any] = []  # recent samples, for `set_priorities`
        self.added = 0  # items ever given to `add`, refused ones included (ids stay unique)
        self.key = jax.random.key(seed)

    @rule(t=st.sampled_from(ADD_STEPS), data=st.data())
    def add(self, t: int | None, data: st.DataObject):
        c = self.c
        n = 1 if t is None else t
        bad = data.draw(st.sampled_from([False] * 7 + [True]), label="an id out of range")
        clusters = st.integers(0, c.num_clusters - 1)
        if bad:
            clusters = clusters | st.sampled_from([-1, c.num_clusters])
        drawn = data.draw(st.lists(clusters, min_size=c.rows * n, max_size=c.rows * n))
        cluster = np.array(drawn, np.int32).reshape(c.rows, n)
        # Ids unique over the run, numbered in the order `add` takes the items: time-major,
        # rows in order within a step.
        ids = (self.added + np.arange(c.rows * n).reshape(n, c.rows).T).astype(np.int32)
        self.added += c.rows * n
        items = {"id": ids, "cluster": cluster, "v": np.stack([ids, -ids], -1).astype(np.float32)}
        batch = items if t is not None else {k: v[:, 0] for k, v in items.items()}
        batch = jax.tree.map(jnp.asarray, batch)
        if ((cluster < 0) | (cluster >= c.num_clusters)).any():
            with pytest.raises(Exception, match=OUT_OF_RANGE):
                _add(self.buffer, batch)
            return  # nothing changed: `self.buffer` is the buffer before the refused add
        self.buffer, seen = _add(self.buffer, batch)
        order = zip(cluster.T.reshape(-1).tolist(), ids.T.reshape(-1).tolist(), strict=True)
        self.ref.add(list(order))
        assert bool(seen["can_sample"]) == self.ref.any_added
        assert int(seen["size"]) == sum(self.ref.sizes())
        assert np.asarray(seen["sizes"]).tolist() == self.ref.sizes()

    @rule(beta=st.sampled_from([0.0, 0.5, 1.0]))
    def sample(self, beta: float):
        self._sample(beta)

    def _sample(self, beta: float) -> None:
        c, ref = self.c, self.ref
        self.key, key = jax.random.split(self.key)
        refusal = ref.refusal() if c.alpha is not None else (None if ref.drawable() else "x")
        if c.alpha is None:
            draw = lambda: _sample(self.buffer, key)  # noqa: E731
        else:
            draw = lambda: _sample_prioritised(self.buffer, key, jnp.float32(beta))  # noqa: E731
        if refusal is not None:
            with pytest.raises(Exception, match=ALL_ZERO if refusal == "all zero" else NOTHING):
                draw()
            return
        sample = draw()
        drawable = ref.drawable()
        cluster = np.asarray(sample.cluster)
        indices = np.asarray(sample.indices)
        steps = np.asarray(sample.steps)
        exp: Any = jax.tree.map(np.asarray, sample.experience)
        assert set(cluster.tolist()) <= set(drawable), (cluster, drawable)
        np.testing.assert_array_equal(exp["cluster"], cluster)
        np.testing.assert_array_equal(exp["v"], np.stack([exp["id"], -exp["id"]], -1))
        np.testing.assert_array_equal(indices // c.capacity, cluster)
        slot_of: dict[int, int] = {}  # one item per slot, one slot per item
        for i, k in enumerate(cluster.tolist()):
            item = int(exp["id"][i])
            assert item in ref.routed[k], f"item {item} is not held by cluster {k}"
            assert slot_of.setdefault(item, int(indices[i])) == int(indices[i])
            assert int(steps[i]) == ref.number[item], "`steps` is not the item's number"
        assert len(set(slot_of.values())) == len(slot_of)
        if c.alpha is None:
            assert isinstance(sample, eb.ClusteredSample)
            return
        assert isinstance(sample, eb.PrioritisedClusteredSample)
        items = exp["id"].tolist()
        p = np.array([ref.probability(i) for i in items])
        assert (p > 0).all(), "an item of priority 0 was drawn"
        np.testing.assert_allclose(np.asarray(sample.probabilities), p, rtol=1e-5)
        scaled = np.array([ref.sizes()[ref.cluster_of[i]] * ref.within(i) for i in items])
        want = (scaled / scaled.min()) ** -beta
        np.testing.assert_allclose(np.asarray(sample.weights), want, rtol=1e-4)
        self.samples = [*self.samples[-2:], sample]

    @precondition(lambda self: self.c.alpha is not None and bool(self.samples))
    @rule(data=st.data(), by_index=st.booleans())
    def set_priorities(self, data: st.DataObject, by_index: bool):
        """Priorities for a recent sample (some of its items may be overwritten since): one
        per row, so an item drawn twice may get two (the last one wins); `DROPPED` for items
        no longer held."""
        ref = self.ref
        assert ref.priorities is not None
        sample = data.draw(st.sampled_from(self.samples), label="sample")
        items = np.asarray(sample.experience["id"]).tolist()
        values = data.draw(
            st.lists(st.sampled_from(PRIORITIES), min_size=len(items), max_size=len(items))
        )
        held = ref.priorities.priority
        priorities = np.array(
            [v if i in held else DROPPED for i, v in zip(items, values, strict=True)], np.float32
        )
        ref.priorities.set(items, priorities)  # type: ignore[arg-type]  (ids, not windows)
        if by_index:
            self.buffer = _set_by_index(
                self.buffer, sample.indices, jnp.asarray(priorities), sample.steps
            )
        else:
            self.buffer, _ = _set(self.buffer, sample, jnp.asarray(priorities))
        assert float(self.buffer.max_priority) == float(ref.priorities.max_priority)
        self._sample(beta=1.0)


ClusteredMachine.TestCase.settings = stateful_settings(max_examples=100, stateful_step_count=14)
TestClusteredMachine = pytest.mark.stateful(ClusteredMachine.TestCase)
