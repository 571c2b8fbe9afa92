"""With 64-bit types switched on (`jax.enable_x64`, which some RL code sets for precise
returns), every buffer keeps the dtypes of its state and its example: a jitted step under
donation adds, samples and updates priorities, and returns a state with the same dtypes,
so it is traced once. (Under x64, `jnp.sum` of int32 and `jnp.arange` without a dtype give
int64; the buffers must not let that reach their counters or indices.)"""

from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb

from .helpers import spread


ROWS, T = 2, 3
EXAMPLE = {
    "obs": jnp.zeros(3, jnp.float32),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
    "truncated": jnp.bool_(False),
    "done": jnp.bool_(False),
}


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


def _batch(i: jax.Array) -> dict:
    """`T` steps for each of `ROWS` rows, in the example's dtypes, episodes ending now and
    then."""
    step = i * T + jnp.arange(T, dtype=jnp.int32)
    lead = (ROWS, T)
    done = jnp.broadcast_to(step % 5 == 4, lead)
    return {
        "obs": jnp.broadcast_to(step.astype(jnp.float32)[None, :, None], (*lead, 3)),
        "action": jnp.broadcast_to(step, lead),
        "reward": jnp.ones(lead, jnp.float32),
        "terminated": done,
        "truncated": jnp.zeros(lead, jnp.bool_),
        "done": done,
    }


def _uniform(buffer: Any, key: jax.Array) -> tuple[Any, Any]:
    return buffer, buffer.sample(key, 4)


def _prioritised(buffer: Any, key: jax.Array) -> tuple[Any, Any]:
    sample = buffer.sample(key, 4, beta=0.4)
    return buffer.set_priorities(sample, jnp.arange(1, 5, dtype=jnp.float32)), sample


def _limited(limited: Any, key: jax.Array) -> tuple[Any, Any]:
    return limited.sample(key, 4)


def _queue(queue: Any, key: jax.Array) -> tuple[Any, Any]:
    return queue.sample()


def _mixer(mixer: Any, key: jax.Array) -> tuple[Any, Any]:
    sample = mixer.sample(key, 4, beta=0.4)
    return mixer.set_priorities(sample, jnp.ones(4, jnp.float32)), sample


def _clusters(item: dict) -> jax.Array:
    return (item["action"] % 2).astype(jnp.int32)


kw = dict(add_batch_size=ROWS, max_length_time_axis=12)
CASES: dict[str, tuple[Callable[[], Any], Callable[[Any, jax.Array], tuple[Any, Any]]]] = {
    "trajectory": (lambda: eb.TrajectoryBuffer(EXAMPLE, sequence_length=2, **kw), _uniform),
    "transition": (lambda: eb.TransitionBuffer(EXAMPLE, **kw), _uniform),
    "n-step": (lambda: eb.TransitionBuffer(EXAMPLE, n_step=2, discount=0.9, **kw), _uniform),
    "item": (lambda: eb.ItemBuffer(EXAMPLE, **kw), _uniform),
    "episode never_cross": (
        lambda: eb.EpisodeTrajectoryBuffer(EXAMPLE, sequence_length=2, **kw),
        _uniform,
    ),
    "episode pad": (
        lambda: eb.EpisodeTrajectoryBuffer(EXAMPLE, sequence_length=3, mode="pad", **kw),
        _uniform,
    ),
    "prioritised trajectory": (
        lambda: eb.PrioritisedTrajectoryBuffer(EXAMPLE, sequence_length=2, **kw),
        _prioritised,
    ),
    "prioritised transition": (
        lambda: eb.PrioritisedTransitionBuffer(EXAMPLE, **kw),
        _prioritised,
    ),
    "prioritised item": (lambda: eb.PrioritisedItemBuffer(EXAMPLE, **kw), _prioritised),
    "rank-prioritised": (
        lambda: eb.PrioritisedBuffer(
            EXAMPLE, rule=eb.rules.RankPrioritised(), view=eb.views.PairView(), **kw
        ),
        _prioritised,
    ),
    "prioritised episode": (
        lambda: eb.PrioritisedEpisodeTrajectoryBuffer(EXAMPLE, sequence_length=2, **kw),
        _prioritised,
    ),
    "queue": (
        lambda: eb.Queue(EXAMPLE, add_batch_size=ROWS, max_length_time_axis=6, sequence_length=T),
        _queue,
    ),
    "clustered": (
        lambda: eb.ClusteredBuffer(
            EXAMPLE,
            add_batch_size=ROWS,
            num_clusters=2,
            cluster_capacity=8,
            cluster_fn=_clusters,
        ),
        _uniform,
    ),
    "prioritised clustered": (
        lambda: eb.PrioritisedClusteredBuffer(
            EXAMPLE,
            add_batch_size=ROWS,
            num_clusters=2,
            cluster_capacity=8,
            cluster_fn=_clusters,
            weights=(0.25, 0.75),
        ),
        _prioritised,
    ),
    "rate limited": (
        lambda: eb.RateLimited(eb.ItemBuffer(EXAMPLE, **kw), 1.0, tolerance=100.0),
        _limited,
    ),
    "mixer": (
        lambda: eb.Mixer(
            (eb.ItemBuffer(EXAMPLE, **kw), eb.PrioritisedItemBuffer(EXAMPLE, **kw)),
            (0.5, 0.5),
        ),
        _mixer,
    ),
}


