"""Reading an archive: its committed snapshot (what a reader sees, moved forward by `refresh`
or by its own writer's commits), time slices of it as NumPy arrays, iteration in blocks, and
loading steps into a buffer (`load`, `restore`)."""

import contextlib
import dataclasses
import importlib.util
import threading
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import zarr
from zarr.abc.store import Store

from .._checks import check_positive_int
from .._frames import as_frames, Frames, stacks_on_host
from .._ring import RingStorage
from ._chunks import Chunks, direct_io, EMPTY, LeafIO, Shards
from ._format import ATTR, Commit, Layout, schema_diff, schema_of, storage_of
from ._store import fetch_pool, Objects, READ_AHEAD, read_json, run_all


@dataclasses.dataclass
class Progress:
    """Whether long reads and writes show a progress bar, and after how many seconds."""

    show: bool
    delay: float

    def bar(self, total: int, desc: str) -> Any:
        if not self.show:  # tqdm is not imported for nothing (~25 ms at a process's first use)
            return _NoBar()
        return progress_bar()(total=total, unit="step", desc=desc, delay=self.delay)


class _NoBar(contextlib.nullcontext):
    """The bar of `progress=False`: a context whose `update` does nothing."""

    def __enter__(self) -> "_NoBar":
        return self

    def update(self, n: int) -> None:
        pass


def progress_bar() -> type:
    """tqdm's bar class: its notebook widget where ipywidgets is installed, its text bar
    otherwise. (`tqdm.auto` alone, imported in a Jupyter kernel without ipywidgets, warns
    "IProgress not found" and falls back to the text bar anyway; importing it lazily here also
    keeps `import equibuffer` from importing tqdm.)"""
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm


def ring_holding(storage: RingStorage, data: list[np.ndarray], total: int) -> RingStorage:
    """A copy of `storage` whose counters say `total` steps were added and which holds `data`
    (one array per leaf, `(rows, k, *leaf)` with `k <= length`) as the newest `k` steps.

    Consistent with `RingStorage.write`: `fill = k`, `head = total mod length`, the count words
    from `total`, step `total - k + j` at slot `(head - k + j) mod length`; other slots are zero.
    """
    length, rows = storage.length, storage.rows
    leaves, treedef = jax.tree.flatten(storage.data)
    if len(data) != len(leaves):
        raise ValueError(f"ring_holding(): {len(data)} arrays for {len(leaves)} leaves.")
    k = data[0].shape[1]
    if not 0 <= k <= min(length, total):
        raise ValueError(f"ring_holding(): cannot hold {k} steps of {total} in length={length}.")
    head = total % length
    slots = (head - k + np.arange(k)) % length
    new = []
    for stored, d in zip(leaves, data, strict=True):
        if d.shape != (rows, k, *stored.shape[2:]):
            raise ValueError(f"ring_holding(): got shape {d.shape} for {stored.shape}.")
        ring = np.zeros(stored.shape, stored.dtype)
        ring[:, slots] = np.asarray(d, stored.dtype)
        new.append(jnp.asarray(ring))
    filled = eqx.tree_at(lambda s: s.data, storage, jax.tree.unflatten(treedef, new))
    return filled.with_counters(head=head, fill=k, steps_added=total)


def holding(where: str, buffer: Any, storage: RingStorage, priority: float | None) -> Any:
    """`buffer` holding `storage`, the state beside its ring rebuilt from it by the buffer's
    own `with_storage` (a `RingStorage` is returned as it is)."""
    if isinstance(buffer, RingStorage):
        if priority is not None:
            raise TypeError(f"{where}: a RingStorage has no priorities: drop `priority`.")
        return storage
    rebuilt = getattr(buffer, "with_storage", None)
    if rebuilt is None:
        raise TypeError(
            f"{where}: a {type(buffer).__name__} holds a RingStorage but has no "
            "`with_storage(storage)` to rebuild the rest of its state from it: load into its "
            "storage (`archive.load(x.storage)`) and rebuild the rest yourself, or give the "
            "class a `with_storage` method."
        )
    return rebuilt(storage) if priority is None else rebuilt(storage, priority=priority)


