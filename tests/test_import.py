"""The imports of offline data sets into an Archive (`eb.from_minari`, `eb.from_d4rl`), on data
sets built here with the real tools: Minari's `DataCollector` on Gymnasium environments and
h5py for D4RL's layout. Each archive holds exactly the source's steps, bit for bit, with its
episode ends; the loader's windows never cross them; errors come before any write; a killed
import carries on with nothing lost or doubled."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings

import gymnasium as gym
import h5py
import jax
import jax.numpy as jnp
import minari
import numpy as np
import pytest

import equibuffer as eb
from equibuffer._offline._minari import space_example


# ------------------------------------------------------------------------------ sources


@pytest.fixture
def datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    return tmp_path


def record(
    dataset_id: str, env: gym.Env, episodes: int, seed: int = 0, data_format: str | None = None
) -> minari.MinariDataset:
    """A Minari data set recorded with its own collector, random actions, seeded (in
    Minari's default format, HDF5, or `data_format`)."""
    env.action_space.seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # minari's note that eval_env defaults to env
        collector = minari.DataCollector(env, data_format=data_format)
        for k in range(episodes):
            collector.reset(seed=seed + k)
            done = False
            while not done:
                *_, terminated, truncated, _ = collector.step(env.action_space.sample())
                done = terminated or truncated
        dataset = collector.create_dataset(dataset_id, algorithm_name="random", author="tests")
        close(collector)
    return dataset


def close(collector: minari.DataCollector) -> None:
    """`DataCollector.close`, and its temporary directory's own cleanup (minari 0.5.4 removes
    the directory but leaves the TemporaryDirectory to warn when collected)."""
    collector.close()
    with contextlib.suppress(FileNotFoundError):
        collector._tmp_dir.cleanup()


class DictWorld(gym.Env):
    """Dict observations (a float image-like array, a Tuple of an int vector and a Discrete),
    a Tuple action of a Box and a Discrete; episodes of 3 to 9 steps, some truncated."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Dict(
            {
                "pos": gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32),
                "parts": gym.spaces.Tuple(
                    (gym.spaces.MultiDiscrete([3, 4]), gym.spaces.Discrete(5))
                ),
                "seen": gym.spaces.MultiBinary(4),
            }
        )
        self.action_space = gym.spaces.Tuple(
            (gym.spaces.Box(-2.0, 2.0, (2,), np.float64), gym.spaces.Discrete(3))
        )
        self.t = 0
        self.length = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.length = int(self.np_random.integers(3, 10))
        self.observation_space.seed(int(self.np_random.integers(1 << 30)))
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        done = self.t >= self.length
        terminated = done and self.length % 2 == 0
        return (
            self.observation_space.sample(),
            float(self.t),
            terminated,
            done and not terminated,
            {},
        )


def episode_steps(episodes) -> dict:
    """The layout the import promises, built from Minari's own episodes."""

    def pad(x):
        x = np.asarray(x)
        return np.concatenate([x, np.zeros((1, *x.shape[1:]), x.dtype)])

    out = []
    for e in episodes:
        t = len(e.rewards)
        end = np.zeros(t + 1, bool)
        end[-1] = True
        out.append(
            {
                "observation": e.observations,
                "action": jax.tree.map(pad, e.actions),
                "reward": pad(e.rewards),
                "terminated": pad(e.terminations),
                "truncated": pad(e.truncations),
                "episode_end": end,
            }
        )
    return jax.tree.map(lambda *xs: np.concatenate(xs)[None], *out)


def assert_identical(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def d4rl_file(path, n=1000, seed=0, next_obs=True, obs_shape=(11,)):
    """A D4RL-layout file: flat arrays of `n` steps, episodes ended by terminals or timeouts,
    the last one unfinished."""
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n + 1, *obs_shape)).astype(np.float32)
    terminals = rng.random(n) < 0.02
    timeouts = np.zeros(n, bool)
    timeouts[np.arange(57, n, 97)] = True
    timeouts &= ~terminals
    timeouts[-1] = False
    with h5py.File(path, "w") as f:
        f["observations"] = obs[:-1]
        if next_obs:
            f["next_observations"] = obs[1:]
        f["actions"] = rng.uniform(-1, 1, (n, 3)).astype(np.float32)
        f["rewards"] = rng.normal(size=n).astype(np.float32)
        f["terminals"] = terminals
        f["timeouts"] = timeouts
        f.attrs["env"] = "hopper-medium-v2"
        f["metadata/algorithm"] = "SAC"
        f["metadata/policy/nonlinearity"] = "relu"
    return obs, terminals, timeouts


