"""Stateful test of `ClusteredBuffer`: random adds (items routed to random clusters, some to
an id out of range, which must raise and change nothing) and samples, against the NumPy
reference of `tests/reference.py`: which items each cluster holds, its size, which clusters
a sample may draw from (non-empty, of positive weight) and the items drawn.

Only the public API is used, and every buffer is built by `_make`.
"""

import dataclasses
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, rule

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


def _make(c: Config) -> eb.ClusteredBuffer:
    """The one place the clustered buffers are built."""
    return eb.ClusteredBuffer(
        EXAMPLE,
        add_batch_size=c.rows,
        num_clusters=c.num_clusters,
        cluster_capacity=c.capacity,
        cluster_fn=_cluster_of,
        weights=c.weights,
    )


CONFIGS = [
    Config(2, 3, 4, None),
    Config(1, 1, 3, None),
    Config(3, 2, 2, (0.25, 0.75)),
    Config(2, 3, 5, (0.5, 0.0, 0.5)),  # a cluster never drawn: sampling may find nothing
    Config(1, 4, 1, (0.0, 0.0, 1.0, 0.0)),
]
ADD_STEPS = (3, None, 1, 7)  # None: one item per row, `(rows, *leaf)`
BATCH = 12
NOTHING = "no cluster of positive weight holds an item"
OUT_OF_RANGE = r"outside \[0, num_clusters=[0-9]+\)"


@eqx.filter_jit
def _add(buffer, batch):
    buffer = buffer.add(batch)
    return buffer, {
        "can_sample": buffer.can_sample(),
        "size": buffer.size(),
        "sizes": buffer.cluster_sizes(),
    }


@eqx.filter_jit
def _sample(buffer, key):
    return buffer.sample(key, BATCH)


class ClusteredMachine(CountedMachine):
    """Random adds and samples of a `ClusteredBuffer`."""

    @initialize(config=st.sampled_from(CONFIGS), seed=st.integers(0, 2**32 - 1))
    def setup(self, config: Config, seed: int):
        self.c = config
        self.buffer = _make(config)
        self.ref = ClusteredReference(config.num_clusters, config.capacity, config.weights)
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

    @rule()
    def sample(self):
        c, ref = self.c, self.ref
        self.key, key = jax.random.split(self.key)
        drawable = ref.drawable()
        if not drawable:
            with pytest.raises(Exception, match=NOTHING):
                _sample(self.buffer, key)
            return
        sample = _sample(self.buffer, key)
        cluster = np.asarray(sample.cluster)
        indices = np.asarray(sample.indices)
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
        assert len(set(slot_of.values())) == len(slot_of)


ClusteredMachine.TestCase.settings = stateful_settings(max_examples=80, stateful_step_count=12)
TestClusteredMachine = pytest.mark.stateful(ClusteredMachine.TestCase)
