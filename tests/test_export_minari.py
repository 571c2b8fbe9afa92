"""`to_minari`: an archive (or a buffer) in the layout of the imports out as a Minari data set
that `minari.load_dataset` opens, episode for episode and bit for bit."""

import gc
import os
import warnings

import gymnasium as gym
import jax
import jax.numpy as jnp
import minari
import numpy as np
import pytest
from minari.dataset._storages.hdf5_storage import HDF5Storage
from minari.serialization import serialize_space

import equibuffer as eb
from equibuffer._archive._format import StepSchema
from equibuffer._offline._source import MIN_MEMORY


# Every test below stays well under 20 s on two shared cores (the first one pays minari's and
# gymnasium's imports).

INT64 = np.iinfo(np.int64)
FLAGS = ("terminated", "truncated", "episode_end")
# The metadata every export below records (Minari's fields, as `create_dataset_from_buffers`
# takes them).
META = {
    "algorithm_name": "random",
    "author": "equibuffer",
    "author_email": "equibuffer@example.com",
    "code_permalink": "https://example.com/equibuffer",
    "description": "an export test",
    "requirements": ["gymnasium>=1.0"],
}


@pytest.fixture(autouse=True)
def minari_root(tmp_path, monkeypatch):
    """Every data set of a test under its own MINARI_DATASETS_PATH (never ~/.minari)."""
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


# --------------------------------------------------------------------------- building


def _draw(rng, like, shape):
    """Random values of `like`'s dtype shaped `shape + like.shape`."""
    dtype = np.dtype(like.dtype)
    full = (*shape, *like.shape)
    if dtype == np.bool_:
        return rng.random(full) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), full, dtype=dtype)
    return rng.standard_normal(full).astype(dtype)


def layout(rng, rows, length, example):
    """Steps of `rows` rows of `length` steps in the imports' layout: `rows[r]` is row r's
    episodes as `(T, how)` (`how` "term", "trunc" or None), back to back, each `T + 1`
    steps; the steps after the last are an unfinished episode (random, no end). Returns the
    steps (`example`'s tree of `(rows, length, *leaf)`) and the episodes as Minari holds
    them, row 0's first."""
    steps = jax.tree.map(lambda x: _draw(rng, x, (len(rows), length)), example)
    for flag in FLAGS:
        steps[flag] = np.zeros((len(rows), length), bool)
    bounds = []  # (row, first step, final observation's step) of each episode
    for r, row in enumerate(rows):
        at = 0
        for t, how in row:
            last = at + t
            for x in [steps["reward"], *jax.tree.leaves(steps["action"])]:
                x[r, last] = 0
            steps["terminated"][r, last - 1] = how == "term"
            steps["truncated"][r, last - 1] = how == "trunc"
            steps["episode_end"][r, last] = True
            bounds.append((r, at, last))
            at = last + 1
        assert at <= length

    def cut(tree, r, a, b):
        return jax.tree.map(lambda x: np.array(x[r, a:b]), tree)

    episodes = [
        {
            "observations": cut(steps["observation"], r, a, b + 1),
            "actions": cut(steps["action"], r, a, b),
            "rewards": cut(steps["reward"], r, a, b),
            "terminations": cut(steps["terminated"], r, a, b),
            "truncations": cut(steps["truncated"], r, a, b),
        }
        for r, a, b in bounds
    ]
    return steps, episodes


def example_of(observation, action=np.int64, reward=np.float32):
    return {
        "observation": observation,
        "action": np.zeros((), action),
        "reward": np.zeros((), reward),
        **{flag: np.zeros((), bool) for flag in FLAGS},
    }


def archive_of(path, steps, rows):
    """An archive of `steps` (the schema given as the imports give it: NumPy dtypes, so
    int64 without x64)."""
    schema = StepSchema(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, 1, *x.shape[2:]), x.dtype), steps),
        rows,
    )
    archive = eb.Archive(str(path), schema, progress=False)
    archive.append(steps)
    return archive


