"""`Archive`: a zarr v3 store that extends a buffer's time axis without bound. The class
assembles the pieces, one per concern: the format (`_format`), the store and its lock
(`_store`), the archive's own chunk and shard I/O (`_chunks`), reading (`_reader`), writing
(`_writer`) and sampling (`_sampler`). This module holds the class itself: opening, the
counters and the layout; its write methods are `_archive_writes.ArchiveWrites`, its read
and sampling methods `_archive_reads.ArchiveReads`, both inherited."""

import copy
import json
import os
from typing import Any, Literal

import numpy as np
from zarr.abc.store import Store

from ._archive_reads import ArchiveReads
from ._archive_writes import ArchiveWrites
from ._format import (
    ATTR,
    BufferLike,
    Compression,
    create,
    Layout,
    OnLost,
    schema_diff,
    schema_of,
    StepSchema,
    storage_of,
)
from ._reader import Progress, Reader
from ._store import clean_partial, location_of, Objects, open_store, read_json, WriterLock
from ._writer import Writer


def json_checked(where: str, metadata: Any) -> dict[str, Any]:
    """`metadata` as JSON keeps it (a dict of JSON values), or an error naming the value that
    is not."""
    if not isinstance(metadata, dict):
        raise TypeError(f"{where}: `metadata` must be a dict, got {type(metadata).__name__}.")
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{where}: `metadata` must hold JSON values only (str, int, float, bool, None, "
            f"lists and dicts with str keys): {error}."
        ) from None