# ------------------------------------------------------------------------------ Minari


def test_minari_cartpole_bit_for_bit(datasets):
    dataset = record("cartpole/random-v0", gym.make("CartPole-v1"), episodes=8)
    archive = eb.from_minari("cartpole/random-v0", datasets / "cp.zarr", progress=False)
    assert archive.read_only and archive.rows == 1
    assert len(archive) == dataset.total_steps + dataset.total_episodes
    assert_identical(archive.read(), episode_steps(dataset.iterate_episodes()))
    meta = archive.metadata
    assert meta["format"] == "minari" and meta["dataset_id"] == "cartpole/random-v0"
    assert "CartPole-v1" in meta["env_spec"] and meta["episodes"] == 8
    assert meta["minari"]["algorithm_name"] == "random"
    # by path, and from the MinariDataset itself: the same steps
    by_path = eb.from_minari(dataset.storage.data_path.parent, datasets / "p.zarr", progress=False)
    by_object = eb.from_minari(dataset, datasets / "o.zarr", progress=False)
    assert_identical(by_path.read(), archive.read())
    assert_identical(by_object.read(), archive.read())


def test_minari_nested_spaces_and_small_memory(datasets):
    dataset = record("dict/world-v0", DictWorld(), episodes=40, seed=3)
    big = eb.from_minari("dict/world-v0", datasets / "big.zarr", progress=False)
    # memory of 1 MiB stages a fifth: 209715 bytes, i.e. blocks of a few thousand steps;
    # chunk_steps=4 and many small appends (memory below) exercise episodes cut by blocks.
    small = eb.from_minari(
        "dict/world-v0", datasets / "small.zarr", memory=1 << 20, chunk_steps=4, progress=False
    )
    want = episode_steps(dataset.iterate_episodes())
    assert_identical(big.read(), want)
    assert_identical(small.read(), want)
    steps = big.read()
    assert steps["observation"]["pos"].dtype == np.float32
    assert steps["observation"]["parts"][1].dtype == np.int64  # Discrete
    assert steps["action"][0].dtype == np.float64 and steps["action"][0].shape[-1] == 2
    assert isinstance(steps["observation"]["parts"], tuple)


def test_minari_episodes_cut_across_blocks(datasets, monkeypatch):
    """Blocks of 5 steps: nearly every episode spans two or more blocks."""
    import equibuffer._offline._source as source

    dataset = record("cartpole/cut-v0", gym.make("CartPole-v1"), episodes=5, seed=7)
    monkeypatch.setattr(source, "block_steps", lambda where, s, memory: 5)
    archive = eb.from_minari("cartpole/cut-v0", datasets / "a.zarr", progress=False)
    assert_identical(archive.read(), episode_steps(dataset.iterate_episodes()))


def test_minari_loader_windows_stay_in_episodes(datasets):
    dataset = record("cartpole/loader-v0", gym.make("CartPole-v1"), episodes=12, seed=1)
    archive = eb.from_minari("cartpole/loader-v0", datasets / "a.zarr", progress=False)
    lengths = [len(e.rewards) for e in dataset.iterate_episodes()]
    with eb.ArchiveLoader(
        archive, 0, 32, sequence_length=4, episode_end="episode_end", epochs=1
    ) as loader:
        count = 0
        for batch in loader:
            ends = np.asarray(batch.experience["episode_end"])[np.asarray(batch.mask)]
            assert not ends[:, :-1].any()  # an end only as a window's last step
            count += int(batch.mask.sum())
    assert count == sum(max(0, t + 1 - 3) for t in lengths)
    # transitions: exactly the T of every episode, the last one onto the final observation
    obs = {}
    with eb.ArchiveLoader(
        archive, 0, 64, view="transition", episode_end="episode_end", epochs=1
    ) as loader:
        count = 0
        for batch in loader:
            t = batch.experience
            m = np.asarray(batch.mask)
            first = np.asarray(t.first["observation"])[m]
            second = np.asarray(t.second["observation"])[m]
            for a, b in zip(first, second, strict=True):
                obs[a.tobytes()] = b
            count += int(m.sum())
    assert count == dataset.total_steps
    for e in dataset.iterate_episodes():
        for a, b in zip(e.observations[:-1], e.observations[1:], strict=True):
            np.testing.assert_array_equal(obs[a.tobytes()], b)


