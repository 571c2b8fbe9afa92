"""Frames stored once (issue 46): every sample returns the stacks the environment's
frame-stacking wrapper returned, checked against a NumPy model of the wrapper on random
episode layouts (episodes shorter than `k`, wrap-around, several rows), for every kind of
ring buffer; adds of stacked observations and of single frames store the same; every step
is drawn as often as any other, the first `k - 1` of each episode included; bad input gets
its own error and changes nothing; the stored bytes are one frame per step."""

import re

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from scipy import stats

import equibuffer as eb

from .helpers import budget, spread


FRAME = (2,)  # each frame: [row * 10_000 + step, step], so every frame is its own


def wrapper_stack(frames, dones, t, k, padding, axis):
    """What a frame-stacking wrapper (Gymnasium's FrameStackObservation, SB3's
    VecFrameStack with `padding="zeros"`) returns at step `t` of one row: the last `k`
    frames of `t`'s episode, oldest first, the episode's first frame (or zeros) before it."""
    start = t
    while start > 0 and not dones[start - 1] and t - start < k - 1:
        start -= 1
    out = []
    for p in range(t - k + 1, t + 1):
        if p >= start:
            out.append(frames[p])
        elif padding == "reset":
            out.append(frames[start])
        else:
            out.append(np.zeros_like(frames[start]))
    return np.stack(out, axis=axis)


class History:
    """Every step ever added to each row, and the wrapper's stacks."""

    def __init__(self, rows, k, padding, axis):
        self.rows, self.k, self.padding, self.axis = rows, k, padding, axis
        self.frames = [[] for _ in range(rows)]
        self.dones = [[] for _ in range(rows)]

    def steps(self, rng, t, p_done):
        """The next `t` steps of every row: single frames, stacks, dones, as arrays."""
        single, stacked, done = [], [], []
        for r in range(self.rows):
            n0 = len(self.frames[r])
            for j in range(t):
                self.frames[r].append(np.array([r * 10_000 + n0 + j, n0 + j], np.int32))
                self.dones[r].append(bool(rng.random() < p_done))
            single.append(np.stack(self.frames[r][n0:]))
            stacked.append(np.stack([self.stack(r, n0 + j) for j in range(t)]))
            done.append(np.array(self.dones[r][n0:]))
        return np.stack(single), np.stack(stacked), np.stack(done)

    def stack(self, row, t):
        return wrapper_stack(self.frames[row], self.dones[row], t, self.k, self.padding, self.axis)


def step_batch(obs, done):
    """A batch of the tests' example: observations (stacked or single frames), rewards of
    one and the episode ends `done`, leaves `(rows, [T], *leaf)`."""
    return {
        "obs": jnp.asarray(obs),
        "reward": jnp.ones(np.shape(done), jnp.float32),
        "done": jnp.asarray(done),
    }


def _kinds():
    """Constructors of every ring buffer kind, `(example, rows, length, frames) -> buffer`."""
    return {
        "trajectory": lambda ex, rows, length, f: eb.TrajectoryBuffer(
            ex, add_batch_size=rows, max_length_time_axis=length, sequence_length=2, frames=f
        ),
        "transition": lambda ex, rows, length, f: eb.TransitionBuffer(
            ex, add_batch_size=rows, max_length_time_axis=length, frames=f
        ),
        "item": lambda ex, rows, length, f: eb.ItemBuffer(
            ex, add_batch_size=rows, max_length_time_axis=length, frames=f
        ),
        "nstep": lambda ex, rows, length, f: eb.TransitionBuffer(
            ex,
            add_batch_size=rows,
            max_length_time_axis=length,
            n_step=2,
            discount=0.9,
            terminated="done",
            truncated=None,
            frames=f,
        ),
        "episode_pad": lambda ex, rows, length, f: eb.EpisodeTrajectoryBuffer(
            ex,
            add_batch_size=rows,
            max_length_time_axis=length,
            sequence_length=2,
            episode_end="done",
            mode="pad",
            frames=f,
        ),
        "prioritised": lambda ex, rows, length, f: eb.PrioritisedTransitionBuffer(
            ex, add_batch_size=rows, max_length_time_axis=length, frames=f
        ),
        "prioritised_episodic": lambda ex, rows, length, f: eb.PrioritisedTransitionBuffer(
            ex,
            add_batch_size=rows,
            max_length_time_axis=length,
            episode_end="done",
            frames=f,
        ),
        "ranked": lambda ex, rows, length, f: eb.PrioritisedBuffer(
            ex,
            add_batch_size=rows,
            max_length_time_axis=length,
            rule=eb.rules.RankPrioritised(),
            view=eb.views.PairView(),
            frames=f,
        ),
    }


