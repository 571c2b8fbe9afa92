"""Frames stored once through the library's other parts (issue 46): a `Mixer` of buffers
that stack frames, `RateLimited`, the checked step with donation and adds in a `lax.scan`,
`eqx.tree_serialise_leaves`, `with_storage`, `vmap` over seeds, and rows split over two
devices (`shard_rows`, both axis types, and `row_blocks`) or one buffer per device
(`per_device`): each gives the wrapper's stacks."""

import textwrap

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zarr
from hypothesis import given, settings

import equibuffer as eb

from .helpers import budget, run_on_host_devices
from .test_frames import _check_sample, _example, History, step_batch, wrapper_stack


K = 3


def _frames():
    return eb.Frames("obs", k=K, episode_end="done")


def _filled(rows=2, length=12, t=20, seed=0, cls=eb.TransitionBuffer, **kw):
    history = History(rows, K, "reset", -1)
    single, _, done = history.steps(np.random.default_rng(seed), t, 0.3)
    buffer = cls(
        _example(K, -1), add_batch_size=rows, max_length_time_axis=length, frames=_frames(), **kw
    )
    buffer = buffer.add(step_batch(single, done))
    return buffer, history, t


def test_a_mixer_of_framed_buffers_returns_each_sources_stacks():
    (a, ha, ta), (b, hb, tb) = _filled(seed=1), _filled(seed=2, length=16)
    mixer = eb.Mixer([a, b], proportions=[0.5, 0.5])
    sample = eqx.filter_jit(lambda m, key: m.sample(key, 16))(mixer, jax.random.key(0))
    rows = 0
    for source, buffer, history, t in zip(sample.samples, (a, b), (ha, hb), (ta, tb), strict=True):
        n = source.indices.shape[0]
        experience = jax.tree.map(lambda x: x[rows : rows + n], sample.experience)  # noqa: B023
        _check_sample(
            "transition",
            buffer,
            history,
            eqx.tree_at(lambda s: s.experience, source, experience, is_leaf=lambda x: x is None),
            t,
        )
        rows += n


def test_rate_limited_framed_buffer_adds_and_samples_stacks():
    buffer, history, t = _filled()
    limited = eb.RateLimited(buffer, samples_per_insert=4.0, tolerance=1_000.0)
    single, stacked, done = history.steps(np.random.default_rng(5), 3, 0.3)
    limited = limited.add(step_batch(stacked, done))
    limited, sample = limited.sample(jax.random.key(1), 8)
    _check_sample("transition", limited.buffer, history, sample, t + 3)


def test_checked_step_adds_stacks_in_a_scan_with_donation():
    """The way users train: `eb.filter_jit(donate="all")`, the environment's stacked
    observations added inside a `lax.scan`, a sample per step."""
    rows, length, t = 2, 16, 10
    history = History(rows, K, "reset", -1)
    _, stacked, done = history.steps(np.random.default_rng(3), t, 0.25)
    buffer = eb.PrioritisedTransitionBuffer(
        _example(K, -1), add_batch_size=rows, max_length_time_axis=length, frames=_frames()
    )

    @eb.filter_jit(donate="all")
    def run(buffer, obs, done, key):
        def body(buffer, x):
            obs, done = x
            buffer = buffer.add({"obs": obs, "reward": jnp.ones(rows, jnp.float32), "done": done})
            return buffer, None

        buffer, _ = jax.lax.scan(body, buffer, (jnp.swapaxes(obs, 0, 1), jnp.swapaxes(done, 0, 1)))
        sample = buffer.sample(key, 32)
        return buffer.set_priorities(sample, sample.weights + 1.0), sample

    buffer, sample = run(buffer, jnp.asarray(stacked), jnp.asarray(done), jax.random.key(0))
    _check_sample("prioritised", buffer, history, sample, t)
    np.testing.assert_array_equal(
        np.asarray(buffer.storage.data["obs"][:, :t]),
        np.stack([np.stack(f) for f in history.frames]),
    )


