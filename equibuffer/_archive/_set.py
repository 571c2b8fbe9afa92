"""Several archives read as one data set: one archive per writer (per host), rows side by side.

Each writer process keeps its own archive (its own one-writer lock, its own objects: writers
never share an object, so none waits for another and a writer killed mid-write costs only its
own uncommitted steps). A reader opens the set and sees the rows of every member, each member
at its own committed length.
"""

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree
from zarr.abc.store import Store

from ._archive import Archive
from ._format import BufferLike
from ._sampler import ArchiveSample, sample_arguments, Seed, window_starts


class ArchiveSet:
    """Several archives of one schema read as one data set, their rows side by side: the
    archives of the writer processes of a multi-host run (each host writes its own rows to
    its own archive), for offline training on all of them.

    Row `r` of the set is row `r - offset` of the member whose rows include it, the members
    in the order given. Each member keeps its own committed length (writers run at their own
    pace): `read` covers the steps every member holds (`len(archive_set)`, the shortest),
    `sample` draws from every member up to its own length.

    **Arguments:**

    - `stores`: the members, each as `Archive` takes it (a path, a URL or a zarr store).
    - `like`: optional, a buffer of the schema: results in its tree structure.
    - `progress`, `storage_options`: as for `Archive` (the same for every member).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp, tempfile

        folder = tempfile.mkdtemp()
        for host in range(2):  # each host's writer: its own archive of its own rows
            buffer = eb.ItemBuffer({"t": jnp.float32(0)}, add_batch_size=2, capacity=16)
            buffer = buffer.add({"t": jnp.full((2, 8), float(host))})
            with eb.Archive(f"{folder}/host{host}.zarr", buffer) as archive:
                archive.write(buffer)
        data = eb.ArchiveSet([f"{folder}/host0.zarr", f"{folder}/host1.zarr"])
        assert data.rows == 4 and len(data) == 8
        assert data.read()["t"][:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
        batch = data.sample(jax.random.key(0), 16, sequence_length=4)
        assert batch.experience["t"].shape == (16, 4) and batch.rows.max() <= 3
        ```
    """

    def __init__(
        self,
        stores: Sequence[str | os.PathLike | Store],
        like: BufferLike | None = None,
        *,
        progress: bool = True,
        storage_options: dict[str, Any] | None = None,
    ):
        where = "ArchiveSet()"
        if isinstance(stores, str | os.PathLike) or not len(stores):
            raise TypeError(f"{where}: `stores` must be a non-empty sequence of archives.")
        self.archives = [
            Archive(s, like, mode="r", progress=progress, storage_options=storage_options)
            for s in stores
        ]
        first = self.archives[0]._reader.layout.leaves
        for i, archive in enumerate(self.archives[1:], start=1):
            leaves = archive._reader.layout.leaves
            if leaves != first:
                ours = {leaf.path: (leaf.shape, leaf.dtype) for leaf in first}
                theirs = {leaf.path: (leaf.shape, leaf.dtype) for leaf in leaves}
                raise ValueError(
                    f"{where}: member {i} ({archive._reader.location}) has another schema than "
                    f"member 0: leaves {theirs} against {ours}."
                )
        self.offsets = np.cumsum([0, *(a.rows for a in self.archives)])

    @property
    def rows(self) -> int:
        """The rows of every member, together."""
        return int(self.offsets[-1])

    def __len__(self) -> int:
        """The steps every member holds: the shortest member's committed length."""
        return min(len(a) for a in self.archives)

    def lengths(self) -> list[int]:
        """Each member's committed length, in order."""
        return [len(a) for a in self.archives]

    def refresh(self) -> int:
        """Move every member to its newest committed state; returns `len(self)`."""
        for archive in self.archives:
            archive.refresh()
        return len(self)

    def read(self, start: int = 0, stop: int | None = None) -> PyTree[np.ndarray]:
        """The steps `[start, stop)` (default: all that every member holds) of every row, as
        `Archive.read` returns them, the members' rows concatenated in order."""
        n = len(self)
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise IndexError(
                f"ArchiveSet.read(): steps [{start}, {stop}) are not within the {n} steps every "
                f"member holds (members' lengths: {self.lengths()})."
            )
        parts = [a.read(start, stop) for a in self.archives]
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts)

    def sample(
        self, key: Seed, batch_size: int, sequence_length: int, *, period: int = 1
    ) -> ArchiveSample:
        """Draw `batch_size` windows uniformly with replacement over every window of every
        row of every member, each member up to its own committed length (the law of
        `Archive.sample` over the union); `rows` are rows of the set.

        `key` is a JAX PRNG key (the same key, the same windows), a NumPy generator or an
        int seed, as for `Archive.sample`.
        """
        where = "ArchiveSet.sample()"
        rng, batch_size, seq, period = sample_arguments(
            where, key, batch_size, sequence_length, period
        )
        windows = np.array(
            [a.rows * sum(window_starts(a._reader, seq, period)[1]) for a in self.archives],
            np.int64,
        )
        if windows.sum() == 0:
            raise ValueError(
                f"{where}: no window of sequence_length={seq} (period={period}) fits in any "
                f"member (lengths {self.lengths()}); write more or shorten the window."
            )
        member = np.searchsorted(np.cumsum(windows), rng.integers(0, windows.sum(), batch_size),
                                 side="right")  # fmt: skip
        parts: list[tuple[np.ndarray, ArchiveSample]] = []
        for m, archive in enumerate(self.archives):
            slots = np.flatnonzero(member == m)
            if len(slots):
                got = archive.sample(rng, len(slots), seq, period=period)
                parts.append((slots, got._replace(rows=got.rows + self.offsets[m])))

        def place(*leaves: np.ndarray) -> np.ndarray:
            out = np.empty((batch_size, *leaves[0].shape[1:]), leaves[0].dtype)
            for (slots, _), leaf in zip(parts, leaves, strict=True):
                out[slots] = leaf
            return out

        return jax.tree.map(place, *(p for _, p in parts))

    def __repr__(self) -> str:
        return (
            f"ArchiveSet({len(self.archives)} members, {self.rows} rows, lengths {self.lengths()})"
        )