def test_minari_like_checked_before_any_write(datasets):
    record("cartpole/like-v0", gym.make("CartPole-v1"), episodes=2)
    good = {
        "observation": jnp.zeros(4),
        "action": jnp.int32(0),
        "reward": jnp.float32(0),
        "terminated": jnp.bool_(False),
        "truncated": jnp.bool_(False),
        "episode_end": jnp.bool_(False),
    }
    wrong = dict(good, observation=jnp.zeros(5))
    buffer = eb.TrajectoryBuffer(wrong, add_batch_size=1, capacity=8, sequence_length=1)
    with pytest.raises(
        eb.SourceError,
        match=r"\['observation'\]: shape \(4,\) in the data set, "
        r"\(5,\) in the buffer",
    ):
        eb.from_minari("cartpole/like-v0", datasets / "a.zarr", like=buffer)
    assert not (datasets / "a.zarr").exists()  # nothing written
    missing = {k: v for k, v in good.items() if k != "episode_end"}
    buffer = eb.TrajectoryBuffer(missing, add_batch_size=1, capacity=8, sequence_length=1)
    with pytest.raises(
        eb.SourceError,
        match="leaves in the data set but not in the buffer: "
        r"\['episode_end'\]",
    ):
        eb.from_minari("cartpole/like-v0", datasets / "a.zarr", like=buffer)
    # dtypes: the data set's int64 actions and float64 rewards; a float32 reward differs
    buffer = eb.TrajectoryBuffer(good, add_batch_size=1, capacity=8, sequence_length=1)
    with pytest.raises(eb.SourceError, match=r"\['reward'\]: dtype float64 in the data set"):
        eb.from_minari("cartpole/like-v0", datasets / "a.zarr", like=buffer)
    assert not (datasets / "a.zarr").exists()


def test_minari_errors(datasets):
    with pytest.raises(FileNotFoundError, match="no Minari data set 'nothing/here-v0'"):
        eb.from_minari("nothing/here-v0", datasets / "a.zarr")
    with pytest.raises(FileNotFoundError, match="no Minari data set"):
        eb.from_minari(datasets, datasets / "a.zarr")  # a directory, not a data set
    text = gym.spaces.Text(5)
    with pytest.raises(eb.SourceError, match="the observation space is a Text"):
        space_example("eb.from_minari()", "observation", text)
    assert not (datasets / "a.zarr").exists()


def test_minari_refuses_an_archive_of_something_else(datasets):
    record("cartpole/one-v0", gym.make("CartPole-v1"), episodes=2, seed=0)
    record("cartpole/two-v0", gym.make("CartPole-v1"), episodes=3, seed=5)
    eb.from_minari("cartpole/one-v0", datasets / "a.zarr", progress=False)
    again = eb.from_minari("cartpole/one-v0", datasets / "a.zarr", progress=False)  # done: kept
    assert again.metadata["dataset_id"] == "cartpole/one-v0"
    with pytest.raises(eb.SourceError, match="holds an import of .*one-v0.*give the import a new"):
        eb.from_minari("cartpole/two-v0", datasets / "a.zarr", progress=False)


