"""`from_minari`: a local Minari data set (by id or path) into an `Archive`, in the layout of
`_source`: the episodes back to back on one row, each of `T` actions as `T + 1` steps.

Minari's HDF5 format is read directly (`_HDF5`): its file, `main_data.hdf5`, holds a group
`episode_<k>` an episode, with the attribute `total_steps` and the datasets `observations`,
`actions`, `rewards`, `terminations` and `truncations` (a Dict space a group of its keys, a
Tuple space a group of `_index_0`, `_index_1`, ...). The file stays open for the whole
import; every episode's length is read from its attribute at open, and a block's episodes
are opened and read with h5py's low-level calls straight into the block's arrays (a large
unfiltered chunked dataset from its raw chunks, placed with NumPy; any other with
`H5Dread`, which decodes HDF5's filters as Minari's reading does). Episode infos, which the
import does not keep, are not read. An episode is read so only where its datasets are
exactly what Minari's own reading would decode as the spaces say (names, group sizes,
shapes, dtypes); anything else (Minari's Arrow format, JPEG-encoded images, an episode
unlike its spaces, whose error then comes from `MinariSource._check`) is read with Minari's
storage, an episode at a time, as `minari.load_dataset` reads it."""

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from jaxtyping import PyTree
from zarr.abc.store import Store

from .._archive._archive import Archive
from .._archive._format import Compression
from .._frames import Frames
from ._source import DEFAULT_MEMORY, import_source, ImportOptions, Source, SourceError


# A dataset part of at least this many bytes is read from its raw chunks where it can be:
# frames in h5py's guessed chunks, e.g. `(126, 16, 16, 1)`, read so in a fifth to a half of
# the time `H5Dread` takes, while small datasets (a few chunks) read faster with `H5Dread`.
_RAW_BYTES = 1 << 20
# Minari's file is closed and opened again after this many episodes (`_HDF5.touch`).
_REOPEN = 64
# Raw chunks at most this many bytes apart in the file are read with one call.
_RAW_GAP = 1 << 16
_EPISODE_LEAVES = {  # the archive's leaf -> Minari's name, for the leaves of `T` steps
    "action": "actions",
    "reward": "rewards",
    "terminated": "terminations",
    "truncated": "truncations",
}


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


def _space_leaves(space: Any) -> Iterator[Any]:
    """The leaf spaces of a space (the parts of its Dicts and Tuples, recursively)."""
    from gymnasium import spaces

    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        parts = space.spaces.values() if isinstance(space, spaces.Dict) else space.spaces
        for part in parts:
            yield from _space_leaves(part)
    else:
        yield space


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


