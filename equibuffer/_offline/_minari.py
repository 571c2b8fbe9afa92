"""`from_minari`: a local Minari data set (by id or path) into an `Archive`, in the layout of
`_source`: the episodes back to back on one row, each of `T` actions as `T + 1` steps.

The episodes are read with Minari's own storage (so its HDF5 and Arrow formats, JPEG-encoded
images and nested spaces all decode as `minari.load_dataset` decodes them), a few at a time."""

import json
import os
from typing import Any

import numpy as np
from jaxtyping import PyTree
from zarr.abc.store import Store

from .._archive._archive import Archive
from .._archive._format import Compression
from ._source import DEFAULT_MEMORY, import_source, ImportOptions, Source, SourceError


def space_example(where: str, name: str, space: Any) -> PyTree[np.ndarray]:
    """One value of a Gymnasium space as NumPy zeros of its dtype and shape: Box, Discrete,
    MultiDiscrete and MultiBinary are arrays; Dict a dict and Tuple a tuple of their parts."""
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        return {k: space_example(where, f"{name}[{k!r}]", s) for k, s in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(space_example(where, f"{name}[{i}]", s) for i, s in enumerate(space.spaces))
    if isinstance(space, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)):
        assert space.dtype is not None and space.shape is not None
        return np.zeros(space.shape, space.dtype)
    raise SourceError(
        f"{where}: the {name} space is a {type(space).__name__}, which has no fixed shape: the "
        "imports take Box, Discrete, MultiDiscrete, MultiBinary, and Dict and Tuple of them."
    )