class Reader:
    """An archive's committed snapshot and the reads of it.

    `io` is the archive's own chunk (or shard) I/O per leaf, or None where zarr's own path
    reads (and writes) the arrays: when `direct` is off (the tested reference) or when an
    array's codecs or chunks are not the ones the archive writes (changed by another tool).
    """

    def __init__(
        self,
        store: Store,
        objects: Objects,
        layout: Layout,
        meta: dict,
        treedef: Any,
        location: str,
        progress: Progress,
        *,
        writable: bool,
        direct: bool,
    ):
        self.store = store
        self.objects = objects
        self.layout = layout
        self.treedef = treedef
        self.location = location
        self.progress = progress
        self.writable = writable
        self.direct = direct
        self.meta = meta
        self.commit = Commit.from_json(meta["committed"])
        self.open_arrays()

    def open_arrays(self) -> None:
        mode = "r+" if self.writable else "r"
        # As the archive's own writes: every chunk stored, zeros included.
        config: Any = {"write_empty_chunks": True}
        self.arrays = {
            leaf.name: zarr.open_array(
                self.store, path=leaf.name, mode=mode, zarr_format=3, config=config
            )
            for leaf in self.layout.leaves
        }
        io = [
            direct_io(self.arrays[leaf.name], leaf, self.layout, self.objects)
            for leaf in self.layout.leaves
        ]
        self.io: list[LeafIO] | None = None
        if self.direct and all(x is not None for x in io):
            self.io = [x for x in io if x is not None]

    def advance(self, meta: dict, commit: Commit) -> None:
        """The snapshot after a commit of this archive's own writer."""
        self.meta, self.commit = meta, commit

    def refresh(self) -> int:
        """Move to the newest committed state; returns its length."""
        record = read_json(self.store, "zarr.json")
        assert record is not None
        self.advance(
            record["attributes"][ATTR], Commit.from_json(record["attributes"][ATTR]["committed"])
        )
        self.open_arrays()
        return self.commit.length

    # ------------------------------------------------------------------------- checks

    def check_range(self, where: str, start: int, stop: int) -> None:
        n = self.commit.length
        if not 0 <= start <= stop <= n:
            raise IndexError(
                f"{where}: steps [{start}, {stop}) are out of range: the archive holds "
                f"{n} committed steps (indices 0 to {n - 1}); call refresh() to see newer ones."
            )

    def rows_index(self, where: str, rows: Any) -> Any:
        """`rows` as a slice or an array of row indices, checked."""
        if rows is None:
            return slice(None)
        if isinstance(rows, slice):
            return rows
        idx = np.atleast_1d(np.asarray(rows))
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise TypeError(f"{where}: `rows` must be None, a slice or ints, got {rows!r}.")
        n = self.layout.rows
        if idx.size and not (-n <= idx.min() and idx.max() < n):
            raise IndexError(f"{where}: `rows` {rows!r} out of range for {n} rows.")
        return idx % n

    def row_ids(self, rows: Any) -> list[int]:
        if isinstance(rows, slice):
            return list(range(self.layout.rows)[rows])
        return [int(r) for r in rows]

    def unflatten(self, arrays: list[np.ndarray]) -> Any:
        """Stored arrays (one per leaf) as the buffer's tree, in the buffer's dtypes (a dict
        by leaf name when the archive was opened without `like`)."""
        leaves = self.layout.leaves
        out = [
            a.view(np.dtype(leaf.dtype)) if leaf.dtype != leaf.stored else a
            for leaf, a in zip(leaves, arrays, strict=True)
        ]
        if self.treedef is not None:
            return jax.tree.unflatten(self.treedef, out)
        return {leaf.name: a for leaf, a in zip(leaves, out, strict=True)}

    # ------------------------------------------------------------------------- reading

    def read_raw(
        self,
        start: int,
        stop: int,
        rows: Any,
        outs: list[np.ndarray] | None = None,
        whole: bool = True,
    ) -> list[np.ndarray]:
        """Steps `[start, stop)` of `rows`, per leaf `(rows, stop - start, *leaf)` in the
        stored dtype, written into `outs` if given (C-contiguous arrays of that shape).
        `whole=False` reads only the chunks of a sharded archive that the steps touch (a
        few steps of every row: the loader's halo), never whole shards."""
        row_ids = self.row_ids(rows)
        if outs is None:
            outs = [
                np.empty((len(row_ids), stop - start, *leaf.shape), np.dtype(leaf.stored))
                for leaf in self.layout.leaves
            ]
        if self.io is None:
            self._read_zarr(start, stop, rows, outs)
        elif self.layout.shard_steps is None:
            self._read_chunks(self.io, start, stop, row_ids, outs)
        else:
            self._read_shards(self.io, start, stop, row_ids, outs, whole)
        return outs

    def _read_zarr(self, start: int, stop: int, rows: Any, outs: list[np.ndarray]) -> None:
        """zarr's own path: a slice of each array (an orthogonal selection for a list of
        rows)."""
        for leaf, out in zip(self.layout.leaves, outs, strict=True):
            array = self.arrays[leaf.name]
            if isinstance(rows, slice):
                out[...] = array[rows, start:stop]
            else:
                out[...] = array.oindex[rows, start:stop]

    def _read_chunks(
        self, io: list[LeafIO], start: int, stop: int, row_ids: list[int], outs: list
    ) -> None:
        """Unsharded: get and decode every touched chunk concurrently, straight into place."""
        cs = self.layout.chunk_steps
        tasks = [
            (chunks, out, i, r, c)
            for chunks, out in zip(io, outs, strict=True)
            for i, r in enumerate(row_ids)
            for c in range(start // cs, -(-stop // cs))
        ]

        def get(task: tuple[Chunks, np.ndarray, int, int, int]) -> None:
            chunks, out, i, r, c = task
            a, b = max(start, c * cs), min(stop, (c + 1) * cs)
            data = chunks.data(r, c)
            chunks.decode_into(data, out[i, a - start : b - start], a - c * cs)

        for _ in run_all(get, tasks):
            pass

    def _read_shards(
        self,
        io: list[LeafIO],
        start: int,
        stop: int,
        row_ids: list[int],
        outs: list,
        whole: bool = True,
    ) -> None:
        """Sharded: one task per (leaf, shard, row) reads that row's chunks of the shard
        (the whole shard once, when all rows are read and `whole`) and decodes them into
        place."""
        shards_of: list[Any] = io
        layout = self.layout
        assert layout.shard_steps is not None
        cs, ss = layout.chunk_steps, layout.shard_steps
        per = ss // cs
        n = self.commit.length
        whole = whole and len(row_ids) == layout.rows
        lock = threading.Lock()
        last = -(-stop // ss) - 1
        # Whole shards are fetched on their own threads, `READ_AHEAD` shards ahead of the
        # decoding, so that a cold read keeps the disk busy while the codec works; a shard's
        # bytes are dropped once each of its rows is decoded (a long read holds a few shards,
        # not all of them).
        fetched: dict[tuple[int, int], Any] = {}  # (leaf, shard) -> future, or None: done
        pending: dict[tuple[int, int], int] = {}  # (leaf, shard) -> rows not yet decoded

        def fetch(li: int, s: int) -> Any:
            with lock:
                for k in range(s, min(s + READ_AHEAD, last) + 1):
                    if (li, k) not in fetched:
                        fetched[(li, k)] = fetch_pool().submit(shards_of[li].get_shard, k)
                        pending[(li, k)] = len(row_ids)
                future = fetched[(li, s)]
            return future.result()

        def decoded(li: int, s: int) -> None:
            with lock:
                pending[(li, s)] -= 1
                if not pending[(li, s)]:
                    fetched[(li, s)] = None

        def get(task: tuple[int, int, int, int]) -> None:
            li, s, i, r = task
            shards: Shards = shards_of[li]
            out = outs[li]
            cs0, cs1 = max(s * per, start // cs), min((s + 1) * per, -(-stop // cs))
            which = [(r, c - s * per) for c in range(cs0, cs1)]
            if whole:
                got = fetch(li, s)
                if got is None:
                    datas: list = [None] * len(which)
                else:
                    index, blob = got
                    datas = []
                    for rr, j in which:
                        off, size = int(index[rr, j, 0]), int(index[rr, j, 1])
                        datas.append(None if off == EMPTY else blob[off : off + size])
            else:
                datas = shards.get_chunks(s, which, complete=(s + 1) * ss <= n)
            for c, data in zip(range(cs0, cs1), datas, strict=True):
                a, b = max(start, c * cs), min(stop, (c + 1) * cs)
                shards.decode_into(data, out[i, a - start : b - start], a - c * cs)
            if whole:
                del datas
                decoded(li, s)

        tasks = [
            (li, s, i, r)
            for s in range(start // ss, -(-stop // ss))
            for li in range(len(shards_of))
            for i, r in enumerate(row_ids)
        ]
        for _ in run_all(get, tasks):
            pass

    def iter_raw(
        self, start: int, stop: int, rows: Any, steps: int, outs: list | None = None
    ) -> Iterator[tuple[int, list]]:
        with self.progress.bar(stop - start, "archive read") as bar:
            for a in range(start, stop, steps):
                b = min(a + steps, stop)
                into = None if outs is None else [o[:, a - start : b - start] for o in outs]
                yield a, self.read_raw(a, b, rows, into)
                bar.update(b - a)

    def read(self, start: int, stop: int | None, rows: Any) -> Any:
        where = "Archive.read()"
        n = self.commit.length
        start = start + n if start < 0 else start
        stop = n if stop is None else (stop + n if stop < 0 else stop)
        self.check_range(where, start, stop)
        rsel = self.rows_index(where, rows)
        if stop - start > 4 * self.layout.block_steps and self.progress.show:
            # Block by block (for the progress bar), each straight into its place.
            count = len(self.row_ids(rsel))
            outs = [
                np.empty((count, stop - start, *leaf.shape), np.dtype(leaf.stored))
                for leaf in self.layout.leaves
            ]
            for _ in self.iter_raw(start, stop, rsel, self.layout.block_steps, outs):
                pass
            return self.unflatten(outs)
        return self.unflatten(self.read_raw(start, stop, rsel))

    def read_stacked(self, start: int, stop: int | None, rows: Any, frames: Frames) -> Any:
        """`read`, the frames leaf made the stacks the wrapper returned (`frames`), each
        built from the `k - 1` steps before it as well."""
        where = "Archive.read()"
        c = self.commit
        zeros = [np.zeros(leaf.shape, np.dtype(leaf.stored)) for leaf in self.layout.leaves]
        given = as_frames(where, frames)
        assert given is not None  # (`Archive.read` calls this with frames only)
        frames = given.for_stored(where, self.unflatten(zeros))
        if not isinstance(frames.episode_end, str):
            raise TypeError(
                f"{where}: an archive's frames read their episode ends from a leaf: give "
                "`Frames(episode_end=)` the name of the archive's 0-d bool episode-end leaf."
            )
        start = start + c.length if start < 0 else start
        stop = c.length if stop is None else (stop + c.length if stop < 0 else stop)
        self.check_range(where, start, stop)
        segments, back = c.segments(), frames.lookback
        steps = np.arange(start, stop, dtype=np.int64)
        held = stacks_held(segments, steps, back, c.length > 0 and c.source_step(0) == 0)
        if not held.all():
            bad = int(steps[~held][0])
            first = max(a for a, _ in segments if a <= bad)
            raise ValueError(
                f"{where}: step {bad} is fewer than k - 1 = {back} steps into its segment of "
                f"contiguous steps, which starts at {first} (after steps the archive lost, or "
                "where an archive begins that did not begin with its source): the earlier "
                f"frames of its stack are not held. Read from step {first + back} on."
            )
        read_first = max(start - back, max((a for a, _ in segments if a <= start), default=0))
        return stacks_on_host(frames, self.read(read_first, stop, rows), start - read_first)

    def iter(self, steps: int | None, start: int, stop: int | None, rows: Any) -> Iterator:
        where = "Archive.iter()"
        steps = (
            self.layout.block_steps if steps is None else check_positive_int(where, "steps", steps)
        )
        stop = self.commit.length if stop is None else stop
        self.check_range(where, start, stop)
        rsel = self.rows_index(where, rows)
        for a, raw in self.iter_raw(start, stop, rsel, steps):
            yield a, self.unflatten(raw)

    # --------------------------------------------------------------------- into a buffer

    def load(
        self,
        buffer: Any,
        start: int | None,
        stop: int | None,
        rows: Any,
        priority: float | None,
        where: str = "Archive.load()",
    ) -> Any:
        storage = storage_of(buffer, where)
        c = self.commit
        seg_start = c.segments()[-1][0] if c.length else 0
        stop = c.length if stop is None else stop
        if start is None:
            start = max(stop - storage.length, seg_start if stop > seg_start else 0)
        self.check_range(where, start, stop)
        if stop - start > storage.length:
            raise ValueError(
                f"{where}: {stop - start} steps do not fit in the buffer's "
                f"max_length_time_axis={storage.length}; load fewer steps or use a larger buffer."
            )
        for a, b in c.segments():
            if a < stop and start < b and not (a <= start and stop <= b):
                raise ValueError(
                    f"{where}: steps [{start}, {stop}) cross a gap of lost steps at {b}; "
                    f"load within one segment of {c.segments()}."
                )
        rsel = self.rows_index(where, rows)
        leaves, _ = schema_of(storage)
        diff = schema_diff(list(self.layout.leaves), len(self.row_ids(rsel)), leaves, storage.rows)
        if diff:
            raise ValueError(f"{where}: the buffer does not match the archive: {'; '.join(diff)}.")
        raw = self.read_raw(start, stop, rsel)
        data = [
            a.view(np.dtype(leaf.dtype)) for leaf, a in zip(self.layout.leaves, raw, strict=True)
        ]
        total = c.source_step(stop - 1) + 1 if stop > 0 else c.first_step
        return holding(where, buffer, ring_holding(storage, data, total), priority)

    def restore(self, buffer: Any, priority: float | None) -> Any:
        where = "Archive.restore()"
        storage = storage_of(buffer, where)
        c = self.commit
        start = max(c.length - storage.length, c.segments()[-1][0] if c.length else 0)
        return self.load(buffer, start, c.length, None, priority, where)

    def nbytes(self) -> tuple[int, int]:
        leaves = self.layout.leaves
        raw = self.commit.length * self.layout.rows * sum(leaf.step_bytes for leaf in leaves)
        stored = sum(int(a.nbytes_stored()) for a in self.arrays.values())
        return raw, stored


def stacks_held(
    segments: list[tuple[int, int]], starts: np.ndarray, lookback: int, fresh: bool
) -> np.ndarray:
    """Which `starts` have the `lookback` steps before them in their own segment, the
    frames their stacks read: all but the first `lookback` of a segment, unless it is the
    archive's first and starts at the source's first step ever (an episode's first step)."""
    firsts = np.asarray([a for a, _ in segments], np.int64)
    seg = np.searchsorted(firsts, starts, side="right") - 1
    held = starts - firsts[seg] >= lookback
    return held | (fresh & (seg == 0) & (firsts[0] == 0))