# --------------------------------------------------------------------- Minari's HDF5 format


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One dataset of an episode in Minari's HDF5 file, opened: h5py's low-level dataset,
    its shape, and its dtype (the one Minari's reading gives its array)."""

    dataset: Any
    shape: tuple[int, ...]
    dtype: np.dtype


class _Unexpected(Exception):
    """An episode's datasets are not what Minari would decode as the spaces say."""


def _open_leaf(group: Any, name: str) -> _Leaf:
    import h5py

    dataset = h5py.h5d.open(group, name.encode())
    dtype = np.dtype(dataset.dtype)
    if dtype.kind in "biuf":  # h5py's `<f8` as NumPy's own `float64`, as h5py's arrays have it
        dtype = np.dtype(dtype.str)
    return _Leaf(dataset, tuple(dataset.shape), dtype)


def _open_tree(group: Any, name: str, example: Any, steps: int) -> Any:
    """`group[name]` opened as Minari decodes a space there, a tree of `_Leaf` like
    `example`: a Dict a group of exactly its keys, a Tuple a group of exactly `_index_0`,
    `_index_1`, ..., a leaf a dataset of `steps` values of the example's shape and dtype.
    Raises where it is not (`_Unexpected`, or h5py's error for a name that is not there)."""
    import h5py

    if not isinstance(example, (dict, tuple)):
        leaf = _open_leaf(group, name)
        if leaf.shape != (steps, *example.shape) or leaf.dtype != example.dtype:
            raise _Unexpected(name)
        return leaf
    sub = h5py.h5g.open(group, name.encode())
    if len(sub) != len(example):
        raise _Unexpected(name)
    if isinstance(example, dict):
        return {k: _open_tree(sub, str(k), v, steps) for k, v in example.items()}
    return tuple(_open_tree(sub, f"_index_{i}", v, steps) for i, v in enumerate(example))


def _read(leaf: _Leaf, a: int, b: int, out: np.ndarray) -> None:
    """Rows `[a, b)` of a dataset into `out` (C-contiguous, of its dtype) with `H5Dread`."""
    import h5py

    dataset = leaf.dataset
    if a == 0 and b == leaf.shape[0]:
        dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
    else:
        space = dataset.get_space()
        space.select_hyperslab((a,) + (0,) * (len(leaf.shape) - 1), out.shape)
        dataset.read(h5py.h5s.create_simple(out.shape), space, out)


def _runs(chunks: list[Any], size: int) -> Iterator[list[Any]]:
    """Chunks (in the order of their places in the file, of `size` bytes each) in runs of
    at most `_RAW_GAP` bytes between one and the next, each read with one call."""
    run: list[Any] = []
    for info in chunks:
        if run and info.byte_offset - run[-1].byte_offset - size > _RAW_GAP:
            yield run
            run = []
        run.append(info)
    if run:
        yield run


def _overlap(
    offset: tuple[int, ...], chunk: tuple[int, ...], shape: tuple[int, ...], a: int, b: int
) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """Where the chunk at `offset` meets rows `[a, b)` of a dataset of `shape`: its slices
    in the rows' array (row `a` its first) and in the chunk."""
    lo, hi = max(a, offset[0]), min(b, offset[0] + chunk[0])
    into, take = [slice(lo - a, hi - a)], [slice(lo - offset[0], hi - offset[0])]
    for o, c, n in zip(offset[1:], chunk[1:], shape[1:], strict=True):
        into.append(slice(o, min(o + c, n)))
        take.append(slice(0, min(c, n - o)))
    return tuple(into), tuple(take)


class _HDF5:
    """Minari's HDF5 file, held open for a whole import: every episode's length from its
    attribute (`lengths`), an episode's datasets opened (`episode`), and rows of a dataset
    read into a block's array (`fill`), with h5py's low-level calls."""

    def __init__(self, path: str):
        import h5py

        self.path = path
        self.touched = 0  # episodes read since the file was opened
        self.file: Any = h5py.File(path, "r")
        # Raw chunks are read at the addresses HDF5 gives, which count from the end of a user
        # block: a file with one is read with `H5Dread` alone.
        self.raw: Any = None
        try:
            if self.file.id.get_create_plist().get_userblock() == 0:
                self.raw = open(path, "rb", buffering=0)  # (closed in close())
        except BaseException:
            self.file.close()
            raise

    def close(self) -> None:
        self.file.close()
        if self.raw is not None:
            self.raw.close()

    def touch(self) -> Any:
        """The open file, opened anew every `_REOPEN` episodes: HDF5 keeps what it learnt of
        each object read until the file is closed (110 MiB after 1,960 episodes of 100 KB read
        with h5py's low-level calls, 8 MiB when opened anew every 64), which would grow with
        the data set, not the block."""
        import h5py

        self.touched += 1
        if self.touched > _REOPEN:
            self.file.close()
            self.file = h5py.File(self.path, "r")
            self.touched = 1
        return self.file

    def lengths(self, n: int) -> np.ndarray | None:
        """The `total_steps` attribute of episodes `0..n-1`, as Minari's episode metadata
        gives it; None where one is not there or not one integer (Minari's metadata is then
        read, and says what it makes of it)."""
        import h5py

        lengths = np.empty(n, np.int64)
        try:
            for k in range(n):
                name = f"episode_{k}".encode()
                attr = h5py.h5a.open(self.touch().id, b"total_steps", obj_name=name)
                if attr.shape != () or attr.dtype.kind not in "iu":
                    return None
                value = np.empty((), attr.dtype)
                attr.read(value)
                lengths[k] = int(value)
        except Exception:  # (an episode or attribute that is not there: Minari's error)
            return None
        return lengths

    def episode(self, k: int, t: int, example: dict[str, Any]) -> dict[str, Any] | None:
        """Episode `k` (of `t` actions) opened as Minari's `get_episodes` would decode it:
        `observations` and `actions` trees of `_Leaf` of the example's shapes and dtypes (`t +
        1` and `t` steps), and `rewards`, `terminations`, `truncations` of `t` numbers (bool,
        integer or float). None where anything differs."""
        import h5py

        try:
            group = h5py.h5g.open(self.touch().id, f"episode_{k}".encode())
            episode = {
                "observations": _open_tree(group, "observations", example["observation"], t + 1),
                "actions": _open_tree(group, "actions", example["action"], t),
            }
            for name in ("rewards", "terminations", "truncations"):
                leaf = _open_leaf(group, name)
                if leaf.shape != (t,) or leaf.dtype.kind not in "biuf":
                    return None
                episode[name] = leaf
        except Exception:  # (`_Unexpected`, or h5py's error for a name that is not there)
            return None
        return episode

    def fill(self, leaf: _Leaf, a: int, b: int, out: np.ndarray) -> None:
        """Rows `[a, b)` of a dataset into `out` (C-contiguous, of `b - a` rows), cast to its
        dtype as NumPy's `astype` casts."""
        if b <= a or out.size == 0:
            return
        if out.dtype != leaf.dtype:
            held = np.empty(out.shape, leaf.dtype)
            self.fill(leaf, a, b, held)
            out[...] = held
        elif out.nbytes < _RAW_BYTES or not self._chunks(leaf, a, b, out):
            _read(leaf, a, b, out)

    def _chunks(self, leaf: _Leaf, a: int, b: int, out: np.ndarray) -> bool:
        """Rows `[a, b)` of a dataset into `out` from its raw chunks (read from the file at
        the addresses HDF5 gives, a run of them at a time, and placed with NumPy); False,
        where they are not the values as stored in memory: no raw file, a layout other than
        chunked, a filter, a file type other than NumPy's for the dtype, a chunk not written
        (it holds the fill value, which `H5Dread` supplies)."""
        import h5py

        dataset, shape, dtype = leaf.dataset, leaf.shape, leaf.dtype
        if self.raw is None or dtype.kind not in "iuf":
            return False
        plist = dataset.get_create_plist()
        if plist.get_layout() != h5py.h5d.CHUNKED or plist.get_nfilters() != 0:
            return False
        if not dataset.get_type().equal(h5py.h5t.py_create(dtype)):
            return False
        chunk = tuple(plist.get_chunk())
        infos: list[Any] = []
        try:  # (h5py built on an HDF5 without H5Dchunk_iter has no chunk_iter)
            dataset.chunk_iter(infos.append)
        except Exception:
            return False
        if len(infos) != math.prod(-(-n // c) for n, c in zip(shape, chunk, strict=True)):
            return False
        size = math.prod(chunk) * dtype.itemsize
        wanted = [i for i in infos if a < i.chunk_offset[0] + chunk[0] and i.chunk_offset[0] < b]
        if any(i.size != size for i in wanted):
            return False
        wanted.sort(key=lambda i: i.byte_offset)
        for run in _runs(wanted, size):
            begin = run[0].byte_offset
            data = np.empty(run[-1].byte_offset + size - begin, np.uint8)
            self.raw.seek(begin)
            if self.raw.readinto(data) != data.size:
                return False
            for info in run:
                at = info.byte_offset - begin
                into, take = _overlap(info.chunk_offset, chunk, shape, a, b)
                out[into] = data[at : at + size].view(dtype).reshape(chunk)[take]
        return True


def _hdf5(storage: Any) -> _HDF5 | None:
    """Minari's HDF5 file opened for the direct reads, or None where the data set is read
    with Minari's storage: another format, JPEG-encoded images (a leaf space Minari's
    `is_image_space` takes, with `jpeg_encoding`), a file h5py cannot open."""
    if getattr(storage, "FORMAT", None) != "hdf5":
        return None
    if getattr(storage, "jpeg_encoding", False):
        try:
            from minari.dataset.minari_storage import is_image_space
        except ImportError:
            return None
        spaces = (storage.observation_space, storage.action_space)
        if any(is_image_space(leaf) for space in spaces for leaf in _space_leaves(space)):
            return None
    try:
        return _HDF5(os.path.join(storage.data_path, "main_data.hdf5"))
    except OSError:
        return None


def _assign(x: Any, a: int, b: int, out: np.ndarray) -> None:
    """Rows `[a, b)` of an array Minari decoded into `out`, cast as NumPy's `astype` casts."""
    if b > a:
        out[...] = np.asarray(x)[a:b]


# ------------------------------------------------------------------------------ the source


class MinariSource(Source):
    """The steps of a Minari data set's episodes: of its HDF5 file read directly where they
    can be (`_HDF5`), else with its storage."""

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
        self.cache: tuple[int, dict] | None = None
        self.h5 = _hdf5(storage)
        try:
            self._open(data_path)
        except BaseException:
            self.close()
            raise

    def _open(self, data_path: str) -> None:
        from minari.dataset.minari_storage import MinariStorage

        where, storage = self.where, self.storage
        n = storage.total_episodes
        lengths = None if self.h5 is None else self.h5.lengths(n)
        if lengths is None:
            lengths = np.array(
                [int(m["total_steps"]) for m in storage.get_episode_metadata(range(n))],
                np.int64,
            )
        self.lengths = lengths
        # Archive steps of episode k: `[ends[k] - lengths[k] - 1, ends[k])`.
        self.ends = np.cumsum(lengths + 1)
        self.rows = 1
        self.steps = int(self.ends[-1]) if n else 0
        opened = self._opened(0) if n else None
        if opened is not None:
            self.example["reward"] = np.zeros((), opened["rewards"].dtype)
        elif n:
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

    def close(self) -> None:
        if self.h5 is not None:
            self.h5.close()
            self.h5 = None
        self.cache = None

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

    def _opened(self, k: int) -> dict[str, Any] | None:
        """Episode `k`'s datasets opened in the HDF5 file (`_HDF5.episode`), or None where
        Minari's storage reads it."""
        if self.h5 is None:
            return None
        return self.h5.episode(k, int(self.lengths[k]), self.example)

    def _episode(self, k: int) -> dict:
        """Episode `k` as Minari's storage decodes it (the last one read kept: a block's last
        episode is often the next block's first)."""
        if self.cache is None or self.cache[0] != k:
            (episode,) = self.storage.get_episodes([k])
            self.cache = (k, episode)
        return self.cache[1]

    def _place(
        self,
        out: dict[str, Any],
        episode: dict[str, Any],
        fill: Callable[[Any, int, int, np.ndarray], None],
        k: int,
        at: int,
        a: int,
        b: int,
    ) -> None:
        """Steps `[a, b)` of episode `k` into the block's arrays `out` from step `at` on,
        each leaf's rows put there by `fill(x, first_row, end_row, destination)`."""
        t, n = int(self.lengths[k]), b - a
        _tree_map(
            lambda _, w, x, o: fill(x, a, b, o[0, at : at + n]),
            self.example["observation"],
            episode["observations"],
            out["observation"],
        )
        acted = max(0, min(b, t) - a)  # the steps with an action
        for key, name in _EPISODE_LEAVES.items():
            _tree_map(
                lambda _, w, x, o: fill(x, a, a + acted, o[0, at : at + acted]),
                self.example[key],
                episode[name],
                out[key],
            )
        out["episode_end"][0, at : at + n] = False
        if b == t + 1:  # the final observation's step: zero action and reward, false flags
            last = at + n - 1
            for key in _EPISODE_LEAVES:
                _tree_map(
                    lambda _, w, o: o[0, last : last + 1].fill(0), self.example[key], out[key]
                )
            out["episode_end"][0, last] = True

    def read(self, start: int, stop: int) -> PyTree[np.ndarray]:
        """Steps `[start, stop)`, each episode's written straight into the block's arrays.
        The reward's dtype is that of the episodes' rewards together (as NumPy's
        `result_type` makes it), as concatenating them would give: where it is not the
        example's, `Archive.append` refuses the block for it, so its values do not matter."""
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, stop - 1, side="right"))
        out = _tree_map(lambda _, w: np.empty((1, stop - start, *w.shape), w.dtype), self.example)
        reward: Any = None
        for k in range(first, last + 1):
            begin = int(self.ends[k] - self.lengths[k] - 1)
            a, b = max(start, begin) - begin, min(stop, int(self.ends[k])) - begin
            opened = self._opened(k)
            if opened is not None and self.h5 is not None:
                episode, fill, dtype = opened, self.h5.fill, opened["rewards"].dtype
            else:
                episode, fill = self._episode(k), _assign
                self._check(episode, k)
                dtype = np.asarray(episode["rewards"]).dtype
            reward = dtype if reward is None else np.result_type(reward, dtype)
            self._place(out, episode, fill, k, begin + a - start, a, b)
        if reward is not None and reward != out["reward"].dtype:
            out["reward"] = out["reward"].astype(reward)
        return out


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
    frames: Frames | None = None,
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
    - `frames`: an [`equibuffer.Frames`][], to store one frame per step of an observation
        leaf that holds stacked frames (each stack checked against the previous step's
        frames); `eb.ArchiveLoader(..., frames=)` returns the stacks (see
        [Pixels](../pixels.md)). Its episode ends default to the `episode_end` leaf.

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
    return import_source(
        MinariSource(dataset),
        store,
        ImportOptions(
            memory,
            like,
            progress,
            compression,
            chunk_steps,
            shard_steps,
            storage_options,
            frames,
        ),
    )
