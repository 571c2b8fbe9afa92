"""Epochs without replacement (`buffer.epoch`, `buffer.epoch_batch`): every valid window once
per epoch, in a uniformly random order, compared with the NumPy reference model; the short last
batch masked; the buffer growing between epochs; refusals."""

import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings, strategies as st
from jax import lax

import equibuffer as eb
from equibuffer.testing import buffer_configs, BufferReference, filled_buffers

from .helpers import budget, chi_square_pvalue


SETTINGS = settings(
    max_examples=budget(12), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@eqx.filter_jit
def whole_epoch(buffer, key, batch_size):
    """Every batch of an epoch, `lax.scan` over the static `max_batches`, stacked into one
    sample of `max_batches * batch_size` rows, with the `valid` mask and the plan."""
    epoch = buffer.epoch(key, batch_size)

    def body(carry, i):
        return carry, buffer.epoch_batch(epoch, i)

    _, (sample, valid) = lax.scan(body, None, jnp.arange(epoch.max_batches))
    rows = lambda x: x.reshape(-1, *x.shape[2:]) if x.ndim >= 2 else x  # noqa: E731
    return jax.tree.map(rows, sample), valid.reshape(-1), epoch


def check_epoch(buffer, reference: BufferReference, key, batch_size: int) -> None:
    """Run a whole epoch and check it against the reference: the valid places hold every
    valid window exactly once, first and in one block; every place (masked ones too) holds a
    valid window with the reference's data; the error word is clear."""
    sample, valid, epoch = whole_epoch(buffer, key, batch_size)
    eb.check(sample)
    valid = np.asarray(valid)
    windows = reference.windows(eqx.tree_at(lambda s: s.error, sample, sample.error[0]))
    visited = [w for w, v in zip(windows, valid, strict=True) if v]
    want = reference.valid()
    assert len(visited) == len(set(visited)), "a window was visited twice"
    assert set(visited) == want
    count = len(want)
    assert int(epoch.count) == count and int(epoch.num_batches()) == math.ceil(count / batch_size)
    np.testing.assert_array_equal(valid, np.arange(valid.shape[0]) < count)
    # The data of every place, masked or not, is that of its (valid) window: priorities play
    # no part in an epoch, so the uniform reference checks it.
    reference.priorities = None
    reference.check_sample(eqx.tree_at(lambda s: s.error, sample, sample.error[0]))


def _ready(filled) -> bool:
    buffer, reference = filled
    return reference.ready() and bool(reference.valid())


UNIFORM_KINDS = [
    eb.TrajectoryBuffer,
    eb.ItemBuffer,
    eb.TransitionBuffer,
    eb.PrioritisedTrajectoryBuffer,
    eb.PrioritisedItemBuffer,
]


@SETTINGS
@given(
    filled=filled_buffers(
        buffer_configs(UNIFORM_KINDS, n_step=None, episodes=False),
        adds=st.integers(1, 4),
        reference=True,
    ).filter(_ready),
    batch_size=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_each_window_once_uniform(filled, batch_size, seed):
    """Windows (with `period`), pairs and items, uniform and prioritised, after random adds
    (wrapped around or not): each valid window exactly once per epoch."""
    buffer, reference = filled
    check_epoch(buffer, reference, jax.random.key(seed), batch_size)


@SETTINGS
@given(
    filled=filled_buffers(
        buffer_configs(
            [
                eb.EpisodeTrajectoryBuffer,
                eb.PrioritisedEpisodeTrajectoryBuffer,
                eb.TransitionBuffer,
            ],
            n_step=None,
            episodes=True,
            mode=st.sampled_from(["never_cross", "pad"]),
        ),
        adds=st.integers(1, 4),
        reference=True,
    ).filter(_ready),
    batch_size=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_each_window_once_episodes(filled, batch_size, seed):
    """Episode-aware windows (`never_cross` and `pad`, with the pad mask): each window
    valid by the episode rule exactly once per epoch."""
    buffer, reference = filled
    check_epoch(buffer, reference, jax.random.key(seed), batch_size)


@SETTINGS
@given(
    filled=filled_buffers(
        buffer_configs(
            [eb.TransitionBuffer, eb.PrioritisedTransitionBuffer],
            n_step=st.integers(1, 3),
            episodes=st.booleans(),
        ),
        adds=st.integers(1, 4),
        reference=True,
    ).filter(_ready),
    batch_size=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_each_window_once_n_step(filled, batch_size, seed):
    """n-step transitions (cut at episode ends): each valid start exactly once per epoch,
    with the reference's rewards, discounts and steps."""
    buffer, reference = filled
    check_epoch(buffer, reference, jax.random.key(seed), batch_size)


# The tests' setup (adds, plans) runs compiled rather than eagerly, where eagerly each JAX
# operation is a program of its own to compile; a refused operation raises there too
# (`eb.filter_jit`). What a test checks of an eager call stays eager.


@eb.filter_jit
def _add(buffer, batch):
    """`buffer.add(batch)`, compiled (a refused add raises, as eagerly)."""
    return buffer.add(batch)


@eb.filter_jit
def _add_all(buffer, batches):
    """`buffer.add` of each of `batches` in turn: one compiled call."""
    for batch in batches:
        buffer = buffer.add(batch)
    return buffer


@eb.filter_jit
def _plan(buffer, key, batch_size):
    """`buffer.epoch(key, batch_size)`, compiled (a refusal raises, as eagerly)."""
    return buffer.epoch(key, batch_size)


@eqx.filter_jit
def _epoch_batch(buffer, epoch, i):
    """`buffer.epoch_batch(epoch, i)` inside jit (its failure recorded, not raised)."""
    return buffer.epoch_batch(epoch, i)


def _items(n: int, rows: int = 1, capacity: int = 16) -> eb.ItemBuffer:
    buffer = eb.ItemBuffer({"x": jnp.int32(0)}, add_batch_size=rows, capacity=capacity)
    return _add(buffer, {"x": jnp.arange(rows * n, dtype=jnp.int32).reshape(rows, n)})


def test_order_is_uniform_over_permutations():
    """Over many keys (vmapped), each of the 4! orders of 4 windows is equally likely
    (chi-square); the valid windows come first, whatever the other candidate slots."""
    buffer = _items(4, capacity=10)
    keys = jax.random.split(jax.random.key(1), 4800)
    orders = eb.filter_jit(jax.vmap(lambda k: buffer.epoch(k, batch_size=4).indices[:4]))(keys)
    index = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
    counts = np.bincount([index[tuple(o)] for o in np.asarray(orders).tolist()], minlength=24)
    assert chi_square_pvalue(counts, np.full(24, 1 / 24)) > 1e-3


def test_order_is_uniform_among_episode_windows():
    """With an episode rule, the first place of the epoch is uniform over the valid windows
    only (chi-square), and no invalid window is ever planned among the first `count`."""
    example = {"x": jnp.int32(0), "done": jnp.bool_(False)}
    buffer = eb.EpisodeTrajectoryBuffer(
        example, add_batch_size=2, max_length_time_axis=8, sequence_length=2
    )
    done = jnp.array([[0, 1, 0, 0, 0, 1], [0, 0, 1, 0, 0, 0]], bool)
    buffer = _add(buffer, {"x": jnp.zeros((2, 6), jnp.int32), "done": done})
    reference_valid = {0, 2, 3, 4, 8, 9, 11, 12}  # row * 8 + start: no end before the last step
    keys = jax.random.split(jax.random.key(2), 3500)

    @eb.filter_jit
    def plans_and_count(buffer, keys):
        plans = jax.vmap(lambda k: buffer.epoch(k, batch_size=3))(keys)
        return plans, buffer.num_valid_windows()

    plans, count = plans_and_count(buffer, keys)
    assert int(count) == len(reference_valid)
    assert (np.asarray(plans.count) == 8).all()
    planned = np.asarray(plans.indices[:, :8])
    assert all(set(p) == reference_valid for p in planned.tolist())
    first = np.bincount(planned[:, 0], minlength=16)
    probs = np.array([1 / 8 if i in reference_valid else 0.0 for i in range(16)])
    assert chi_square_pvalue(first, probs) > 1e-3


def test_two_keys_give_two_orders():
    buffer = _items(12, capacity=16)
    a = _plan(buffer, jax.random.key(0), 4).indices[:12]
    b = _plan(buffer, jax.random.key(1), 4).indices[:12]
    assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(12))
    assert a.tolist() != b.tolist()


def test_last_batch_masked_and_padded_with_epoch_windows():
    """5 windows in batches of 2: batches of 2, 2 and 1 valid; the short batch's other place
    repeats a window of the epoch; batches past `num_batches()` (and negative ones) are all
    masked out."""
    buffer = _items(5, capacity=8)

    @eb.filter_jit
    def plan_and_batches(buffer, key):
        epoch = buffer.epoch(key, batch_size=2)
        return epoch, epoch.num_batches(), [buffer.epoch_batch(epoch, i) for i in range(-1, 5)]

    epoch, num_batches, batches = plan_and_batches(buffer, jax.random.key(3))
    assert (epoch.max_batches, int(num_batches)) == (4, 3)
    got, masks = [], []
    for sample, valid in batches:
        assert sample.experience["x"].shape == (2,) and valid.dtype == jnp.bool_
        got.append(sample.experience["x"].tolist())
        masks.append(valid.tolist())
    assert masks == [[False, False], [True, True], [True, True], [True, False]] + [[False] * 2] * 2
    order = epoch.indices[:5].tolist()
    assert got[1:4] == [order[0:2], order[2:4], [order[4], order[0]]]


def test_buffer_grows_between_epochs():
    """Adds after a plan (not wrapping over it) leave the epoch in progress as planned, with
    no error; the next plan has the new windows."""
    buffer = eb.TrajectoryBuffer(
        {"x": jnp.int32(0)}, add_batch_size=2, max_length_time_axis=32, sequence_length=3
    )
    buffer = _add(buffer, {"x": jnp.arange(20, dtype=jnp.int32).reshape(2, 10)})
    reference = BufferReference.from_buffer(
        eb.TrajectoryBuffer(
            {"x": jnp.int32(0)}, add_batch_size=2, max_length_time_axis=32, sequence_length=3
        )
    )
    reference.add({"x": np.arange(20, dtype=np.int32).reshape(2, 10)})
    before = reference.valid()

    @eqx.filter_jit(donate="all-except-first")
    def grow(buffer, batch):
        return buffer.add(batch)

    key = jax.random.key(4)
    epoch = _plan(buffer, key, 4)
    seen = []
    for i in range(int(epoch.num_batches())):
        batch = {"x": jnp.full((2, 5), 100 + i, jnp.int32)}
        buffer = grow(buffer, batch)  # 5 more steps per row after each batch
        reference.add({"x": np.asarray(batch["x"])})
        sample, valid = _epoch_batch(buffer, epoch, jnp.int32(i))
        eb.check(sample)
        seen += [w for w, v in zip(reference.windows(sample), valid.tolist(), strict=True) if v]
    assert sorted(seen) == sorted(before)  # the planned windows, each once, none of the new
    assert len(reference.valid()) > len(before)
    sample, valid, next_epoch = whole_epoch(buffer, jax.random.key(5), 4)
    assert int(next_epoch.count) == len(reference.valid())


def test_overwritten_window_refused():
    """Adds that wrap the ring over a planned window make the batch fail: recorded inside
    jit and raised by `eb.check`; raised at once eagerly."""
    buffer = _items(8, capacity=8)
    epoch = _plan(buffer, jax.random.key(0), 8)
    buffer = _add(buffer, {"x": jnp.full((1, 3), 99, jnp.int32)})  # slots of steps 0-2 rewritten
    sample, _ = _epoch_batch(buffer, epoch, 0)
    with pytest.raises(eqx.EquinoxRuntimeError, match="written over by adds made after"):
        eb.check(sample)
    with pytest.raises(eqx.EquinoxRuntimeError, match="Plan the epoch after the adds"):
        buffer.epoch_batch(epoch, 0)


@pytest.mark.parametrize(
    ("batch_size", "error", "match"),
    [
        (0, ValueError, r"ItemBuffer.epoch\(\): `batch_size` must be at least 1, got 0"),
        (-2, ValueError, r"ItemBuffer.epoch\(\): `batch_size` must be at least 1, got -2"),
        # (the library's message, or jaxtyping's in tests: both name the argument)
        (1.5, TypeError, "batch_size"),
    ],
)
def test_bad_batch_size(batch_size, error, match):
    with pytest.raises(error, match=match):
        _items(3).epoch(jax.random.key(0), batch_size)


def test_empty_buffer_refused_eagerly_and_inside_jit():
    buffer = eb.TrajectoryBuffer(
        {"x": jnp.zeros(2)}, add_batch_size=1, max_length_time_axis=8, sequence_length=3
    )
    buffer = _add(buffer, {"x": jnp.ones((1, 2, 2))})  # 2 steps: no window of 3
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        buffer.epoch(jax.random.key(0), 4)

    @eqx.filter_jit
    def first_batch(buffer, key):
        epoch = buffer.epoch(key, 4)
        return epoch, buffer.epoch_batch(epoch, 0)[0]

    epoch, sample = first_batch(buffer, jax.random.key(0))
    for carrier in (epoch, sample):  # recorded in the plan and passed on to its batches
        with pytest.raises(eqx.EquinoxRuntimeError, match=r"TrajectoryBuffer.epoch\(\).*yet"):
            eb.check(carrier)


def test_no_episode_window_refused():
    example = {"x": jnp.float32(0), "done": jnp.bool_(False)}
    buffer = eb.EpisodeTrajectoryBuffer(
        example, add_batch_size=1, max_length_time_axis=8, sequence_length=3
    )
    done = jnp.array([[True, False, True, True, False, True]])  # episodes of 1 or 2 steps
    buffer = _add(buffer, {"x": jnp.zeros((1, 6)), "done": done})
    assert bool(buffer.can_sample())
    with pytest.raises(eqx.EquinoxRuntimeError, match="no window of sequence_length=3 fits"):
        buffer.epoch(jax.random.key(0), 2)


def test_bad_epoch_and_batch_number():
    buffer = _items(4)
    epoch = buffer.epoch(jax.random.key(0), 2)
    with pytest.raises(TypeError, match=r"(?s)epoch_batch.*epoch"):
        buffer.epoch_batch("epoch", 0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="plans 16 candidate windows, but this buffer has .* 8"):
        _items(4, capacity=8).epoch_batch(epoch, 0)
    # (the library's message, or jaxtyping's in tests: both name `i`)
    for i in (jnp.arange(2), jnp.float32(0)):
        with pytest.raises(TypeError, match=r"(?s)epoch_batch.*(`i` must be a 0-d integer|'i')"):
            buffer.epoch_batch(epoch, i)


def test_prioritised_epoch_ignores_priorities():
    """Every window once, priority 0 included; the batches are plain samples, whose indices
    and steps `set_priorities` takes."""
    buffer = eb.PrioritisedItemBuffer({"x": jnp.int32(0)}, add_batch_size=1, capacity=8)
    slots = jnp.arange(6)  # one row: item x in slot x, added at step x
    only_0 = jnp.array([1.0, 0, 0, 0, 0, 0])

    @eb.filter_jit
    def filled_and_planned(buffer, key):
        buffer = buffer.add({"x": jnp.arange(6, dtype=jnp.int32)[None]})
        buffer = buffer.set_priorities(slots, only_0, steps=slots.astype(jnp.uint32))
        return buffer, buffer.epoch(key, batch_size=4)

    @eb.filter_jit
    def train(buffer, epoch, i):
        sample, valid = buffer.epoch_batch(epoch, i)
        return sample, valid, buffer.set_priorities(sample, jnp.full(4, 2.0))

    buffer, epoch = filled_and_planned(buffer, jax.random.key(1))
    seen = []
    for i in range(int(epoch.num_batches())):
        sample, valid, buffer = train(buffer, epoch, jnp.int32(i))
        assert type(sample) is eb.Sample
        seen += np.asarray(sample.experience["x"])[np.asarray(valid)].tolist()
    assert sorted(seen) == list(range(6))
    assert float(buffer.tree.total()) == pytest.approx(6 * 2.0**buffer.alpha)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda items: eb.Mixer((items, items), proportions=(0.5, 0.5)), "fixed proportions"),
        (
            lambda items: eb.RateLimited(items, samples_per_insert=1.0, tolerance=8.0),
            "limited.buffer.epoch",
        ),
        (
            lambda items: eb.Queue({"x": jnp.int32(0)}, add_batch_size=1, capacity=8,
                                   sequence_length=2),
            "exactly once, in order of arrival",
        ),
    ],
)  # fmt: skip
def test_kinds_without_epochs_refuse(build, match):
    source = build(_items(3))
    with pytest.raises(TypeError, match=rf"{type(source).__name__}.epoch\(\): .*{match}"):
        source.epoch(jax.random.key(0), batch_size=2)


