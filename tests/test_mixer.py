import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import equibuffer as eb
from equibuffer import ClusteredBuffer, ItemBuffer, PrioritisedClusteredBuffer, TrajectoryBuffer
from equibuffer._buffers._prioritised import PrioritisedItemBuffer
from equibuffer._mixer import largest_remainder, Mixer

from .helpers import chi_square_pvalue


EXAMPLE = {"x": jnp.int32(0)}


def _filled(buffer, base, steps):
    """Items tagged `base + row * 1000 + step`."""
    rows = buffer.add_batch_size
    tag = base + np.arange(rows)[:, None] * 1000 + np.arange(steps)[None, :]
    return buffer.add({"x": jnp.asarray(tag, jnp.int32)}), tag


@given(
    props=st.lists(st.integers(0, 20), min_size=1, max_size=5).filter(lambda w: sum(w) > 0),
    batch_size=st.integers(1, 300),
)
def test_largest_remainder_against_reference(props, batch_size):
    p = [w / sum(props) for w in props]
    counts = largest_remainder(p, batch_size)
    assert sum(counts) == batch_size
    for c, q in zip(counts, p, strict=True):
        assert abs(c - q * batch_size) < 1 + 1e-9  # within one row of the exact share
        assert c in (np.floor(q * batch_size + 1e-9), np.ceil(q * batch_size - 1e-9))
    # Deterministic and stated: floor, then the largest fractional parts, ties to lower index.
    exact = np.array(p) * batch_size
    want = np.floor(exact).astype(int)
    order = sorted(range(len(p)), key=lambda i: (-(exact[i] - want[i]), i))
    for i in order[: batch_size - want.sum()]:
        want[i] += 1
    assert list(counts) == want.tolist()


def test_shares_sources_and_per_source_distributions():
    """Uniform source: uniform over its items; prioritised source: p**alpha; each row is
    labelled with its source and comes from it."""
    uniform, _ = _filled(ItemBuffer(EXAMPLE, add_batch_size=2, max_length_time_axis=8), 0, 5)
    prio, tags = _filled(
        PrioritisedItemBuffer(EXAMPLE, add_batch_size=2, max_length_time_axis=8), 10**6, 4
    )
    # Priorities 1..8 on the 8 held items (row-major: flat index row * 8 + slot).
    indices = jnp.asarray([r * 8 + s for r in range(2) for s in range(4)], jnp.int32)
    priorities = jnp.arange(1, 9, dtype=jnp.float32)
    steps = jnp.asarray([s for _ in range(2) for s in range(4)], jnp.uint32)
    prio = prio.set_priorities(indices, priorities, steps=steps)
    mixer = Mixer((uniform, prio), proportions=(0.7, 0.3))
    assert mixer.counts(50) == (35, 15)
    draw = eb.filter_jit(lambda m, k: m.sample(k, 50, beta=0.5))
    uniform_counts = np.zeros(10)
    prio_counts = np.zeros(8)
    for i in range(200):
        s = draw(mixer, jax.random.key(i))
        source, x = np.asarray(s.source), np.asarray(s.experience["x"])
        np.testing.assert_array_equal(source, [0] * 35 + [1] * 15)
        assert np.all(x[:35] < 10**6) and np.all(x[35:] >= 10**6)
        np.testing.assert_array_equal(np.asarray(s.weights)[:35], 1.0)
        np.testing.assert_array_equal(np.asarray(s.weights)[35:], np.asarray(s.samples[1].weights))
        # The sources' rows are held once, in `experience`.
        assert s.samples[0].experience is None and s.samples[1].experience is None
        rows, steps_ = np.divmod(x[:35], 1000)
        np.add.at(uniform_counts, rows * 5 + steps_, 1)
        np.add.at(
            prio_counts,
            np.asarray(s.samples[1].indices) // 8 * 4 + np.asarray(s.samples[1].indices) % 8,
            1,
        )
    assert chi_square_pvalue(uniform_counts, np.full(10, 0.1)) > 1e-3
    alpha = prio.alpha
    target = np.arange(1, 9) ** alpha
    assert chi_square_pvalue(prio_counts, target / target.sum()) > 1e-3