def test_serialised_and_restored_buffers_keep_their_frames(tmp_path):
    buffer, history, t = _filled()
    path = tmp_path / "buffer.eqx"
    eqx.tree_serialise_leaves(path, buffer)
    like = eb.TransitionBuffer(
        _example(K, -1), add_batch_size=2, max_length_time_axis=12, frames=_frames()
    )
    restored = eqx.tree_deserialise_leaves(path, like)
    key = jax.random.key(4)
    for x, y in zip(
        jax.tree.leaves(buffer.sample(key, 8)),
        jax.tree.leaves(restored.sample(key, 8)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # with_storage: a ring made with the same frames is taken, another is refused
    taken = restored.with_storage(buffer.storage).storage
    assert all(
        x is y for x, y in zip(jax.tree.leaves(taken), jax.tree.leaves(buffer.storage), strict=True)
    )
    plain = eb.RingStorage(_example(K, -1), rows=2, length=12)
    with pytest.raises(ValueError, match="stacks frames as None"):
        restored.with_storage(plain)


def test_vmap_over_seeds_keeps_can_sample_unbatched():
    """The batched-use invariant: `can_sample()` depends on the counters only, also with
    frames (the dropped oldest starts are a function of them), so a cond on it stays a
    cond under vmap and nothing fails at step 0."""
    rows = 2
    buffer = eb.TransitionBuffer(
        _example(K, -1), add_batch_size=rows, max_length_time_axis=8, frames=_frames()
    )

    def train(seed):
        key = jax.random.key(seed)
        b = buffer.add(
            step_batch(jnp.ones((rows, 2, 2), jnp.int32), jax.random.bernoulli(key, 0.5, (rows, 2)))
        )
        out = jax.lax.cond(
            b.can_sample(),
            lambda: b.sample(key, 4).experience.first["obs"].sum(dtype=jnp.int32),
            lambda: jnp.int32(0),
        )
        return out, b.can_sample()

    out, ready = jax.jit(jax.vmap(train))(jnp.arange(3))
    assert ready.tolist() == [True] * 3 and out.shape == (3,)


SHARDED = textwrap.dedent(
    """
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import equibuffer as eb
    from tests.test_frames import History, _check_sample, _example

    assert jax.device_count() == 2
    rows, k = 4, 3
    frames = eb.Frames("obs", k=k, episode_end="done")
    builders = {
        "transition": lambda: eb.TransitionBuffer(
            _example(k, -1), add_batch_size=rows, max_length_time_axis=10, frames=frames),
        "prioritised": lambda: eb.PrioritisedTransitionBuffer(
            _example(k, -1), add_batch_size=rows, max_length_time_axis=10, frames=frames),
        "episode_pad": lambda: eb.EpisodeTrajectoryBuffer(
            _example(k, -1), add_batch_size=rows, max_length_time_axis=10, sequence_length=2,
            mode="pad", frames=frames),
    }

    @eqx.filter_jit(donate="all-except-first")
    def step(key, buffer, batch, blocks):
        buffer = buffer.add(batch)
        return buffer, buffer.sample(key, 8, row_blocks=blocks)

    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((2,), ("envs",), axis_types=(axis_type,))
        for name, build in builders.items():
            history = History(rows, k, "reset", -1)
            rng = np.random.default_rng(0)
            one, split = build(), eb.shard_rows(build(), mesh, "envs")
            added = 0
            for i in range(4):  # wraps the ring of 10 steps
                _, stacked, done = history.steps(rng, 4, 0.3)
                batch = {"obs": stacked, "reward": np.ones((rows, 4), np.float32), "done": done}
                added += 4
                key = jax.random.key(i)
                one, s1 = step(key, one, jax.tree.map(jnp.asarray, batch), 1)
                placed = jax.device_put(batch, NamedSharding(mesh, P("envs")))
                split, s2 = step(key, split, placed, 1)
                for x, y in zip(jax.tree.leaves((one, s1)), jax.tree.leaves((split, s2))):
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
                if bool(one.can_sample()):
                    _check_sample(name, one, history, s1, added)
                    blocked = eqx.filter_jit(lambda b, key: b.sample(key, 8, row_blocks=2))(
                        split, key)
                    _check_sample(name, split, history, blocked, added)
            assert tuple(split.storage.data["obs"].sharding.spec)[:1] == ("envs",), name

        # per_device: one whole buffer per device, stepped by eqx.filter_vmap under jit
        def local(key, buffer, batch):
            buffer = buffer.add(batch)
            return buffer, buffer.sample(key, 8)

        by_vmap = eqx.filter_jit(eqx.filter_vmap(local), donate="all-except-first")
        one = eqx.filter_jit(local, donate="all-except-first")
        per = eb.per_device(builders["prioritised"](), mesh, "envs")
        singles = [builders["prioritised"]() for _ in range(2)]
        histories = [History(rows, k, "reset", -1) for _ in range(2)]
        rng = np.random.default_rng(1)
        for i in range(4):
            batches = []
            for d in range(2):
                _, stacked, done = histories[d].steps(rng, 4, 0.3)
                batches.append({"obs": stacked, "reward": np.ones((rows, 4), np.float32),
                                "done": done})
            keys = jax.random.split(jax.random.key(i), 2)
            both = jax.tree.map(lambda *x: np.stack(x), *batches)
            placed = jax.device_put((keys, both), NamedSharding(mesh, P("envs")))
            per, s = by_vmap(placed[0], per, placed[1])
            for d in range(2):
                singles[d], sd = one(keys[d], singles[d], jax.tree.map(jnp.asarray, batches[d]))
                mine = jax.tree.map(lambda x: np.asarray(x)[d], s)
                for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(sd)):
                    np.testing.assert_array_equal(x, np.asarray(y))
                if bool(singles[d].can_sample()):
                    _check_sample("prioritised", singles[d], histories[d], sd, 4 * (i + 1))
    print("sharded frames ok")
    """
)


@pytest.mark.slow  # (it starts a process with two host devices)
def test_frames_split_over_devices_match_one_device():
    out = run_on_host_devices(SHARDED, devices=2, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "sharded frames ok" in out.stdout


def test_a_queue_returns_stacks_and_keeps_the_frames_they_read():
    """`Queue(frames=)`: each rollout comes back as the wrapper's stacks, in order; an add
    that would overwrite the `k - 1` steps before the oldest unread one (whose frames its
    stack holds) is refused as a full queue's add is."""
    rows, length, s = 2, 8, 3
    history = History(rows, K, "reset", -1)
    rng = np.random.default_rng(7)
    queue = eb.Queue(
        _example(K, -1),
        add_batch_size=rows,
        max_length_time_axis=length,
        sequence_length=s,
        frames=_frames(),
    )
    read = 0
    for _ in range(5):
        _, stacked, done = history.steps(rng, s, 0.3)
        queue = queue.add(step_batch(stacked, done))
        queue, sample = queue.sample()
        for r in range(rows):
            for j in range(s):
                np.testing.assert_array_equal(
                    np.asarray(sample.experience["obs"][r, j]), history.stack(r, read + j)
                )
        read += s
    # 6 slots of 8 hold unread steps or the k - 1 = 2 before them: room for 2 more, not 3
    _, stacked, done = history.steps(rng, 4, 0.0)
    queue = queue.add(step_batch(stacked[:, :4], done[:, :4]))
    assert bool(queue.can_add(2)) and not bool(queue.can_add(3))
    with pytest.raises(Exception, match=r"or the k - 1 = 2 steps before them \(their frames\)"):
        queue.add(step_batch(jnp.zeros((rows, 3, 2), jnp.int32), jnp.zeros((rows, 3), bool)))
    with pytest.raises(ValueError, match="plus the k - 1 = 2 steps before them"):
        eb.Queue(
            _example(K, -1),
            add_batch_size=1,
            max_length_time_axis=4,
            sequence_length=3,
            frames=_frames(),
        )


def test_the_archive_stores_frames_once_and_restores_a_working_buffer(tmp_path):
    """An `Archive` of a buffer that stacks frames holds one frame per step on disk, and
    `restore` gives back a buffer whose samples are the wrapper's stacks."""
    rows, t = 2, 30
    history = History(rows, K, "reset", -1)
    single, _, done = history.steps(np.random.default_rng(8), t, 0.3)
    buffer = eb.TransitionBuffer(
        _example(K, -1), add_batch_size=rows, max_length_time_axis=16, frames=_frames()
    )
    with eb.Archive(str(tmp_path / "run.zarr"), buffer) as archive:
        for i in range(0, t, 10):
            buffer = buffer.add(step_batch(single[:, i : i + 10], done[:, i : i + 10]))
            archive.write(buffer)
        assert archive.read(0, 30)["obs"].shape == (2, 30, 2)  # one frame per step
        np.testing.assert_array_equal(archive.read(0, 30)["obs"], single)
        # `read(frames=)`: the wrapper's stacks of every step (the archive starts at the
        # source's first step), of any range and rows; the other leaves as they are.
        stacks = np.stack([[history.stack(r, s) for s in range(t)] for r in range(rows)])
        stacked = archive.read(frames=_frames())
        np.testing.assert_array_equal(stacked["obs"], stacks)
        np.testing.assert_array_equal(stacked["done"], done)
        part = archive.read(11, -7, rows=[1], frames=_frames())
        np.testing.assert_array_equal(part["obs"], stacks[1:, 11:23])
        fresh = eb.TransitionBuffer(
            _example(K, -1), add_batch_size=2, max_length_time_axis=16, frames=_frames()
        )
        restored = archive.restore(fresh)
    for x, y in zip(
        jax.tree.leaves(buffer.storage), jax.tree.leaves(restored.storage), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    sample = restored.sample(jax.random.key(2), 64)
    _check_sample("transition", restored, history, sample, t)


def test_an_epoch_visits_every_drawable_step_once_with_its_stacks():
    """Epochs see the windows `sample` draws: after a wrap, every step but the `k - 1`
    oldest (and the newest, which has no second yet), once each, as stacks."""
    buffer, history, t = _filled(length=12, t=20)
    epoch = buffer.epoch(jax.random.key(0), batch_size=8)
    seen = []
    for i in range(int(epoch.num_batches())):
        sample, valid = buffer.epoch_batch(epoch, i)
        _check_sample("transition", buffer, history, sample, t)
        rows = np.asarray(sample.indices) // 12
        seen += [
            (int(r), int(s))
            for r, s, v in zip(rows, np.asarray(sample.steps), np.asarray(valid), strict=True)
            if v
        ]
    oldest = t - 12
    assert sorted(seen) == [(r, s) for r in range(2) for s in range(oldest + K - 1, t - 1)]


@pytest.mark.parametrize("view", ["transition", "window"])
def test_the_archive_loader_returns_stacks(tmp_path, view):
    """`ArchiveLoader(frames=)` over an archive of frames: one epoch visits every window
    once, each step a stack of its own episode (the loader's look-back read with it)."""
    rows, t = 2, 40
    history = History(rows, K, "reset", -1)
    single, _, done = history.steps(np.random.default_rng(9), t, 0.3)
    buffer = eb.TransitionBuffer(
        _example(K, -1), add_batch_size=rows, max_length_time_axis=64, frames=_frames()
    )
    buffer = buffer.add(step_batch(single, done))
    window = 2 if view == "transition" else 3
    kwargs = {"view": "transition"} if view == "transition" else {"sequence_length": 3}
    seen = []
    with eb.Archive(str(tmp_path / "run.zarr"), buffer) as archive:
        archive.write(buffer)
        with eb.ArchiveLoader(
            archive,
            jax.random.key(0),
            batch_size=16,
            block_steps=8,
            pool_blocks=2,
            epochs=1,
            frames=_frames(),
            **kwargs,
        ) as loader:
            for batch in loader:
                for i in np.flatnonzero(np.asarray(batch.mask)):
                    r, s = int(batch.rows[i]), int(batch.starts[i])
                    seen.append((r, s))
                    if view == "transition":
                        got = [batch.experience.first["obs"][i], batch.experience.second["obs"][i]]
                    else:
                        got = [batch.experience["obs"][i, j] for j in range(window)]
                    for j, stack in enumerate(got):
                        np.testing.assert_array_equal(np.asarray(stack), history.stack(r, s + j))
    # the archive starts at the source's first step: every window, the first ones included
    assert sorted(seen) == [(r, s) for r in range(rows) for s in range(t - window + 1)]


def test_the_archive_loader_skips_starts_whose_frames_it_lacks(tmp_path):
    """An archive whose first steps were lost (the ring wrapped before the first write)
    does not hold the frames before its first step: the loader starts no window in its
    first `k - 1` steps, and every later one holds the wrapper's stacks."""
    rows, t, length = 2, 30, 16
    history = History(rows, K, "reset", -1)
    single, _, done = history.steps(np.random.default_rng(10), t, 0.3)
    buffer = eb.TransitionBuffer(
        _example(K, -1), add_batch_size=rows, max_length_time_axis=length, frames=_frames()
    )
    buffer = buffer.add(step_batch(single, done))
    seen = []
    with pytest.warns(eb.StepsLostWarning):
        archive = eb.Archive(str(tmp_path / "run.zarr"), buffer, on_lost="warn")
        archive.write(buffer)
    with (
        archive,
        eb.ArchiveLoader(
            archive, jax.random.key(1), batch_size=8, view="transition", epochs=1, frames=_frames()
        ) as loader,
    ):
        for batch in loader:
            for i in np.flatnonzero(np.asarray(batch.mask)):
                r, s = int(batch.rows[i]), int(batch.starts[i])
                seen.append((r, s))
                source = s + t - length  # the archive's index s holds source step s + 14
                np.testing.assert_array_equal(
                    np.asarray(batch.experience.first["obs"][i]), history.stack(r, source)
                )
    assert sorted(seen) == [(r, s) for r in range(rows) for s in range(K - 1, length - 1)]
    # `read(frames=)` refuses the steps whose earlier frames are lost, saying where to start,
    # and from there returns the wrapper's stacks.
    with pytest.raises(ValueError, match=r"step 1 is fewer than k - 1 = 2 steps into its "
                       r"segment .* starts at 0 .* Read from step 2 on"):  # fmt: skip
        archive.read(1, frames=_frames())
    stacked = archive.read(K - 1, frames=_frames())["obs"]
    for r in range(rows):
        for s in range(K - 1, length):
            np.testing.assert_array_equal(stacked[r, s - K + 1], history.stack(r, s + t - length))


def _stacked_d4rl(path, lengths, padding="reset"):
    """A D4RL file whose observations are 3-frame stacks (each frame its own: [step, 7]),
    episodes of `lengths` actions, each ended by a terminal; returns the stacks of every
    observation the import holds, in its order (each episode's final one included)."""
    import h5py

    obs, nxt, held = [], [], []
    step = 0
    for n in lengths:
        frames = [np.array([step + j, 7], np.int32) for j in range(n + 1)]
        step += n + 1
        dones = [False] * (n + 1)
        stacks = [wrapper_stack(frames, dones, t, K, padding, -1) for t in range(n + 1)]
        obs += stacks[:-1]
        nxt += stacks[1:]
        held += stacks
    n = sum(lengths)
    terminals = np.zeros(n, bool)
    terminals[np.cumsum(lengths) - 1] = True
    with h5py.File(path, "w") as f:
        f["observations"] = np.stack(obs)
        f["next_observations"] = np.stack(nxt)
        f["actions"] = np.zeros((n, 1), np.float32)
        f["rewards"] = np.ones(n, np.float32)
        f["terminals"] = terminals
        f["timeouts"] = np.zeros(n, bool)
    return np.stack(held)


def test_a_data_set_of_stacks_is_imported_one_frame_per_step(tmp_path, monkeypatch):
    """`from_d4rl(frames=)`: the archive holds each stack's newest frame; the loader gives
    the data set's stacks back, episodes never mixed; a data set stacked otherwise than
    said (zeros where the configuration says reset) is refused before anything is kept."""
    held = _stacked_d4rl(tmp_path / "d.hdf5", [5, 1, 4, 2])
    frames = eb.Frames("observation", k=K)
    archive = eb.from_d4rl(
        tmp_path / "d.hdf5", tmp_path / "d.zarr", progress=False, frames=frames, memory=1 << 20
    )
    stored = archive.read()["observation"][0]
    np.testing.assert_array_equal(stored, held[..., -1])  # the newest frames
    assert archive.metadata["frames"]["k"] == K
    # in blocks of 3 steps (each block's first stack checked against the step before it)
    import equibuffer._offline._source as source

    monkeypatch.setattr(source, "block_steps", lambda where, src, memory: 3)
    small = eb.from_d4rl(tmp_path / "d.hdf5", tmp_path / "d3.zarr", progress=False, frames=frames)
    np.testing.assert_array_equal(small.read()["observation"][0], stored)
    seen = 0
    with eb.ArchiveLoader(
        archive,
        jax.random.key(0),
        batch_size=4,
        view="transition",
        episode_end="episode_end",
        frames=frames,
        epochs=1,
    ) as loader:
        for batch in loader:
            for i in np.flatnonzero(np.asarray(batch.mask)):
                s = int(batch.starts[i])
                np.testing.assert_array_equal(
                    np.asarray(batch.experience.first["observation"][i]), held[s]
                )
                np.testing.assert_array_equal(
                    np.asarray(batch.experience.second["observation"][i]), held[s + 1]
                )
                seen += 1
    assert seen == sum([5, 1, 4, 2])  # every transition inside an episode
    _stacked_d4rl(tmp_path / "z.hdf5", [5, 1, 4, 2], padding="zeros")
    with pytest.raises(eb.SourceError, match=r"disagree at step 0 of row 0.*padding='reset'"):
        eb.from_d4rl(tmp_path / "z.hdf5", tmp_path / "z.zarr", progress=False, frames=frames)


@settings(max_examples=budget(20), deadline=None)
@given(
    k=st.integers(1, 4),
    padding=st.sampled_from(["reset", "zeros"]),
    axis=st.sampled_from([0, 1, -1]),
    dones=st.lists(st.lists(st.booleans(), min_size=12, max_size=12), min_size=1, max_size=2),
    t=st.integers(1, 12),
)
def test_read_with_frames_returns_the_wrappers_stacks(k, padding, axis, dones, t):
    """`Archive.read(frames=)` against the wrapper's stacks (NumPy reference) on random
    episode layouts, episodes shorter than `k` included, either padding, any stack axis."""
    rows = len(dones)
    history = History(rows, k, padding, axis)
    single, _, _ = history.steps(np.random.default_rng(0), t, 0.0)
    done = np.array(dones)[:, :t]
    history.dones = [list(d) for d in done]
    frames = eb.Frames("obs", k, axis=axis, padding=padding, episode_end="done")
    buffer = eb.ItemBuffer(
        _example(k, axis), add_batch_size=rows, capacity=16 * rows, frames=frames
    )
    buffer = _ADD(buffer, step_batch(single, done))
    with eb.Archive(zarr.storage.MemoryStore(), buffer) as archive:
        archive.write(buffer)
        stacked = archive.read(frames=frames)["obs"]
    for r in range(rows):
        for s in range(t):
            np.testing.assert_array_equal(stacked[r, s], history.stack(r, s))


_ADD = eqx.filter_jit(lambda buffer, batch: buffer.add(batch))
