import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import equibuffer as eb

from .helpers import budget


def _example():
    return {"obs": jnp.zeros(2, jnp.float32), "reward": jnp.float32(0), "id": jnp.int32(0)}


def _relabel(step):
    """Reward relabelling from another field, and a recomputed integer field."""
    return {
        "obs": step["obs"],
        "reward": step["obs"][0] * 2.0 + step["reward"],
        "id": step["id"] + 1,
    }


@eqx.filter_jit
def _update(buffer):
    return buffer.update(_relabel)


@settings(max_examples=budget(20), deadline=None)
@given(
    rows=st.integers(1, 3),
    length=st.integers(2, 6),
    adds=st.lists(st.integers(1, 8), min_size=0, max_size=4),
    kind=st.sampled_from(["trajectory", "transition", "item"]),
)
def test_update_matches_numpy_on_written_slots_only(rows, length, adds, kind):
    if kind == "trajectory":
        buffer = eb.TrajectoryBuffer(
            _example(), add_batch_size=rows, max_length_time_axis=length, sequence_length=2
        )
    elif kind == "transition":
        buffer = eb.TransitionBuffer(_example(), add_batch_size=rows, max_length_time_axis=length)
    else:
        buffer = eb.ItemBuffer(_example(), add_batch_size=rows, max_length_time_axis=length)
    total = 0
    rng = np.random.default_rng(len(adds))
    for t in adds:
        batch = {
            "obs": rng.normal(size=(rows, t, 2)).astype(np.float32),
            "reward": rng.normal(size=(rows, t)).astype(np.float32),
            "id": rng.integers(1, 100, size=(rows, t)).astype(np.int32),
        }
        buffer = buffer.add(jax.tree.map(jnp.asarray, batch))
        total += t
    before = jax.tree.map(np.asarray, buffer.storage.data)
    updated = _update(buffer)
    after = jax.tree.map(np.asarray, updated.storage.data)
    # Slot s is written once min(total, length) steps are held: all slots once full.
    written = np.arange(length) < min(total, length)
    want_reward = np.where(written, before["obs"][..., 0] * 2.0 + before["reward"], 0.0)
    np.testing.assert_allclose(after["reward"], want_reward, rtol=1e-6)
    np.testing.assert_array_equal(after["id"], np.where(written, before["id"] + 1, 0))
    np.testing.assert_array_equal(after["obs"], before["obs"])
    for name in ("head", "fill", "count_lo", "count_hi"):
        assert int(getattr(updated.storage, name)) == int(getattr(buffer.storage, name))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), after) == jax.tree.map(
        lambda x: (x.shape, x.dtype), before
    )


def test_bad_functions_are_refused_naming_the_leaf():
    buffer = eb.ItemBuffer(_example(), add_batch_size=1, max_length_time_axis=4)
    with pytest.raises(ValueError, match=r"leaf \['id'\] with shape \(\) and dtype float32"):
        buffer.update(lambda s: dict(s, id=s["id"].astype(jnp.float32)))
    with pytest.raises(ValueError, match=r"leaf \['obs'\] with shape \(3,\)"):
        buffer.update(lambda s: dict(s, obs=jnp.zeros(3, jnp.float32)))
    with pytest.raises(ValueError, match=r"missing leaves \['reward'\]"):
        buffer.update(lambda s: {"obs": s["obs"], "id": s["id"]})


def test_donating_jit_traces_once():
    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, scale):
        buffer = buffer.add(
            {"obs": jnp.ones((2, 2)), "reward": jnp.ones(2), "id": jnp.ones(2, jnp.int32)}
        )
        return buffer.update(lambda s: dict(s, reward=s["reward"] * scale))

    buffer = eb.TransitionBuffer(_example(), add_batch_size=2, max_length_time_axis=4)
    for _ in range(3):
        buffer = step(buffer, jnp.float32(2.0))
    np.testing.assert_array_equal(np.asarray(buffer.storage.data["reward"])[0], [8, 4, 2, 0])