def _json(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def _tree_map(f: Any, example: Any, *trees: Any, name: str = "") -> Any:
    """`f(name, example_leaf, *leaves)` over the example's dicts and tuples (Minari returns
    the same nesting; a key it lacks is a KeyError named by the caller)."""
    if isinstance(example, dict):
        return {
            k: _tree_map(f, v, *(t[k] for t in trees), name=f"{name}[{k!r}]")
            for k, v in example.items()
        }
    if isinstance(example, tuple):
        return tuple(
            _tree_map(f, v, *(t[i] for t in trees), name=f"{name}[{i}]")
            for i, v in enumerate(example)
        )
    return f(name, example, *trees)


class MinariSource(Source):
    """The steps of a Minari data set's episodes, read with its storage."""

    def __init__(self, dataset: Any, where: str = "eb.from_minari()"):
        from minari.dataset.minari_storage import MinariStorage
        from minari.storage.datasets_root_dir import get_dataset_path

        self.where = where
        if hasattr(dataset, "storage") and hasattr(dataset, "spec"):  # a MinariDataset
            data_path = str(dataset.storage.data_path)
        else:
            given = os.fspath(dataset)
            if os.path.isdir(given):
                data_path = (
                    os.path.join(given, "data")
                    if os.path.isdir(os.path.join(given, "data"))
                    else given
                )
            else:
                data_path = os.path.join(get_dataset_path(given), "data")
            if not os.path.isfile(os.path.join(data_path, "metadata.json")):
                raise FileNotFoundError(
                    f"{where}: there is no Minari data set {given!r} (no {data_path}/"
                    "metadata.json): give a local data set's id (under MINARI_DATASETS_PATH, "
                    "by default ~/.minari/datasets; `minari download` fetches one) or its path."
                )
        data_path = os.path.abspath(data_path)
        try:
            self.storage = storage = MinariStorage.read(data_path)
        except Exception as error:
            raise SourceError(f"{where}: Minari cannot read {data_path}: {error}") from error
        self.example = {
            "observation": space_example(where, "observation", storage.observation_space),
            "action": space_example(where, "action", storage.action_space),
        }
        n = storage.total_episodes
        lengths = np.array(
            [int(m["total_steps"]) for m in storage.get_episode_metadata(range(n))], np.int64
        )
        self.lengths = lengths
        # Archive steps of episode k: `[ends[k] - lengths[k] - 1, ends[k])`.
        self.ends = np.cumsum(lengths + 1)
        self.rows = 1
        self.steps = int(self.ends[-1]) if n else 0
        self.cache: tuple[int, dict] | None = None
        if n:
            first = self._episode(0)
            for leaf in ("rewards", "terminations", "truncations"):
                if leaf not in first:
                    raise SourceError(f"{where}: the episodes of {data_path} have no {leaf!r}.")
            self.example["reward"] = np.zeros((), np.asarray(first["rewards"]).dtype)
            self._check(first, 0)
        else:
            self.example["reward"] = np.zeros((), np.float64)
        self.example.update(
            terminated=np.zeros((), bool),
            truncated=np.zeros((), bool),
            episode_end=np.zeros((), bool),
        )
        # Minari's record as stored (spaces and env spec as its JSON strings).
        meta = MinariStorage.read_raw_metadata(data_path)
        self.metadata = {
            "format": "minari",
            "dataset_id": meta.get("dataset_id"),
            "minari_version": meta.get("minari_version"),
            "observation_space": meta.get("observation_space"),
            "action_space": meta.get("action_space"),
            "env_spec": meta.get("env_spec"),
            "episodes": int(n),
            "minari": _json(meta),
        }
        self.identity = {
            "format": "minari",
            "location": data_path,
            "steps": self.steps,
            "episodes": int(n),
        }

    def _check(self, episode: dict, k: int) -> None:
        """An episode's arrays have the spaces' shapes and dtypes, and `T + 1` observations."""
        t = int(self.lengths[k])

        def check(name: str, want: np.ndarray, got: Any, steps: int) -> None:
            got = np.asarray(got)
            if got.shape != (steps, *want.shape) or got.dtype != want.dtype:
                raise SourceError(
                    f"{self.where}: episode {k}'s {name} is {got.dtype}{list(got.shape)}; its "
                    f"space says {want.dtype}{[steps, *want.shape]}."
                )

        try:
            _tree_map(
                lambda n, w, g: check("observations" + n, w, g, t + 1),
                self.example["observation"],
                episode["observations"],
            )
            _tree_map(
                lambda n, w, g: check("actions" + n, w, g, t),
                self.example["action"],
                episode["actions"],
            )
        except KeyError as error:
            raise SourceError(
                f"{self.where}: episode {k} lacks the part {error} its space has."
            ) from None
        for leaf in ("rewards", "terminations", "truncations"):
            if np.shape(episode[leaf]) != (t,):
                raise SourceError(
                    f"{self.where}: episode {k}'s {leaf} has shape {np.shape(episode[leaf])}; "
                    f"expected ({t},)."
                )

    def _episode(self, k: int) -> dict:
        if self.cache is None or self.cache[0] != k:
            (episode,) = self.storage.get_episodes([k])
            self.cache = (k, episode)
        return self.cache[1]

    def _steps(self, k: int) -> PyTree[np.ndarray]:
        """Episode `k` as its `T + 1` archive steps."""
        episode = self._episode(k)
        self._check(episode, k)
        t = int(self.lengths[k])

        def padded(x: Any, dtype: Any = None) -> np.ndarray:
            x = np.asarray(x) if dtype is None else np.asarray(x).astype(dtype)
            return np.concatenate([x, np.zeros((1, *x.shape[1:]), x.dtype)])

        end = np.zeros(t + 1, bool)
        end[t] = True
        return {
            "observation": _tree_map(
                lambda n, w, g: np.asarray(g), self.example["observation"], episode["observations"]
            ),
            "action": _tree_map(
                lambda n, w, g: padded(g), self.example["action"], episode["actions"]
            ),
            "reward": padded(episode["rewards"]),
            "terminated": padded(episode["terminations"], bool),
            "truncated": padded(episode["truncations"], bool),
            "episode_end": end,
        }

    def read(self, start: int, stop: int) -> PyTree[np.ndarray]:
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, stop - 1, side="right"))
        parts = []
        for k in range(first, last + 1):
            begin = int(self.ends[k] - self.lengths[k] - 1)
            a, b = max(start, begin) - begin, min(stop, int(self.ends[k])) - begin
            cut = slice(a, b)
            parts.append(_tree_map(lambda n, w, x, cut=cut: x[cut], self.example, self._steps(k)))
        return _tree_map(lambda n, w, *xs: np.concatenate(xs)[None], self.example, *parts)


