"""Every check the buffers make inside jit, one case each: a state and the step that fails
its check. Shared by the scripts of tests/test_sharding_errors.py (8 devices of one process)
and tests/test_many_hosts.py (2 processes), imported inside their processes."""

import time

import equinox as eqx
import jax
import jax.numpy as jnp

import equibuffer as eb


R = 8  # rows: a multiple of every mesh's size
ex = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
key = jax.random.key(0)


def steps(t, done=False):
    return {"obs": jnp.ones((R, t, 2)), "done": jnp.full((R, t), done)}


def traj(**kw):
    return eb.TrajectoryBuffer(
        ex, add_batch_size=R, max_length_time_axis=8, sequence_length=4, **kw
    )


def prio(**kw):
    return eb.PrioritisedTrajectoryBuffer(
        ex, add_batch_size=R, max_length_time_axis=8, sequence_length=2, **kw
    )


def sample(b):
    return b.sample(key, 8)


def psample(beta):
    return lambda b: b.sample(key, 8, beta=beta)


def set_prio(indices, values):
    def step(b):
        s = b.sample(key, 2)
        s = eqx.tree_at(lambda s: s.indices, s, jnp.asarray(indices, jnp.int32))
        return b.set_priorities(s, jnp.asarray(values, jnp.float32))

    return step


def zero_priorities(b):
    s = b.sample(key, 64)
    return b.set_priorities(s, jnp.zeros(64))


def ids(x):
    return x["obs"][0].astype(jnp.int32)


def clustered(prioritised=False, fn=ids):
    cls = eb.PrioritisedClusteredBuffer if prioritised else eb.ClusteredBuffer
    return cls(ex, add_batch_size=R, num_clusters=2, cluster_capacity=8, cluster_fn=fn)


def with_credit(limited, whole):
    return eqx.tree_at(lambda r: r.credit_whole, limited, jnp.int32(whole))


def count_past_uint32(b):
    storage = b.storage.with_counters(steps_added=2**32)
    return eqx.tree_at(lambda b: b.storage, b, storage)


def item():
    return eb.ItemBuffer(ex, add_batch_size=R, capacity=8 * R)


def queue():
    return eb.Queue(ex, add_batch_size=R, max_length_time_axis=4, sequence_length=2)


def nstep():
    return eb.TransitionBuffer(
        ex
        | {"reward": jnp.float32(0), "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)},
        add_batch_size=R,
        max_length_time_axis=8,
        n_step=3,
        discount=0.9,
    )


def nstep_steps(t):
    return jax.tree.map(lambda x: jnp.zeros((R, t, *x.shape), x.dtype), nstep().storage.example())


# name: () -> (state, step run on it, jitted). Each state is run as built (one device) and
# placed with shard_rows on the mesh.
CASES = {
    "too_early": lambda: (traj().add(steps(2)), sample),
    "transition_too_early": lambda: (
        eb.TransitionBuffer(ex, add_batch_size=R, capacity=8 * R),
        sample,
    ),
    "item_too_early": lambda: (item(), sample),
    "prioritised_too_early": lambda: (prio(), psample(0.5)),
    "episode_no_window": lambda: (
        eb.EpisodeTrajectoryBuffer(
            ex, add_batch_size=R, max_length_time_axis=8, sequence_length=3
        ).add(steps(4, done=True)),
        sample,
    ),
    "prioritised_episode_no_window": lambda: (
        eb.PrioritisedEpisodeTrajectoryBuffer(
            ex, add_batch_size=R, max_length_time_axis=8, sequence_length=3
        ).add(steps(4, done=True)),
        psample(0.5),
    ),
    "nstep_too_early": lambda: (nstep().add(nstep_steps(3)), sample),
    "zero_priorities": lambda: (zero_priorities(prio().add(steps(4))), psample(0.5)),
    "negative_beta": lambda: (prio().add(steps(4)), psample(jnp.float32(-1.0))),
    "negative_priority": lambda: (prio().add(steps(4)), set_prio([0, 1], [1.0, -1.0])),
    "nan_priority": lambda: (prio().add(steps(4)), set_prio([0, 1], [jnp.nan, 1.0])),
    "priority_index": lambda: (prio().add(steps(4)), set_prio([0, 64], [1.0, 1.0])),
    "queue_full": lambda: (queue().add(steps(4)), lambda q: q.add(steps(1))),
    "queue_empty": lambda: (queue().add(steps(1)), lambda q: q.sample()),
    "cluster_id": lambda: (
        clustered(),
        lambda b: b.add(steps(1) | {"obs": jnp.full((R, 1, 2), 5.0)}),
    ),
    "cluster_nothing_held": lambda: (clustered(), sample),
    "prioritised_cluster_nothing_held": lambda: (clustered(True), psample(0.5)),
    "prioritised_cluster_beta": lambda: (
        clustered(True).add(steps(1)),
        lambda b: b.sample(key, 4, beta=jnp.float32(-1)),
    ),
    "sumtree_get": lambda: (
        {"tree": eb.SumTree(16), "b": traj()},
        lambda s: s["tree"].get(jnp.array([3, 16])),
    ),
    "sumtree_set": lambda: (
        {"tree": eb.SumTree(16), "b": traj()},
        lambda s: s["tree"].set(jnp.array([3]), jnp.array([-2.0])),
    ),
    "mixer_too_early": lambda: (eb.Mixer((traj().add(steps(4)), traj()), (0.5, 0.5)), sample),
    "rate_limited_too_early": lambda: (eb.RateLimited(traj(), 1.0, 4.0), sample),
    "rate_limited_credit_high": lambda: (
        with_credit(eb.RateLimited(traj(), 1.0, 4.0), 2**30),
        lambda r: r.add(steps(4)),
    ),
    "rate_limited_credit_low": lambda: (
        with_credit(eb.RateLimited(traj(), 1.0, 4.0).add(steps(4)), -(2**30) + 2),
        lambda r: r.sample(key, 8),
    ),
    "steps_added_past_uint32": lambda: (count_past_uint32(traj()), lambda b: b.steps_added()),
}


def message(error):
    """The check's own message: Equinox's report around it (raised inside the call), or the
    note after it (a recorded failure, raised when the call returns) left out."""
    text = str(error)
    head = "equinox.EquinoxRuntimeError: "
    if head in text:
        return text[text.index(head) + len(head) : text.index("\n\n-------------------")]
    return text[: text.index("\n\n(")]  # (recorded, or carried out of the checked step)


def run(state, step):
    """The step's error message (recorded and raised when the call returns, or raised inside
    it with `EQX_ON_ERROR=raise`), or None, and the seconds it took."""

    @eb.filter_jit(donate="all")
    def jitted(state):
        return step(state)

    start = time.perf_counter()
    try:
        jax.block_until_ready(jitted(state))
    except eqx.EquinoxRuntimeError as e:
        return message(e), time.perf_counter() - start
    return None, time.perf_counter() - start


def run_hidden(state, step):
    """`run`, the step as users write it: inside a `lax.scan` body, only a number computed
    from what it returns leaving the call (the failing buffer or sample is not returned)."""

    @eb.filter_jit
    def jitted(state):
        def body(total, _):
            out = eqx.filter(step(state), eqx.is_inexact_array)
            return total + sum(jnp.sum(x).astype(jnp.float32) for x in jax.tree.leaves(out)), None

        return jax.lax.scan(body, jnp.float32(0), None, length=2)[0]

    try:
        jax.block_until_ready(jitted(state))
    except eqx.EquinoxRuntimeError as e:
        return message(e)
    return None
