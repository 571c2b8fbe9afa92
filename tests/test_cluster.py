import collections

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import equibuffer as eb
from equibuffer import ClusteredBuffer, PrioritisedClusteredBuffer

from .helpers import budget, chi_square_pvalue


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


@eb.filter_jit
def _add(buffer, batch):
    return buffer.add(batch)


@settings(max_examples=budget(15), deadline=None)
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
    draw = eb.filter_jit(lambda b, k: b.sample(k, 3000))
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
        eb.filter_jit(lambda b: b.sample(jax.random.key(0), 2))(buffer)
    assert not bool(buffer.can_sample())


@pytest.mark.parametrize("cls", [ClusteredBuffer, PrioritisedClusteredBuffer])
def test_donating_jit_traces_once(cls):
    @eb.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, batch, key):
        buffer = buffer.add(batch)
        sample = buffer.sample(key, 4)
        if isinstance(buffer, PrioritisedClusteredBuffer):
            buffer = buffer.set_priorities(sample, sample.weights + 1.0)
        return buffer, sample.experience["id"]

    buffer = cls(
        EXAMPLE, add_batch_size=2, num_clusters=3, cluster_capacity=4, cluster_fn=_by_return
    )
    rng = np.random.default_rng(0)
    for i in range(5):
        buffer, ids = step(buffer, _batch(rng, 2, 3, 6 * i), jax.random.key(i))
        assert np.all(np.asarray(ids) < 6 * (i + 1))


@pytest.mark.parametrize("kind", ["uniform", "prioritised"])
def test_vmapped_run_branches_on_can_sample(kind):
    """`can_sample()` does not depend on the routing (which is batched under `vmap`), so
    `lax.cond(can_sample(), learn, skip)` stays a branch: at step 0 the empty buffer is not
    sampled (as a select of both branches, `sample` would raise)."""
    cls = ClusteredBuffer if kind == "uniform" else PrioritisedClusteredBuffer
    buffer = cls(
        EXAMPLE, add_batch_size=2, num_clusters=3, cluster_capacity=4, cluster_fn=_by_return
    )

    def learn(buffer, key):
        s = buffer.sample(key, 4)
        if kind == "prioritised":
            buffer = buffer.set_priorities(s, s.weights + 1.0)
        return buffer, jnp.int32(1), jnp.max(s.experience["id"])

    def skip(buffer, key):
        return buffer, jnp.int32(0), jnp.int32(-1)

    def train(seed):
        def body(i, carry):
            buffer, learnt, newest = carry
            key = jax.random.fold_in(jax.random.key(seed), i)
            buffer, did, got = jax.lax.cond(buffer.can_sample(), learn, skip, buffer, key)
            ret = jax.random.uniform(key, (2,), jnp.float32, 0, 3)  # routing differs per seed
            buffer = buffer.add({"id": jnp.full(2, i, jnp.int32), "ret": ret})
            return buffer, learnt + did, jnp.maximum(newest, got)

        return jax.lax.fori_loop(0, 6, body, (buffer, jnp.int32(0), jnp.int32(-1)))

    buffers, learnt, newest = eb.filter_jit(jax.vmap(train))(jnp.arange(4))
    assert buffers.storage.fill.shape == (4, 3)  # the routing is batched ...
    assert np.asarray(learnt).tolist() == [5] * 4  # ... the branch is not: steps 1 to 5 learn
    assert (np.asarray(newest) <= 4).all()  # only items added before each draw were drawn


# --- PrioritisedClusteredBuffer ---------------------------------------------------------------


def _cluster_is_ret(item):
    return item["ret"].astype(jnp.int32)  # here `ret` is the cluster id itself


def _prioritised(cap=8, weights=None, alpha=0.6, rows=9):
    return PrioritisedClusteredBuffer(
        EXAMPLE,
        add_batch_size=rows,
        num_clusters=3,
        cluster_capacity=cap,
        cluster_fn=_cluster_is_ret,
        weights=weights,
        alpha=alpha,
    )