def assert_same(got, want, name=""):
    """The same tree of dicts and tuples, and arrays of the same dtype, shape and bytes."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (name, got)
        for k in want:
            assert_same(got[k], want[k], f"{name}[{k!r}]")
    elif isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), (name, got)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{name}[{i}]")
    else:
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
        assert got.tobytes() == want.tobytes(), name


def assert_episodes(dataset, want):
    assert dataset.total_episodes == len(want)
    assert dataset.total_steps == sum(len(e["rewards"]) for e in want)
    got = list(dataset.iterate_episodes())
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.id == k
        for field, value in w.items():
            assert_same(getattr(g, field), value, f"episode {k} {field}")


# Two rows of 40 steps: episodes of various lengths, ending by termination, truncation, or
# neither (the data ends there), every row ending on an episode end.
ROWS = [
    [(5, "term"), (1, "trunc"), (12, "term"), (7, None), (10, "trunc")],
    [(20, "trunc"), (2, "term"), (3, "term"), (11, "term")],
]


# --------------------------------------------------------------------------- the exports


def test_box_observations_two_rows(tmp_path):
    rng = np.random.default_rng(0)
    steps, episodes = layout(rng, ROWS, 40, example_of(np.zeros(3, np.float32)))
    archive = archive_of(tmp_path / "a.zarr", steps, 2)
    returned = eb.to_minari(archive, "box/equibuffer-v0", progress=False, **META)
    dataset = minari.load_dataset("box/equibuffer-v0")
    assert_episodes(dataset, episodes)
    assert returned.total_episodes == 9 and returned.total_steps == dataset.total_steps == 71
    assert dataset.observation_space == gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    assert dataset.action_space == gym.spaces.Box(int(INT64.min), int(INT64.max), (), np.int64)
    meta = dataset.storage.metadata
    assert meta["total_episodes"] == 9 and meta["total_steps"] == 71
    assert meta["dataset_id"] == "box/equibuffer-v0" and meta["jpeg_encoding"] is False
    for key in ("algorithm_name", "code_permalink", "description", "requirements"):
        assert meta[key] == META[key]
    assert meta["author"] == {"equibuffer"} and meta["author_email"] == {META["author_email"]}
    assert dataset.spec.env_spec is None
    # Minari's advice on the metadata left out is not repeated (warnings are errors here).
    eb.to_minari(archive, "box/bare-v0", progress=False)
    assert minari.load_dataset("box/bare-v0").total_episodes == 9


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_nested_observations(tmp_path, kind):
    parts = {
        "pos": np.zeros(2, np.float64),
        "grid": np.zeros((3, 3), np.uint8),
        "seen": np.zeros((), bool),
    }
    observation = parts if kind == "dict" else tuple(parts.values())
    rng = np.random.default_rng(1)
    steps, episodes = layout(rng, ROWS, 40, example_of(observation, np.int32, np.float64))
    path = tmp_path / "a.zarr"
    archive_of(path, steps, 2).close()
    # Opened without `like`, the archive reads a dict by leaf name: the nesting is its own.
    reader = eb.Archive(str(path), mode="r", progress=False)
    assert ("observation.pos" if kind == "dict" else "observation.0") in reader.read(0, 1)
    eb.to_minari(reader, f"nested/{kind}-v0", progress=False, **META)
    dataset = minari.load_dataset(f"nested/{kind}-v0")
    assert_episodes(dataset, episodes)
    spaces = [
        gym.spaces.Box(-np.inf, np.inf, (2,), np.float64),
        gym.spaces.Box(0, 255, (3, 3), np.uint8),
        gym.spaces.Box(0, 1, (), np.bool_),
    ]
    want = (
        gym.spaces.Dict(dict(zip(parts, spaces, strict=True)))
        if kind == "dict"
        else gym.spaces.Tuple(spaces)
    )
    assert dataset.observation_space == want
    assert dataset.action_space == gym.spaces.Box(-(2**31), 2**31 - 1, (), np.int32)


def test_arrow_format(tmp_path):
    observation = {"pos": np.zeros(2, np.float32), "seen": (np.zeros((), bool),)}
    rng = np.random.default_rng(2)
    steps, episodes = layout(rng, ROWS, 40, example_of(observation))
    archive = archive_of(tmp_path / "a.zarr", steps, 2)
    eb.to_minari(archive, "arrow/equibuffer-v0", progress=False, data_format="arrow", **META)
    dataset = minari.load_dataset("arrow/equibuffer-v0")
    assert dataset.storage.FORMAT == "arrow"
    assert_episodes(dataset, episodes)


def test_small_memory_gives_the_same_data_set(tmp_path, monkeypatch):
    """1 MiB of staging: blocks of 63 steps of a row (4111-byte steps), so that episodes
    straddle blocks (some several) and go to Minari in many batches; the data set is the
    same as with the default bound (one read a row, one batch)."""
    rows = [
        [(150, "term"), (3, "trunc"), (70, "term"), (1, "term"), (40, None), (130, "trunc")],
        [(61, "term"), (62, "trunc"), (63, "term"), (200, "term"), (1, "trunc"), (7, None)],
    ]
    rng = np.random.default_rng(3)
    steps, episodes = layout(rng, rows, 400, example_of(np.zeros(1024, np.float32)))
    archive = archive_of(tmp_path / "a.zarr", steps, 2)

    reads, batches = [], []
    read, update = eb.Archive.read, HDF5Storage.update_episodes

    def counted_read(self, start=0, stop=None, **kwargs):
        reads.append(stop - start)
        return read(self, start, stop, **kwargs)

    def counted_update(self, episodes):
        batches.append(len(episodes))
        return update(self, episodes)

    monkeypatch.setattr(eb.Archive, "read", counted_read)
    monkeypatch.setattr(HDF5Storage, "update_episodes", counted_update)
    eb.to_minari(archive, "memory/small-v0", memory=MIN_MEMORY, progress=False, **META)
    # (1 MiB / 4) // 4111 bytes = 63 steps a block: 7 blocks a row. The first "batch" is
    # the empty one the data set is created with.
    assert reads == [63] * 6 + [22] + [63] * 6 + [22]
    assert batches[0] == 0 and len(batches) > 5 and sum(batches) == 12
    reads.clear()
    batches.clear()
    eb.to_minari(archive, "memory/large-v0", progress=False, **META)
    assert reads == [400, 400] and batches == [0, 12]
    small, large = minari.load_dataset("memory/small-v0"), minari.load_dataset("memory/large-v0")
    assert_episodes(small, episodes)
    assert_episodes(large, episodes)
    assert small.storage.metadata["total_steps"] == 788 == sum(t for row in rows for t, _ in row)


def test_unfinished_tail_is_left_out_with_a_warning(tmp_path):
    rows = [[(5, "term"), (10, "trunc")], [(3, "term"), (0, None), (4, "term"), (2, "trunc")]]
    rng = np.random.default_rng(4)
    # Row 0 holds 17 steps of episodes, row 1 13 (one an episode of no action, which Minari
    # cannot hold): then 3 and 7 steps of unfinished episodes.
    steps, episodes = layout(rng, rows, 20, example_of(np.zeros(3, np.float32)))
    archive = archive_of(tmp_path / "a.zarr", steps, 2)
    with pytest.warns(UserWarning, match=r"left out 10 steps after the last episode end") as got:
        eb.to_minari(archive, "tail/equibuffer-v0", progress=False, **META)
    (said,) = [str(w.message) for w in got]
    assert "(row 0: 3, row 1: 7); 1 episode of one step" in said
    kept = [e for e in episodes if len(e["rewards"])]
    assert len(kept) == 5 == len(episodes) - 1
    assert_episodes(minari.load_dataset("tail/equibuffer-v0"), kept)


def test_keys_name_other_leaves(tmp_path):
    rng = np.random.default_rng(5)
    steps, episodes = layout(rng, ROWS, 40, example_of(np.zeros(2, np.float32)))
    names = {
        "observation": "obs",
        "action": "act",
        "reward": "rew",
        "terminated": "term",
        "truncated": "trunc",
        "episode_end": "last",
    }
    renamed = {names[k]: v for k, v in steps.items()}
    renamed["extra"] = np.zeros((2, 40, 5), np.float32)  # not exported
    archive = archive_of(tmp_path / "a.zarr", renamed, 2)
    eb.to_minari(archive, "keys/equibuffer-v0", keys=names, progress=False, **META)
    assert_episodes(minari.load_dataset("keys/equibuffer-v0"), episodes)


# --------------------------------------------------------------------------- buffers


def test_buffer_and_its_archive(tmp_path):
    example = {
        "observation": jnp.zeros(3),
        "action": jnp.int32(0),
        "reward": jnp.float32(0),
        **{flag: jnp.bool_(False) for flag in FLAGS},
    }
    host = jax.tree.map(np.asarray, example)
    buffer = eb.TrajectoryBuffer(
        example, add_batch_size=2, max_length_time_axis=48, sequence_length=2
    )
    rng = np.random.default_rng(6)
    steps, episodes = layout(rng, ROWS, 40, host)
    buffer = buffer.add(jax.tree.map(jnp.asarray, steps))
    eb.to_minari(buffer, "buffer/held-v0", progress=False, **META)
    assert_episodes(minari.load_dataset("buffer/held-v0"), episodes)
    with eb.Archive(str(tmp_path / "a.zarr"), buffer, progress=False) as archive:
        archive.write(buffer)
        eb.to_minari(archive, "buffer/archived-v0", progress=False, **META)
    assert_episodes(minari.load_dataset("buffer/archived-v0"), episodes)

    # 40 more steps (the same in both rows): the ring of 48 holds steps 32 to 79, of which
    # 32 to 39 end the last episode of each row, begun in overwritten steps: left out.
    more, later = layout(rng, [[(9, "term"), (19, "trunc"), (9, "term")]], 40, host)
    more = jax.tree.map(lambda x: jnp.asarray(np.concatenate([x, x])), more)
    wrapped = buffer.add(more)
    with pytest.warns(UserWarning, match=r"left out 16 steps of episodes whose start") as got:
        eb.to_minari(wrapped, "buffer/wrapped-v0", progress=False, **META)
    assert len(got) == 1
    assert_episodes(minari.load_dataset("buffer/wrapped-v0"), later + later)

    # An archive with a gap: it holds steps 0 to 39, then (40 to 71 lost) 72 to 119; 72 to
    # 79 end an episode begun in lost steps, and are left out.
    with eb.Archive(str(tmp_path / "gap.zarr"), buffer, progress=False, on_lost="warn") as gap:
        gap.write(buffer)
        with pytest.warns(eb.StepsLostWarning):
            gap.write(wrapped.add(more))
        assert gap.segments == [(0, 40), (40, 88)]
        with pytest.warns(UserWarning, match=r"left out 16 steps of episodes whose start"):
            eb.to_minari(gap, "buffer/gap-v0", progress=False, **META)
    assert_episodes(
        minari.load_dataset("buffer/gap-v0"), [*episodes[:5], *later, *episodes[5:], *later]
    )


# --------------------------------------------------------------------------- errors


def _nothing_created(dataset_id):
    from minari.storage.datasets_root_dir import get_dataset_path

    assert not os.path.exists(get_dataset_path(dataset_id))


def test_errors_before_anything_is_created(tmp_path):
    rng = np.random.default_rng(7)
    steps, _ = layout(rng, ROWS, 40, example_of(np.zeros(3, np.float32)))
    archive = archive_of(tmp_path / "a.zarr", steps, 2)

    partial = {k: v for k, v in steps.items() if k != "truncated"}
    lacking = archive_of(tmp_path / "b.zarr", partial, 2)
    with pytest.raises(ValueError, match=r"has no leaf 'truncated'; its leaves are 'action', "):
        eb.to_minari(lacking, "errors/lacking-v0", progress=False)
    _nothing_created("errors/lacking-v0")
    with pytest.raises(ValueError, match=r"no leaf 'last' \(the episode_end\)"):
        eb.to_minari(archive, "errors/keys-v0", keys={"episode_end": "last"}, progress=False)
    with pytest.raises(ValueError, match=r"`keys` has 'obs', not among the roles"):
        eb.to_minari(archive, "errors/keys-v0", keys={"obs": "observation"}, progress=False)

    ints = dict(steps, episode_end=steps["episode_end"].astype(np.int8))
    with pytest.raises(
        ValueError, match=r"episode_end 'episode_end' has dtype int8; expected bool"
    ):
        eb.to_minari(archive_of(tmp_path / "c.zarr", ints, 2), "errors/ints-v0", progress=False)
    _nothing_created("errors/ints-v0")

    complex_ = dict(steps, observation=steps["observation"].astype(np.complex64))
    with pytest.raises(ValueError, match=r"observation \(dtype complex64\) has no Box to infer"):
        eb.to_minari(
            archive_of(tmp_path / "d.zarr", complex_, 2), "errors/complex-v0", progress=False
        )
    _nothing_created("errors/complex-v0")

    with pytest.raises(ValueError, match=r"its observation is float32\[3\], not the Box's"):
        eb.to_minari(
            archive,
            "errors/space-v0",
            observation_space=gym.spaces.Box(-1, 1, (4,), np.float32),
            progress=False,
        )
    with pytest.raises(ValueError, match=r"observation is an array float32\[3\], not a dict"):
        eb.to_minari(
            archive,
            "errors/space-v0",
            observation_space=gym.spaces.Dict({"a": gym.spaces.Discrete(2)}),
            progress=False,
        )
    _nothing_created("errors/space-v0")

    with pytest.raises(ValueError, match=r"No storage implemented for zip"):
        eb.to_minari(archive, "errors/format-v0", data_format="zip", progress=False)
    _nothing_created("errors/format-v0")  # (Minari had made its directory)
    with pytest.raises(ValueError, match=r"'no-version' is not a Minari data set id"):
        eb.to_minari(archive, "no-version", progress=False)
    with pytest.raises(TypeError, match=r"unexpected keyword 'authors'"):
        eb.to_minari(archive, "errors/meta-v0", authors="me", progress=False)
    with pytest.raises(ValueError, match=r"memory=1000 bytes is too small"):
        eb.to_minari(archive, "errors/memory-v0", memory=1000, progress=False)

    eb.to_minari(archive, "errors/taken-v0", progress=False)
    with pytest.raises(ValueError, match=r"'errors/taken-v0' exists already"):
        eb.to_minari(archive, "errors/taken-v0", progress=False)
    assert minari.load_dataset("errors/taken-v0").total_episodes == 9
    assert sorted(minari.list_local_datasets()) == ["errors/taken-v0"]


def test_a_failed_write_removes_the_data_set(tmp_path, monkeypatch):
    rng = np.random.default_rng(8)
    steps, _ = layout(rng, ROWS, 40, example_of(np.zeros(3, np.float32)))
    archive = archive_of(tmp_path / "a.zarr", steps, 2)
    storage = minari.dataset._storages.hdf5_storage.HDF5Storage
    update = storage.update_episodes

    def failing(self, episodes):
        if list(episodes):
            raise OSError("disk full")
        return update(self, [])

    monkeypatch.setattr(storage, "update_episodes", failing)
    with pytest.raises(OSError, match="disk full"):
        eb.to_minari(archive, "failed/equibuffer-v0", progress=False)
    _nothing_created("failed/equibuffer-v0")
    assert archive.progress is False  # as it was


# --------------------------------------------------------------------------- round trips


def _collected(dataset_id, seeds):
    """A CartPole data set (episodes of at most 12 steps) recorded by Minari's collector."""
    # The collector drops a temporary directory at `create_dataset` and leaves another's
    # finalizer armed after `close` (Minari 0.5.4): each warns when collected, here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        warnings.simplefilter("ignore", UserWarning)  # Minari's advice: no `eval_env`
        env = minari.DataCollector(gym.make("CartPole-v1", max_episode_steps=12))
        env.action_space.seed(0)
        for seed in seeds:
            env.reset(seed=seed)
            done = False
            while not done:
                *_, terminated, truncated, _ = env.step(env.action_space.sample())
                done = terminated or truncated
        dataset = env.create_dataset(dataset_id, **META)
        env.close()
        del env
        gc.collect()
    return dataset