def test_vmapped_runs_each_see_their_windows_once():
    """A training run vmapped over seeds, each with its own episode buffer (so the count of
    valid windows, and the loop's bound, are batched): each run visits its windows once."""
    example = {"x": jnp.int32(0), "done": jnp.bool_(False)}
    empty = eb.EpisodeTrajectoryBuffer(
        example, add_batch_size=1, max_length_time_axis=16, sequence_length=2
    )

    def run(key):
        k1, k2 = jax.random.split(key)
        done = jax.random.bernoulli(k1, 0.3, (1, 12))
        buffer = empty.add({"x": jnp.arange(12, dtype=jnp.int32)[None], "done": done})
        epoch = buffer.epoch(k2, batch_size=3)

        def body(i, visits):
            sample, valid = buffer.epoch_batch(epoch, i)
            return visits.at[sample.experience["x"][:, 0]].add(valid.astype(jnp.int32))

        visits = lax.fori_loop(0, epoch.num_batches(), body, jnp.zeros(12, jnp.int32))
        return visits, done, buffer.num_valid_windows()

    keys = jax.random.split(jax.random.key(7), 8)
    visits, done, counts = eqx.filter_jit(jax.vmap(run))(keys)
    assert len(set(np.asarray(counts).tolist())) > 1  # the runs' counts differ
    for v, d in zip(np.asarray(visits), np.asarray(done)[:, 0], strict=True):
        valid = [t for t in range(11) if not d[t]]  # window t, t+1: no end at step t
        assert v.tolist() == [1 if t in valid else 0 for t in range(12)]


