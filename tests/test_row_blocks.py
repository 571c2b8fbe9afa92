"""`sample(..., row_blocks=n)` on one device: each block of rows gets its own draws, by the
buffer's rule restricted to its rows (chi-square), the gathered experience is that of the
drawn windows, `row_blocks=1` is the plain sample, and bad values are refused. The sum tree's
block search against NumPy. The same for the clustered buffers (block d: the d-th run of
every cluster's slots), the `Mixer` (block d of the mix: block d of each source's own sample)
and `RateLimited` (passed to its buffer). (On 8 devices: test_sharding_law.py and
test_sharding_kinds.py.)"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb

from .helpers import chi_square_pvalue


R, L, BLOCKS, KEYS, BATCH = 4, 8, 2, 64, 128


# The tests' setup (adds, priorities, the reference samples) runs compiled rather than
# eagerly, where each JAX operation is a program of its own to compile; a refused operation
# raises there too (`eb.filter_jit`).


@eb.filter_jit
def _add(buffer, batch):
    """`buffer.add(batch)`, compiled (a refused add raises, as eagerly)."""
    return buffer.add(batch)


@eb.filter_jit
def _set_priorities(buffer, *args, **kwargs):
    """`buffer.set_priorities(*args, **kwargs)`, compiled (a refusal raises, as eagerly)."""
    return buffer.set_priorities(*args, **kwargs)


@eqx.filter_jit
def _numbers(storage, cluster, slot):
    """`storage.numbers(cluster, slot)`, compiled."""
    return storage.numbers(cluster, slot)


def _filled(buffer, steps=11):
    t = np.arange(R * steps, dtype=np.int32).reshape(R, steps)
    done = (t % 5) == 0
    batch = {"t": jnp.asarray(t), "r": jnp.asarray(t, jnp.float32), "done": jnp.asarray(done)}
    return _add(buffer, batch)


EXAMPLE = {"t": jnp.int32(0), "r": jnp.float32(0), "done": jnp.bool_(False)}
SIZES = dict(add_batch_size=R, max_length_time_axis=L)
KINDS = {
    "trajectory": lambda: eb.TrajectoryBuffer(EXAMPLE, sequence_length=3, **SIZES),
    "n_step": lambda: eb.TransitionBuffer(
        EXAMPLE, n_step=2, discount=0.5, reward="r", terminated="done", truncated=None, **SIZES
    ),
    "episodes_pad": lambda: eb.EpisodeTrajectoryBuffer(
        EXAMPLE, sequence_length=3, episode_end="done", mode="pad", **SIZES
    ),
    "prioritised": lambda: eb.PrioritisedTrajectoryBuffer(EXAMPLE, sequence_length=3, **SIZES),
    "prioritised_episodes": lambda: eb.PrioritisedTransitionBuffer(
        EXAMPLE, episode_end="done", **SIZES
    ),
}


def _slot_steps(buffer, indices):
    """The absolute step held at each flat index (11 steps added per row)."""
    offset = (indices % L - buffer.storage.head + buffer.storage.fill) % L
    return (11 - buffer.storage.fill + offset).astype(jnp.uint32)


@eb.filter_jit
def _set_at_slots(buffer, indices, priorities):
    """`buffer.set_priorities` of the windows at flat `indices`, each with its step."""
    return buffer.set_priorities(indices, priorities, steps=_slot_steps(buffer, indices))


@eqx.filter_jit
def _first_and_plain(buffer, sample):
    """The first of a vmapped `sample`, and the plain gather of its indices (padded with
    its mask, for an episode buffer)."""
    one = jax.tree.map(lambda x: x[0], sample)
    plain = buffer.view.gather(buffer.storage, one.indices, getattr(one, "mask", None))
    if getattr(one, "mask", None) is not None:
        plain = buffer.view.padded(plain, one.mask)
    return one, plain


def _valid(buffer) -> np.ndarray:
    """1 at the flat index of every window the buffer may draw, from its global sample."""
    keys = jax.random.split(jax.random.key(99), KEYS)
    drawn = jax.jit(jax.vmap(lambda k: buffer.sample(k, BATCH).indices))(keys)
    return np.bincount(np.asarray(drawn).ravel(), minlength=R * L) > 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_block_draws_its_own_rows_by_the_rule(kind):
    buffer = _filled(KINDS[kind]())
    if isinstance(buffer, eb.AbstractPrioritisedBuffer):
        # Unequal priorities over every window ever valid (stale ones are dropped).
        indices = jnp.arange(R * L)
        p = jnp.asarray(np.random.default_rng(1).uniform(0.1, 3.0, R * L), jnp.float32)
        buffer = _set_at_slots(buffer, indices, p)
        target = np.asarray(buffer.tree.values(), np.float64)
    else:
        target = _valid(buffer).astype(np.float64)
    keys = jax.random.split(jax.random.key(0), KEYS)
    sample = jax.jit(jax.vmap(lambda k: buffer.sample(k, BATCH, row_blocks=BLOCKS)))(keys)
    indices = np.asarray(sample.indices).reshape(KEYS, BLOCKS, -1)
    per = R // BLOCKS * L
    for b in range(BLOCKS):
        own = np.zeros(R * L)
        own[b * per : (b + 1) * per] = target[b * per : (b + 1) * per]
        counts = np.bincount(indices[:, b].ravel(), minlength=R * L)
        assert chi_square_pvalue(counts, own) > 1e-3, (kind, b)
        if isinstance(buffer, eb.AbstractPrioritisedBuffer):
            drawn = indices[:, b]
            probabilities = np.asarray(sample.probabilities).reshape(indices.shape)[:, b]
            np.testing.assert_allclose(probabilities, own[drawn] / own.sum(), rtol=1e-5)
    # The experience is the drawn windows' (the plain gather of the same indices).
    one, plain = _first_and_plain(buffer, sample)
    for x, y in zip(jax.tree.leaves(one.experience), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", ["trajectory", "prioritised"])
def test_one_block_is_the_plain_sample(kind):
    buffer = _filled(KINDS[kind]())
    key = jax.random.key(3)
    a = eb.filter_jit(lambda b: b.sample(key, 16))(buffer)
    b = eb.filter_jit(lambda b: b.sample(key, 16, row_blocks=1))(buffer)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_row_blocks_must_divide_rows_and_batch():
    buffer = _filled(KINDS["trajectory"]())
    with pytest.raises(ValueError) as e:
        buffer.sample(jax.random.key(0), 8, row_blocks=3)
    assert str(e.value) == (
        "TrajectoryBuffer.sample(): row_blocks=3 must divide add_batch_size=4 (each block of "
        "rows gets batch_size / row_blocks of the draws)."
    )
    with pytest.raises(ValueError, match=r"row_blocks=2 must divide batch_size=5"):
        buffer.sample(jax.random.key(0), 5, row_blocks=2)
    with pytest.raises(ValueError, match="row_blocks"):
        buffer.sample(jax.random.key(0), 8, row_blocks=0)


def test_a_block_with_nothing_to_draw_raises():
    buffer = _filled(KINDS["prioritised"]())
    per = R // BLOCKS * L
    indices = jnp.arange(per)  # every window of block 0 to priority 0
    buffer = _set_at_slots(buffer, indices, jnp.zeros(per))
    eb.filter_jit(lambda b: b.sample(jax.random.key(0), 8))(buffer)  # globally fine
    with pytest.raises(eqx.EquinoxRuntimeError, match="one of the row_blocks=2 blocks"):
        eb.filter_jit(lambda b: b.sample(jax.random.key(0), 8, row_blocks=BLOCKS))(buffer)


@eqx.filter_jit
def _set_and_search_blocks(tree, values, blocks, probe):
    """After `set` of every leaf to `values`: `block_totals(blocks)` and
    `search_blocks(probe)`, in one compiled call."""
    tree = tree.set(jnp.arange(values.shape[0]), values)
    return tree.block_totals(blocks), tree.search_blocks(probe)


@pytest.mark.parametrize(
    ("capacity", "blocks"),
    [(12, 3), (2 * 512, 2), pytest.param(4 * 40, 4, marks=pytest.mark.thorough)],
)
def test_sum_tree_block_search_matches_numpy(capacity, blocks):
    rng = np.random.default_rng(capacity)
    values = rng.uniform(0.0, 2.0, capacity).astype(np.float32)
    values[rng.random(capacity) < 0.4] = 0.0
    values[: capacity // blocks // 2] = 0.0  # leading zeros in block 0
    blocks_of = values.reshape(blocks, -1).astype(np.float64)
    # Every block's cumulative ranges, probed at their middles, at 0 and at the total: block
    # b's probes in row b, padded with 0.0 (its first positive leaf), searched in one call.
    per = capacity // blocks
    probes, expected = [], []
    for b in range(blocks):
        running = np.cumsum(blocks_of[b])
        mids = running - blocks_of[b] / 2
        probes.append(
            np.concatenate([mids[blocks_of[b] > 0], [0.0, running[-1], 10 * running[-1]]])
        )
        positive = np.flatnonzero(blocks_of[b] > 0) + b * per
        expected.append(np.concatenate([positive, [positive[0], positive[-1], positive[-1]]]))
    width = max(len(p) for p in probes)
    probe = np.stack([np.pad(p, (0, width - len(p))) for p in probes])
    want = np.stack([np.pad(e, (0, width - len(e)), constant_values=e[-3]) for e in expected])
    totals, (leaves, found) = _set_and_search_blocks(
        eb.SumTree(capacity), jnp.asarray(values), blocks, jnp.asarray(probe, jnp.float32)
    )
    np.testing.assert_allclose(totals, blocks_of.sum(1), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(leaves), want)
    np.testing.assert_array_equal(np.asarray(found), values[want])


# --- The clustered buffers: block d = the d-th run of every cluster's slots -----------------

CAP, WIDTH = 8, 4  # cluster_capacity, slots per block (2 blocks)
SHARES = (0.5, 0.3, 0.2)
CLUSTERED = {"t": jnp.int32(0), "c": jnp.int32(0)}


def _cluster_of(item):
    """Each item's cluster: its `c` (one function for every buffer, so that a buffer's
    compiled programs serve every buffer of its kind and sizes)."""
    return item["c"]


def _clustered(kind, **kw):
    """3 clusters of 8 slots, filled unevenly: cluster 0 has wrapped (11 items routed), 1
    holds 6 (4 in block 0, 2 in block 1), 2 holds 3 (all in block 0)."""
    c = np.array([0] * 11 + [1] * 6 + [2] * 3)
    c = np.random.default_rng(5).permutation(c).reshape(10, 2).T  # 2 rows, 10 steps
    buffer = kind(
        CLUSTERED,
        add_batch_size=2,
        num_clusters=3,
        cluster_capacity=CAP,
        cluster_fn=_cluster_of,
        weights=SHARES,
        **kw,
    )
    t = np.arange(20, dtype=np.int32).reshape(10, 2).T
    return _add(buffer, {"t": jnp.asarray(t), "c": jnp.asarray(c, jnp.int32)})


def _held_in_block(buffer) -> np.ndarray:
    """(blocks, clusters): items held in each block (a cluster holds slots [0, fill))."""
    fill = np.asarray(buffer.cluster_sizes())
    return np.clip(fill[None, :] - WIDTH * np.arange(CAP // WIDTH)[:, None], 0, WIDTH)


def _cluster_law(buffer, leaf_weights: np.ndarray) -> np.ndarray:
    """(blocks, clusters * CAP): the exact law of each block, from per-slot weights
    (`p ** alpha`, or 1 on every held slot) by the clustered rule restricted to the block."""
    law = np.zeros((CAP // WIDTH, 3 * CAP))
    for d in range(CAP // WIDTH):
        within = np.zeros((3, CAP))
        within[:, d * WIDTH : (d + 1) * WIDTH] = leaf_weights[:, d * WIDTH : (d + 1) * WIDTH]
        totals = within.sum(1)
        share = np.where(totals > 0, SHARES, 0.0)
        share = share / share.sum()
        law[d] = (share[:, None] * within / np.where(totals > 0, totals, 1)[:, None]).ravel()
    return law


def _draw_blocks(buffer, **kw):
    keys = jax.random.split(jax.random.key(0), KEYS)
    return jax.jit(jax.vmap(lambda k: buffer.sample(k, BATCH, row_blocks=2, **kw)))(keys)


def _blocks_of(x) -> np.ndarray:
    return np.asarray(x).reshape(KEYS, 2, -1)


def test_clustered_blocks_draw_their_own_slots_by_the_cluster_rule():
    buffer = _clustered(eb.ClusteredBuffer)
    held = np.asarray(buffer.cluster_sizes())
    assert held.tolist() == [8, 6, 3] and _held_in_block(buffer).tolist() == [[4, 4, 3], [4, 2, 0]]
    ones = (np.arange(CAP)[None, :] < held[:, None]).astype(np.float64)
    law = _cluster_law(buffer, ones)
    sample = _draw_blocks(buffer)
    indices = _blocks_of(sample.indices)
    for d in range(2):
        counts = np.bincount(indices[:, d].ravel(), minlength=3 * CAP)
        assert chi_square_pvalue(counts, law[d]) > 1e-3, d
    # Each item is the one its index names, of the cluster it says, numbered as stored.
    data = buffer.storage.data
    cluster, slot = np.asarray(sample.cluster), np.asarray(sample.indices) % CAP
    np.testing.assert_array_equal(cluster, np.asarray(sample.indices) // CAP)
    np.testing.assert_array_equal(sample.experience["t"], np.asarray(data["t"])[cluster, slot])
    np.testing.assert_array_equal(sample.experience["c"], cluster)
    _, number = _numbers(
        buffer.storage, sample.cluster.reshape(-1), sample.indices.reshape(-1) % CAP
    )
    np.testing.assert_array_equal(np.asarray(sample.steps).ravel(), np.asarray(number))


def test_prioritised_clustered_blocks_draw_by_their_own_totals():
    alpha, beta = 0.7, 0.6
    buffer = _clustered(eb.PrioritisedClusteredBuffer, alpha=alpha)
    held = np.asarray(buffer.cluster_sizes())
    p = np.random.default_rng(2).uniform(0.2, 3.0, (3, CAP)).astype(np.float32)
    p[1, 4:] = 0.0  # every item of cluster 1 in block 1 at priority 0: its share moves
    slots = np.arange(CAP)
    cluster, slot = np.nonzero(slots[None, :] < held[:, None])
    _, steps = _numbers(
        buffer.storage, jnp.asarray(cluster, jnp.int32), jnp.asarray(slot, jnp.int32)
    )
    buffer = _set_priorities(
        buffer,
        jnp.asarray(cluster * CAP + slot, jnp.int32),
        jnp.asarray(p[cluster, slot]),
        steps=steps,
    )
    leaf = np.where(slots[None, :] < held[:, None], p.astype(np.float64) ** alpha, 0.0)
    law = _cluster_law(buffer, leaf)
    sample = _draw_blocks(buffer, beta=beta)
    indices = _blocks_of(sample.indices)
    probabilities = _blocks_of(sample.probabilities)
    weights = _blocks_of(sample.weights)
    items = _held_in_block(buffer)
    for d in range(2):
        counts = np.bincount(indices[:, d].ravel(), minlength=3 * CAP)
        assert chi_square_pvalue(counts, law[d]) > 1e-3, d
        drawn = indices[:, d]
        np.testing.assert_allclose(probabilities[:, d], law[d][drawn], rtol=1e-5)
        # (n_{c,d} P(i | c, d)) ** -beta over the block's largest.
        c = drawn // CAP
        block = leaf[:, d * WIDTH : (d + 1) * WIDTH].sum(1)
        scaled = items[d][c] * leaf.ravel()[drawn] / block[c]
        expected = (scaled / scaled.min(axis=1, keepdims=True)) ** -beta
        np.testing.assert_allclose(weights[:, d], expected, rtol=1e-5)


def test_clustered_row_blocks_must_divide_capacity_and_batch():
    for kind in (eb.ClusteredBuffer, eb.PrioritisedClusteredBuffer):
        buffer = _clustered(kind)
        name = kind.__name__
        with pytest.raises(ValueError) as e:
            buffer.sample(jax.random.key(0), 6, row_blocks=3)
        assert str(e.value) == (
            f"{name}.sample(): row_blocks=3 must divide cluster_capacity=8 (block d of every "
            "cluster's slots gets batch_size / row_blocks of the draws)."
        )
        with pytest.raises(ValueError) as e:
            buffer.sample(jax.random.key(0), 5, row_blocks=2)
        assert str(e.value) == (
            f"{name}.sample(): row_blocks=2 must divide batch_size=5 (block d of every "
            "cluster's slots gets batch_size / row_blocks of the draws)."
        )
        with pytest.raises(ValueError, match="row_blocks"):
            buffer.sample(jax.random.key(0), 8, row_blocks=0)


@pytest.mark.parametrize("kind", [eb.ClusteredBuffer, eb.PrioritisedClusteredBuffer])
def test_clustered_block_with_nothing_held_raises(kind):
    buffer = kind(
        CLUSTERED,
        add_batch_size=2,
        num_clusters=3,
        cluster_capacity=CAP,
        cluster_fn=_cluster_of,
    )
    # 3 items per cluster: block 1 (slots 4-7) of every cluster is empty.
    buffer = _add(buffer, {"t": jnp.zeros((2, 3), jnp.int32), "c": jnp.array([[0, 1, 2]] * 2)})
    sample = eb.filter_jit(lambda b: b.sample(jax.random.key(0), 8))
    sample(buffer)  # globally fine
    blocks = eb.filter_jit(lambda b: b.sample(jax.random.key(0), 8, row_blocks=2))
    with pytest.raises(eqx.EquinoxRuntimeError, match="in one of the row_blocks=2 blocks of slots"):
        blocks(buffer)
    buffer = _add(buffer, {"t": jnp.zeros((2, 2), jnp.int32), "c": jnp.zeros((2, 2), jnp.int32)})
    assert blocks(buffer).cluster.reshape(2, 4)[1].tolist() == [0] * 4  # only cluster 0 there


def test_prioritised_clustered_block_at_priority_zero_raises():
    buffer = _clustered(eb.PrioritisedClusteredBuffer)
    cluster = jnp.array([0, 0, 0, 0, 1, 1], jnp.int32)  # every item held in block 1
    slot = jnp.array([4, 5, 6, 7, 4, 5], jnp.int32)
    _, steps = _numbers(buffer.storage, cluster, slot)
    buffer = _set_priorities(buffer, cluster * CAP + slot, jnp.zeros(6), steps=steps)
    eb.filter_jit(lambda b: b.sample(jax.random.key(0), 8))(buffer)  # globally fine
    with pytest.raises(eqx.EquinoxRuntimeError, match="every item held in the clusters of"):
        eb.filter_jit(lambda b: b.sample(jax.random.key(0), 8, row_blocks=2))(buffer)


# --- Mixer: block d of the mix = block d of each source's own sample ------------------------


def _sources():
    ring = _filled(KINDS["trajectory"]())
    prioritised = _filled(KINDS["prioritised"]())
    return ring, prioritised


def test_mixer_block_d_is_block_d_of_each_source():
    ring, prioritised = _sources()
    mixer = eb.Mixer((ring, prioritised), (0.25, 0.75))
    assert mixer.counts(16) == (4, 12)
    key = jax.random.key(4)
    sample = eb.filter_jit(lambda m: m.sample(key, 16, beta=0.5, row_blocks=2))(mixer)
    assert sample.row_blocks == 2
    # The sources' own samples, with the keys the mixer gives them.
    k0, k1 = jax.random.split(key, 2)
    own = eb.filter_jit(
        lambda r, p: (r.sample(k0, 4, row_blocks=2), p.sample(k1, 12, beta=0.5, row_blocks=2))
    )(ring, prioritised)
    expected = np.concatenate(
        [
            np.asarray(own[0].experience["t"]).reshape(2, 2, -1),
            np.asarray(own[1].experience["t"]).reshape(2, 6, -1),
        ],
        axis=1,
    ).reshape(16, -1)
    np.testing.assert_array_equal(np.asarray(sample.experience["t"]), expected)
    assert np.asarray(sample.source).tolist() == ([0] * 2 + [1] * 6) * 2
    weights = np.concatenate([np.ones((2, 2)), np.asarray(own[1].weights).reshape(2, 6)], 1)
    np.testing.assert_allclose(np.asarray(sample.weights), weights.ravel(), rtol=1e-6)
    for mine, theirs in zip(sample.samples, own, strict=True):
        np.testing.assert_array_equal(np.asarray(mine.indices), np.asarray(theirs.indices))
    # Block d of each source comes from its own block d of rows (2 rows of 8 slots each).
    rows = np.asarray(own[0].indices).reshape(2, -1) // L, np.asarray(own[1].indices) // L
    assert (rows[0][0] < 2).all() and (rows[0][1] >= 2).all()
    assert (rows[1].reshape(2, -1)[0] < 2).all() and (rows[1].reshape(2, -1)[1] >= 2).all()
    # set_priorities hands each prioritised source its own rows, in its own order.
    priorities = jnp.arange(1.0, 17.0)
    updated = eb.filter_jit(lambda m, s: m.set_priorities(s, priorities))(mixer, sample)
    mine = priorities.reshape(2, 8)[:, 2:].reshape(-1)
    direct = _set_priorities(prioritised, own[1], mine)
    np.testing.assert_array_equal(
        np.asarray(updated.buffers[1].tree.values()), np.asarray(direct.tree.values())
    )


def test_mixer_row_blocks_must_divide_every_share():
    ring, prioritised = _sources()
    mixer = eb.Mixer((ring, prioritised, ring), (0.5, 0.25, 0.25))
    with pytest.raises(ValueError) as e:
        mixer.sample(jax.random.key(0), 12, row_blocks=2)
    assert str(e.value) == (
        "Mixer.sample(): row_blocks=2 must divide every source's share of the batch, "
        "counts(batch_size=12) = (6, 3, 3) (block d of the mix is block d of each source's "
        "own sample, counts[i] / row_blocks rows of source i)."
    )
    with pytest.raises(ValueError, match="row_blocks"):
        mixer.sample(jax.random.key(0), 12, row_blocks=0)
    # A source of share 0 is skipped; a source's own condition is its own message.
    skipped = eb.Mixer((ring, prioritised), (1.0, 0.0))
    sample = eb.filter_jit(lambda m: m.sample(jax.random.key(0), 4, row_blocks=2))(skipped)
    assert sample.source.tolist() == [0] * 4
    with pytest.raises(
        ValueError, match=r"TrajectoryBuffer.sample\(\): row_blocks=8 must divide add_batch_size=4"
    ):
        eb.Mixer((ring,), (1.0,)).sample(jax.random.key(0), 8, row_blocks=8)


# --- RateLimited: row_blocks passed to its buffer ------------------------------------------


def test_rate_limited_passes_row_blocks_and_counts_the_whole_batch():
    buffer = _filled(KINDS["prioritised"]())
    limited = eb.RateLimited(buffer, samples_per_insert=4.0, tolerance=64.0)
    limited = _add(limited, {"t": jnp.zeros((R, 2), jnp.int32), **_steps(2)})
    credit = float(limited.credit())
    key = jax.random.key(7)
    after, sample = eb.filter_jit(lambda r: r.sample(key, 8, row_blocks=2, beta=0.4))(limited)
    own = eb.filter_jit(lambda b: b.sample(key, 8, beta=0.4, row_blocks=2))(limited.buffer)
    for x, y in zip(jax.tree.leaves(sample), jax.tree.leaves(own), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(after.credit()) == credit - 8
    with pytest.raises(ValueError, match=r"row_blocks=3 must divide add_batch_size=4"):
        limited.sample(key, 6, row_blocks=3)


def _steps(t):
    return {"r": jnp.zeros((R, t), jnp.float32), "done": jnp.zeros((R, t), bool)}
