"""What "a buffer" is: code written against `AbstractReplayBuffer`, `AbstractSource` and
`AbstractPrioritisedSource` runs, under `eqx.filter_jit`, over every buffer kind, and
`Mixer` and `RateLimited` accept every kind they are meant to."""

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import equibuffer as eb

from .helpers import spread


ROWS, T, LENGTH, CAP = 2, 4, 16, 16
EXAMPLE = {
    "obs": jnp.zeros(2, jnp.float32),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
    "truncated": jnp.bool_(False),
    "done": jnp.bool_(False),
}


def _cluster_of(step):
    return (step["obs"][0] > 0).astype(jnp.int32)


def _clustered(cls: Any) -> Callable[[], Any]:
    return lambda: cls(
        EXAMPLE, add_batch_size=ROWS, num_clusters=2, cluster_capacity=CAP, cluster_fn=_cluster_of
    )


kw: dict[str, Any] = dict(add_batch_size=ROWS, capacity=ROWS * LENGTH)
n_step: dict[str, Any] = dict(n_step=3, discount=0.9)
KINDS: dict[str, Callable[[], Any]] = {
    "trajectory": lambda: eb.TrajectoryBuffer(EXAMPLE, sequence_length=3, **kw),
    "transition": lambda: eb.TransitionBuffer(EXAMPLE, **kw),
    "n-step transition": lambda: eb.TransitionBuffer(EXAMPLE, **n_step, **kw),
    "episode-aware transition": lambda: eb.TransitionBuffer(EXAMPLE, episode_end="done", **kw),
    "item": lambda: eb.ItemBuffer(EXAMPLE, **kw),
    "episode trajectory": lambda: eb.EpisodeTrajectoryBuffer(
        EXAMPLE, sequence_length=2, mode="pad", **kw
    ),
    "prioritised trajectory": lambda: eb.PrioritisedTrajectoryBuffer(
        EXAMPLE, sequence_length=3, **kw
    ),
    "prioritised transition": lambda: eb.PrioritisedTransitionBuffer(EXAMPLE, **kw),
    "prioritised n-step transition": lambda: eb.PrioritisedTransitionBuffer(
        EXAMPLE, episode_end="done", **n_step, **kw
    ),
    "prioritised item": lambda: eb.PrioritisedItemBuffer(EXAMPLE, **kw),
    "prioritised episode trajectory": lambda: eb.PrioritisedEpisodeTrajectoryBuffer(
        EXAMPLE, sequence_length=2, **kw
    ),
    "clustered": _clustered(eb.ClusteredBuffer),
    "prioritised clustered": _clustered(eb.PrioritisedClusteredBuffer),
}
PRIORITISED = [k for k in KINDS if k.startswith("prioritised")]


def _batch(i: int) -> dict:
    """`T` steps for each row, tagged: `obs = ±(1 + row * 1000 + step)` (the sign alternates
    with the step, so both clusters get items), an episode end every 5 steps."""
    steps = i * T + np.arange(T)
    tag = 1 + np.arange(ROWS)[:, None] * 1000 + steps[None, :]
    sign = np.where(steps % 2 == 0, 1.0, -1.0)[None, :]
    obs = np.stack([sign * tag, np.zeros_like(tag)], axis=-1).astype(np.float32)
    done = np.broadcast_to(steps % 5 == 4, (ROWS, T))
    return {
        "obs": jnp.asarray(obs),
        "reward": jnp.ones((ROWS, T), jnp.float32),
        "terminated": jnp.zeros((ROWS, T), bool),
        "truncated": jnp.asarray(done),
        "done": jnp.asarray(done),
    }


def _first_obs(experience: Any) -> np.ndarray:
    """The first step's `obs[0]` of each sampled element, whatever the view."""
    if isinstance(experience, eb.Transition | eb.NStepTransition):
        return np.asarray(experience.first["obs"][:, 0])
    obs = np.asarray(experience["obs"])
    return obs[:, 0, 0] if obs.ndim == 3 else obs[:, 0]