def _routed(clusters):
    """One add of one item per row, item `i` (id `i`) to `clusters[i]`; and each item's
    number in its cluster (the first add fills each cluster from slot 0, so it is the slot)."""
    clusters = np.asarray(clusters)
    batch = {
        "id": jnp.arange(len(clusters), dtype=jnp.int32),
        "ret": jnp.asarray(clusters, jnp.float32),
    }
    number = np.array([np.sum(clusters[:i] == c) for i, c in enumerate(clusters)])
    return batch, number


def test_prioritised_sampling_law_chi_square():
    """Cluster by weight among the clusters holding an item of positive priority, then
    `p**alpha` inside it; probabilities and weights as documented."""
    cap, alpha = 8, 0.7
    clusters = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    priorities = np.array([1.0, 2.0, 5.0, 0.0, 0.0, 0.5, 1.0, 0.0, 4.0], np.float32)
    batch, number = _routed(clusters)
    buffer = _prioritised(cap, weights=(0.2, 0.3, 0.5), alpha=alpha).add(batch)
    c = np.asarray(clusters)
    indices = jnp.asarray(c * cap + number, jnp.int32)
    buffer = buffer.set_priorities(
        indices, jnp.asarray(priorities), steps=jnp.asarray(number, jnp.uint32)
    )
    # Cluster 1's items all have priority 0: its share goes to clusters 0 and 2.
    leaf = np.where(priorities > 0, priorities.astype(np.float64) ** alpha, 0.0)
    share = np.array([0.2, 0.0, 0.5]) / 0.7
    total = np.array([leaf[c == k].sum() for k in range(3)])
    within = np.where(total[c] > 0, leaf / np.where(total[c] > 0, total[c], 1.0), 0.0)
    want = share[c] * within
    draw = eb.filter_jit(lambda b, k: b.sample(k, 2000, beta=0.5))
    counts = np.zeros(9)
    for i in range(10):
        s = draw(buffer, jax.random.key(i))
        ids = np.asarray(s.experience["id"])
        np.add.at(counts, ids, 1)
        np.testing.assert_array_equal(np.asarray(s.cluster), c[ids])
        np.testing.assert_array_equal(np.asarray(s.indices), np.asarray(indices)[ids])
        np.testing.assert_array_equal(np.asarray(s.steps), number[ids])
        np.testing.assert_allclose(np.asarray(s.probabilities), want[ids], rtol=1e-5)
        scaled = np.bincount(c, minlength=3)[c[ids]] * within[ids]
        np.testing.assert_allclose(
            np.asarray(s.weights), (scaled / scaled.min()) ** -0.5, rtol=1e-5
        )
    assert chi_square_pvalue(counts, want) > 1e-3


def test_alpha_zero_is_the_uniform_clustered_law_with_unit_weights(getkey):
    batch, _ = _routed([0, 1, 1, 2, 2, 2])
    buffer = _prioritised(alpha=0.0, rows=6).add(batch)
    s = eb.filter_jit(lambda b, k: b.sample(k, 3000, beta=1.0))(buffer, getkey())
    ids = np.asarray(s.experience["id"])
    want = np.array([1 / 3, 1 / 6, 1 / 6, 1 / 9, 1 / 9, 1 / 9])  # as for ClusteredBuffer
    assert chi_square_pvalue(np.bincount(ids, minlength=6), want) > 1e-3
    np.testing.assert_allclose(np.asarray(s.probabilities), want[ids], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(s.weights), 1.0)