def frames(episodes: int, seed: int = 0) -> list:
    """Episodes of 32x32 RGB frames (an image space, as Minari's `is_image_space` says) and
    Discrete actions, as Minari's buffers, of 3 to 12 steps."""
    from minari.data_collector import EpisodeBuffer

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(episodes):
        t = int(rng.integers(3, 13))
        ends = np.zeros(t, bool)
        ends[-1] = True
        out.append(
            EpisodeBuffer(
                observations=rng.integers(0, 256, (t + 1, 32, 32, 3), dtype=np.uint8),
                actions=rng.integers(0, 4, t),
                rewards=rng.standard_normal(t),
                terminations=ends,
                truncations=np.zeros(t, bool),
            )
        )
    return out


def from_buffers(dataset_id: str, episodes: list, jpeg: bool) -> minari.MinariDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # minari's notes on the metadata left unset
        return minari.create_dataset_from_buffers(
            dataset_id,
            episodes,
            algorithm_name="random",
            observation_space=gym.spaces.Box(0, 255, (32, 32, 3), np.uint8),
            action_space=gym.spaces.Discrete(4),
            jpeg_encoding=jpeg,
        )


def test_minari_arrow_and_jpeg_read_with_minari_bit_for_bit(datasets):
    """Where the direct HDF5 read does not apply (Minari's Arrow format; JPEG-encoded
    frames), Minari's own storage reads the episodes: the archive holds what it decodes."""
    from equibuffer._offline._minari import MinariSource

    arrow = record("dict/arrow-v0", DictWorld(), episodes=12, seed=5, data_format="arrow")
    assert arrow.storage.FORMAT == "arrow"
    jpeg = from_buffers("frames/jpeg-v0", frames(6), jpeg=True)
    assert jpeg.storage.FORMAT == "hdf5" and jpeg.storage.jpeg_encoding
    for name, dataset in (("arrow", arrow), ("jpeg", jpeg)):
        source = MinariSource(dataset)
        assert source.h5 is None  # (read with Minari's storage)
        source.close()
        want = episode_steps(dataset.iterate_episodes())
        archive = eb.from_minari(dataset, datasets / f"{name}.zarr", progress=False)
        assert_identical(archive.read(), want)
        cut = eb.from_minari(
            dataset, datasets / f"{name}-cut.zarr", memory=1 << 20, chunk_steps=3, progress=False
        )
        assert_identical(cut.read(), want)


def test_minari_hdf5_read_directly(datasets, monkeypatch):
    """An HDF5 data set (nested Dict and Tuple spaces; frames, some episodes rewritten in
    other layouts) is read without Minari's `get_episodes` or episode metadata, bit for
    bit; so too with episodes cut across blocks, every dataset read from its raw chunks
    where it can be, and some episodes read by Minari among the others."""
    from minari.dataset._storages.hdf5_storage import HDF5Storage

    import equibuffer._offline._minari as module
    import equibuffer._offline._source as source

    nested = record("dict/direct-v0", DictWorld(), episodes=30, seed=6)
    plain = from_buffers("frames/plain-v0", frames(6, seed=1), jpeg=False)
    with h5py.File(plain.storage.data_path / "main_data.hdf5", "a") as f:
        for k, layout in enumerate(  # chunks cut in every dimension; gzip; contiguous
            [{"chunks": (3, 10, 7, 2)}, {"chunks": (5, 32, 32, 3), "compression": "gzip"}, {}]
        ):
            x = f[f"episode_{k}/observations"][()]
            del f[f"episode_{k}/observations"]
            f.create_dataset(f"episode_{k}/observations", data=x, **layout)
    wants = [episode_steps(d.iterate_episodes()) for d in (nested, plain)]

    def refused(*args, **kwargs):
        raise AssertionError("read with Minari's storage")

    with monkeypatch.context() as patch:
        patch.setattr(HDF5Storage, "get_episodes", refused)
        patch.setattr(HDF5Storage, "get_episode_metadata", refused)
        for i, (dataset, want) in enumerate(zip((nested, plain), wants, strict=True)):
            direct = module.MinariSource(dataset)
            assert direct.h5 is not None
            assert repr(direct.example["reward"].dtype) == "dtype('float64')"  # (not h5py's <f8)
            direct.close()
            archive = eb.from_minari(dataset, datasets / f"{i}.zarr", progress=False)
            assert_identical(archive.read(), want)
    opened = module._HDF5.episode
    monkeypatch.setattr(source, "block_steps", lambda where, s, memory: 7)
    monkeypatch.setattr(module, "_RAW_BYTES", 0)
    monkeypatch.setattr(module, "_REOPEN", 2)  # the file opened anew every other episode
    monkeypatch.setattr(  # episodes 2, 5, 8, ... read by Minari
        module._HDF5, "episode", lambda self, k, *a: None if k % 3 == 2 else opened(self, k, *a)
    )
    for i, (dataset, want) in enumerate(zip((nested, plain), wants, strict=True)):
        archive = eb.from_minari(dataset, datasets / f"mixed{i}.zarr", progress=False)
        assert_identical(archive.read(), want)