@eqx.filter_jit
def _generic_step(buffer: eb.AbstractReplayBuffer, batch: Any, key: jax.Array) -> Any:
    """Code written for "a buffer", knowing nothing of its kind."""
    buffer = buffer.add(batch)
    sample = buffer.sample(key, 8)
    return buffer, sample, buffer.can_sample(), buffer.size()


@pytest.mark.parametrize("kind", spread(KINDS))
def test_generic_code_runs_on_every_buffer_kind(kind):
    buffer = KINDS[kind]()
    assert isinstance(buffer, eb.AbstractReplayBuffer) and isinstance(buffer, eb.AbstractSource)
    assert isinstance(buffer, eb.AbstractPrioritisedSource) == (kind in PRIORITISED)
    assert buffer.add_batch_size == ROWS
    assert buffer.steps_in(_batch(0), "mine()") == T
    with pytest.raises(ValueError, match=r"mine\(\): leaf \['obs'\] has shape"):
        buffer.steps_in({**_batch(0), "obs": jnp.zeros((3, 2))}, "mine()")
    for i in range(3):
        buffer, sample, ready, size = _generic_step(buffer, _batch(i), jax.random.key(i))
        assert isinstance(sample, eb.AbstractSample)
        assert isinstance(sample, eb.AbstractPrioritisedSample) == (kind in PRIORITISED)
        assert bool(ready) and ready.dtype == jnp.bool_
        assert int(size) == ROWS * T * (i + 1) and size.dtype == jnp.int32
        tags = _first_obs(sample.experience)
        steps = np.asarray(sample.steps)
        if "clustered" in kind:
            # `steps` numbers the items of each cluster; every draw is one of its cluster.
            cluster = np.asarray(sample.cluster)
            np.testing.assert_array_equal(cluster, (tags > 0).astype(int))
            np.testing.assert_array_equal(np.asarray(sample.indices) // CAP, cluster)
            assert (steps < ROWS * T * (i + 1) / 2).all()
        else:
            # Each element starts at the step and row its tag names.
            row, step = np.divmod(np.abs(tags).astype(int) - 1, 1000)
            np.testing.assert_array_equal(steps, step)
            np.testing.assert_array_equal(np.asarray(sample.indices) // LENGTH, row)


@eqx.filter_jit
def _generic_learn(source: eb.AbstractPrioritisedSource, key: jax.Array) -> Any:
    """Code written for any prioritised source (a buffer or a `Mixer`)."""
    sample = source.sample(key, 8, beta=0.5)
    return source.set_priorities(sample, jnp.full(8, 3.0)), sample.weights


def _filled(kind: str) -> Any:
    buffer = KINDS[kind]()
    for i in range(2):
        buffer = buffer.add(_batch(i))
    return buffer


@pytest.mark.parametrize("kind", [*PRIORITISED, "mixer"])
def test_generic_prioritised_code_runs_on_every_prioritised_source(kind):
    if kind == "mixer":
        sources = (_filled("item"), _filled("prioritised clustered"))
        source: Any = eb.Mixer(sources, proportions=(0.5, 0.5))
    else:
        source = _filled(kind)
    updated, weights = _generic_learn(source, jax.random.key(0))
    assert type(updated) is type(source) and weights.shape == (8,)
    assert float(weights.max()) == 1.0
    prioritised = updated.buffers[1] if kind == "mixer" else updated
    assert float(prioritised.max_priority) == 3.0  # the priorities reached the buffer


@pytest.mark.parametrize("kind", spread(KINDS))
def test_every_buffer_kind_is_rate_limited(kind):
    limited = eb.RateLimited(KINDS[kind](), samples_per_insert=0.5, tolerance=8.0)

    @eqx.filter_jit
    def step(limited, batch, key):
        limited = limited.add(batch)  # ROWS * T = 8 steps: credit + 4
        return limited.sample(key, 4)  # credit - 4

    for i in range(3):
        limited, sample = step(limited, _batch(i), jax.random.key(i))
        assert isinstance(sample, eb.AbstractSample)
    assert float(limited.credit()) == 0.0
    if kind in PRIORITISED:
        limited = limited.set_priorities(sample, jnp.full(4, 2.0))
        assert float(limited.buffer.max_priority) == 2.0
    else:
        with pytest.raises(TypeError, match="has no priorities"):
            limited.set_priorities(sample, jnp.full(4, 2.0))


@pytest.mark.parametrize("kind", spread(KINDS))
def test_every_buffer_kind_is_a_mixer_source(kind):
    """Two sources of each kind (the same kind: the rows are concatenated), one of them holding
    negated tags, so each row shows its source."""

    def negated(i):
        batch = _batch(i)
        return {**batch, "obs": -batch["obs"]}

    a, b = KINDS[kind](), KINDS[kind]()
    for i in range(2):
        a, b = a.add(_batch(i)), b.add(negated(i))
    mixer = eb.Mixer((a, b), proportions=(0.25, 0.75))
    sample = eqx.filter_jit(lambda m, k: m.sample(k, 8, beta=0.5))(mixer, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(sample.source), [0] * 2 + [1] * 6)
    tags = _first_obs(sample.experience)
    for source, rows in ((0, slice(0, 2)), (1, slice(2, 8))):
        part = sample.samples[source]
        assert isinstance(part, eb.AbstractSample) and part.experience is None
        # Source 0 holds `obs[0] > 0` at even steps, source 1 (negated) at odd ones.
        row, step = np.divmod(np.abs(tags[rows]).astype(int) - 1, 1000)
        sign = np.where(step % 2 == 0, 1, -1) * (1 if source == 0 else -1)
        np.testing.assert_array_equal(np.sign(tags[rows]), sign)
        if "clustered" in kind:
            np.testing.assert_array_equal(np.asarray(part.cluster), tags[rows] > 0)
        else:
            np.testing.assert_array_equal(np.asarray(part.steps), step)
            np.testing.assert_array_equal(np.asarray(part.indices) // LENGTH, row)
    weights = np.asarray(sample.weights)
    if kind in PRIORITISED:
        np.testing.assert_array_equal(weights[2:], np.asarray(sample.samples[1].weights))
    else:
        np.testing.assert_array_equal(weights, 1.0)


def test_mixers_nest():
    """A `Mixer` is a source: its rows, weights and priorities pass through the outer one."""
    online = _filled("item")
    inner = eb.Mixer((_filled("prioritised item"), _filled("prioritised clustered")), (0.5, 0.5))
    outer = eb.Mixer((online, inner), proportions=(0.5, 0.5))
    assert int(outer.size()) == int(online.size()) + int(inner.size()) == 3 * 16
    sample = eqx.filter_jit(lambda m, k: m.sample(k, 8, beta=0.5))(outer, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(sample.source), [0] * 4 + [1] * 4)
    nested = sample.samples[1]
    assert isinstance(nested, eb.MixedSample) and nested.experience is None
    np.testing.assert_array_equal(np.asarray(nested.source), [0, 0, 1, 1])
    np.testing.assert_array_equal(np.asarray(sample.weights)[4:], np.asarray(nested.weights))
    priorities = jnp.array([9.0] * 4 + [2.0, 2.0, 5.0, 5.0])
    updated = eqx.filter_jit(lambda m, s, p: m.set_priorities(s, p))(outer, sample, priorities)
    assert float(updated.buffers[1].buffers[0].max_priority) == 2.0
    assert float(updated.buffers[1].buffers[1].max_priority) == 5.0
    assert eqx.tree_equal(updated.buffers[0], online)  # a uniform source is left alone


def test_what_is_not_a_buffer_is_refused():
    queue = eb.Queue(EXAMPLE, add_batch_size=ROWS, capacity=32, sequence_length=2)
    assert not isinstance(queue, eb.AbstractSource)
    with pytest.raises(TypeError, match="buffers|not a buffer"):  # beartype's or our own
        eb.Mixer((_filled("item"), queue), (0.5, 0.5))  # pyright: ignore[reportArgumentType]
    mixer = eb.Mixer((_filled("item"),), (1.0,))
    assert not isinstance(mixer, eb.AbstractReplayBuffer)  # it is not added to
    with pytest.raises(TypeError, match="must be a replay buffer|parameter 'buffer'"):
        eb.RateLimited(mixer, 1.0, 4.0)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("kind", spread(KINDS))
def test_every_buffer_kind_counts_steps_added_inside_jit(kind):
    """`steps_added()` of every replay buffer (and of one rate-limited), read inside a jitted
    step as well as outside: the steps per row ever added, overwritten ones included."""

    @eqx.filter_jit
    def add_and_count(buffer: eb.AbstractReplayBuffer, batch: Any) -> Any:
        buffer = buffer.add(batch)
        return buffer, buffer.steps_added()

    buffer = KINDS[kind]()
    limited = eb.RateLimited(KINDS[kind](), samples_per_insert=1.0, tolerance=1e6)
    for i in range(6):  # more than a row holds (LENGTH = 16 steps)
        buffer, inside = add_and_count(buffer, _batch(i))
        limited, inside_limited = add_and_count(limited, _batch(i))
        assert int(inside) == int(buffer.steps_added()) == int(inside_limited) == (i + 1) * T


def _sources() -> dict[str, Callable[[], Any]]:
    """Every kind, a `Mixer` of two and a `RateLimited` one: whatever takes a key."""
    return {
        **KINDS,
        "mixer": lambda: eb.Mixer(
            (_filled("item"), _filled("prioritised item")), proportions=(0.5, 0.5)
        ),
        "rate limited": lambda: eb.RateLimited(
            _filled("transition"), samples_per_insert=4.0, tolerance=64.0
        ),
    }


@pytest.fixture
def as_users_run(monkeypatch):
    """jaxtyping's runtime checks off, as in a user's program: the tests' import hook would
    otherwise refuse a wrong key by its annotation before the library's own check speaks."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


@pytest.mark.parametrize("kind", spread(_sources()))
def test_a_seed_or_a_batch_of_keys_is_refused_with_what_to_pass(kind, as_users_run):
    """`sample` and `epoch` take one PRNG key: a seed (eager or traced) or a batch of keys is
    refused at once, naming the method and what to pass; `jax.random.PRNGKey`'s raw keys
    (Flashbax's examples use them) are accepted, and a key batched by `vmap` is one key."""
    source = _sources()[kind]()
    keys = jax.random.split(jax.random.key(0), 3)
    wrong = {
        "a seed": (0, r"got int 0 \(a seed is not a key\)"),
        "a traced seed": (jnp.int32(0), r"got int32\[\] \(a seed is not a key\)"),
        "keys": (keys, r"got an array of 3 keys \(shape \(3,\)\); to draw one sample per key, jax"),
        "raw keys": (
            jax.vmap(jax.random.key_data)(keys),
            r"got an array of 3 keys \(shape \(3, 2\)",
        ),
    }
    methods = ["sample"] + (["epoch"] if kind not in ("mixer", "rate limited") else [])
    for method in methods:
        call = getattr(source, method)
        jitted = eqx.filter_jit(lambda s, k, m=method: getattr(s, m)(k, 8))
        for bad, words in wrong.values():
            where = (
                "Mixer.sample()" if kind == "mixer"
                else "TransitionBuffer.sample()" if kind == "rate limited"  # the wrapped buffer's
                else f"{type(source).__name__}.{method}()"
            )  # fmt: skip
            message = re.escape(where) + r": `key` must be one JAX PRNG key, e\.g\. jax\.random"
            with pytest.raises(TypeError, match=message + r"\.key\(0\), " + words):
                call(bad, 8)
            with pytest.raises(TypeError, match=message):
                jitted(source, bad)
    filled = source.add(_batch(0)) if kind in KINDS else source
    out = filled.sample(jax.random.PRNGKey(0), 8)
    sample = out[1] if kind == "rate limited" else out
    assert isinstance(sample, eb.MixedSample if kind == "mixer" else eb.AbstractSample)
    if kind in KINDS:
        vmapped = jax.vmap(lambda k: filled.sample(k, 4).indices)(keys)
        assert vmapped.shape == (3, 4)


def test_sum_tree_sample_refuses_a_seed(as_users_run):
    tree = eb.SumTree(4).set(jnp.array([1]), jnp.array([1.0]))
    with pytest.raises(TypeError, match=r"SumTree\.sample\(\): `key` must be one JAX PRNG key"):
        tree.sample(7, 2)
    assert (tree.sample(jax.random.PRNGKey(0), 2) == 1).all()