def _dtypes(tree: Any) -> Any:
    return jax.tree.map(lambda x: (x.shape, x.dtype), eqx.filter(tree, eqx.is_array))


def _add(state: Any, batch: dict) -> Any:
    if isinstance(state, eb.Mixer):  # a mixer's sources are added to one by one
        buffers = tuple(b.add(batch) for b in state.buffers)
        return eqx.tree_at(lambda m: m.buffers, state, buffers)
    return state.add(batch)


@pytest.mark.parametrize("name", spread(CASES))
def test_a_jitted_step_keeps_every_dtype(name):
    make, draw = CASES[name]

    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(state, i, key):
        state = _add(state, _batch(i))
        return draw(state, key)

    state = make()
    before = _dtypes(state)
    for i in range(3):
        state, sample = step(state, jnp.int32(i), jax.random.key(i))
        assert _dtypes(state) == before
    experience = sample.experience
    if isinstance(experience, eb.Transition | eb.NStepTransition):
        experience = experience.first
    for leaf in ("obs", "action", "reward"):
        assert experience[leaf].dtype == EXAMPLE[leaf].dtype, leaf


def test_sum_tree_and_n_step_function():
    tree = eb.SumTree(10)
    before = _dtypes(tree)
    tree = eqx.filter_jit(eb.SumTree.set)(
        tree, jnp.array([1, 4], jnp.int32), jnp.array([1.0, 3.0], jnp.float32)
    )
    assert _dtypes(tree) == before
    draws = tree.sample(jax.random.key(0), 64)
    assert set(np.asarray(draws).tolist()) <= {1, 4}
    sequences = jax.tree.map(lambda x: x[:1], _batch(jnp.int32(1)))  # (1, T, ...)
    n_step = eb.n_step_transition(sequences, n=2, discount=0.5)
    assert n_step.first["obs"].dtype == jnp.float32
    assert n_step.reward.dtype == jnp.float32 and n_step.discount.dtype == jnp.float32


def test_archive_round_trip(tmp_path):
    buffer = eb.TrajectoryBuffer(
        EXAMPLE, add_batch_size=ROWS, max_length_time_axis=8, sequence_length=2
    )
    buffer = eqx.filter_jit(lambda b, i: b.add(_batch(i)))(buffer, jnp.int32(0))
    with eb.Archive(str(tmp_path / "a"), buffer, progress=False) as archive:
        assert archive.write(buffer) == T
    reader = eb.Archive(str(tmp_path / "a"), buffer, mode="r", progress=False)
    back = reader.read()
    assert back["obs"].dtype == np.float32 and back["action"].dtype == np.int32
    np.testing.assert_array_equal(back["action"], np.asarray(_batch(jnp.int32(0))["action"]))
    fresh = eb.TrajectoryBuffer(
        EXAMPLE, add_batch_size=ROWS, max_length_time_axis=8, sequence_length=2
    )
    restored = reader.restore(fresh)
    assert _dtypes(restored) == _dtypes(fresh)
    assert restored.storage.steps_added() == T