def test_set_priorities_go_to_their_cluster_and_stale_ones_are_dropped():
    cap = 2
    # Rows of 2 items, 3 steps: clusters 0, 1, 2 get ids (0, 1), (2, 3), (4, 5).
    buffer = _prioritised(cap, alpha=1.0, rows=2)
    ids = jnp.arange(6, dtype=jnp.int32).reshape(3, 2).T
    buffer = buffer.add({"id": ids, "ret": jnp.array([[0.0, 1.0, 2.0]] * 2)})
    sample = buffer.sample(jax.random.key(0), 64)
    drawn = np.asarray(sample.experience["id"])
    assert set(drawn.tolist()) == set(range(6))
    # Cluster 0 is overwritten by two new items (entering at priority 1); 1 and 2 keep theirs.
    overwritten = buffer.add({"id": jnp.array([10, 11], jnp.int32), "ret": jnp.zeros(2)})
    priorities = jnp.asarray(drawn + 2.0, jnp.float32)  # item i gets priority i + 2
    set_ = eb.filter_jit(lambda b, s, p: b.set_priorities(s, p))
    updated = set_(overwritten, sample, priorities)
    np.testing.assert_array_equal(np.asarray(updated.trees[0].values()), [1.0, 1.0])  # dropped
    # Each current item's priority (alpha=1) is in its own cluster's tree, at its own slot.
    np.testing.assert_array_equal(np.asarray(updated.trees[1].values()), [4.0, 5.0])
    np.testing.assert_array_equal(np.asarray(updated.trees[2].values()), [6.0, 7.0])
    assert float(updated.max_priority) == 7.0  # the largest applied (item 5)
    # Without the add every update applies, cluster 0's included.
    fresh = set_(buffer, sample, priorities)
    np.testing.assert_array_equal(np.asarray(fresh.trees[0].values()), [2.0, 3.0])
    # New items enter at the largest priority set so far.
    entered = updated.add({"id": jnp.array([12, 13], jnp.int32), "ret": jnp.ones(2)})
    np.testing.assert_array_equal(np.asarray(entered.trees[1].values()), [7.0, 7.0])


def test_prioritised_errors():
    buffer = _prioritised(4, rows=2)
    draw = eb.filter_jit(lambda b, beta: b.sample(jax.random.key(0), 4, beta=beta))
    with pytest.raises(eqx.EquinoxRuntimeError, match="no cluster of positive weight holds"):
        draw(buffer, 0.5)
    assert not bool(buffer.can_sample())
    buffer = buffer.add({"id": jnp.array([0, 1], jnp.int32), "ret": jnp.array([0.0, 2.0])})
    assert bool(buffer.can_sample())
    sample = buffer.sample(jax.random.key(0), 4)
    # Both items (slot 0 of clusters 0 and 2, the first of each) at priority 0.
    both, first = jnp.array([0, 2 * 4]), jnp.zeros(2, jnp.uint32)
    zero = buffer.set_priorities(both, jnp.zeros(2), steps=first)
    with pytest.raises(
        eqx.EquinoxRuntimeError,
        match="every item held in the clusters of positive weight has priority 0",
    ):
        draw(zero, 0.5)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"`beta` must be finite and >= 0\."):
        draw(buffer, jnp.float32(-1.0))
    with pytest.raises(ValueError, match=r"`beta` must be finite and >= 0, got -1\.0"):
        buffer.sample(jax.random.key(0), 4, beta=-1.0)
    set_ = eb.filter_jit(lambda b, i, p, s: b.set_priorities(i, p, steps=s))
    steps = jnp.zeros(1, jnp.uint32)
    with pytest.raises(
        eqx.EquinoxRuntimeError,
        match=r"every index must be in \[0, num_clusters \* cluster_capacity=12\)",
    ):
        set_(buffer, jnp.array([12]), jnp.ones(1), steps)
    with pytest.raises(eqx.EquinoxRuntimeError, match="every priority must be non-negative"):
        set_(buffer, jnp.array([0]), jnp.array([-1.0]), steps)
    with pytest.raises(TypeError, match="pass the whole sample"):
        buffer.set_priorities(sample.indices, jnp.ones(4))
    with pytest.raises(TypeError, match="`steps` is taken from the sample"):
        buffer.set_priorities(sample, jnp.ones(4), steps=sample.steps)
    with pytest.raises(ValueError, match=r"`alpha` must be finite and >= 0"):
        _prioritised(alpha=-1.0)