def test_set_priorities_are_routed_to_their_source():
    uniform, _ = _filled(ItemBuffer(EXAMPLE, add_batch_size=1, max_length_time_axis=8), 0, 4)
    prio, _ = _filled(
        PrioritisedItemBuffer(EXAMPLE, add_batch_size=1, max_length_time_axis=8), 100, 4
    )
    mixer = Mixer((uniform, prio), proportions=(0.5, 0.5))
    s = mixer.sample(jax.random.key(0), 8)
    mixer = mixer.set_priorities(s, jnp.arange(8, dtype=jnp.float32))
    leaves = np.asarray(mixer.buffers[1].tree.levels[0])
    idx = np.asarray(s.samples[1].indices)
    # The last update of an index wins: each sampled leaf holds the priority of its last row.
    for j, i in enumerate(idx):
        if j == max(k for k in range(4) if idx[k] == i):
            np.testing.assert_allclose(leaves[i], (4 + j) ** prio.alpha, rtol=1e-6)
    assert mixer.buffers[0] is uniform or eqx.tree_equal(mixer.buffers[0], uniform)


def test_zero_share_source_is_skipped_and_mixed_kinds_refused():
    a, _ = _filled(ItemBuffer(EXAMPLE, add_batch_size=1, max_length_time_axis=4), 0, 2)
    b = ItemBuffer(EXAMPLE, add_batch_size=1, max_length_time_axis=4)  # empty but never drawn
    mixer = Mixer((a, b), proportions=(1.0, 0.0))
    s = mixer.sample(jax.random.key(0), 4)
    assert s.samples[1] is None and bool(mixer.can_sample())
    traj, _ = _filled(
        TrajectoryBuffer(EXAMPLE, add_batch_size=1, max_length_time_axis=4, sequence_length=2), 0, 3
    )
    with pytest.raises(ValueError, match=r"leaf \['x'\] is int32\[2\] per row in buffers\[1\]"):
        Mixer((a, traj), proportions=(0.5, 0.5)).sample(jax.random.key(0), 4)


def test_bad_proportions():
    a = ItemBuffer(EXAMPLE, add_batch_size=1, max_length_time_axis=4)
    with pytest.raises(ValueError, match="must sum to 1"):
        Mixer((a, a), proportions=(0.5, 0.4))
    with pytest.raises(ValueError, match="2 proportions for 1 buffers"):
        Mixer((a,), proportions=(0.5, 0.5))
    with pytest.raises(ValueError, match=r"proportions\[0\] must be finite and >= 0"):
        Mixer((a, a), proportions=(-0.5, 1.5))
    with pytest.raises(TypeError, match="buffers"):  # jaxtyping or our own check
        Mixer((a, {}), proportions=(0.5, 0.5))  # type: ignore[arg-type]


def test_empty_source_raises_inside_jit():
    a, _ = _filled(ItemBuffer(EXAMPLE, add_batch_size=1, max_length_time_axis=4), 0, 2)
    b = ItemBuffer(EXAMPLE, add_batch_size=1, max_length_time_axis=4)
    mixer = Mixer((a, b), proportions=(0.5, 0.5))
    assert not bool(mixer.can_sample())
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        eb.filter_jit(lambda m: m.sample(jax.random.key(0), 4))(mixer)


def test_in_a_donating_train_step_traces_once():
    class State(eqx.Module):
        mixer: Mixer
        total: jax.Array

    @eb.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(state, key, i):
        online = state.mixer.buffers[0].add({"x": jnp.full((2,), i, jnp.int32)})
        mixer = eqx.tree_at(lambda m: m.buffers[0], state.mixer, online)
        s = mixer.sample(key, 8, beta=0.4)
        mixer = mixer.set_priorities(s, jnp.ones(8, jnp.float32))
        return State(mixer, state.total + jnp.sum(s.experience["x"]))

    online = ItemBuffer(EXAMPLE, add_batch_size=2, max_length_time_axis=16)
    offline, _ = _filled(
        PrioritisedItemBuffer(EXAMPLE, add_batch_size=2, max_length_time_axis=8), 0, 8
    )
    state = State(Mixer((online, offline), proportions=(0.5, 0.5)), jnp.int32(0))
    for i in range(5):
        state = step(state, jax.random.key(i), jnp.int32(i))
    assert int(state.mixer.buffers[0].storage.fill) == 5


