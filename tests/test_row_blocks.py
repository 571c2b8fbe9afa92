"""`sample(..., row_blocks=n)` on one device: each block of rows gets its own draws, by the
buffer's rule restricted to its rows (chi-square), the gathered experience is that of the
drawn windows, `row_blocks=1` is the plain sample, and bad values are refused. The sum tree's
block search against NumPy. (On 8 devices: test_sharding_law.py.)"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb

from .helpers import chi_square_pvalue


R, L, BLOCKS, KEYS, BATCH = 4, 8, 2, 64, 128


def _filled(buffer, steps=11):
    t = jnp.arange(R * steps, dtype=jnp.int32).reshape(R, steps)
    done = (t % 5) == 0
    return buffer.add({"t": t, "r": t.astype(jnp.float32), "done": done})


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
        buffer = buffer.set_priorities(indices, p, steps=_slot_steps(buffer, indices))
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
    one = jax.tree.map(lambda x: x[0], sample)
    plain = buffer.view.gather(buffer.storage, one.indices, getattr(one, "mask", None))
    if getattr(one, "mask", None) is not None:
        plain = buffer.view.padded(plain, one.mask)
    for x, y in zip(jax.tree.leaves(one.experience), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", ["trajectory", "prioritised"])
def test_one_block_is_the_plain_sample(kind):
    buffer = _filled(KINDS[kind]())
    key = jax.random.key(3)
    a = eqx.filter_jit(lambda b: b.sample(key, 16))(buffer)
    b = eqx.filter_jit(lambda b: b.sample(key, 16, row_blocks=1))(buffer)
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
    buffer = buffer.set_priorities(indices, jnp.zeros(per), steps=_slot_steps(buffer, indices))
    eqx.filter_jit(lambda b: b.sample(jax.random.key(0), 8))(buffer)  # globally fine
    with pytest.raises(eqx.EquinoxRuntimeError, match="one of the row_blocks=2 blocks"):
        eqx.filter_jit(lambda b: b.sample(jax.random.key(0), 8, row_blocks=BLOCKS))(buffer)


@pytest.mark.parametrize(("capacity", "blocks"), [(12, 3), (2 * 512, 2), (4 * 40, 4)])
def test_sum_tree_block_search_matches_numpy(capacity, blocks):
    rng = np.random.default_rng(capacity)
    values = rng.uniform(0.0, 2.0, capacity).astype(np.float32)
    values[rng.random(capacity) < 0.4] = 0.0
    values[: capacity // blocks // 2] = 0.0  # leading zeros in block 0
    tree = eb.SumTree(capacity).set(jnp.arange(capacity), jnp.asarray(values))
    blocks_of = values.reshape(blocks, -1).astype(np.float64)
    np.testing.assert_allclose(tree.block_totals(blocks), blocks_of.sum(1), rtol=1e-5)
    # Every block's cumulative ranges, probed at their middles, at 0 and at the total.
    per = capacity // blocks
    for b in range(blocks):
        running = np.cumsum(blocks_of[b])
        mids = running - blocks_of[b] / 2
        probe = np.concatenate([mids[blocks_of[b] > 0], [0.0, running[-1], 10 * running[-1]]])
        leaves, found = tree.search_blocks(jnp.asarray(np.tile(probe, (blocks, 1)), jnp.float32))
        leaves, found = np.asarray(leaves[b]), np.asarray(found[b])
        positive = np.flatnonzero(blocks_of[b] > 0) + b * per
        expected = np.concatenate([positive, [positive[0], positive[-1], positive[-1]]])
        np.testing.assert_array_equal(leaves, expected)
        np.testing.assert_array_equal(found, values[expected])