def test_minari_hdf5_episodes_unlike_their_spaces(datasets):
    """An HDF5 episode that does not match the spaces is refused as before, naming its dtype
    and shape, or the part it lacks (episode 0's before anything is written)."""
    dataset = record("cartpole/odd-v0", gym.make("CartPole-v1"), episodes=4, seed=3)
    t = len(list(dataset.iterate_episodes())[2].rewards)
    with h5py.File(dataset.storage.data_path / "main_data.hdf5", "a") as f:
        x = f["episode_2/observations"][()]
        del f["episode_2/observations"]
        f["episode_2/observations"] = x.astype(np.float64)
    with pytest.raises(
        eb.SourceError,
        match=rf"eb.from_minari\(\): episode 2's observations is float64\[{t + 1}, 4\]; its "
        rf"space says float32\[{t + 1}, 4\]\.",
    ):
        eb.from_minari("cartpole/odd-v0", datasets / "a.zarr", progress=False)
    nested = record("dict/odd-v0", DictWorld(), episodes=3, seed=2)
    with h5py.File(nested.storage.data_path / "main_data.hdf5", "a") as f:
        del f["episode_0/observations/seen"]
    with pytest.raises(eb.SourceError, match="episode 0 lacks the part 'seen' its space has"):
        eb.from_minari("dict/odd-v0", datasets / "b.zarr", progress=False)
    assert not (datasets / "b.zarr").exists()


# ------------------------------------------------------------------------------- D4RL


@pytest.mark.parametrize("next_obs", [True, False])
def test_d4rl_bit_for_bit(tmp_path, next_obs):
    obs, terminals, timeouts = d4rl_file(tmp_path / "h.hdf5", next_obs=next_obs)
    archive = eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "h.zarr", progress=False)
    steps = {k: v[0] for k, v in archive.read().items()}
    n = len(terminals)
    ends = terminals | timeouts
    ends[-1] = True
    with h5py.File(tmp_path / "h.hdf5") as f:
        source = {k: f[k][()] for k in ("actions", "rewards")}
    if next_obs:
        episodes = np.split(np.arange(n), np.flatnonzero(ends)[:-1] + 1)
        assert len(archive) == n + len(episodes)
        at = 0
        for ep in episodes:
            t = len(ep)
            np.testing.assert_array_equal(steps["observation"][at : at + t], obs[ep])
            np.testing.assert_array_equal(steps["observation"][at + t], obs[ep[-1] + 1])
            np.testing.assert_array_equal(steps["action"][at : at + t], source["actions"][ep])
            np.testing.assert_array_equal(steps["reward"][at : at + t], source["rewards"][ep])
            np.testing.assert_array_equal(steps["terminated"][at : at + t], terminals[ep])
            np.testing.assert_array_equal(steps["truncated"][at : at + t], timeouts[ep])
            assert steps["action"][at + t].tolist() == [0, 0, 0] and steps["reward"][at + t] == 0
            assert not steps["terminated"][at + t] and not steps["truncated"][at + t]
            assert steps["episode_end"][at : at + t + 1].tolist() == [False] * t + [True]
            at += t + 1
        assert at == len(archive)
    else:
        assert len(archive) == n
        np.testing.assert_array_equal(steps["observation"], obs[:-1])
        np.testing.assert_array_equal(steps["action"], source["actions"])
        np.testing.assert_array_equal(steps["episode_end"], ends)
        np.testing.assert_array_equal(steps["terminated"], terminals)
        np.testing.assert_array_equal(steps["truncated"], timeouts)
    assert archive.metadata["attributes"] == {"env": "hopper-medium-v2"}
    assert archive.metadata["metadata"]["algorithm"] == "SAC"
    assert archive.metadata["final_observations"] is next_obs
    assert all(x.dtype == np.float32 for x in (steps["observation"], steps["reward"]))