def test_round_trip_through_minari_collector(tmp_path):
    """A data set recorded by Minari's own collector, laid out by hand in an archive with
    the metadata an import records, exported under a new id: the same episodes, spaces
    and env spec."""
    original = _collected("cartpole/random-v0", seeds=range(6))
    episodes = list(original.iterate_episodes())
    assert any(e.truncations[-1] for e in episodes) and any(e.terminations[-1] for e in episodes)

    parts = []
    for e in episodes:
        t = len(e.rewards)
        end = np.zeros(t + 1, bool)
        end[-1] = True
        parts.append(
            {
                "observation": e.observations,
                "action": np.concatenate([e.actions, np.zeros(1, e.actions.dtype)]),
                "reward": np.concatenate([e.rewards, np.zeros(1, e.rewards.dtype)]),
                "terminated": np.concatenate([e.terminations, [False]]),
                "truncated": np.concatenate([e.truncations, [False]]),
                "episode_end": end,
            }
        )
    steps = jax.tree.map(lambda *xs: np.concatenate(xs)[None], *parts)
    schema = StepSchema(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, 1, *x.shape[2:]), x.dtype), steps), 1
    )
    spec = original.spec.env_spec
    record = {
        "observation_space": serialize_space(original.observation_space),
        "action_space": serialize_space(original.action_space),
        "env_spec": spec.to_json(),
    }
    with eb.Archive(str(tmp_path / "a.zarr"), schema, metadata=record) as archive:
        archive.append(steps)
    archive = eb.Archive(str(tmp_path / "a.zarr"), mode="r", progress=False)
    eb.to_minari(archive, "cartpole/equibuffer-v0", progress=False, **META)
    exported = minari.load_dataset("cartpole/equibuffer-v0")
    want = [
        {
            "observations": e.observations,
            "actions": e.actions,
            "rewards": e.rewards,
            "terminations": e.terminations,
            "truncations": e.truncations,
        }
        for e in episodes
    ]
    assert_episodes(exported, want)
    assert exported.total_steps == original.total_steps
    assert exported.observation_space == original.observation_space
    assert exported.action_space == original.action_space == gym.spaces.Discrete(2)
    assert exported.spec.env_spec == spec and exported.spec.env_spec.max_episode_steps == 12
    assert exported.recover_environment().spec.id == "CartPole-v1"

    # An `env` gives the spec (and the spaces): the same data set from steps without record.
    plain = eb.Archive(str(tmp_path / "b.zarr"), schema, progress=False)
    plain.append(steps)
    eb.to_minari(plain, "cartpole/env-v0", env="CartPole-v1", progress=False, **META)
    again = minari.load_dataset("cartpole/env-v0")
    assert_episodes(again, want)
    assert again.action_space == gym.spaces.Discrete(2)
    assert again.spec.env_spec == gym.spec("CartPole-v1")
