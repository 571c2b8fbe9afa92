"""The buffer used the way DESIGN.md says users use it: a field of a train state, stepped by
`eqx.filter_jit(donate="all")`, vmapped, serialised."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb

from .helpers import spread


EXAMPLE = {"obs": jnp.zeros(3), "action": jnp.int32(0), "reward": jnp.float32(0)}


def _steps(rows, value, t=None):
    lead = (rows,) if t is None else (rows, t)
    return {
        "obs": jnp.full((*lead, 3), value, jnp.float32),
        "action": jnp.full(lead, value, jnp.int32),
        "reward": jnp.full(lead, value, jnp.float32),
    }


def _buffers():
    return [
        eb.TrajectoryBuffer(
            EXAMPLE, add_batch_size=4, max_length_time_axis=16, sequence_length=4, period=2
        ),
        eb.TransitionBuffer(EXAMPLE, add_batch_size=4, capacity=64),
        eb.ItemBuffer(EXAMPLE, add_batch_size=4, capacity=64),
    ]


class State(eqx.Module):
    linear: eqx.nn.Linear
    buffer: eb.AbstractBuffer
    step: jax.Array
    last_mean: jax.Array


@pytest.mark.parametrize("buffer", _buffers(), ids=lambda b: type(b).__name__)
def test_train_state_under_donating_jit_traces_once(buffer):
    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(state: State, key) -> State:
        batch = jax.tree.map(lambda x: x + state.step.astype(x.dtype), _steps(4, 0.0))
        buffer = state.buffer.add(batch)

        def learn(b):
            obs = jax.tree.leaves(b.sample(key, 8).experience)[-1]  # any leaf
            return jnp.mean(obs.astype(jnp.float32))

        mean = jax.lax.cond(buffer.can_sample(), learn, lambda b: jnp.float32(-1), buffer)
        return State(state.linear, buffer, state.step + 1, mean)

    state = State(eqx.nn.Linear(3, 2, key=jax.random.key(0)), buffer, jnp.array(0), jnp.float32(0))
    means = []
    for i in range(25):
        state = step(state, jax.random.key(i))
        means.append(float(state.last_mean))
    assert state.buffer.storage.steps_added() == 25
    # -1 until `min_length_time_axis` steps are held (the cond skipped sampling), then real data.
    ready = state.buffer.min_length_time_axis - 1
    assert means[:ready] == [-1.0] * ready and means[ready] >= 0 and means[-1] > 0
    stored = np.asarray(state.buffer.storage.data["action"])
    held = min(25, state.buffer.max_length_time_axis)
    assert sorted(set(stored.ravel().tolist())) == list(range(25 - held, 25))


def test_add_under_donation_reuses_memory():
    buffer = eb.ItemBuffer(EXAMPLE, add_batch_size=4, capacity=4096)
    add = eqx.filter_jit(lambda b, x: b.add(x), donate="all")
    buffer = add(buffer, _steps(4, 1.0))
    before = buffer.storage.data["obs"].unsafe_buffer_pointer()
    buffer = add(buffer, _steps(4, 2.0))
    assert buffer.storage.data["obs"].unsafe_buffer_pointer() == before


@pytest.mark.parametrize("make", range(3), ids=["trajectory", "transition", "item"])
def test_vmap_over_a_stack_of_buffers(make):
    one = _buffers()[make]
    stack = jax.tree.map(lambda x: jnp.stack([x, x, x]), one)
    batches = jax.tree.map(lambda *x: jnp.stack(x), *[_steps(4, v, t=6) for v in (1.0, 2.0, 3.0)])
    stack = eqx.filter_vmap(lambda b, x: b.add(x))(stack, batches)
    keys = jax.random.split(jax.random.key(0), 3)
    samples = eqx.filter_vmap(lambda b, k: b.sample(k, 5))(stack, keys)
    actions = jax.tree.leaves(samples.experience)[0]  # ['action'] or .first['action']
    for i, v in enumerate((1, 2, 3)):
        assert np.all(np.asarray(actions[i]) == v)


@pytest.mark.parametrize("buffer", _buffers(), ids=lambda b: type(b).__name__)
def test_serialise_round_trip(buffer):
    buffer = buffer.add(_steps(4, 7.0, t=9))
    f = io.BytesIO()
    eqx.tree_serialise_leaves(f, buffer)
    f.seek(0)
    like = type(buffer)  # a fresh buffer of the same configuration is the template
    fresh = _buffers()[[type(b) for b in _buffers()].index(like)]
    loaded = eqx.tree_deserialise_leaves(f, fresh)
    assert jax.tree.structure(loaded) == jax.tree.structure(buffer)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(buffer), strict=True):
        np.testing.assert_array_equal(a, b)
    assert loaded.storage.steps_added() == 9
    loaded = loaded.add(_steps(4, 8.0))  # and it carries on
    assert loaded.storage.steps_added() == 10


def test_vmapped_training_run_with_can_sample_cond():
    """DESIGN's batched use: the whole run vmapped over seeds, `lax.cond(can_sample)` inside.
    `can_sample` depends only on counters, so the cond is not turned into a select and the
    error in `sample` does not fire at step 0."""

    def train(seed):
        buffer = eb.TrajectoryBuffer(
            EXAMPLE, add_batch_size=2, max_length_time_axis=8, sequence_length=3
        )
        key = jax.random.key(seed)

        def body(carry, t):
            buffer, key = carry
            key, k1, k2 = jax.random.split(key, 3)
            noise = jax.random.normal(k1, (2, 3))
            batch = {
                "obs": noise,
                "action": jnp.full((2,), t, jnp.int32),
                "reward": jnp.zeros(2, jnp.float32),
            }
            buffer = buffer.add(batch)
            learned = jax.lax.cond(
                buffer.can_sample(),
                lambda b: jnp.min(b.sample(k2, 4).experience["action"]),
                lambda b: jnp.int32(-1),
                buffer,
            )
            return (buffer, key), learned

        _, learned = jax.lax.scan(body, (buffer, key), jnp.arange(6, dtype=jnp.int32))
        return learned

    learned = jax.jit(jax.vmap(train))(jnp.arange(4))
    assert learned.shape == (4, 6)
    np.testing.assert_array_equal(learned[:, :2], -1)  # steps 0, 1: too few steps, skipped
    assert np.all(np.asarray(learned[:, 2:]) >= 0)


def _every_kind():
    """One buffer of every kind, each with a batch it takes."""
    ex = {"obs": jnp.zeros(3), "reward": jnp.float32(0), "terminated": jnp.bool_(False)}
    step = {"obs": jnp.ones((4, 3)), "reward": jnp.ones(4), "terminated": jnp.zeros(4, bool)}
    nstep = dict(n_step=2, discount=0.9, truncated=None)
    kinds = {
        "trajectory": eb.TrajectoryBuffer(ex, add_batch_size=4, capacity=64, sequence_length=2),
        "transition": eb.TransitionBuffer(ex, add_batch_size=4, capacity=64),
        "nstep": eb.TransitionBuffer(ex, add_batch_size=4, capacity=64, **nstep),
        "episodic transition": eb.TransitionBuffer(
            ex, add_batch_size=4, capacity=64, episode_end="terminated"
        ),
        "item": eb.ItemBuffer(ex, add_batch_size=4, capacity=64),
        "episode trajectory": eb.EpisodeTrajectoryBuffer(
            ex, add_batch_size=4, capacity=64, sequence_length=2, episode_end="terminated"
        ),
        "prioritised trajectory": eb.PrioritisedTrajectoryBuffer(
            ex, add_batch_size=4, capacity=64, sequence_length=2
        ),
        "prioritised transition": eb.PrioritisedTransitionBuffer(ex, add_batch_size=4, capacity=64),
        "prioritised item": eb.PrioritisedItemBuffer(ex, add_batch_size=4, capacity=64),
        "prioritised episode": eb.PrioritisedEpisodeTrajectoryBuffer(
            ex, add_batch_size=4, capacity=64, sequence_length=2, episode_end="terminated"
        ),
        "clustered": eb.ClusteredBuffer(
            ex,
            add_batch_size=4,
            num_clusters=2,
            cluster_capacity=16,
            cluster_fn=lambda s: s["terminated"].astype(jnp.int32),
        ),  # fmt: skip
    }
    return [(name, buffer, step) for name, buffer in kinds.items()]


@pytest.mark.parametrize(
    "name,buffer,step", spread(_every_kind(), unpack=True), ids=[k[0] for k in _every_kind()]
)
def test_every_buffer_steps_under_plain_jax_jit(name, buffer, step):
    """The faster spelling the docs give for one call per step from Python: every buffer is
    a valid `jax.jit` argument (all its leaves arrays), donated, and compiles once."""
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(buffer))
    add = jax.jit(eqx.debug.assert_max_traces(lambda b, x: b.add(x), max_traces=1),
                  donate_argnums=0)  # fmt: skip
    sample = jax.jit(eqx.debug.assert_max_traces(lambda b, k: b.sample(k, 8), max_traces=1))
    for _ in range(5):
        old = buffer
        buffer = add(buffer, step)
        # Donated: the stored steps are written in place (a leaf the add sets to a constant,
        # such as the clustered buffer's `added` flag, need not be reused).
        assert all(x.is_deleted() for x in jax.tree.leaves(old.storage.data))
    drawn = sample(buffer, jax.random.key(0))
    assert int(buffer.steps_added()) == 5
    assert jax.tree.leaves(drawn.experience)[0].shape[0] == 8
    if isinstance(buffer, eb.AbstractPrioritisedSource):
        update = jax.jit(lambda b, s: b.set_priorities(s, jnp.full(8, 2.0)), donate_argnums=0)
        buffer = update(buffer, drawn)
        assert jax.tree.leaves(sample(buffer, jax.random.key(1)).experience)[0].shape[0] == 8
