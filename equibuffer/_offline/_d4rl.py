"""`from_d4rl`: a D4RL-format HDF5 file (flat arrays of every step, episodes ended by
`terminals | timeouts`) into an `Archive`, in the layout of `_source`."""

import os
from typing import Any

import numpy as np
from jaxtyping import Bool, PyTree
from zarr.abc.store import Store

from .._archive._archive import Archive
from .._archive._format import Compression
from .._frames import Frames
from ._source import DEFAULT_MEMORY, import_source, ImportOptions, Source, SourceError


_PIECE_BYTES = 4 << 20  # a leaf is read in pieces of this size at most (a block is larger)
# Read-ahead through the kernel (`posix_fadvise`; not on macOS or Windows: reads as they come).
_ADVISE = hasattr(os, "posix_fadvise")
_FIELDS = {  # D4RL's name -> the archive's leaf
    "observations": "observation",
    "actions": "action",
    "rewards": "reward",
    "terminals": "terminated",
    "timeouts": "truncated",
}


def _json_value(x: Any) -> Any:
    """An HDF5 attribute or scalar as a JSON value (bytes decoded, arrays as lists)."""
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    if isinstance(x, np.ndarray):
        return [_json_value(v) for v in x.tolist()] if x.ndim else _json_value(x.item())
    if isinstance(x, np.generic):
        return _json_value(x.item())
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    if isinstance(x, (list, tuple)):
        return [_json_value(v) for v in x]
    return x if isinstance(x, (str, int, float, bool)) or x is None else str(x)


