"""One buffer of every kind, with the batches it takes and one add-and-sample step, for the
scripts that run every kind on 8 host devices (tests/test_sharding_kinds.py,
tests/test_per_device.py; imported inside those scripts' processes), and every prioritised
kind, for the tests of what holds for each (tests/test_inplace.py, tests/test_last_wins.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp

import equibuffer as eb


EXAMPLE = {
    "obs": jnp.zeros(4),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
    "truncated": jnp.bool_(False),
}


def batch(i: int, rows: int, t: int = 4) -> dict:
    """`t` steps for each of `rows` rows, different for each `i`; some steps end episodes."""
    obs = jnp.arange(rows * t * 4, dtype=jnp.float32).reshape(rows, t, 4) + 1000 * i
    ends = (jnp.arange(rows * t).reshape(rows, t) + i) % 5 == 0
    return {
        "obs": obs,
        "reward": obs[..., 0] / 7,
        "terminated": ends,
        "truncated": jnp.zeros((rows, t), bool),
    }


def cluster_of(item: dict) -> jax.Array:
    return (item["obs"][0] % 3).astype(jnp.int32)


def _sizes(rows: int, length: int) -> tuple[dict, dict]:
    """The size arguments of `rows` rows of `length` steps, and of 3 clusters of `length`."""
    size = dict(add_batch_size=rows, max_length_time_axis=length)
    return size, dict(add_batch_size=rows, num_clusters=3, cluster_capacity=length)


def kinds(rows: int, length: int) -> dict:
    """Builders of every kind of buffer, `rows` rows of `length` steps (clusters of `length`
    slots)."""
    (size, clusters), ex = _sizes(rows, length), EXAMPLE
    return {
        "trajectory": lambda: eb.TrajectoryBuffer(ex, sequence_length=4, **size),
        "transition": lambda: eb.TransitionBuffer(ex, **size),
        "item": lambda: eb.ItemBuffer(ex, **size),
        "prioritised": lambda: eb.PrioritisedTrajectoryBuffer(ex, sequence_length=4, **size),
        "prioritised_item": lambda: eb.PrioritisedItemBuffer(ex, **size),
        "episodes": lambda: eb.EpisodeTrajectoryBuffer(
            ex, sequence_length=3, episode_end="terminated", mode="pad", **size
        ),
        "prioritised_episodes": lambda: eb.PrioritisedEpisodeTrajectoryBuffer(
            ex, sequence_length=3, episode_end="terminated", **size
        ),
        "n_step": lambda: eb.TransitionBuffer(ex, n_step=3, discount=0.9, **size),
        "queue": lambda: eb.Queue(ex, sequence_length=3, **size),
        "clustered": lambda: eb.ClusteredBuffer(ex, cluster_fn=cluster_of, **clusters),
        "prioritised_clustered": lambda: eb.PrioritisedClusteredBuffer(
            ex, cluster_fn=cluster_of, **clusters
        ),
        "mixer": lambda: eb.Mixer(
            (
                eb.TrajectoryBuffer(ex, sequence_length=4, **size),
                eb.PrioritisedTrajectoryBuffer(ex, sequence_length=4, **size),
            ),
            (0.25, 0.75),
        ),
        "rate_limited": lambda: eb.RateLimited(
            eb.TrajectoryBuffer(ex, sequence_length=4, **size), 4.0, 64.0
        ),
    }


def prioritised_kinds(rows: int, length: int) -> dict:
    """Builders of every kind of prioritised buffer (and a mix and a rate limiter of them),
    `rows` rows of `length` steps (clusters of `length` slots)."""
    (size, clusters), ex = _sizes(rows, length), EXAMPLE
    return {
        "trajectory": lambda: eb.PrioritisedTrajectoryBuffer(ex, sequence_length=4, **size),
        "transition": lambda: eb.PrioritisedTransitionBuffer(ex, **size),
        "n_step": lambda: eb.PrioritisedTransitionBuffer(ex, n_step=3, discount=0.9, **size),
        "n_step_episodes": lambda: eb.PrioritisedTransitionBuffer(
            ex, n_step=3, discount=0.9, episode_end="terminated", **size
        ),
        "item": lambda: eb.PrioritisedItemBuffer(ex, **size),
        "episodes": lambda: eb.PrioritisedEpisodeTrajectoryBuffer(
            ex, sequence_length=3, episode_end="terminated", mode="pad", **size
        ),
        "clustered": lambda: eb.PrioritisedClusteredBuffer(ex, cluster_fn=cluster_of, **clusters),
        "mixer": lambda: eb.Mixer(
            (
                eb.PrioritisedTrajectoryBuffer(ex, sequence_length=3, **size),
                eb.PrioritisedEpisodeTrajectoryBuffer(
                    ex, sequence_length=3, episode_end="terminated", **size
                ),
            ),
            (0.5, 0.5),
        ),
        "rate_limited": lambda: eb.RateLimited(eb.PrioritisedItemBuffer(ex, **size), 4.0, 64.0),
    }


def add(buffer, b):
    if isinstance(buffer, eb.Mixer):  # adds go to its sources
        added = tuple(x.add(b) for x in buffer.buffers)
        return eqx.tree_at(lambda m: m.buffers, buffer, added)
    return buffer.add(b)


def draw(buffer, key, batch_size: int, row_blocks: int = 1):
    """The buffer's own sample (`beta=0.5` for a prioritised source)."""
    kw = {} if row_blocks == 1 else {"row_blocks": row_blocks}
    if isinstance(buffer, eb.AbstractPrioritisedSource):
        kw["beta"] = 0.5
    return buffer.sample(key, batch_size, **kw)


def sample(buffer, key, batch_size: int, row_blocks: int = 1):
    """`(buffer, sample)`: a sample of `batch_size` (the queue's: all it holds), and for a
    prioritised source its priorities set from the sample."""
    if isinstance(buffer, eb.Queue):
        return buffer.sample()
    if isinstance(buffer, eb.RateLimited):
        return draw(buffer, key, batch_size, row_blocks)
    if isinstance(buffer, eb.AbstractPrioritisedSource):
        s = draw(buffer, key, batch_size, row_blocks)
        return buffer.set_priorities(s, s.weights + 1.0), s
    return buffer, draw(buffer, key, batch_size, row_blocks)
