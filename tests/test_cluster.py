import collections

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from equibuffer._cluster import ClusteredBuffer

from .helpers import chi_square_pvalue


EXAMPLE = {"id": jnp.int32(0), "ret": jnp.float32(0)}


def _by_return(item):
    return jnp.clip(jnp.floor(item["ret"]), 0, 2).astype(jnp.int32)


def _batch(rng, rows, t, start):
    n = 1 if t is None else t
    ids = start + np.arange(rows * n).reshape(n, rows).T  # unique, time-major numbering
    ret = rng.uniform(0, 3, size=(rows, n)).astype(np.float32)
    batch = {"id": ids.astype(np.int32), "ret": ret}
    if t is None:
        batch = {k: v[:, 0] for k, v in batch.items()}
    return jax.tree.map(jnp.asarray, batch)


@eqx.filter_jit
def _add(buffer, batch):
    return buffer.add(batch)


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 3),
    cap=st.integers(1, 5),
    adds=st.lists(st.one_of(st.none(), st.integers(1, 6)), min_size=1, max_size=4),
)
def test_routing_matches_numpy_reference(rows, cap, adds):
    rng = np.random.default_rng(rows * 10 + cap)
    buffer = ClusteredBuffer(
        EXAMPLE, add_batch_size=rows, num_clusters=3, cluster_capacity=cap, cluster_fn=_by_return
    )
    ref = [collections.deque(maxlen=cap) for _ in range(3)]
    start = 0
    for t in adds:
        batch = _batch(rng, rows, t, start)
        buffer = _add(buffer, batch)
        ids = np.asarray(batch["id"]).reshape(rows, -1).T.reshape(-1)  # time-major
        rets = np.asarray(batch["ret"]).reshape(rows, -1).T.reshape(-1)
        for i, r in zip(ids, rets, strict=True):
            ref[int(np.clip(np.floor(r), 0, 2))].append(int(i))
        start += ids.size
    assert np.asarray(buffer.cluster_sizes()).tolist() == [len(d) for d in ref]
    data = np.asarray(buffer.storage.data["id"])
    for c in range(3):
        fill, head = int(buffer.storage.fill[c]), int(buffer.storage.head[c])
        held = [int(data[c, (head - fill + j) % cap]) for j in range(fill)]
        assert held == list(ref[c])  # oldest first, the newest `cap` kept


def test_sampling_uniform_over_clusters_then_items(getkey):
    buffer = ClusteredBuffer(
        EXAMPLE, add_batch_size=6, num_clusters=3, cluster_capacity=8, cluster_fn=_by_return
    )
    # Cluster 0 gets 1 item, cluster 1 gets 2, cluster 2 gets 3.
    batch = {"id": jnp.arange(6, dtype=jnp.int32), "ret": jnp.array([0.5, 1.5, 1.5, 2.5, 2.5, 2.5])}
    buffer = buffer.add(batch)
    draw = eqx.filter_jit(lambda b, k: b.sample(k, 3000))
    s = draw(buffer, getkey())
    ids, cluster = np.asarray(s.experience["id"]), np.asarray(s.cluster)
    np.testing.assert_array_equal(cluster, np.clip(np.floor(np.asarray(batch["ret"])[ids]), 0, 2))
    counts = np.bincount(ids, minlength=6)
    want = np.array([1 / 3, 1 / 6, 1 / 6, 1 / 9, 1 / 9, 1 / 9])
    assert chi_square_pvalue(counts, want) > 1e-3

    weighted = ClusteredBuffer(
        EXAMPLE,
        add_batch_size=6,
        num_clusters=3,
        cluster_capacity=8,
        cluster_fn=_by_return,
        weights=(0.2, 0.0, 0.8),
    ).add(batch)
    cluster = np.asarray(draw(weighted, getkey()).cluster)
    assert chi_square_pvalue(np.bincount(cluster, minlength=3), np.array([0.2, 0.0, 0.8])) > 1e-3
    # An empty cluster's weight goes to the others.
    only_low = weighted.add({"id": jnp.zeros(6, jnp.int32), "ret": jnp.zeros(6)})
    empty_high = ClusteredBuffer(
        EXAMPLE,
        add_batch_size=6,
        num_clusters=3,
        cluster_capacity=8,
        cluster_fn=_by_return,
        weights=(0.2, 0.0, 0.8),
    ).add({"id": jnp.zeros(6, jnp.int32), "ret": jnp.zeros(6)})
    assert np.all(np.asarray(draw(empty_high, getkey()).cluster) == 0)
    assert int(only_low.size()) == 12


def test_errors():
    with pytest.raises(TypeError, match="must return a 0-d integer cluster id"):
        ClusteredBuffer(
            EXAMPLE,
            add_batch_size=1,
            num_clusters=2,
            cluster_capacity=4,
            cluster_fn=lambda item: item["ret"],
        )
    with pytest.raises(ValueError, match="weights must sum to 1"):
        ClusteredBuffer(
            EXAMPLE,
            add_batch_size=1,
            num_clusters=2,
            cluster_capacity=4,
            cluster_fn=_by_return,
            weights=(0.5, 0.6),
        )
    buffer = ClusteredBuffer(
        EXAMPLE, add_batch_size=2, num_clusters=2, cluster_capacity=4, cluster_fn=_by_return
    )
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"outside \[0, num_clusters=2\)"):
        _add(buffer, {"id": jnp.zeros(2, jnp.int32), "ret": jnp.array([0.5, 2.5])})
    with pytest.raises(ValueError, match=r"leaf \['ret'\] has shape \(3,\)"):
        buffer.add({"id": jnp.zeros(2, jnp.int32), "ret": jnp.zeros(3)})
    with pytest.raises(eqx.EquinoxRuntimeError, match="no cluster of positive weight"):
        eqx.filter_jit(lambda b: b.sample(jax.random.key(0), 2))(buffer)
    assert not bool(buffer.can_sample())


def test_donating_jit_traces_once():
    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, batch, key):
        buffer = buffer.add(batch)
        return buffer, buffer.sample(key, 4).experience["id"]

    buffer = ClusteredBuffer(
        EXAMPLE, add_batch_size=2, num_clusters=3, cluster_capacity=4, cluster_fn=_by_return
    )
    rng = np.random.default_rng(0)
    for i in range(5):
        buffer, ids = step(buffer, _batch(rng, 2, 3, 6 * i), jax.random.key(i))
        assert np.all(np.asarray(ids) < 6 * (i + 1))
