import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb
from equibuffer import n_step_transition, NStepTransition


def _example():
    return {
        "obs": jnp.zeros(2, jnp.float32),
        "t": jnp.int32(0),
        "reward": jnp.float32(0),
        "terminated": jnp.bool_(False),
        "truncated": jnp.bool_(False),
    }


def _episodes(rng, rows, steps, p_end=0.25):
    """Random rewards and both kinds of ends (sometimes both flags on one step)."""
    tag = np.arange(rows)[:, None] * 100_000 + np.arange(steps)[None, :]
    return {
        "obs": np.stack([tag, -tag], -1).astype(np.float32),
        "t": tag.astype(np.int32),
        "reward": rng.normal(size=(rows, steps)).astype(np.float32),
        "terminated": rng.random((rows, steps)) < p_end,
        "truncated": rng.random((rows, steps)) < p_end,
    }


def _reference(reward, terminated, truncated, t, n, g):
    """Plain Python: (steps taken, discounted reward, bootstrap discount) from step t."""
    total, m = 0.0, 0
    for k in range(n):
        total += g**k * float(reward[t + k])
        m += 1
        if terminated[t + k] or (truncated is not None and truncated[t + k]):
            break
    disc = 0.0 if terminated[t + m - 1] else g**m
    return m, total, disc


def _check(out: NStepTransition, history, rows, starts, n, g, use_truncated=True):
    for i, (row, t) in enumerate(zip(rows, starts, strict=True)):
        trunc = history["truncated"][row] if use_truncated else None
        m, total, disc = _reference(
            history["reward"][row], history["terminated"][row], trunc, t, n, g
        )
        assert int(out.steps[i]) == m
        np.testing.assert_allclose(float(out.reward[i]), total, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(out.discount[i]), disc, rtol=1e-6)
        assert int(out.first["t"][i]) == history["t"][row, t]
        assert int(out.last["t"][i]) == history["t"][row, t + m - 1]
        assert int(out.second["t"][i]) == history["t"][row, t + m]
        assert float(out.second["obs"][i, 1]) == -history["t"][row, t + m]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("use_truncated", [True, False])