KINDS = sorted(_kinds())


def _example(k, axis):
    shape = list(FRAME)
    shape.insert(axis % (len(FRAME) + 1), k)
    return {
        "obs": jnp.zeros(tuple(shape), jnp.int32),
        "reward": jnp.float32(0),
        "done": jnp.bool_(False),
    }


def _positions(kind, experience, steps):
    """`(stacks, step offsets from the window start, in-episode mask or None)` of a
    sample's experience: one entry per step position the view returns."""
    if kind in ("trajectory", "episode_pad"):
        obs = experience["obs"]
        return [(obs[:, j], j) for j in range(obs.shape[1])]
    if kind == "item":
        return [(experience["obs"], 0)]
    if kind == "nstep":
        n = np.asarray(experience.steps)
        return [(experience.first["obs"], 0), (experience.second["obs"], n)]
    return [(experience.first["obs"], 0), (experience.second["obs"], 1)]


def _check_sample(kind, buffer, history, sample, added):
    """Every stack of `sample` is the wrapper's, and no window starts where the ring has
    written over frames of its stack."""
    length, k = buffer.max_length_time_axis, history.k
    rows = np.asarray(sample.indices) // length
    starts = np.asarray(sample.steps).astype(np.int64)
    oldest = max(0, added - length)
    mask = getattr(sample, "mask", None)
    mask = None if mask is None else np.asarray(mask)
    for t in starts:
        assert oldest <= t < added
        if oldest > 0:  # wrapped: the frames of the stack are all held
            assert t - (k - 1) >= oldest, (t, oldest, k)
    for stacks, offset in _positions(kind, sample.experience, starts):
        stacks = np.asarray(stacks)
        offsets = np.broadcast_to(offset, starts.shape)
        for i, (r, t, d) in enumerate(zip(rows, starts, offsets, strict=True)):
            if mask is not None and not bool(mask[i, d]):
                assert not stacks[i].any()  # past the episode's end: zero
                continue
            expected = history.stack(int(r), int(t + d))
            np.testing.assert_array_equal(
                stacks[i], expected, err_msg=f"{kind} row {r} step {t}+{d}"
            )


@pytest.mark.parametrize("kind", spread(KINDS))
@settings(max_examples=budget(12))
@given(data=st.data())
def test_samples_hold_the_wrappers_stacks(kind, data):
    """Random layouts: several rows, episodes shorter than `k`, wrap-around, adds of one or
    several steps, stacked or single frames; the samples hold the wrapper's stacks."""
    k = data.draw(st.integers(1, 4), label="k")
    rows = data.draw(st.integers(1, 2), label="rows")
    length = data.draw(st.integers(2 + k, 9), label="length")  # (a window and k - 1 steps)
    padding = data.draw(st.sampled_from(["reset", "zeros"]), label="padding")
    axis = data.draw(st.sampled_from([-1, 0]), label="axis")
    p_done = data.draw(st.sampled_from([0.0, 0.3, 0.7]), label="p_done")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    frames = eb.Frames("obs", k=k, axis=axis, padding=padding, episode_end="done")
    buffer = _kinds()[kind](_example(k, axis), rows, length, frames)
    history = History(rows, k, padding, axis)
    sample_fn = eqx.filter_jit(lambda b, key: b.sample(key, batch_size=32))
    add_fn = eqx.filter_jit(lambda b, x: b.add(x))
    added = 0
    for step in range(data.draw(st.integers(1, 5), label="adds")):
        t = data.draw(st.integers(1, length + 2), label="t")
        single, stacked, done = history.steps(rng, t, p_done)
        obs = stacked if data.draw(st.booleans(), label="stacked") else single
        batch = {"obs": obs, "reward": np.ones((rows, t), np.float32), "done": done}
        buffer = add_fn(buffer, jax.tree.map(jnp.asarray, batch))
        added += t
        if kind.startswith("episode") or kind == "prioritised_episodic":
            if int(buffer.num_valid_windows()) == 0:
                continue
        if not bool(buffer.can_sample()):
            continue
        sample = sample_fn(buffer, jax.random.key(step))
        _check_sample(kind, buffer, history, sample, added)