def test_d4rl_small_blocks_equal_one_block(tmp_path, monkeypatch):
    import equibuffer._offline._source as source

    d4rl_file(tmp_path / "h.hdf5", n=600)
    whole = eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "a.zarr", progress=False).read()
    monkeypatch.setattr(source, "block_steps", lambda where, s, memory: 7)
    cut = eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "b.zarr", progress=False).read()
    assert_identical(cut, whole)


def d4rl_reference(path) -> dict:
    """What `from_d4rl` promises for a file with `next_observations`, episode by episode."""
    with h5py.File(path) as f:
        src = {k: f[k][()] for k in f if isinstance(f[k], h5py.Dataset)}
    for k in ("rewards", "terminals", "timeouts"):  # (n,) or (n, 1) in the file: (n,) here
        src[k] = src[k].reshape(-1)
    ends = src["terminals"] | src["timeouts"]
    ends[-1] = True
    out = []
    for ep in np.split(np.arange(len(ends)), np.flatnonzero(ends)[:-1] + 1):

        def pad(x):
            return np.concatenate([x, np.zeros((1, *x.shape[1:]), x.dtype)])

        out.append({
            "observation": np.concatenate(
                [src["observations"][ep], src["next_observations"][ep[-1:]]]
            ),
            "action": pad(src["actions"][ep]),
            "reward": pad(src["rewards"][ep]),
            "terminated": pad(src["terminals"][ep]),
            "truncated": pad(src["timeouts"][ep]),
            "episode_end": np.arange(len(ep) + 1) == len(ep),
        })  # fmt: skip
    return {k: np.concatenate([o[k] for o in out])[None] for k in out[0]}


@pytest.mark.parametrize("block, piece", [(1, 1), (2, 30), (3, 1 << 20), (5, 50), (64, 100)])
def test_d4rl_tiny_episodes_any_block(tmp_path, monkeypatch, block, piece):
    """Episodes of 1 to 4 steps (every block holds finals, episodes cut anywhere), a block of
    one step, and a file read in pieces of `piece` bytes (one step of a leaf or more): the
    same steps as the file's episodes padded with their finals."""
    import equibuffer._offline._d4rl as d4rl
    import equibuffer._offline._source as source

    monkeypatch.setattr(d4rl, "_PIECE_BYTES", piece)
    rng = np.random.default_rng(block)
    n = 120
    with h5py.File(tmp_path / "h.hdf5", "w") as f:
        obs = rng.normal(size=(n, 2, 3)).astype(np.float32)
        f["observations"] = obs
        f["next_observations"] = obs + 100
        f["actions"] = rng.integers(0, 5, (n, 1)).astype(np.int64)
        f["rewards"] = rng.normal(size=(n, 1)).astype(np.float64)
        f["terminals"] = rng.random(n) < 0.4
        f["timeouts"] = rng.random(n) < 0.2
    monkeypatch.setattr(source, "block_steps", lambda where, s, memory: block)
    got = eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "a.zarr", progress=False)
    assert_identical(got.read(), d4rl_reference(tmp_path / "h.hdf5"))