def from_minari(
    dataset: Any,
    store: str | os.PathLike | Store,
    *,
    memory: int = DEFAULT_MEMORY,
    like: Any = None,
    progress: bool = True,
    compression: Compression = "zstd",
    chunk_steps: int | None = None,
    shard_steps: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Archive:
    """Import a local Minari data set into an `Archive`, streamed, resumably.

    The archive has one row holding the data set's episodes back to back. Each step is a
    dict `{"observation", "action", "reward", "terminated", "truncated", "episode_end"}`:
    the observation and action are pytrees of the spaces (Box, Discrete, MultiDiscrete and
    MultiBinary arrays of their dtypes and shapes; Dict a dict, Tuple a tuple), the reward of
    the data set's dtype, and `terminated`/`truncated` Minari's `terminations`/
    `truncations`. An episode of `T` actions (and `T + 1` observations) is `T + 1` steps:
    steps `0..T-1` hold each observation with the action taken there, its reward and flags;
    step `T` holds the final observation, a zero action and reward, false flags, and
    `episode_end` true. So `eb.ArchiveLoader(archive, ..., episode_end="episode_end")`
    delivers windows inside one episode, and with `view="transition"` exactly the `T`
    transitions of every episode, the last one paired with the true final observation (a
    truncated episode bootstraps from it). Episode infos are not imported. The data set's
    metadata (id, spaces, env spec, Minari's version and its whole metadata record) is kept
    in `archive.metadata`.

    **Arguments:**

    - `dataset`: a local data set's id (`"D4RL/door/human-v2"`, under `MINARI_DATASETS_PATH`
        or `~/.minari/datasets`), its directory, or a `minari.MinariDataset`.
    - `store`: where the archive goes (as for `eb.Archive`). If an earlier run of the same
        import stopped (killed, or failed), it carries on from the last step committed: no
        step is written twice or lost. An archive holding anything else is refused.
    - `memory`: the bound, in bytes, of what the import stages in memory (steps read, and
        their encoded chunks), plus the episode being read; never the data set's size.
    - `like`: a buffer whose steps the data set's must match (leaf for leaf, shapes and
        dtypes): checked before anything is written, with an error naming each field.
    - `progress`: a tqdm progress bar.
    - `compression`, `chunk_steps`, `shard_steps`, `storage_options`: as for `eb.Archive`.

    **Returns:**

    The archive, opened read-only. A data set that is not there raises a
    `FileNotFoundError`; a space without a fixed shape or episodes that do not match their
    spaces an `eb.SourceError`; both before any write.

    !!! example

        ```python
        import os, tempfile, warnings

        os.environ["MINARI_DATASETS_PATH"] = tempfile.mkdtemp()
        import equibuffer as eb, gymnasium as gym, minari, numpy as np
        from minari.data_collector import EpisodeBuffer

        episodes = [  # two episodes of 3 and 2 steps: T + 1 observations each
            EpisodeBuffer(observations=np.arange(8, dtype=np.float32).reshape(4, 2),
                          actions=np.array([0, 1, 0]), rewards=[1.0, 1.0, 1.0],
                          terminations=[False, False, True], truncations=[False] * 3),
            EpisodeBuffer(observations=np.arange(6, dtype=np.float32).reshape(3, 2),
                          actions=np.array([1, 1]), rewards=[1.0, 1.0],
                          terminations=[False, False], truncations=[False, True]),
        ]
        with warnings.catch_warnings():  # Minari's notes on the metadata left unset
            warnings.simplefilter("ignore")
            minari.create_dataset_from_buffers(
                "toy/random-v0", episodes, algorithm_name="random",
                observation_space=gym.spaces.Box(-10, 10, (2,), np.float32),
                action_space=gym.spaces.Discrete(2),
            )
        archive = eb.from_minari("toy/random-v0", tempfile.mkdtemp() + "/toy.zarr",
                                 progress=False)
        assert len(archive) == 7  # 5 steps and one final observation an episode
        steps = archive.read()
        assert steps["episode_end"][0].tolist() == [0, 0, 0, 1, 0, 0, 1]
        assert steps["observation"][0, 3].tolist() == [6.0, 7.0]  # episode 0's final one
        assert archive.metadata["dataset_id"] == "toy/random-v0"
        ```
    """
    source = MinariSource(dataset)
    return import_source(
        source,
        store,
        ImportOptions(
            memory, like, progress, compression, chunk_steps, shard_steps, storage_options
        ),
    )