class Archive(ArchiveWrites, ArchiveReads):
    """A zarr v3 archive of a buffer's experience that grows along time without bound: the
    on-disk (or object-storage) dataset for offline RL on more than fits in memory.

    Each leaf of the experience tree is stored as one array `(rows, time, *leaf)`; `write`
    appends exactly the steps added to a buffer since the last write, so a training loop
    calls it every so often (at least once every `max_length_time_axis` steps, or steps are lost,
                             which
    is never silent). Reads give NumPy arrays back (`eb.as_jax` makes them JAX arrays), fill
    a buffer, or sample random windows reading only the chunks they touch.

    **Arguments:**

    - `store`: where the archive lives: a local directory path (the default kind), a URL
        such as `"s3://bucket/run.zarr"` (through `obstore` if installed, else fsspec, which
        can only read: see `storage_options`), a `.zip` file (read-only), or any
        `zarr.abc.store.Store` (e.g. `zarr.storage.MemoryStore()`). A writer needs a store
        that creates an object with one conditional put (a local directory, memory, obstore):
        the one-writer lock relies on it, so another store (e.g. zarr's `FsspecStore`) is
        refused for writing.
    - `like`: a buffer (or its `RingStorage`) that fixes the schema: required to create an
        archive; when opening an existing one it is checked against the stored schema (an
        error names every differing leaf) and reads come back in its tree structure.
        Without it, reads return a dict keyed by leaf name.
    - `mode`: `"a"` opens for writing, creating the archive if needed, and takes the
        writer lock; `"r"` opens read-only (no lock; any number of readers).
    - `compression`: `"zstd"` (level 1, the default: the best ratio at a speed above the
        disk's, measured in `benchmarks/bench_archive.py`), `"lz4"` (blosc, faster, lower
        ratio) or `"none"`. Only used when creating.
    - `chunk_steps`: time steps per chunk (one row); by default about 128 KiB, in a power
        of two (small, for random windows; the chunks of a call are processed
        concurrently, so large reads and writes stay fast). Only used when creating.
    - `shard_steps`: time steps per shard: chunks are packed into zarr shards
        `(rows, shard_steps)`, one object each. None (the default) picks about 16 MiB
        of raw data per shard (a power of two times `chunk_steps`): few large objects
        for long reads and writes, while random windows read only the chunks they need.
        An int must be a multiple of `chunk_steps`; 0 stores each chunk as its own
        object (no shards). Only used when creating.
    - `on_lost`: what `write` does when the ring has overwritten steps never written:
        `"raise"` a `StepsLostError` (the default) or `"warn"`: write the steps still held,
        warn with a `StepsLostWarning` saying how many were lost, and record the gap.
    - `progress`: show a tqdm progress bar on long writes and reads.
    - `break_lock`: take the writer lock even if another writer holds it. A lock left by a
        killed process on this host is detected and broken automatically; use this for
        one left on another host, only once sure that writer is gone.
    - `fsync`: on a local directory, flush every object written to disk (`fsync`)
        before the commit that makes it visible, and the commit itself, so that a
        committed write also survives power loss or an OS crash, not only a killed
        process (see Durability below). Costs 3 to 5% of write throughput in the measured
        case; off by default.
    - `storage_options`: options of a URL's store. For `s3://` URLs, obstore's spelling
        (`endpoint`, `access_key_id`, `secret_access_key`, `session_token`, `region`,
        `skip_signature`, `request_payer`, `client_options={"allow_http": True}`, ...) or
        s3fs's (`endpoint_url`, `key`, `secret`, `token`, `anon`, `requester_pays`,
        `client_kwargs={"region_name": ...}`): either reaches the same store whether obstore
        is installed or not, and a setting the backend in use has no spelling for is an
        error that says what to do. Other URLs take their backend's own options.
    - `metadata`: a JSON-serialisable dict kept in the archive beside its data (the data
        set's name, the environment's spec, versions: what the imports `eb.from_minari`,
        `eb.from_d4rl` and `eb.from_vault` record); read back as `archive.metadata`. Only
        used when creating.

    Safety: the visible length advances only after the data it covers is written (a writer
    killed at any moment leaves the last committed state readable and writable); one writer
    at a time (a second one gets `ArchiveLockedError`), any number of readers, each reading a
    committed snapshot (`refresh()` moves it forward); committed steps are never rewritten.

    Durability: by default "crash" means the writing *process* dying (SIGKILL, an exception,
    out of memory): everything it wrote went to the operating system, which keeps it, and
    the archive opens at its last commit (tested by killing writers at random moments). A
    power loss or OS crash can lose what the page cache had not yet flushed, in any order:
    the commit may then cover chunks that never reached the disk. `fsync=True` (local
    directories) closes that gap: every object is flushed before it is renamed into place,
    then its directory and the arrays' metadata, and only then the commit, itself flushed.
    Its cost, measured in `benchmarks/README.md` (2^17 steps of `(32, 32, 3)` frames, 8
    rows, writes of 2048 steps): 3% of write throughput for uint8, 5% for float32 (one run
    on a loaded machine; small writes not measured). Object stores make a PUT durable when
    it returns, so there the ordering alone suffices.

    Cost of a write: a few small objects per call (the lock checked, each array's shape and
    then the commit rewritten: about 4 ms per call for small leaves on a local disk,
    measured), plus the data: every chunk the new steps touch is encoded, and every shard
    they touch is written whole. The last shard is usually partial, so each write also
    rewrites it (its committed chunks as stored, its partial chunk completed; the writer
    keeps both from its previous write, so only a reopened writer reads them back): a write
    of few steps costs about as much as rewriting up to a whole shard (`shard_steps` steps of
    every row, ~16 MiB raw by default). Measured (`benchmarks/README.md`, `(32, 32, 3)` uint8,
    8 rows, default shards of 512 steps): 8 ms per write of 1 step, 8.5 ms per write of 16
    steps (46 MB/s), 18 ms per write of 256 steps (340 MB/s), against 520 to 580 MB/s for
    writes of 2048 steps; 7 ms per write of 1 or 16 steps with `shard_steps=0` (one object
    per chunk). So write in blocks of hundreds of steps or more where you can (once every
    `max_length_time_axis` steps is the natural rhythm); for frequent small writes choose a small
    `shard_steps` (or `0`), whose rewrite is cheaper. `write_async` takes all of it but the
    copy of the new steps off the training loop (12 ms instead of 94 ms per write of 2048
    steps of 8 uint8 frames).

    This is host-side I/O: call it outside `jit`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp, tempfile

        buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(3)}, add_batch_size=2,
                                     max_length_time_axis=16,
                                     sequence_length=4)
        path = tempfile.mkdtemp() + "/run.zarr"
        with eb.Archive(path, buffer) as archive:
            for _ in range(5):
                buffer = buffer.add({"obs": jnp.ones((2, 10, 3))})
                archive.write(buffer)                    # the 10 new steps
            assert len(archive) == 50
            obs = archive.read(40, 50)["obs"]            # (2, 10, 3) NumPy array
            windows = archive.sample(jax.random.key(0), 32, sequence_length=4)
        reader = eb.Archive(path, mode="r")              # any number of readers
        assert repr(reader).startswith("Archive(") and "length=50" in repr(reader)
        ```
    """

    _progress_delay: float = 1.0  # seconds before a progress bar appears
    # The archive's own chunk and shard I/O where the layout allows (measured faster); False
    # reads and writes through zarr's own array API, the reference it is tested against.
    _direct_io: bool = True

    def __init__(
        self,
        store: str | os.PathLike | Store,
        like: BufferLike | StepSchema | None = None,
        *,
        mode: Literal["a", "r"] = "a",
        compression: Compression = "zstd",
        chunk_steps: int | None = None,
        shard_steps: int | None = None,
        on_lost: OnLost = "raise",
        progress: bool = True,
        break_lock: bool = False,
        fsync: bool = False,
        storage_options: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        where = "Archive()"
        if mode not in ("a", "r"):
            raise ValueError(f"{where}: `mode` must be 'a' (write) or 'r' (read), got {mode!r}.")
        if on_lost not in ("raise", "warn"):
            raise ValueError(f"{where}: `on_lost` must be 'raise' or 'warn', got {on_lost!r}.")
        read_only = mode == "r"
        self._writer: Writer | None = None
        self._store = open_store(store, storage_options, read_only)
        self._location = location_of(store)
        self._objects = objects = Objects(self._store, bool(fsync))
        if like is None or isinstance(like, StepSchema):
            storage = like
        else:
            storage = storage_of(like, where)
        record = read_json(self._store, "zarr.json")
        meta = None if record is None else record.get("attributes", {}).get(ATTR)
        if meta is None and (read_only or storage is None):
            what = "no archive" if record is None else "a zarr group that is not an archive"
            hint = "" if read_only else " (pass a buffer as `like` to create one)"
            raise FileNotFoundError(f"{where}: there is {what} at {self._location}{hint}.")
        lock = None
        if not read_only:
            lock = WriterLock(objects, self._location, break_lock)
            record = read_json(self._store, "zarr.json")
            meta = None if record is None else record.get("attributes", {}).get(ATTR)
        try:
            if meta is None:
                assert storage is not None
                if metadata is not None:
                    metadata = json_checked(where, metadata)
                meta = create(self._store, storage, compression, chunk_steps, shard_steps, metadata)
            elif lock is not None:
                clean_partial(self._store)
            layout = Layout.from_meta(meta, self._location)
            treedef = None
            if storage is not None:
                leaves, treedef = schema_of(storage)
                diff = schema_diff(list(layout.leaves), layout.rows, leaves, storage.rows)
                if diff:
                    raise ValueError(
                        f"{where}: the buffer does not match the archive at {self._location}: "
                        + "; ".join(diff)
                        + "."
                    )
            self._reader = Reader(
                self._store,
                objects,
                layout,
                meta,
                treedef,
                self._location,
                Progress(bool(progress), self._progress_delay),
                writable=not read_only,
                direct=self._direct_io,
            )
            if lock is not None:
                self._writer = Writer(self._reader, lock, bool(fsync), on_lost)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    def __repr__(self) -> str:
        layout = self._reader.layout
        leaves = ", ".join(f"{leaf.path}: {leaf.dtype}{list(leaf.shape)}" for leaf in layout.leaves)
        mode = "r" if self.read_only else "a"
        return (
            f"Archive({self._location}, mode={mode!r}, length={len(self)}, rows={layout.rows}, "
            f"leaves={{{leaves}}})"
        )

    # ------------------------------------------------------------------------- opening

    def refresh(self) -> int:
        """Move this reader's snapshot to the newest committed state; returns the length.
        (A writer's own state is always the newest; for one, this first waits for its
        background writes, as `flush` does.)

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=16)
            path = tempfile.mkdtemp() + "/run.zarr"
            with eb.Archive(path, buffer) as writer:
                reader = eb.Archive(path, mode="r")
                writer.write(buffer.add({"x": jnp.arange(4.0)[None]}))
                assert len(reader) == 0  # its snapshot is from before the write
                assert reader.refresh() == 4 and len(reader) == 4
            ```
        """
        if self._writer is not None:
            self._writer.flush()
        return self._reader.refresh()

    def close(self) -> None:
        """Finish the background writes (raising the error of one that failed), then release
        the writer lock (also done at exit); reads still work afterwards.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=16)
            path = tempfile.mkdtemp() + "/run.zarr"
            archive = eb.Archive(path, buffer)
            archive.write(buffer.add({"x": jnp.arange(4.0)[None]}))
            archive.close()  # another writer may open it now
            assert archive.read()["x"].tolist() == [[0.0, 1.0, 2.0, 3.0]]
            with eb.Archive(path, buffer) as again:
                assert len(again) == 4
            ```
        """
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ counters

    def __len__(self) -> int:
        """The number of committed time steps (per row) in this snapshot."""
        return self._reader.commit.length

    @property
    def source_steps(self) -> int:
        """The source buffer's count of steps added that this archive has accounted for
        (written or lost): the next `write` starts there.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
            with eb.Archive(zarr.storage.MemoryStore(), buffer, on_lost="warn") as archive:
                archive.write(buffer.add({"x": jnp.arange(3.0)[None]}))
                assert archive.source_steps == len(archive) == 3
            ```
        """
        return self._reader.commit.source_steps

    @property
    def steps_lost(self) -> int:
        """How many of the source's steps were overwritten before being written.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, warnings, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
            with eb.Archive(zarr.storage.MemoryStore(), buffer, on_lost="warn") as archive:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the StepsLostWarning
                    archive.write(buffer.add({"x": jnp.arange(6.0)[None]}))  # 2 overwritten
                assert archive.steps_lost == 2 and len(archive) == 4
            ```
        """
        c = self._reader.commit
        return c.source_steps - c.length

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Archive index ranges `[start, stop)` contiguous in the source (one unless steps
        were lost with `on_lost="warn"`).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8)
            with eb.Archive(zarr.storage.MemoryStore(), buffer) as archive:
                assert archive.segments == []
                archive.write(buffer.add({"x": jnp.arange(5.0)[None]}))
                assert archive.segments == [(0, 5)]
            ```
        """
        return self._reader.commit.segments()

    def source_step(self, index: int | np.integer) -> int:
        """The source buffer's absolute step stored at archive time index `index`.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile, warnings

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer, on_lost="warn") as archive:
                buffer = buffer.add({"x": jnp.arange(4.0)[None]})
                archive.write(buffer)  # source steps 0 to 3
                buffer = buffer.add({"x": jnp.arange(4.0, 10.0)[None]})  # 4 and 5 overwritten
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the StepsLostWarning
                    archive.write(buffer)  # source steps 6 to 9
                assert [archive.source_step(i) for i in (3, 4, 7)] == [3, 6, 9]
                assert archive.segments == [(0, 4), (4, 8)]
            ```
        """
        index = int(index)
        self._reader.check_range("source_step()", index, index + 1)
        return self._reader.commit.source_step(index)

    # -------------------------------------------------------------------------- layout

    @property
    def read_only(self) -> bool:
        """Whether this archive was opened with `mode="r"`.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
            store = zarr.storage.MemoryStore()
            with eb.Archive(store, buffer) as writer:
                assert not writer.read_only and eb.Archive(store, mode="r").read_only
            ```
        """
        return self._writer is None

    @property
    def rows(self) -> int:
        """The number of rows (the buffer's `add_batch_size`).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=3, capacity=12)
            assert eb.Archive(zarr.storage.MemoryStore(), buffer).rows == 3
            ```
        """
        return self._reader.layout.rows

    @property
    def chunk_steps(self) -> int:
        """Time steps per chunk (of one row).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.zeros(1024)}, add_batch_size=1, capacity=4)
            archive = eb.Archive(zarr.storage.MemoryStore(), buffer)
            assert archive.chunk_steps == 32  # 4 KiB per step: 128 KiB chunks
            ```
        """
        return self._reader.layout.chunk_steps

    @property
    def shard_steps(self) -> int | None:
        """Time steps per shard (of every row), or None for one object per chunk.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.zeros(1024)}, add_batch_size=1, capacity=4)
            store = zarr.storage.MemoryStore()
            assert eb.Archive(store, buffer, chunk_steps=8, shard_steps=64).shard_steps == 64
            assert eb.Archive(zarr.storage.MemoryStore(), buffer, shard_steps=0).shard_steps is None
            ```
        """
        return self._reader.layout.shard_steps

    @property
    def block_steps(self) -> int:
        """Time steps per block of a long read or of `iter` (about 32 MiB, whole shards).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.zeros(1024)}, add_batch_size=1, capacity=4)
            archive = eb.Archive(zarr.storage.MemoryStore(), buffer)
            assert archive.block_steps * 4096 == 32 << 20
            ```
        """
        return self._reader.layout.block_steps

    @property
    def compression(self) -> str:
        """The compression the archive was created with (`"zstd"`, `"lz4"` or `"none"`).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
            archive = eb.Archive(zarr.storage.MemoryStore(), buffer, compression="lz4")
            assert archive.compression == "lz4"
            ```
        """
        return self._reader.layout.compression

    @property
    def progress(self) -> bool:
        """Whether long reads and writes show a progress bar (may be changed).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
            archive = eb.Archive(zarr.storage.MemoryStore(), buffer)
            archive.progress = False
            assert not archive.progress
            ```
        """
        return self._reader.progress.show

    @progress.setter
    def progress(self, show: bool) -> None:
        self._reader.progress.show = bool(show)

    @property
    def metadata(self) -> dict[str, Any]:
        """The metadata the archive was created with (`metadata=`; an empty dict if none):
        for an imported data set, its name, environment spec and versions.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
            store = zarr.storage.MemoryStore()
            archive = eb.Archive(store, buffer, metadata={"env": "Pendulum-v1"})
            assert archive.metadata == {"env": "Pendulum-v1"}
            ```
        """
        return copy.deepcopy(self._reader.meta.get("metadata", {}))

    def nbytes(self) -> tuple[int, int]:
        """`(raw, stored)`: the bytes of the committed data and the bytes the store holds.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.ItemBuffer({"obs": jnp.zeros(64, jnp.uint8)}, add_batch_size=2,
                                   capacity=2048)
            buffer = buffer.add({"obs": jnp.zeros((2, 1024, 64), jnp.uint8)})
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                archive.write(buffer)
                raw, stored = archive.nbytes()
            assert raw == 2 * 1024 * 64  # rows * steps * bytes per step
            assert 0 < stored < raw  # zeros compress well
            ```
        """
        return self._reader.nbytes()

    def compression_ratio(self) -> float:
        """Raw bytes over stored bytes of the committed data.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.ItemBuffer({"obs": jnp.zeros(64, jnp.uint8)}, add_batch_size=2,
                                   capacity=2048)
            buffer = buffer.add({"obs": jnp.zeros((2, 1024, 64), jnp.uint8)})
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                archive.write(buffer)
                raw, stored = archive.nbytes()
                assert archive.compression_ratio() == raw / stored > 10
            ```
        """
        raw, stored = self.nbytes()
        return raw / stored if stored else float("nan")