@pytest.mark.parametrize("next_obs", [True, False])
@pytest.mark.parametrize("chunked", [(), ("rewards",)])
def test_d4rl_asks_the_kernel_for_the_next_block_ahead(tmp_path, monkeypatch, next_obs, chunked):
    """Reading block `[a, b)` of an import (blocks in order), the source asks the kernel
    (`posix_fadvise(WILLNEED)`) for the bytes of every contiguous dataset's source steps up to
    the end of the next block, `2b - a`, each byte once and none outside the dataset (a chunked
    dataset is not asked for); the import's result is the same with the read-ahead on or off,
    and the file it opened for it is closed with the source."""
    import equibuffer._offline._d4rl as d4rl
    import equibuffer._offline._source as source

    # (Recorded, not called: the same on a platform without posix_fadvise.)
    monkeypatch.setattr(d4rl, "_ADVISE", True)
    monkeypatch.setattr(
        os, "POSIX_FADV_WILLNEED", getattr(os, "POSIX_FADV_WILLNEED", 3), raising=False
    )
    rng = np.random.default_rng(7)
    n = 300
    with h5py.File(tmp_path / "h.hdf5", "w") as f:
        obs = rng.normal(size=(n, 5)).astype(np.float32)
        f["observations"] = obs
        if next_obs:
            f["next_observations"] = obs + 100
        f["actions"] = rng.integers(0, 5, (n, 2)).astype(np.int64)
        f.create_dataset("rewards", data=rng.normal(size=n), chunks=(16,) if chunked else None)
        f["terminals"] = rng.random(n) < 0.05
        f["timeouts"] = rng.random(n) < 0.02
    asked: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        os, "posix_fadvise", lambda fd, o, n, advice: asked.append((o, n, advice)), raising=False
    )
    src = d4rl.D4RLSource(tmp_path / "h.hdf5")
    with h5py.File(tmp_path / "h.hdf5") as f:
        extents = {
            name: (
                f[name].id.get_offset(),
                f[name].dtype.itemsize * int(np.prod(f[name].shape[1:])),
            )
            for name in d4rl._FIELDS
            if name not in chunked
        }
    assert [o for o, _ in src.spans] == [o for o, _ in extents.values()]
    # The source step each archive step reads (an episode's final observation: the next
    # episode's first step), and the end.
    with h5py.File(tmp_path / "h.hdf5") as f:
        ends = f["terminals"][()] | f["timeouts"][()]
    ends[-1] = True
    if next_obs:
        episodes = np.split(np.arange(n), np.flatnonzero(ends)[:-1] + 1)
        source_of = np.concatenate([np.r_[ep, ep[-1] + 1] for ep in episodes] + [[n]])
    else:
        source_of = np.arange(n + 1)
    assert len(source_of) == src.steps + 1
    size = 37
    for a in range(0, src.steps, size):
        b = min(src.steps, a + size)
        before = src.advised
        del asked[:]
        src.read(a, b)
        upto = int(source_of[min(src.steps, 2 * b - a)])
        expected = [
            (offset + before * per, (upto - before) * per, os.POSIX_FADV_WILLNEED)
            for offset, per in extents.values()
            if upto > before
        ]
        assert sorted(asked) == sorted(expected), (a, b)
        assert src.advised == max(before, upto)
    assert src.advised == n
    fd = src.fd
    src.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    monkeypatch.setattr(source, "block_steps", lambda where, s, memory: size)
    on = eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "on.zarr", progress=False).read()
    monkeypatch.setattr(d4rl, "_ADVISE", False)
    off = eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "off.zarr", progress=False).read()
    assert_identical(on, off)