class D4RLSource(Source):
    """The steps of a D4RL file. Without `next_observations` each of its `N` steps is one
    archive step; with it, each episode gains the step holding its final observation."""

    def __init__(self, path: str | os.PathLike, where: str = "eb.from_d4rl()"):
        import h5py

        self.where = where
        path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{where}: there is no D4RL file at {path}.")
        try:  # (h5py's objects typed as Any: its stubs type every member as a link too)
            self.file: Any = h5py.File(path, "r")
        except OSError as error:
            raise SourceError(f"{where}: {path} is not an HDF5 file ({error}).") from None
        try:
            self._open(path)
        except BaseException:
            self.file.close()
            raise

    def _open(self, path: str) -> None:
        where, file = self.where, self.file
        missing = [name for name in _FIELDS if name not in file]
        if missing:
            raise SourceError(
                f"{where}: {path} has no field "
                + ", ".join(repr(m) for m in missing)
                + f" (a D4RL file holds {', '.join(_FIELDS)}; it has "
                + ", ".join(sorted(file.keys()))
                + ")."
                + (
                    " Without 'timeouts' the file does not say where episodes were cut off by"
                    " a time limit (D4RL's v0 files do not): those episodes would run into"
                    " the next, and windows would cross their ends. Write the field (true on"
                    " each step a time limit ended) with h5py, then import."
                    if "timeouts" in missing
                    else ""
                )
            )
        self.data: dict[str, Any] = {leaf: file[name] for name, leaf in _FIELDS.items()}
        n = self.data["observation"].shape[0]
        for name, leaf in _FIELDS.items():
            x = self.data[leaf]
            if x.shape[:1] != (n,):
                raise SourceError(
                    f"{where}: field {name!r} has shape {x.shape}; expected {n} steps first, "
                    f"as 'observations' has."
                )
        for name in ("rewards", "terminals", "timeouts"):
            x = file[name]
            if x.ndim != 1 and x.shape[1:] != (1,):
                raise SourceError(
                    f"{where}: field {name!r} has shape {x.shape}; expected ({n},) (one value "
                    "a step)."
                )
        self.next: Any = file.get("next_observations")
        if self.next is not None and self.next.shape != self.data["observation"].shape:
            raise SourceError(
                f"{where}: field 'next_observations' has shape {self.next.shape}; expected "
                f"{self.data['observation'].shape}, as 'observations' has."
            )
        self.n = n
        # Where episodes end: O(N) booleans (2 bytes a step), read in blocks.
        ends = np.zeros(n, bool)
        for a in range(0, n, 1 << 20):
            b = min(n, a + (1 << 20))
            ends[a:b] = self._flag("terminated", a, b) | self._flag("truncated", a, b)
        if n:
            ends[-1] = True  # the data ends there
        self.last = np.flatnonzero(ends)  # the last source step of each episode
        if self.next is None:
            self.steps = n
            self.starts = None
        else:  # episode k's steps start at its source start plus k (the final steps before)
            self.steps = n + len(self.last)
            first = np.concatenate([[0], self.last[:-1] + 1])
            self.starts = first + np.arange(len(first))
        self.rows = 1
        self.example = {
            "observation": np.zeros(
                self.data["observation"].shape[1:], self.data["observation"].dtype
            ),
            "action": np.zeros(self.data["action"].shape[1:], self.data["action"].dtype),
            "reward": np.zeros((), self.data["reward"].dtype),
            "terminated": np.zeros((), bool),
            "truncated": np.zeros((), bool),
            "episode_end": np.zeros((), bool),
        }
        attrs = {k: _json_value(v) for k, v in file.attrs.items()}
        extra = {}
        group = file.get("metadata")
        if group is not None:
            for key, x in group.items():
                if hasattr(x, "shape") and x.size <= 64:
                    extra[key] = _json_value(x[()])
        self.metadata = {
            "format": "d4rl",
            "file": os.path.basename(path),
            "attributes": attrs,
            "metadata": extra,
            "episodes": int(len(self.last)),
            "final_observations": self.next is not None,
        }
        size = os.path.getsize(path)
        self.identity = {"format": "d4rl", "location": path, "steps": self.steps, "bytes": size}
        # Where each contiguous (unchunked) dataset's steps lie in the file, for read-ahead.
        self.spans: list[tuple[int, int]] = []  # (file offset of step 0, bytes a step)
        for leaf in _FIELDS.values():
            x = self.data[leaf]
            offset = x.id.get_offset()  # None: chunked (or not yet written)
            per = x.dtype.itemsize * int(np.prod(x.shape[1:]))
            if offset is not None and per:
                self.spans.append((offset, per))
        # The descriptor HDF5 reads through (its default driver's), closed with the file.
        self.fd = self.file.id.get_vfd_handle() if self.spans and _ADVISE else None
        self.advised = 0  # source steps [0, advised) already asked of the kernel

    def _source_step(self, step: int) -> int:
        """The source step that archive step `step` reads (or the next one, for a step that
        holds an episode's final observation)."""
        if self.starts is None:
            return min(step, self.n)
        k = int(np.searchsorted(self.starts, step, "right")) - 1
        return min(max(0, step - max(k, 0)), self.n)

    def _read_ahead(self, start: int, stop: int) -> None:
        """Ask the kernel to read into its page cache, in the background, the source bytes of
        this block and of the next one as long (the import reads blocks in order): the disk
        then works while the block is copied and written, where read by pieces, dataset by
        dataset, it waits for each piece (a 2 GB file of small steps read cold in 1.4 to 1.5 s
        instead of 3.1 to 3.8 s, benchmarks/README.md). The pages are the kernel's cache, not
        the import's memory."""
        if self.fd is None:
            return
        a = max(self._source_step(start), self.advised)
        b = self._source_step(stop + (stop - start))
        if a >= b:
            return
        for offset, per in self.spans:
            os.posix_fadvise(self.fd, offset + a * per, (b - a) * per, os.POSIX_FADV_WILLNEED)
        self.advised = b

    def _flag(self, leaf: str, a: int, b: int) -> Bool[np.ndarray, " k"]:
        x = np.asarray(self.data[leaf][a:b])
        return x.reshape(b - a).astype(bool)

    def _plain(self, leaf: str, a: int, b: int) -> np.ndarray:
        """Source steps `[a, b)` of a leaf, in its archive dtype and shape (one HDF5 read)."""
        x = np.asarray(self.data[leaf][a:b]).reshape(b - a, *self.example[leaf].shape)
        return x.astype(bool, copy=False) if leaf in ("terminated", "truncated") else x

    def read(self, start: int, stop: int) -> PyTree[np.ndarray]:
        self._read_ahead(start, stop)
        if self.starts is None:  # archive step j is source step j
            out = {leaf: self._plain(leaf, start, stop) for leaf in _FIELDS.values()}
            ends = np.zeros(stop - start, bool)
            i, j = np.searchsorted(self.last, [start, stop])
            ends[self.last[i:j] - start] = True
            out["episode_end"] = ends
            return {k: out[k][None] for k in self.example}
        # Episode k's steps are archive steps `[starts[k], starts[k] + t_k]`: its t_k source
        # steps `[starts[k] - k, ...)` in order, then its final observation. Each leaf is read
        # over the source steps the block covers, in pieces of at most `_PIECE_BYTES`, and
        # copied episode by episode, a slice each.
        k0, k1 = (int(k) - 1 for k in np.searchsorted(self.starts, [start, stop - 1], "right"))
        runs = []  # (archive steps [a, b) of an episode's source steps from source step u)
        finals = []  # (the archive step of an episode's final observation, its last step)
        for k in range(k0, k1 + 1):
            begin = int(self.starts[k])
            final = int(self.last[k]) + k + 1
            a, b = max(start, begin), min(stop, final)
            if a < b:
                runs.append((a - start, b - start, a - k))
            if start <= final < stop:
                finals.append((final - start, int(self.last[k])))
        out = {leaf: self._placed(leaf, runs, stop - start) for leaf in _FIELDS.values()}
        end = np.zeros(stop - start, bool)
        if finals:
            at = [f for f, _ in finals]
            for leaf in _FIELDS.values():
                out[leaf][at] = 0
            end[at] = True
            out["observation"][at] = np.asarray(self.next[[s for _, s in finals]])
        out["episode_end"] = end
        return {key: out[key][None] for key in self.example}

    def _placed(self, leaf: str, runs: list[tuple[int, int, int]], steps: int) -> np.ndarray:
        """A leaf's `steps` archive steps holding, for each run `(a, b, u)`, source steps
        `[u, u + b - a)` at `[a, b)` (the runs in order; the other steps left unset); the
        source read in pieces of at most `_PIECE_BYTES`, so that no more than one piece is
        held beside the result."""
        example = self.example[leaf]
        y = np.empty((steps, *example.shape), example.dtype)
        if not runs:
            return y
        lo, hi = runs[0][2], runs[-1][2] + runs[-1][1] - runs[-1][0]
        per = max(1, _PIECE_BYTES // max(1, example.nbytes))
        first = 0  # the first run that may reach into the piece
        for p in range(lo, hi, per):
            q = min(hi, p + per)
            x = self._plain(leaf, p, q)
            for a, b, u in runs[first:]:
                if u >= q:
                    break
                v, w = max(u, p), min(u + b - a, q)
                y[a + v - u : a + w - u] = x[v - p : w - p]
                if u + b - a <= q:
                    first += 1
        return y

    def close(self) -> None:
        self.fd = None
        self.file.close()


def from_d4rl(
    path: str | os.PathLike,
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
    """Import a D4RL-format HDF5 file (`observations`, `actions`, `rewards`, `terminals`,
    `timeouts`, and optionally `next_observations`, each one row per step) into an
    `Archive`, streamed, resumably.

    The archive has one row holding the file's episodes back to back, each step a dict
    `{"observation", "action", "reward", "terminated", "truncated", "episode_end"}`
    (`terminals` and `timeouts` renamed to the buffers' `terminated` and `truncated`),
    dtypes and shapes as in the file. An episode ends where `terminals | timeouts` (and at
    the file's end); `episode_end` is true on its last step. With `next_observations`, each
    episode gains one step after its last: the final observation, a zero action and reward,
    false flags and `episode_end` (so that its last transition is there too); without
    them, `episode_end` is on the step whose flag ended it (whose next observation the file
    does not hold). Windows of `eb.ArchiveLoader(..., episode_end="episode_end")` never
    cross an episode's end. The file's attributes and its `metadata/` scalars are kept in
    `archive.metadata`.

    **Arguments:**

    - `path`: the HDF5 file.
    - `store`: where the archive goes (as for `eb.Archive`: a directory, a URL, a zarr
        store). If an earlier run of the same import stopped (killed, or failed), it carries
        on from the last step committed: no step is written twice or lost. An archive
        holding anything else is refused.
    - `memory`: the bound, in bytes, of what the import stages in memory (the file's steps
        read and their encoded chunks); never the file's size. At least 1 MiB.
    - `like`: a buffer whose steps the data set's must match (leaf for leaf, shapes and
        dtypes): checked before anything is written, with an error naming each field.
    - `progress`: a tqdm progress bar.
    - `compression`, `chunk_steps`, `shard_steps`, `storage_options`: as for `eb.Archive`.
    - `frames`: an [`equibuffer.Frames`][], to store one frame per step of an observation
        leaf that holds stacked frames (each stack checked against the previous step's
        frames); `eb.ArchiveLoader(..., frames=)` returns the stacks (see
        [Pixels](../pixels.md)). Its episode ends default to the `episode_end` leaf.

    **Returns:**

    The archive, opened read-only. Missing files and fields raise before any write
    (`FileNotFoundError`, `eb.SourceError`).

    !!! example

        ```python
        import equibuffer as eb, h5py, numpy as np, tempfile

        path = tempfile.mkdtemp() + "/hopper.hdf5"
        with h5py.File(path, "w") as f:  # two episodes: 3 steps that terminate, then 2
            f["observations"] = np.arange(10, dtype=np.float32).reshape(5, 2)
            f["next_observations"] = np.arange(2, 12, dtype=np.float32).reshape(5, 2)
            f["actions"] = np.zeros((5, 1), np.float32)
            f["rewards"] = np.ones(5, np.float32)
            f["terminals"] = np.array([0, 0, 1, 0, 0], bool)
            f["timeouts"] = np.array([0, 0, 0, 0, 1], bool)
        archive = eb.from_d4rl(path, tempfile.mkdtemp() + "/hopper.zarr", progress=False)
        assert len(archive) == 7  # 5 steps and 2 final observations
        steps = archive.read()
        assert steps["episode_end"][0].tolist() == [0, 0, 0, 1, 0, 0, 1]
        assert steps["observation"][0, 3].tolist() == [6.0, 7.0]  # the final observation
        ```
    """
    return import_source(
        D4RLSource(path),
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
