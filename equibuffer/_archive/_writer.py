"""Writing an archive: a write is planned (the new steps copied from the buffer, steps the ring
lost counted) and then applied (the data written, the arrays' shapes, then the commit), in
the calling thread (`write`) or on one writer thread in call order (`write_async`).

The commit is the root group's `zarr.json`, replaced atomically after everything it covers:
a killed writer leaves the last commit. The writer keeps what it rewrites: the metadata
documents (only the shape or the commit changes) and the partial chunks and shard its last
write ended with, as its own copies (a view of the ring would stop the next donated add from
writing in place). A reopened writer reads them back; both leave the same bytes.
"""

import concurrent.futures
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import zarr

from .._checks import keystr
from .._ring import host_counters
from ._chunks import Chunks, EMPTY, LeafIO, Shards
from ._format import (
    ATTR,
    Commit,
    create_leaf_array,
    direct_codecs,
    document,
    INT64_MAX,
    OnLost,
    schema_diff,
    schema_of,
    storage_of,
    worth_compressing,
)
from ._reader import Reader
from ._store import fsync_path, read_json, run_all, WriterLock


_INLINE_BYTES = 1 << 20  # writes smaller than this run in the calling thread
_MAX_PENDING = 2  # background writes (write_async) waiting at most: one running, one queued


def _chunk(
    row: np.ndarray,
    old: int,
    new: int,
    c: int,
    cs: int,
    like: Chunks | Shards,
    before: Callable[[], np.ndarray | None],
) -> tuple[np.ndarray, int, int]:
    """Chunk `c` (of `cs` steps) of one row of a leaf once its steps `[old, new)` (`row`:
    the row's new steps) are written, and the steps `[a, b)` of the chunk they fill: their
    slice of `row` when they fill it all, else a new array of `like`'s chunk shape and dtype
    holding the chunk's committed steps, from `before()` (called only when the chunk has
    some; None: none kept), then the new ones, then zeros."""
    a, b = max(old, c * cs), min(new, (c + 1) * cs)
    if a == c * cs and b == (c + 1) * cs:
        return row[a - old : b - old], a, b
    x = np.zeros(like.shape, like.dtype)
    if a > c * cs:
        prev = before()
        if prev is not None:
            x[: a - c * cs] = prev[: a - c * cs]
    x[a - c * cs : b - c * cs] = row[a - old : b - old]
    return x, a, b


class StepsLostError(RuntimeError):
    """Raised by `Archive.write` when the ring overwrote steps that were never written (with
    `on_lost="warn"`, a [`equibuffer.StepsLostWarning`][] instead, and the steps still held are
    written).

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp, tempfile, warnings

        buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
        with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
            buffer = buffer.add({"x": jnp.arange(6.0)[None]})  # 6 steps into a ring of 4
            try:
                archive.write(buffer)
                lost = False
            except eb.StepsLostError as error:
                lost = "2 of the 6 steps" in str(error)
            assert lost and len(archive) == 0  # nothing was written
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert archive.write(buffer, on_lost="warn") == 4  # the 4 steps still held
            assert [w.category for w in caught] == [eb.StepsLostWarning]
            assert archive.steps_lost == 2 and archive.source_step(0) == 2
        ```
    """


class StepsLostWarning(UserWarning):
    """Warned by `Archive.write(..., on_lost="warn")` with the number of steps lost; the
    example under [`equibuffer.StepsLostError`][] shows both."""


class Plan(NamedTuple):
    """A write worked out but not yet done: the new steps per leaf `(rows, keep, *leaf)`,
    the committed length it appends to, and the commit it ends with."""

    host: list[np.ndarray]
    base: int
    keep: int
    commit: Commit