def test_stacked_and_single_frames_store_the_same():
    """A step that adds the environment's stacked observations and one that adds single
    frames hold the same arrays, and give the same samples."""
    rng = np.random.default_rng(0)
    k, rows, length = 4, 3, 16
    history = History(rows, k, "reset", -1)
    frames = eb.Frames("obs", k=k, episode_end="done")
    a, b = (
        eb.TransitionBuffer(
            _example(k, -1), add_batch_size=rows, capacity=rows * length, frames=frames
        )
        for _ in range(2)
    )
    add = eqx.filter_jit(lambda buf, batch: buf.add(batch), donate="all")
    for _ in range(7):
        single, stacked, done = history.steps(rng, 5, 0.3)
        reward = np.ones((rows, 5), np.float32)
        a = add(
            a,
            {"obs": jnp.asarray(stacked), "reward": jnp.asarray(reward), "done": jnp.asarray(done)},
        )
        b = add(
            b,
            {"obs": jnp.asarray(single), "reward": jnp.asarray(reward), "done": jnp.asarray(done)},
        )
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    key = jax.random.key(3)
    for x, y in zip(
        jax.tree.leaves(a.sample(key, 64)), jax.tree.leaves(b.sample(key, 64)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", ["transition", "prioritised"])
def test_every_step_is_drawn_as_often_the_first_of_each_episode_included(kind):
    """Chi-square: with episodes of 1 to 5 steps (shorter than `k = 4` too), every valid
    transition start is drawn uniformly (by priority, all equal), the first `k - 1` steps
    of every episode included; after the ring wrapped, the `k - 1` oldest steps, whose
    frames it wrote over, are never drawn."""
    rng = np.random.default_rng(1)
    k, rows, length = 4, 2, 40
    history = History(rows, k, "reset", -1)
    frames = eb.Frames("obs", k=k, episode_end="done")
    buffer = _kinds()[kind](_example(k, -1), rows, length, frames)
    single, _, done = history.steps(rng, 52, 0.35)  # wraps: 12 steps written over
    buffer = buffer.add(step_batch(single, done))
    draws = 40_000
    sample = eqx.filter_jit(lambda b, key: b.sample(key, batch_size=draws))(
        buffer, jax.random.key(0)
    )
    steps = np.asarray(sample.steps).astype(np.int64)
    row = np.asarray(sample.indices) // length
    oldest = 52 - length
    # pairs start at oldest + 3 ... 50 (the last step has no second yet)
    valid = [(r, t) for r in range(rows) for t in range(oldest + k - 1, 51)]
    counts = {v: 0 for v in valid}
    for r, t in zip(row, steps, strict=True):
        counts[(int(r), int(t))] += 1  # a KeyError: a start that is not valid
    observed = np.array(list(counts.values()))
    assert stats.chisquare(observed).pvalue > 1e-4
    firsts = [v for v in valid if v[1] == 0 or history.dones[v[0]][v[1] - 1]]
    assert len(firsts) > 5  # episode starts are among them, drawn like the rest
    _check_sample("transition", buffer, history, sample, 52)


def test_memory_is_one_frame_per_step():
    """10**4 transitions of (84, 84) uint8 frames stacked by 4: the ring holds one frame per
    step plus the other leaves (7,056 + 4 + 4 + 1 bytes), not the stack (28,224)."""
    example = {
        "obs": jnp.zeros((84, 84, 4), jnp.uint8),
        "action": jnp.int32(0),
        "reward": jnp.float32(0),
        "done": jnp.bool_(False),
    }
    once = eb.TransitionBuffer(
        example,
        add_batch_size=10,
        capacity=10_000,
        frames=eb.Frames("obs", k=4, episode_end="done"),
    )
    whole = eb.TransitionBuffer(example, add_batch_size=10, capacity=10_000)
    nbytes = lambda b: sum(x.nbytes for x in jax.tree.leaves(b.storage.data))  # noqa: E731
    assert nbytes(once) == 10_000 * (84 * 84 + 4 + 4 + 1)
    assert nbytes(whole) == 10_000 * (84 * 84 * 4 + 4 + 4 + 1)


def _errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_bad_configuration_is_refused_naming_what_to_pass():
    ex = _example(4, -1)

    def build(frames, **kw):
        return lambda: eb.TransitionBuffer(ex, add_batch_size=1, capacity=8, frames=frames, **kw)

    _errors(build(eb.Frames("obs", k=0, episode_end="done")), r"`Frames.k` must be at least 1")
    _errors(
        build(eb.Frames("pixels", k=4, episode_end="done")), r"names no top-level leaf.*\['obs'\]"
    )
    _errors(build(eb.Frames("obs", k=3, episode_end="done")), r"not `k=3` frames.*axis=-1")
    _errors(
        build(eb.Frames("obs", k=4, axis=2, episode_end="done")), r"`Frames.axis=2` is not an axis"
    )
    _errors(build(eb.Frames("reward", k=4, episode_end="done")), r"is 0-d: it has no stack axis")
    _errors(build(eb.Frames("obs", k=4)), r"needs to know where episodes start.*episode_end=")
    # (an annotation: refused by the constructor under a type checker, else by the buffer)
    _errors(
        lambda: build(eb.Frames("obs", k=4, padding="edge", episode_end="done"))(),
        r"'reset'.*'zeros'",
    )
    _errors(build(eb.Frames("obs", k=4, episode_end="reward")), r"must be a 0-d bool")
    _errors(build(eb.Frames("obs", k=4, episode_end="terminated"), episode_end="done"), r"disagree")
    _errors(build("obs"), r"`frames` must be an eb.Frames|Frames \| None")
    small = eb.Frames("obs", k=4, episode_end="done")
    _errors(
        lambda: eb.TransitionBuffer(ex, add_batch_size=1, max_length_time_axis=4, frames=small),
        r"must hold one window of 2 steps \(one transition\) and the k - 1 = 3 steps before it, "
        r"5 steps, but it holds max_length_time_axis=4",
    )
    # An episode-aware rule's episode ends are the frames' own.
    buffer = eb.TransitionBuffer(
        ex, add_batch_size=1, capacity=8, episode_end="done", frames=eb.Frames("obs", k=4)
    )
    assert buffer.storage.frames.episode_end == "done"


def test_disagreeing_stacks_are_refused_and_nothing_is_lost():
    """A stack whose older frames are not what the buffer holds for its row (rows shuffled
    between adds, the wrong leaf stacked, the wrong padding) is refused: eagerly it raises,
    under `eb.filter_jit` too, and the buffer holds what it held."""
    rng = np.random.default_rng(2)
    k, rows = 4, 2
    history = History(rows, k, "reset", -1)
    frames = eb.Frames("obs", k=k, episode_end="done")
    buffer = eb.TransitionBuffer(_example(k, -1), add_batch_size=rows, capacity=32, frames=frames)
    _, stacked, done = history.steps(rng, 3, 0.0)
    buffer = buffer.add(step_batch(stacked, done))
    _, stacked, done = history.steps(rng, 2, 0.0)
    swapped = step_batch(stacked[::-1], done)
    message = re.escape(
        "the stacked observations ['obs'] disagree with the frames the buffer holds"
    )
    with pytest.raises(Exception, match=message):
        buffer.add(swapped)
    zeros_padded = step_batch(jnp.asarray(stacked) * 0, done)
    with pytest.raises(Exception, match=message):
        buffer.add(zeros_padded)
    step = eb.filter_jit(lambda b, batch: b.add(batch), donate="all")
    before = jax.tree.map(np.asarray, buffer)
    donated = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, buffer)
    with pytest.raises(eqx.EquinoxRuntimeError, match=message) as info:
        step(donated, swapped)  # (a copy donated: `buffer` goes on)
    kept = info.value.output  # what the refused step returned: the buffer as it was
    for x, y in zip(
        jax.tree.leaves(before.storage.data), jax.tree.leaves(kept.storage.data), strict=True
    ):
        np.testing.assert_array_equal(x, np.asarray(y))
    # the buffer goes on from what it held: the right stacks are taken
    right = step_batch(stacked, done)
    assert int(buffer.add(right).size()) == rows * 5


def test_a_shape_that_is_neither_a_stack_nor_a_frame_is_refused():
    buffer = eb.TransitionBuffer(
        _example(4, -1),
        add_batch_size=2,
        capacity=16,
        frames=eb.Frames("obs", k=4, episode_end="done"),
    )
    bad = {
        "obs": jnp.zeros((2, 5), jnp.int32),
        "reward": jnp.ones(2, jnp.float32),
        "done": jnp.zeros(2, bool),
    }
    with pytest.raises(
        ValueError, match=r"expected stacked observations \(add_batch_size=2, 2, 4\)"
    ):
        buffer.add(bad)


def test_clustered_buffers_refuse_frames_saying_why():
    with pytest.raises(TypeError, match="refuses `frames`: its items keep no time order"):
        eb.ClusteredBuffer(
            {"obs": jnp.zeros((2, 4))},
            add_batch_size=1,
            num_clusters=2,
            cluster_capacity=4,
            cluster_fn=lambda s: jnp.int32(0),
            frames=eb.Frames("obs", k=4, episode_end="done"),
        )


def test_an_episode_end_attribute_of_a_module_example():
    """`episode_end` names a leaf of a dict example or an attribute of a module one, for the
    frames and for an episode-aware rule alike."""
    import equinox as eqx

    class Step(eqx.Module):
        obs: jax.Array
        done: jax.Array

    example = Step(jnp.zeros((2, 3), jnp.int32), jnp.bool_(False))
    frames = eb.Frames("obs", k=3, episode_end="done")
    buffer = eb.TransitionBuffer(example, add_batch_size=1, capacity=8, frames=frames)
    buffer = buffer.add(
        Step(
            jnp.arange(4, dtype=jnp.int32).reshape(1, 4, 1) * jnp.ones((1, 1, 2), jnp.int32),
            jnp.array([[False, True, False, False]]),
        )
    )
    stacks = buffer.storage.take(jnp.array([2, 3])).obs[:, 0]
    assert stacks.tolist() == [[2, 2, 2], [2, 2, 3]]  # step 2 starts an episode
    episodic = eb.EpisodeTrajectoryBuffer(
        example, add_batch_size=1, capacity=8, sequence_length=2, episode_end="done"
    )
    assert (
        int(
            episodic.add(
                Step(jnp.zeros((1, 4, 2, 3), jnp.int32), jnp.array([[False, True, False, False]]))
            ).num_valid_windows()
        )
        == 2
    )


def test_disagreeing_stacks_in_a_scan_under_plain_jit_change_nothing():
    """The way a ported step runs: adds in a `lax.scan` under plain `eqx.filter_jit`. A stack
    that disagrees with the frames held is refused there too: every array of data is as it
    was, and the failure is recorded in the buffer (`eb.check` raises it)."""
    rng = np.random.default_rng(4)
    k, rows = 3, 2
    history = History(rows, k, "reset", -1)
    frames = eb.Frames("obs", k=k, episode_end="done")
    buffer = eb.TransitionBuffer(_example(k, -1), add_batch_size=rows, capacity=32, frames=frames)
    _, stacked, done = history.steps(rng, 3, 0.0)
    buffer = buffer.add(step_batch(stacked, done))
    before = [np.asarray(x) for x in jax.tree.leaves(buffer.storage.data)]
    _, stacked, done = history.steps(rng, 2, 0.0)

    @eqx.filter_jit
    def step(buffer, obs, done):
        def body(buffer, x):
            return buffer.add(
                {"obs": x[0], "reward": jnp.ones(rows, jnp.float32), "done": x[1]}
            ), None

        return jax.lax.scan(body, buffer, (jnp.swapaxes(obs, 0, 1), jnp.swapaxes(done, 0, 1)))[0]

    refused = step(buffer, jnp.asarray(stacked[::-1]), jnp.asarray(done))  # rows swapped
    for x, y in zip(before, jax.tree.leaves(refused.storage.data), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    with pytest.raises(Exception, match="disagree with the frames the buffer holds"):
        eb.check(refused)
    accepted = step(buffer, jnp.asarray(stacked), jnp.asarray(done))
    assert int(accepted.size()) == rows * 5


def test_frames_under_x64():
    """With 64-bit types on (and NumPy int64 indices given to `take`), the stacks are the
    wrapper's and the buffer's dtypes stay its own."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(11)
        k, rows = 3, 2
        history = History(rows, k, "reset", -1)
        frames = eb.Frames("obs", k=k, episode_end="done")
        buffer = eb.PrioritisedTransitionBuffer(
            _example(k, -1), add_batch_size=rows, max_length_time_axis=8, frames=frames
        )
        add = eqx.filter_jit(lambda b, x: b.add(x))  # (compiled whole, not op by op)
        for _ in range(3):
            _, stacked, done = history.steps(rng, 4, 0.3)
            buffer = add(buffer, step_batch(stacked, done))
        sample = eqx.filter_jit(lambda b, key: b.sample(key, 16))(buffer, jax.random.key(0))
        _check_sample("prioritised", buffer, history, sample, 12)
        stacks = buffer.storage.take(jnp.asarray(np.array([7], np.int64)))["obs"]
        assert stacks.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(stacks[0]), history.stack(0, 7))