def test_d4rl_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no D4RL file at .*missing.hdf5"):
        eb.from_d4rl(tmp_path / "missing.hdf5", tmp_path / "a.zarr")
    (tmp_path / "text.hdf5").write_text("not hdf5")
    with pytest.raises(eb.SourceError, match="text.hdf5 is not an HDF5 file"):
        eb.from_d4rl(tmp_path / "text.hdf5", tmp_path / "a.zarr")
    d4rl_file(tmp_path / "h.hdf5", n=50)
    with h5py.File(tmp_path / "h.hdf5", "a") as f:
        del f["timeouts"]
    with pytest.raises(eb.SourceError, match="has no field 'timeouts'") as raised:
        eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "a.zarr")
    assert "windows would cross their ends" in str(raised.value)
    assert not (tmp_path / "a.zarr").exists()  # refused before any write
    d4rl_file(tmp_path / "h.hdf5", n=50)
    with h5py.File(tmp_path / "h.hdf5", "a") as f:
        del f["rewards"]
    with pytest.raises(eb.SourceError, match="has no field 'rewards'") as raised:
        eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "a.zarr")
    assert "time limit" not in str(raised.value)  # (the note is about 'timeouts' alone)
    d4rl_file(tmp_path / "h.hdf5", n=50)
    with h5py.File(tmp_path / "h.hdf5", "a") as f:
        del f["rewards"]
        f["rewards"] = np.zeros(49, np.float32)
    with pytest.raises(eb.SourceError, match="field 'rewards' has shape \\(49,\\); expected 50"):
        eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "a.zarr")
    d4rl_file(tmp_path / "h.hdf5", n=50)
    with pytest.raises(ValueError, match="memory=1000 bytes is too small"):
        eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "a.zarr", memory=1000)
    assert not (tmp_path / "a.zarr").exists()


_KILLED = """
import sys, time
import equibuffer._offline._source as source
import equibuffer as eb
appended = eb.Archive.append
def slow(self, steps):  # slow enough to be killed between (or in) the appends
    n = appended(self, steps)
    time.sleep(0.05)
    return n
eb.Archive.append = slow
source.block_steps = lambda where, s, memory: 37
eb.from_d4rl(sys.argv[1], sys.argv[2], progress=False)
"""


@pytest.mark.slow
def test_d4rl_resumes_after_sigkill(tmp_path):
    """SIGKILL at random moments of an import, then run again: the same archive as one run,
    no step lost or doubled."""
    d4rl_file(tmp_path / "h.hdf5", n=3000)
    want = eb.from_d4rl(tmp_path / "h.hdf5", tmp_path / "once.zarr", progress=False)
    path = tmp_path / "killed.zarr"
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED, str(tmp_path / "h.hdf5"), str(path)]
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if len(eb.Archive(path, mode="r", progress=False)) > (lengths or [0])[-1]:
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        time.sleep(float(rng.uniform(0, 0.2)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        lengths.append(len(eb.Archive(path, mode="r", progress=False)))
    assert 0 < lengths[-1] < len(want)  # killed midway
    got = eb.from_d4rl(tmp_path / "h.hdf5", path, progress=False)
    assert len(got) == got.source_steps == len(want)
    assert_identical(got.read(), want.read())
    assert got.segments == [(0, len(want))]


@pytest.mark.slow
def test_minari_resumes_after_sigkill(datasets):
    dataset = record("cartpole/kill-v0", gym.make("CartPole-v1"), episodes=30, seed=2)
    code = _KILLED.replace("eb.from_d4rl", "eb.from_minari").replace("37", "11")
    path = datasets / "killed.zarr"
    env = dict(os.environ, MINARI_DATASETS_PATH=os.environ["MINARI_DATASETS_PATH"])
    proc = subprocess.Popen([sys.executable, "-c", code, "cartpole/kill-v0", str(path)], env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if len(eb.Archive(path, mode="r", progress=False)) > 100:
                break
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    held = len(eb.Archive(path, mode="r", progress=False))
    total = dataset.total_steps + dataset.total_episodes
    assert 0 < held < total
    got = eb.from_minari("cartpole/kill-v0", path, progress=False)
    assert len(got) == total
    assert_identical(got.read(), episode_steps(dataset.iterate_episodes()))


def test_round_trip_archive_minari_archive(datasets):
    """archive -> Minari -> archive is the identity, nested spaces and dtypes included."""
    record("dict/trip-v0", DictWorld(), episodes=25, seed=4)
    first = eb.from_minari("dict/trip-v0", datasets / "first.zarr", progress=False)
    exported = eb.to_minari(first, "dict/exported-v0", progress=False, author="tests")
    assert exported.total_episodes == 25
    again = eb.from_minari("dict/exported-v0", datasets / "again.zarr", progress=False)
    assert_identical(again.read(), first.read())
    assert again.metadata["observation_space"] == first.metadata["observation_space"]
    assert again.metadata["action_space"] == first.metadata["action_space"]