def test_function_matches_python_reference(n, use_truncated):
    rng = np.random.default_rng(n)
    g = 0.9
    history = _episodes(rng, rows=3, steps=40)
    starts = rng.integers(0, 40 - n, size=64)
    rows = rng.integers(0, 3, size=64)
    windows = {
        k: jnp.asarray(np.stack([v[r, s : s + n + 1] for r, s in zip(rows, starts, strict=True)]))
        for k, v in history.items()
    }
    out = n_step_transition(windows, n, g, truncated="truncated" if use_truncated else None)
    _check(out, history, rows, starts, n, g, use_truncated)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_buffer_matches_python_reference(n, getkey):
    rng = np.random.default_rng(10 + n)
    g, rows, length = 0.8, 2, 11
    buffer = eb.TransitionBuffer(
        _example(), add_batch_size=rows, max_length_time_axis=length, n_step=n, discount=g
    )
    assert buffer.sequence_length == n + 1 and buffer.min_length_time_axis == n + 1
    history = _episodes(rng, rows, 30)
    sample_fn = eb.filter_jit(lambda b, k: b.sample(k, 128))
    added = 0
    for t in (3, 5, 1, 9, 12):  # wraps the ring several times
        chunk = {k: jnp.asarray(v[:, added : added + t]) for k, v in history.items()}
        buffer = buffer.add(chunk)
        added += t
        if not bool(buffer.can_sample()):
            assert added < n + 1
            continue
        sample = sample_fn(buffer, getkey())
        starts = np.asarray(sample.steps).astype(np.int64)
        held = min(added, length)
        assert np.all(starts >= added - held) and np.all(starts + n < added)
        _check(sample.experience, history, np.asarray(sample.indices) // length, starts, n, g)


def test_trajectory_buffer_sequences_give_the_same_values(getkey):
    rng = np.random.default_rng(0)
    history = _episodes(rng, 2, 20)
    buffer = eb.TrajectoryBuffer(
        _example(), add_batch_size=2, max_length_time_axis=20, sequence_length=4
    )
    buffer = buffer.add(jax.tree.map(jnp.asarray, history))
    sample = buffer.sample(getkey(), 64)
    out = n_step_transition(sample.experience, 3, 0.5)
    rows = np.asarray(sample.indices) // 20
    _check(out, history, rows, np.asarray(sample.steps).astype(np.int64), 3, 0.5)


def test_truncation_keeps_bootstrap_termination_cuts_it():
    steps = {
        "obs": jnp.arange(8.0).reshape(2, 4),
        "reward": jnp.ones((2, 4)),
        "terminated": jnp.array([[False, True, False, False], [False] * 4]),
        "truncated": jnp.array([[False] * 4, [False, True, False, False]]),
    }
    out = n_step_transition(steps, 3, 0.5)
    assert out.steps.tolist() == [2, 2]
    assert out.reward.tolist() == [1.5, 1.5]
    assert out.discount.tolist() == [0.0, 0.25]
    assert out.last["obs"].tolist() == [1.0, 5.0]
    assert out.second["obs"].tolist() == [2.0, 6.0]


def test_errors():
    ex = _example()
    with pytest.raises(ValueError, match="`n_step` must be at least 1"):
        eb.TransitionBuffer(ex, add_batch_size=1, max_length_time_axis=8, n_step=0, discount=0.9)
    with pytest.raises(TypeError, match="give both `n_step` and `discount`"):
        eb.TransitionBuffer(ex, add_batch_size=1, max_length_time_axis=8, n_step=2)
    with pytest.raises(ValueError, match="`discount` must be between 0 and 1"):
        eb.TransitionBuffer(ex, add_batch_size=1, max_length_time_axis=8, n_step=2, discount=1.5)
    with pytest.raises(ValueError, match=r"n_step \+ 1 = 6 steps is larger than the ring"):
        eb.TransitionBuffer(ex, add_batch_size=1, max_length_time_axis=5, n_step=5, discount=0.9)
    with pytest.raises(ValueError, match="no leaf 'done'; .* `terminated=`"):
        eb.TransitionBuffer(
            ex, add_batch_size=1, max_length_time_axis=8, n_step=2, discount=0.9, terminated="done"
        )
    bad = dict(ex, truncated=jnp.int32(0))
    with pytest.raises(
        TypeError, match="leaf 'truncated' .* must be a scalar bool per step, got int32"
    ):
        eb.TransitionBuffer(bad, add_batch_size=1, max_length_time_axis=8, n_step=2, discount=0.9)
    bad = dict(ex, reward=jnp.int32(0))
    with pytest.raises(TypeError, match="leaf 'reward' .* must be a scalar float"):
        eb.TransitionBuffer(bad, add_batch_size=1, max_length_time_axis=8, n_step=2, discount=0.9)
    seq = jax.tree.map(lambda x: jnp.zeros((4, 3, *x.shape), x.dtype), ex)
    with pytest.raises(ValueError, match=r"expected \(batch, n \+ 1 = 4"):
        n_step_transition(seq, 3, 0.9)
    with pytest.raises(ValueError, match="`n_step` must be at least 1"):
        n_step_transition(seq, 0, 0.9)
    seq.pop("terminated")
    with pytest.raises(ValueError, match="no leaf 'terminated'"):
        n_step_transition(seq, 2, 0.9)
    buffer = eb.TransitionBuffer(
        ex, add_batch_size=1, max_length_time_axis=8, n_step=3, discount=0.9
    )
    buffer = buffer.add(jax.tree.map(lambda x: jnp.zeros((1, 3, *x.shape), x.dtype), ex))
    with pytest.raises(eqx.EquinoxRuntimeError, match="n_step \\+ 1 = 4"):
        eb.filter_jit(lambda b: b.sample(jax.random.key(0), 4))(buffer)


def test_donating_jit_traces_once():
    @eb.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, batch, key):
        buffer = buffer.add(batch)
        value = jax.lax.cond(
            buffer.can_sample(),
            lambda b: jnp.mean(b.sample(key, 16).experience.reward),
            lambda b: jnp.float32(0),
            buffer,
        )
        return buffer, value

    buffer = eb.TransitionBuffer(
        _example(), add_batch_size=2, max_length_time_axis=16, n_step=3, discount=0.9
    )
    rng = np.random.default_rng(0)
    for i in range(8):
        batch = jax.tree.map(lambda x: jnp.asarray(x[:, 0]), _episodes(rng, 2, 1))
        buffer, value = step(buffer, batch, jax.random.key(i))
        assert np.isfinite(float(value))