def test_clustered_sources_rows_data_and_priorities_routed_back():
    """An `ItemBuffer`, a `ClusteredBuffer` and a `PrioritisedClusteredBuffer` in one mix:
    each row comes from its source with its source's data; the prioritised clustered
    source's rows carry its weights and get their priorities back, each in its item's own
    cluster; the uniform ones are untouched."""

    def by_sign(item):
        return (item["x"] > 0).astype(jnp.int32)

    def clustered(cls):
        return cls(
            EXAMPLE, add_batch_size=2, num_clusters=2, cluster_capacity=4, cluster_fn=by_sign
        )

    items, _ = _filled(
        ItemBuffer(EXAMPLE, add_batch_size=2, max_length_time_axis=8), 0, 3
    )  # 0..2, 1000..
    # Clustered sources: x = ±(base + i), the sign alternating, so both clusters get items.
    x = np.array([[1, -2, 3], [-4, 5, -6]])
    uniform = clustered(ClusteredBuffer).add(
        {"x": jnp.asarray((100 + np.abs(x)) * np.sign(x), jnp.int32)}
    )
    prio = clustered(PrioritisedClusteredBuffer).add(
        {"x": jnp.asarray((200 + np.abs(x)) * np.sign(x), jnp.int32)}
    )
    mixer = Mixer((items, uniform, prio), proportions=(0.25, 0.25, 0.5))
    assert mixer.counts(16) == (4, 4, 8)
    s = eb.filter_jit(lambda m, k: m.sample(k, 16, beta=1.0))(mixer, jax.random.key(0))
    got = np.asarray(s.experience["x"])
    np.testing.assert_array_equal(np.asarray(s.source), [0] * 4 + [1] * 4 + [2] * 8)
    assert set(got[:4].tolist()) <= {0, 1, 2, 1000, 1001, 1002}
    assert set(np.abs(got[4:8]).tolist()) <= set(range(101, 107))
    assert set(np.abs(got[8:]).tolist()) <= set(range(201, 207))
    part = s.samples[2]
    assert isinstance(part, eb.PrioritisedClusteredSample)
    np.testing.assert_array_equal(np.asarray(part.cluster), got[8:] > 0)
    np.testing.assert_array_equal(np.asarray(s.weights)[8:], np.asarray(part.weights))
    np.testing.assert_array_equal(np.asarray(s.weights)[:8], 1.0)
    assert isinstance(s.samples[1], eb.ClusteredSample)
    np.testing.assert_array_equal(np.asarray(s.samples[1].cluster), got[4:8] > 0)
    # Each prioritised row's priority is |x| - 200 (one per item, whatever row it is on).
    priorities = jnp.asarray(np.concatenate([np.full(8, 50.0), np.abs(got[8:]) - 200.0]))
    updated = eb.filter_jit(lambda m, s, p: m.set_priorities(s, p))(mixer, s, priorities)
    trees = updated.buffers[2].trees
    for i, (c, index) in enumerate(
        zip(np.asarray(part.cluster), np.asarray(part.indices), strict=True)
    ):
        slot = index % 4
        leaf = float(trees[c].values()[slot])
        np.testing.assert_allclose(
            leaf, (abs(got[8 + i]) - 200.0) ** updated.buffers[2].alpha, rtol=1e-6
        )
    assert float(updated.buffers[2].max_priority) == float(np.abs(got[8:]).max() - 200)
    assert eqx.tree_equal(updated.buffers[0], items) and eqx.tree_equal(updated.buffers[1], uniform)