class Writer:
    """The writes of an archive's one writer (it holds the lock)."""

    def __init__(self, reader: Reader, lock: WriterLock, fsync: bool, on_lost: OnLost):
        if fsync and reader.io is None:
            raise ValueError(
                f"Archive(): fsync=True is not available for {reader.location}: its arrays are "
                "written through zarr's own path (their codecs or chunks are not the ones the "
                "archive writes itself), which does not flush to disk."
            )
        self.reader = reader
        self.objects = reader.objects
        self.lock = lock
        self.fsync = fsync
        self.on_lost: OnLost = on_lost
        # Copies of the metadata documents this writer rewrites (read when first needed).
        self.records: dict[str, dict | None] | None = None
        self.group_record: dict | None = None
        self.group: Any = None  # zarr's own path: the root group
        # `(length, data)`: the partly filled chunks (or shard) the last write ended with.
        self.tail: tuple[int, Any] | None = None
        self.next_tail: tuple[int, Any] | None = None
        # Background writes (`write_async`): one writer thread, the futures not yet waited
        # for, the commit they lead to, and the error of one that failed.
        self.thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.pending: list[concurrent.futures.Future[int]] = []
        self.planned: Commit | None = None
        self.failed: BaseException | None = None

    # ----------------------------------------------------------------------------- calls

    def write(self, buffer: Any, on_lost: OnLost | None) -> int:
        self.flush()
        plan = self.plan(buffer, on_lost, "Archive.write()", copy=False)
        return 0 if plan is None else self.apply(plan)

    def write_async(self, buffer: Any, on_lost: OnLost | None) -> concurrent.futures.Future[int]:
        where = "Archive.write_async()"
        # Back-pressure: at most `_MAX_PENDING` writes (and their copies of the steps) wait.
        self.pending = [f for f in self.pending if not f.done()]
        while len(self.pending) >= _MAX_PENDING:
            concurrent.futures.wait(self.pending[:1])
            self.pending = [f for f in self.pending if not f.done()]
        if self.failed is not None:
            self.flush()  # waits for the writes after the one that failed; raises its error
        plan = self.plan(buffer, on_lost, where, copy=True)
        if plan is None:
            done: concurrent.futures.Future[int] = concurrent.futures.Future()
            done.set_result(0)
            return done
        if self.thread is None:
            self.thread = concurrent.futures.ThreadPoolExecutor(1, "equibuffer-archive")
        self.planned = plan.commit
        future = self.thread.submit(self.apply_in_background, plan)
        self.pending.append(future)
        return future

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        concurrent.futures.wait(pending)
        self.planned = None
        failed, self.failed = self.failed, None
        if failed is not None:
            raise RuntimeError(
                "Archive: a background write (write_async) failed, so it and the writes after "
                "it were not committed; the archive holds its last commit. Write again to "
                "write those steps (if the ring still holds them)."
            ) from failed

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self.thread is not None:
                self.thread.shutdown()
                self.thread = None
            self.lock.release()

    # ------------------------------------------------------------------------- planning

    def plan(self, buffer: Any, on_lost: OnLost | None, where: str, copy: bool) -> Plan | None:
        """What a write of `buffer` appends (host copies of the new steps when `copy`, else
        views where possible) and the commit it leads to, counted from the last commit or
        the last planned one: None when there is nothing new."""
        self.lock.check(where, self.reader.location)
        policy = self.on_lost if on_lost is None else on_lost
        storage = storage_of(buffer, where)
        layout = self.reader.layout
        leaves, _ = schema_of(storage)
        diff = schema_diff(list(layout.leaves), layout.rows, leaves, storage.rows)
        if diff:
            raise ValueError(f"{where}: the buffer does not match the archive: {'; '.join(diff)}.")
        head, fill, total = host_counters(storage)
        c = self.reader.commit if self.planned is None else self.planned
        if total > INT64_MAX:
            raise OverflowError(f"{where}: {total} steps is beyond int64.")
        if total < c.source_steps:
            raise ValueError(
                f"{where}: the buffer's count of steps added is {total}, but the archive "
                f"already holds the source up to step {c.source_steps}; resume a run with "
                "`buffer = archive.restore(buffer)` before writing."
            )
        new = total - c.source_steps
        if new == 0:
            return None
        length = storage.length
        keep = min(new, fill)
        lost = new - keep
        if lost:
            msg = (
                f"{where}: {lost} of the {new} steps added since the last write were overwritten "
                f"by the ring (max_length_time_axis={length}) before being written"
            )
            if policy == "raise":
                raise StepsLostError(
                    msg + "; call write() at least every max_length_time_axis steps, or pass "
                    "on_lost='warn' to write the rest and record the gap."
                )
            # stacklevel: the caller of Archive.write / write_async.
            warnings.warn(
                msg + "; the rest is written and the gap recorded.", StepsLostWarning, stacklevel=4
            )
        start = (head - keep) % length
        pieces = [(start, min(start + keep, length))]
        if start + keep > length:
            pieces.append((0, start + keep - length))
        host = []
        for leaf, x in zip(layout.leaves, jax.tree.leaves(storage.data), strict=True):
            view = all(d.platform == "cpu" for d in x.devices())
            if keep == length and start == 0 or view:
                whole = np.asarray(jax.device_get(x))  # on CPU: a view, no copy
                parts = [whole[:, a:b] for a, b in pieces]
            else:  # on an accelerator: bring back only the new steps
                parts = [np.asarray(jax.device_get(x[:, a:b])) for a, b in pieces]
            if len(parts) > 1:
                block = np.concatenate(parts, axis=1)
            else:  # a view of the ring must not outlive this call when the write is deferred
                block = parts[0].copy() if copy and view else parts[0]
            host.append(block.view(np.dtype(leaf.stored)))
        return Plan(host, c.length, keep, c.after(total, keep))

    def append_steps(self, steps: Any, where: str) -> int:
        """Append `steps` (the archive's tree, or a dict by leaf name, of arrays `(rows, k,
        *leaf)`) after the committed length as `k` more source steps, and commit them."""
        self.flush()
        self.lock.check(where, self.reader.location)
        layout = self.reader.layout
        names = [leaf.name for leaf in layout.leaves]
        if isinstance(steps, dict) and set(steps) == set(names) and self.reader.treedef is None:
            flat = [steps[name] for name in names]
            paths = names
        else:
            found, _ = jax.tree_util.tree_flatten_with_path(steps)
            by_path = {keystr(p): x for p, x in found}
            paths = [leaf.path for leaf in layout.leaves]
            missing = [p for p in paths if p not in by_path]
            extra = [p for p in by_path if p not in set(paths)]
            if missing or extra:
                said = []
                if missing:
                    said.append("leaves of the archive not given: " + ", ".join(missing))
                if extra:
                    said.append("leaves given that the archive does not hold: " + ", ".join(extra))
                raise ValueError(f"{where}: {'; '.join(said)}.")
            flat = [by_path[p] for p in paths]
        host, k = [], None
        for leaf, path, x in zip(layout.leaves, paths, flat, strict=True):
            x = np.asarray(x)
            want = (layout.rows, k if k is not None else "k", *leaf.shape)
            if (
                x.ndim != 2 + len(leaf.shape)
                or x.shape[0] != layout.rows
                or (x.shape[2:] != leaf.shape or (k is not None and x.shape[1] != k))
            ):
                raise ValueError(
                    f"{where}: leaf {path} has shape {x.shape}; expected (rows, steps, *leaf) "
                    f"= {tuple(want)}."
                )
            if x.dtype != np.dtype(leaf.dtype):
                raise ValueError(
                    f"{where}: leaf {path} has dtype {x.dtype}; the archive holds {leaf.dtype}."
                )
            k = x.shape[1]
            host.append(np.ascontiguousarray(x).view(np.dtype(leaf.stored)))
        if not k:
            return 0
        c = self.reader.commit
        plan = Plan(host, c.length, k, c.after(c.source_steps + k, k))
        return self.apply(plan)

    # ------------------------------------------------------------------------- applying

    def apply(self, plan: Plan) -> int:
        """Write and commit a planned write; returns the steps written."""
        if self.reader.commit.length != plan.base:
            raise RuntimeError(
                f"Archive: a write planned after {plan.base} committed steps found "
                f"{self.reader.commit.length}; nothing was written."
            )
        self.next_tail = None
        if plan.base == 0:
            self.choose_codecs(plan.host)
        self.append(plan.host)
        self.commit(plan.commit)
        self.tail = self.next_tail  # kept only once committed
        return plan.keep

    def apply_in_background(self, plan: Plan) -> int:
        if self.failed is not None:
            raise RuntimeError("an earlier background write failed") from self.failed
        try:
            self.lock.check("Archive.write_async()", self.reader.location)
            return self.apply(plan)
        except BaseException as error:
            self.failed = error
            raise

    def choose_codecs(self, host: list[np.ndarray]) -> None:
        """Before the archive's first steps are written: each leaf whose chunks its codec
        hardly shrinks (`worth_compressing`: random frames, noise, chunks smaller than the
        codec's frame) is recreated without the codec, so that reading it costs a copy
        rather than a decode; a leaf of which the write holds too little to judge keeps it.
        Each array's metadata says how it is stored, so zarr and every reader (refreshed)
        read it as written."""
        layout = self.reader.layout
        chunks = layout.chunk_steps
        group = None
        for leaf, steps in zip(layout.leaves, host, strict=True):
            # (an array another tool re-encoded, which `direct_codecs` refuses, is kept)
            how = direct_codecs(self.reader.arrays[leaf.name])
            if how is None or how[0] is None or worth_compressing(how[0], steps, chunks):
                continue
            if group is None:
                group = zarr.open_group(self.reader.store, mode="a", zarr_format=3)
            create_leaf_array(
                group, leaf, layout.rows, layout.chunk_steps, layout.shard_steps, None
            )
        if group is not None:
            self.reader.open_arrays()

    def append(self, host: list[np.ndarray]) -> None:
        """Write `host` (per leaf `(rows, k, *leaf)`) after the committed length. Nothing is
        visible until `commit`."""
        old = self.reader.commit.length
        new = old + host[0].shape[1]
        io = self.reader.io
        if io is None:
            self._append_zarr(host, old, new)
            return
        # What the last write left of a partly filled chunk or shard, if it ended at `old`;
        # dropped now, so that a write that fails midway leaves none behind.
        tail, self.tail = self.tail, None
        tail = tail[1] if tail is not None and tail[0] == old else None
        self._resize(new)
        if self.reader.layout.shard_steps is None:
            self._append_chunks(io, host, old, new, tail)
        else:
            self._append_shards(io, host, old, new, tail)

    def _append_zarr(self, host: list[np.ndarray], old: int, new: int) -> None:
        """zarr's own path (the reference): each array resized, then the steps assigned."""
        layout = self.reader.layout
        for leaf, block in zip(layout.leaves, host, strict=True):
            array = self.reader.arrays[leaf.name]
            array.resize((layout.rows, new, *leaf.shape))
            array[:, old:new] = block

    def _resize(self, length: int) -> None:
        """Set every leaf array's time length in its metadata document (the document zarr's
        `resize` writes, without its per-array round trips): the documents read once, then
        replaced with the new shape only."""
        layout = self.reader.layout
        if self.records is None:
            self.records = {
                leaf.name: read_json(self.reader.store, f"{leaf.name}/zarr.json")
                for leaf in layout.leaves
            }
        items = []
        for leaf in layout.leaves:
            record = self.records[leaf.name]
            assert record is not None
            record["shape"] = [layout.rows, length, *leaf.shape]
            items.append((f"{leaf.name}/zarr.json", document(record)))
        self.objects.put_many(items)

    def _run_writes(
        self, work: Callable[[Any], int], tasks: list, total: int, host: list[np.ndarray]
    ) -> None:
        """Run `work` over `tasks` on the I/O threads (in this thread for a write of less
        than `_INLINE_BYTES`, where handing tasks to threads costs more than it saves), a
        progress bar counting the steps each returns."""
        inline = sum(x.nbytes for x in host) < _INLINE_BYTES
        with self.reader.progress.bar(total, "archive write") as bar:
            for done in run_all(work, tasks, inline):
                bar.update(done)

    def _append_chunks(
        self, io: list[LeafIO], host: list[np.ndarray], old: int, new: int, tail: dict | None
    ) -> None:
        """Unsharded: encode and put every chunk that steps `[old, new)` touch, concurrently.
        A chunk already holding committed steps is completed and replaced whole: its steps
        come from `tail` (`(leaf, row) -> the chunk`, kept by the previous write of this
        writer) or are read back."""
        layout = self.reader.layout
        cs = layout.chunk_steps
        tasks = [
            (li, r, c)
            for li in range(len(io))
            for r in range(layout.rows)
            for c in range(old // cs, -(-new // cs))
        ]
        keep: dict[tuple[int, int], np.ndarray] = {}

        chunks_of: list[Any] = io

        def put(task: tuple[int, int, int]) -> int:
            li, r, c = task
            chunks: Chunks = chunks_of[li]
            before = lambda: tail[(li, r)] if tail is not None else chunks.get(r, c)  # noqa: E731
            x, a, b = _chunk(host[li][r], old, new, c, cs, chunks, before)
            if b < (c + 1) * cs:
                keep[(li, r)] = x  # the new partial chunk (a copy: never the ring's)
            chunks.put(r, c, x)
            return b - a

        self._run_writes(put, tasks, (new - old) * layout.rows * len(layout.leaves), host)
        self.next_tail = (new, keep) if new % cs else None

    def _append_shards(
        self, io: list[LeafIO], host: list[np.ndarray], old: int, new: int, tail: Any
    ) -> None:
        """Sharded: encode the chunks that steps `[old, new)` touch concurrently (one task per
        leaf, shard and row) and write each shard once, whole, as soon as its chunks are
        encoded. The shard already holding committed steps keeps their encoded chunks as
        stored (a chunk holding some is decoded, completed and encoded again); both come
        from `tail` (kept by this writer's previous write) or are read back."""
        layout = self.reader.layout
        assert layout.shard_steps is not None
        shards_of: list[Any] = io
        rows, cs, ss = layout.rows, layout.chunk_steps, layout.shard_steps
        per = ss // cs
        first, last = old // ss, -(-new // ss)
        kept: list[dict[tuple[int, int], Any]] = [{} for _ in shards_of]
        prefix: list[dict[int, np.ndarray]] = [{} for _ in shards_of]
        if old % ss and tail is not None:
            kept, prefix = tail
        elif old % ss:
            for li, shards in enumerate(shards_of):
                got = shards.get_shard(first)
                if got is None:
                    continue
                index, data = got
                for r in range(rows):
                    for j in range(per):
                        c = first * per + j
                        off, n = int(index[r, j, 0]), int(index[r, j, 1])
                        if off == EMPTY or c * cs >= old:
                            continue
                        if (c + 1) * cs <= old:
                            kept[li][(r, j)] = bytes(data[off : off + n])
                        else:
                            prefix[li][r] = shards.decode(data[off : off + n])
        lock = threading.Lock()
        pending: dict[tuple[int, int], int] = {}
        encoded: dict[tuple[int, int], dict[tuple[int, int], Any]] = {}
        tasks = []
        for s in range(first, last):
            for li in range(len(shards_of)):
                pending[(li, s)] = rows
                encoded[(li, s)] = dict(kept[li]) if s == first else {}
                tasks.extend((li, s, r) for r in range(rows))
        # The complete chunks and the partial chunk of the last shard, if it is partial.
        next_kept: list[dict[tuple[int, int], Any]] = [
            dict(kept[li]) if last - 1 == first else {} for li in range(len(shards_of))
        ]
        next_prefix: list[dict[int, np.ndarray]] = [{} for _ in shards_of]

        def encode(task: tuple[int, int, int]) -> int:
            li, s, r = task
            shards: Shards = shards_of[li]
            row = host[li][r]
            mine = {}
            done = 0
            for c in range(max(s * per, old // cs), min((s + 1) * per, -(-new // cs))):
                x, a, b = _chunk(row, old, new, c, cs, shards, lambda: prefix[li].get(r))
                data = mine[(r, c - s * per)] = shards.encode(x)
                done += b - a
                if s == last - 1 and new % ss:  # what the next write starts from
                    if b < (c + 1) * cs:
                        next_prefix[li][r] = np.array(x)  # a copy: never the ring's
                    else:
                        next_kept[li][(r, c - s * per)] = bytes(data)
            with lock:
                encoded[(li, s)].update(mine)
                pending[(li, s)] -= 1
                complete = pending[(li, s)] == 0
            if complete:  # the last row of this shard encoded: write it
                shards.put_shard(s, encoded.pop((li, s)))
            return done

        self._run_writes(encode, tasks, (new - old) * rows * len(layout.leaves), host)
        self.next_tail = (new, (next_kept, next_prefix)) if new % ss else None

    def commit(self, commit: Commit) -> None:
        """Make `commit` the visible state: the root group's document replaced whole (one
        atomic object write), after everything it covers."""
        reader = self.reader
        meta = dict(reader.meta, committed=commit.as_json())
        if reader.io is None:  # zarr's own path (the reference)
            if self.group is None:
                self.group = zarr.open_group(reader.store, mode="r+", zarr_format=3)
            self.group.update_attributes({ATTR: meta})
            reader.advance(meta, commit)
            return
        root = self.objects.root
        if self.fsync and root is not None:
            # Everything the commit covers reaches the disk first: the objects, the arrays'
            # metadata documents included (each flushed as written, before its rename), then
            # their directory entries (the renames).
            for folder in self.objects.dirs:
                fsync_path(folder)
        # The group's document, read once by this writer (the only one: nothing else changes
        # it), replaced whole with the new commit.
        if self.group_record is None:
            self.group_record = read_json(reader.store, "zarr.json")
        record = self.group_record
        assert record is not None
        record.setdefault("attributes", {})[ATTR] = meta
        self.objects.put("zarr.json", [document(record)])
        if self.fsync and root is not None:
            fsync_path(root)
        reader.advance(meta, commit)