def test_donated_step_does_not_retrace():
    """A donated jitted step that adds and then trains one whole epoch: one trace, as the
    buffer grows and the count of windows changes."""

    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, key):
        buffer = buffer.add({"x": jnp.ones((2, 3), jnp.float32)})
        epoch = buffer.epoch(key, batch_size=4)

        def body(i, total):
            sample, valid = buffer.epoch_batch(epoch, i)
            return total + jnp.sum(jnp.where(valid, sample.experience["x"], 0.0))

        return buffer, lax.fori_loop(0, epoch.num_batches(), body, jnp.float32(0))

    buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=2, capacity=16)
    for n in range(1, 5):
        buffer, total = step(buffer, jax.random.key(n))
        assert float(total) == min(6 * n, 16)
    eb.check(buffer)


# ------------------------------------------------------------------- clustered buffers

CLUSTERED = [eb.ClusteredBuffer, eb.PrioritisedClusteredBuffer]


def _clustered(kind, rows, clusters, capacity, weights=None):
    return kind(
        {"x": jnp.int32(0)},
        add_batch_size=rows,
        num_clusters=clusters,
        cluster_capacity=capacity,
        cluster_fn=lambda item: item["x"] % clusters,
        weights=weights,
    )


@SETTINGS
@given(
    kind=st.sampled_from(CLUSTERED),
    rows=st.integers(1, 3),
    clusters=st.integers(1, 3),
    capacity=st.integers(1, 5),
    steps=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    batch_size=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_each_clustered_item_once(kind, rows, clusters, capacity, steps, batch_size, seed):
    """Random adds routed to clusters that wrap or not: each item held exactly once per epoch
    (whatever its cluster's weight), with its cluster, index and number in its cluster, as
    a NumPy model of the clusters' rings says."""
    weights = None if clusters == 1 else (1.0,) + (0.0,) * (clusters - 1)
    buffer = _clustered(kind, rows, clusters, capacity, weights)
    routed = [[] for _ in range(clusters)]  # every item's value, per cluster, in order
    value, batches = 0, []
    for t in steps:
        x = np.arange(value, value + rows * t, dtype=np.int32).reshape(t, rows).T
        value += rows * t
        batches.append({"x": jnp.asarray(x)})
        for v in x.T.reshape(-1):  # time-major, rows in order
            routed[v % clusters].append(int(v))
    buffer = _add_all(buffer, batches)  # each batch added in turn
    held = {
        v: (c, n)
        for c, items in enumerate(routed)
        for n, v in enumerate(items[-capacity:], start=max(0, len(items) - capacity))
    }
    sample, valid, epoch = whole_epoch(buffer, jax.random.key(seed), batch_size)
    eb.check(sample)
    valid = np.asarray(valid)
    values = np.asarray(sample.experience["x"]).tolist()
    visited = [v for v, ok in zip(values, valid, strict=True) if ok]
    assert sorted(visited) == sorted(held)  # each held item once
    assert int(epoch.count) == len(held)
    assert int(epoch.num_batches()) == math.ceil(len(held) / batch_size)
    np.testing.assert_array_equal(valid, np.arange(valid.shape[0]) < len(held))
    cluster, steps_, indices = (
        np.asarray(a) for a in (sample.cluster, sample.steps, sample.indices)
    )
    for k, v in enumerate(values):  # masked places too: held items, with their own numbers
        c, n = held[v]
        assert (cluster[k], steps_[k], indices[k] // capacity) == (c, n, c)


def test_clustered_order_is_uniform():
    """Three items in two clusters: the 6 orders of an epoch equally likely (chi-square)."""
    buffer = _clustered(eb.ClusteredBuffer, rows=3, clusters=2, capacity=4)
    buffer = _add(buffer, {"x": jnp.array([0, 1, 2], jnp.int32)})

    def order(key):
        return buffer.epoch_batch(buffer.epoch(key, batch_size=3), 0)[0].experience["x"]

    orders = np.asarray(jax.jit(jax.vmap(order))(jax.random.split(jax.random.key(3), 1200)))
    perms = np.array(list(itertools.permutations(range(3))))
    counts = (orders[:, None, :] == perms[None]).all(axis=2).sum(axis=0)
    assert counts.sum() == 1200
    assert chi_square_pvalue(counts, np.full(6, 1 / 6)) > 1e-3


@pytest.mark.parametrize("kind", CLUSTERED)
def test_clustered_epoch_refusals(kind):
    """Nothing added: refused eagerly and recorded inside jit; an item written over since the
    plan: its batch refused; an epoch of another buffer's size refused."""
    buffer = _clustered(kind, rows=2, clusters=2, capacity=2)
    name = kind.__name__
    with pytest.raises(eqx.EquinoxRuntimeError, match=rf"{name}.epoch\(\): no item was added"):
        buffer.epoch(jax.random.key(0), 2)
    epoch = eqx.filter_jit(lambda b, k: b.epoch(k, 2))(buffer, jax.random.key(0))
    with pytest.raises(eqx.EquinoxRuntimeError, match="no item was added yet"):
        eb.check(epoch)
    buffer = _add(buffer, {"x": jnp.array([0, 1], jnp.int32)})
    epoch = _plan(buffer, jax.random.key(0), 2)
    wrapped = _add(buffer, {"x": jnp.array([[2, 4], [3, 5]], jnp.int32)})  # each cluster wraps
    sample, _ = _epoch_batch(wrapped, epoch, 0)
    with pytest.raises(eqx.EquinoxRuntimeError, match="written over by adds made after"):
        eb.check(sample)
    with pytest.raises(eqx.EquinoxRuntimeError, match="cluster_capacity=2 items"):
        wrapped.epoch_batch(epoch, 0)
    with pytest.raises(ValueError, match="num_clusters \\* cluster_capacity = 8"):
        _clustered(kind, rows=2, clusters=2, capacity=4).epoch_batch(epoch, 0)


def test_clustered_epoch_in_a_donated_step_and_set_priorities():
    """A donated jitted step: add, then one epoch whose batches set every item's priority
    (the batches' indices and steps go to `set_priorities`); one trace as the buffer grows."""

    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, key, t):
        buffer = buffer.add({"x": t * 2 + jnp.arange(2, dtype=jnp.int32)})
        epoch = buffer.epoch(key, batch_size=3)

        def body(i, carry):
            buffer, total = carry
            sample, valid = buffer.epoch_batch(epoch, i)
            buffer = buffer.set_priorities(sample, jnp.where(valid, 2.0, 0.0))
            return buffer, total + jnp.sum(jnp.where(valid, sample.experience["x"], 0))

        return lax.fori_loop(0, epoch.num_batches(), body, (buffer, jnp.int32(0)))

    buffer = _clustered(eb.PrioritisedClusteredBuffer, rows=2, clusters=2, capacity=3)
    for t in range(5):
        buffer, total = step(buffer, jax.random.key(t), jnp.int32(t))
        held = [v for c in range(2) for v in list(range(c, 2 * t + 2, 2))[-3:]]
        assert int(total) == sum(held)
    eb.check(buffer)
    assert float(buffer.max_priority) == 2.0
