"""Archive: a zarr v3 group that extends a buffer's time axis without bound.

Layout (plain zarr v3, readable by any zarr tool or xarray):

- one array per leaf of the experience tree, shaped `(rows, time, *leaf)`, chunked
  `(1, chunk_steps, *leaf)` inside shards `(rows, shard_steps, *leaf)` (zarr's sharding codec:
  one object per shard holding its chunks and an index of them; or, with `shard_steps=0`,
  one object per chunk), with `dimension_names` `("row", "time", ...)`;
- the root group's attribute `"equibuffer"`: the format version, the schema (leaf paths, shapes,
  dtypes) and the *committed* state (how many time steps are visible, and which steps of the
  source buffer they are). It is rewritten only after every chunk it covers has been written,
  and readers never look past it, so a writer killed at any moment leaves the last committed
  state readable;
- while a writer holds the archive, a small group `_writer_lock` whose attributes name it.

Every key is replaced atomically (a local directory writes a temporary file and renames it;
an object store replaces whole objects), which is what makes the ordering above crash-safe.

Speed: this module reads and writes the chunks and shards itself, the same bytes zarr's codecs
write (`bytes`, then zstd or blosc, in zarr's shard format), on a thread pool: the codecs and
file I/O release the GIL. A long write or read moves whole shards (few, large objects: the
per-object cost of creating files dominated with one object per ~100 KiB chunk); random
windows read a shard's index and only the chunks they touch. The codecs are taken from each
array's zarr metadata, so archives written with other codecs or with the earlier default of
one object per chunk read the same way.
"""

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import re
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import zarr
import zarr.codecs
import zarr.storage
from jaxtyping import Array, PyTree, Shaped
from tqdm.auto import tqdm
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from ._checks import check_positive_int, keystr
from ._ring import RingStorage


FORMAT_VERSION = 1
_ATTR = "equibuffer"
_LOCK_KEY = "_writer_lock/zarr.json"
_TWO_32 = 1 << 32
_INT64_MAX = (1 << 63) - 1
_CHUNK_BYTES = 1 << 17  # target uncompressed bytes of one chunk (one row)
_SHARD_BYTES = 16 << 20  # target uncompressed bytes of one shard (all rows)
_BLOCK_BYTES = 32 << 20  # target uncompressed bytes of one read block (all rows)
_INLINE_BYTES = 1 << 20  # writes smaller than this run in the calling thread
_MAX_PENDING = 2  # background writes (write_async) waiting at most: one running, one queued
_THREADS = max(4, 2 * (os.cpu_count() or 1))
_MAX_CHUNK_STEPS = 1 << 14

Compression = Literal["zstd", "lz4", "none"]
OnLost = Literal["raise", "warn"]


class ArchiveLockedError(RuntimeError):
    """Raised when a second writer opens an archive that a writer already holds.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp, tempfile

        buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1, max_length=4,
                                     sequence_length=1)
        path = tempfile.mkdtemp() + "/run.zarr"
        with eb.Archive(path, buffer):
            try:
                eb.Archive(path, buffer)  # a second writer
                locked = False
            except eb.ArchiveLockedError:
                locked = True
            assert locked
            assert len(eb.Archive(path, mode="r")) == 0  # readers are always welcome
        ```
    """


class StepsLostError(RuntimeError):
    """Raised by `Archive.write` when the ring overwrote steps that were never written.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp, tempfile

        buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1, max_length=4,
                                     sequence_length=1)
        with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
            buffer = buffer.add({"x": jnp.arange(6.0)[None]})  # 6 steps into a ring of 4
            try:
                archive.write(buffer)
                lost = False
            except eb.StepsLostError as error:
                lost = "2 of the 6 steps" in str(error)
            assert lost and len(archive) == 0  # nothing was written
        ```
    """


class StepsLostWarning(UserWarning):
    """Warned by `Archive.write(..., on_lost="warn")` with the number of steps lost.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp, tempfile, warnings

        buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1, max_length=4,
                                     sequence_length=1)
        with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
            buffer = buffer.add({"x": jnp.arange(6.0)[None]})  # 6 steps into a ring of 4
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert archive.write(buffer, on_lost="warn") == 4  # the 4 steps still held
            assert [w.category for w in caught] == [eb.StepsLostWarning]
            assert archive.steps_lost == 2 and archive.source_step(0) == 2
        ```
    """


class ArchiveSample(NamedTuple):
    """Windows sampled from an archive: `experience` leaves `(batch, sequence_length, *leaf)`
    (NumPy), and for each window its `row` and the archive time index `start` of its first
    step.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp, zarr

        buffer = eb.TrajectoryBuffer({"t": jnp.float32(0)}, add_batch_size=2, max_length=16,
                                     sequence_length=1)
        buffer = buffer.add({"t": jnp.tile(jnp.arange(16.0), (2, 1))})  # step t holds t
        with eb.Archive(zarr.storage.MemoryStore(), buffer) as archive:
            archive.write(buffer)
            sample = archive.sample(0, batch_size=8, sequence_length=3)
        assert isinstance(sample, eb.ArchiveSample)
        assert sample.experience["t"].shape == (8, 3) and sample.rows.shape == (8,)
        assert (sample.experience["t"][:, 0] == sample.starts).all()
        ```
    """

    experience: PyTree[np.ndarray]
    rows: np.ndarray
    starts: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: str  # keystr of the leaf path, e.g. "['obs']"
    name: str  # zarr array name
    shape: tuple[int, ...]
    dtype: str  # dtype of the leaf as the buffer holds it
    stored: str  # dtype zarr stores (a same-size unsigned int for dtypes zarr lacks)

    def as_json(self) -> dict:
        return {
            "path": self.path,
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "stored_dtype": self.stored,
        }


@dataclasses.dataclass(frozen=True)
class _Commit:
    """What is visible: `length` time steps, holding source steps `first_step, ...` with the
    runs of lost steps given by `gaps` (`[archive index, steps lost before it]`)."""

    length: int = 0
    source_steps: int = 0
    first_step: int = 0
    gaps: tuple[tuple[int, int], ...] = ()

    def as_json(self) -> dict:
        return {
            "length": self.length,
            "source_steps": self.source_steps,
            "first_step": self.first_step,
            "gaps": [list(g) for g in self.gaps],
        }

    @classmethod
    def from_json(cls, d: dict) -> "_Commit":
        return cls(
            int(d["length"]),
            int(d["source_steps"]),
            int(d["first_step"]),
            tuple((int(a), int(b)) for a, b in d["gaps"]),
        )

    def segments(self) -> list[tuple[int, int]]:
        """Archive index ranges `[a, b)` of steps contiguous in the source."""
        cuts = [0, *(at for at, _ in self.gaps if 0 < at < self.length), self.length]
        return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]

    def source_step(self, index: int) -> int:
        """The source buffer's absolute step held at archive time index `index`."""
        return self.first_step + index + sum(lost for at, lost in self.gaps if at <= index)


class _Plan(NamedTuple):
    """A write worked out but not yet done: the new steps per leaf `(rows, keep, *leaf)`,
    the committed length it appends to, and the commit it ends with."""

    host: list[np.ndarray]
    base: int
    keep: int
    commit: _Commit


def _stored_dtype(dtype: np.dtype) -> np.dtype:
    """zarr stores the standard NumPy dtypes; others (bfloat16, float8, int4 from ml_dtypes)
    are stored bit for bit as an unsigned int of the same size."""
    if dtype.kind in "biufc" and dtype.isnative or dtype.kind == "b":
        return dtype
    return np.dtype(f"uint{8 * dtype.itemsize}")


def _name_of(path: Sequence[Any]) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    name = re.sub(r"[^A-Za-z0-9_.\-]", "_", ".".join(parts)) or "data"
    return "x" + name if name.startswith(("_", ".")) else name


def _schema_of(storage: RingStorage) -> tuple[list[_Leaf], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(storage.data)
    leaves, used = [], set()
    for path, x in flat:
        name = base = _name_of(path)
        i = 1
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        dtype = np.dtype(x.dtype)
        leaves.append(
            _Leaf(keystr(path), name, tuple(x.shape[2:]), dtype.name, _stored_dtype(dtype).name)
        )
    return leaves, treedef


def _schema_diff(stored: list[_Leaf], rows: int, new: list[_Leaf], new_rows: int) -> list[str]:
    old = {leaf.path: leaf for leaf in stored}
    got = {leaf.path: leaf for leaf in new}
    out = []
    if rows != new_rows:
        out.append(f"rows: the archive has {rows}, the buffer has add_batch_size={new_rows}")
    missing = [p for p in old if p not in got]
    extra = [p for p in got if p not in old]
    if missing:
        out.append("leaves in the archive but not in the buffer: " + ", ".join(missing))
    if extra:
        out.append("leaves in the buffer but not in the archive: " + ", ".join(extra))
    for p in old:
        if p in got:
            a, b = old[p], got[p]
            if a.shape != b.shape:
                out.append(f"leaf {p}: shape {a.shape} in the archive, {b.shape} in the buffer")
            if a.dtype != b.dtype:
                out.append(f"leaf {p}: dtype {a.dtype} in the archive, {b.dtype} in the buffer")
    return out


def _storage_of(like: Any, where: str) -> RingStorage:
    storage = getattr(like, "storage", like)
    if not isinstance(storage, RingStorage):
        raise TypeError(
            f"{where}: expected a buffer (e.g. eb.TrajectoryBuffer) or an eb.RingStorage, got "
            f"{type(like).__name__}."
        )
    return storage


def ring_holding(storage: RingStorage, data: Sequence[np.ndarray], total: int) -> RingStorage:
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
    return eqx.tree_at(
        lambda s: (s.data, s.head, s.fill, s.count_lo, s.count_hi),
        storage,
        (
            jax.tree.unflatten(treedef, new),
            jnp.array(head, jnp.int32),
            jnp.array(k, jnp.int32),
            jnp.array(total % _TWO_32, jnp.uint32),
            jnp.array(total // _TWO_32, jnp.uint32),
        ),
    )


def _open_store(store: Any, storage_options: dict | None, read_only: bool) -> Store:
    if isinstance(store, Store):
        if read_only and not store.read_only:
            return store.with_read_only(True)
        return store
    if not isinstance(store, str | os.PathLike):
        raise TypeError(
            f"Archive(): `store` must be a path, a URL or a zarr store, got {type(store).__name__}."
        )
    s = os.fspath(store)
    if "://" in s and not s.startswith("file://"):
        options = dict(storage_options or {})
        try:
            from obstore.store import from_url
        except ImportError:
            return zarr.storage.FsspecStore.from_url(
                s, storage_options=options, read_only=read_only
            )
        return zarr.storage.ObjectStore(from_url(s, **options), read_only=read_only)
    s = s.removeprefix("file://")
    if s.endswith(".zip"):
        if not read_only:
            raise ValueError(
                f"Archive(): {s!r} is a zip file, which can only be opened with mode='r' "
                "(a zip cannot replace entries atomically): write to a directory, then zip it."
            )
        return sync(zarr.storage.ZipStore.open(s, mode="r"))
    return zarr.storage.LocalStore(s, read_only=read_only)


def _get_json(store: Store, key: str) -> dict | None:
    buf = sync(store.get(key, prototype=default_buffer_prototype()))
    return None if buf is None else json.loads(buf.to_bytes())


def _put_json(store: Store, key: str, value: dict, *, exclusive: bool = False) -> None:
    buf = default_buffer_prototype().buffer.from_bytes(json.dumps(value).encode())
    sync(store.set_if_not_exists(key, buf) if exclusive else store.set(key, buf))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _release(store: Store, token: str) -> None:
    with contextlib.suppress(Exception):
        held = _get_json(store, _LOCK_KEY)
        if held is not None and held["attributes"][_ATTR + "_lock"]["token"] == token:
            sync(store.delete(_LOCK_KEY))
            if isinstance(store, zarr.storage.LocalStore):  # no empty directory left behind
                (store.root / _LOCK_KEY).parent.rmdir()


def _codecs(compression: str) -> Any:
    if compression == "zstd":
        return zarr.codecs.ZstdCodec(level=1)
    if compression == "lz4":
        return zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    if compression == "none":
        return None
    raise ValueError(
        f"Archive(): `compression` must be 'zstd', 'lz4' or 'none', got {compression!r}."
    )


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(np.floor(np.log2(max(x, 1.0)))))


def _separator(array: Any) -> str:
    encoding = getattr(array.metadata, "chunk_key_encoding", None)
    return getattr(encoding, "separator", "/")


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_TMP_PREFIX = uuid.uuid4().hex[:12]  # temporary file names: unique to this process
_TMP_COUNT = itertools.count()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for chunk I/O: the codecs release the GIL, and so does file I/O."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(_THREADS, "equibuffer-archive")
    return _POOL


def _numcodec(codec: Any) -> Any:
    """The numcodecs twin of a zarr v3 compressor (same bytes), None for no compressor, or
    `False` for one this module does not handle directly (zarr's own path is used then)."""
    import numcodecs

    if codec is None:
        return None
    if isinstance(codec, zarr.codecs.ZstdCodec):
        return numcodecs.Zstd(level=codec.level, checksum=codec.checksum)
    if isinstance(codec, zarr.codecs.BloscCodec):
        shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[
            str(getattr(codec.shuffle, "value", codec.shuffle))
        ]
        return numcodecs.Blosc(
            cname=str(getattr(codec.cname, "value", codec.cname)),
            clevel=codec.clevel,
            shuffle=shuffle,
            blocksize=codec.blocksize,
        )
    return False


def _direct_codecs(array: Any) -> tuple[Any, Any] | None:
    """`(compressor, sharding)` when this module can read and write `array`'s chunks
    directly: the `bytes` codec (little endian) then at most one zstd/blosc compressor,
    either unsharded or in zarr's default shard layout (index at the end: `(offset, nbytes)`
    uint64 pairs in C order over the shard's chunks, then its crc32c). None otherwise."""
    codecs = list(array.metadata.codecs)
    sharding = None
    if len(codecs) == 1 and isinstance(codecs[0], zarr.codecs.ShardingCodec):
        sharding = codecs[0]
        index = list(sharding.index_codecs)
        location = str(getattr(sharding.index_location, "value", sharding.index_location))
        if (
            location != "end"
            or len(index) != 2
            or not isinstance(index[0], zarr.codecs.BytesCodec)
            or not isinstance(index[1], zarr.codecs.Crc32cCodec)
        ):
            return None
        codecs = list(sharding.codecs)
    if not codecs or not isinstance(codecs[0], zarr.codecs.BytesCodec) or len(codecs) > 2:
        return None
    endian = getattr(codecs[0].endian, "value", codecs[0].endian)
    if endian not in (None, "little"):
        return None
    compressor = _numcodec(codecs[1] if len(codecs) == 2 else None)
    return None if compressor is False else (compressor, sharding)


class _Objects:
    """Whole-object and byte-range I/O on a store: plain files for a local directory (each
    object replaced atomically: a temporary file renamed over it; with `fsync`, flushed to
    disk first), the store's own calls otherwise."""

    def __init__(self, store: Store, fsync: bool):
        self.store = store
        self.root = str(store.root) if isinstance(store, zarr.storage.LocalStore) else None
        self.fsync = fsync and self.root is not None
        self.dirs: set[str] = set()  # directories known to exist

    def get(self, key: str) -> bytes | None:
        if self.root is not None:
            try:
                with open(os.path.join(self.root, key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        buf = sync(self.store.get(key, prototype=default_buffer_prototype()))
        return None if buf is None else buf.to_bytes()

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """The bytes `[a, b)` of each range (`a < 0`: the last `-a` bytes) of an object on a
        store, by concurrent ranged GETs (only for objects never replaced while read), or
        None if it does not exist."""
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest

        proto = default_buffer_prototype()

        async def fetch() -> list:
            return await asyncio.gather(
                *(
                    self.store.get(
                        key, proto, SuffixByteRequest(-a) if a < 0 else RangeByteRequest(a, b)
                    )
                    for a, b in ranges
                )
            )

        got = sync(fetch())
        return None if any(g is None for g in got) else [g.to_bytes() for g in got]

    def put(self, key: str, parts: Sequence[Any]) -> None:
        """Replace the object `key` by the concatenation of `parts` (bytes-like)."""
        if self.root is None:
            data = b"".join(parts)
            sync(self.store.set(key, default_buffer_prototype().buffer.from_bytes(data)))
            return
        path = os.path.join(self.root, key)
        folder = os.path.dirname(path)
        if folder not in self.dirs:
            os.makedirs(folder, exist_ok=True)
            self.dirs.add(folder)
        tmp = f"{path}.{_TMP_PREFIX}{next(_TMP_COUNT)}.partial"
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Replace several objects, each as `put` does (concurrently on a store)."""
        if self.root is not None:
            for key, data in items:
                self.put(key, [data])
            return
        proto = default_buffer_prototype()

        async def put_all() -> None:
            await asyncio.gather(
                *(self.store.set(key, proto.buffer.from_bytes(data)) for key, data in items)
            )

        sync(put_all())


def _fsync_path(path: str) -> None:
    """Flush a file's data, or a directory's entries (renames), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Chunks:
    """Direct I/O of the chunks of one unsharded leaf array, byte for byte what zarr writes and
    reads: key `name/c.row.chunk.0...` (or with the array's own separator), the `bytes` codec
    (little endian), then the compressor; every chunk full-sized (the tail chunk padded with
    the fill value 0)."""

    def __init__(
        self, objects: _Objects, leaf: _Leaf, chunk_steps: int, codec: Any, separator: str
    ):
        self.objects = objects
        self.name = leaf.name
        self.shape = (chunk_steps, *leaf.shape)
        self.dtype = np.dtype(leaf.stored).newbyteorder("<")
        self.sep = separator
        self.tail = f"{separator}0" * len(leaf.shape)
        self.codec = codec

    def key(self, row: int, chunk: int) -> str:
        sep = self.sep
        return f"{self.name}/c{sep}{row}{sep}{chunk}{self.tail}"

    def decode(self, data: Any, out: np.ndarray | None = None) -> np.ndarray:
        """One encoded chunk decoded (read-only; or straight into `out`, a C-contiguous array
        of the chunk's shape and dtype)."""
        if out is not None and self.codec is not None:
            self.codec.decode(data, out=out)
            return out
        if self.codec is not None:
            data = self.codec.decode(data)
        x = np.frombuffer(data, self.dtype).reshape(self.shape)
        if out is not None:
            out[...] = x
            return out
        return x

    def decode_into(self, data: Any, dst: np.ndarray, lo: int = 0) -> None:
        """Decode one encoded chunk (None: never written, zarr's fill value 0) into `dst`,
        which receives the chunk's steps `[lo, lo + len(dst))`: in place when `dst` is the
        whole chunk (C-contiguous)."""
        if data is None:
            dst[...] = 0
        elif dst.shape[0] == self.shape[0]:
            self.decode(data, dst)
        else:
            dst[...] = self.decode(data)[lo : lo + dst.shape[0]]

    def encode(self, x: np.ndarray) -> Any:
        x = np.ascontiguousarray(x, self.dtype)
        return memoryview(x).cast("B") if self.codec is None else self.codec.encode(x)

    def data(self, row: int, chunk: int) -> Any:
        """The encoded chunk, or None if it was never written."""
        return self.objects.get(self.key(row, chunk))

    def get(self, row: int, chunk: int) -> np.ndarray | None:
        """The decoded chunk (read-only), or None if it was never written."""
        data = self.data(row, chunk)
        return None if data is None else self.decode(data)

    def put(self, row: int, chunk: int, x: np.ndarray) -> None:
        """Replace one chunk atomically (a temporary file renamed over it, or one PUT)."""
        self.objects.put(self.key(row, chunk), [self.encode(x)])


_EMPTY = (1 << 64) - 1  # the shard index's mark of a chunk that is not stored


class _Shards(_Chunks):
    """Direct I/O of one leaf array stored in shards `(rows, shard_steps, *leaf)` of chunks
    `(1, chunk_steps, *leaf)`, byte for byte zarr's sharding codec: the shard object
    `name/c.0.shard.0...` holds the encoded chunks back to back, then the index (an
    `(offset, nbytes)` pair of little-endian uint64 per chunk, C order over `(row, chunk)`,
    `2**64 - 1` twice for a chunk not stored) and the crc32c of the index.

    A long read or write moves whole shards (few, large objects); random windows read the
    index and only the chunks they need (the index of a complete shard is cached: such a
    shard is never rewritten)."""

    def __init__(
        self,
        objects: _Objects,
        leaf: _Leaf,
        rows: int,
        chunk_steps: int,
        shard_steps: int,
        codec: Any,
        separator: str,
    ):
        super().__init__(objects, leaf, chunk_steps, codec, separator)
        self.rows = rows
        self.per_shard = shard_steps // chunk_steps  # chunks per row in a shard
        self.index_bytes = 16 * rows * self.per_shard + 4
        self.indexes: dict[int, np.ndarray] = {}  # complete shards' indexes

    def shard_key(self, shard: int) -> str:
        return self.key(0, shard)

    def parse_index(self, shard: int, raw: bytes) -> np.ndarray:
        """`(rows, per_shard, 2)` offsets and sizes, checked against the crc32c."""
        import google_crc32c

        body, crc = raw[:-4], raw[-4:]
        if google_crc32c.value(body) != int.from_bytes(crc, "little"):
            raise OSError(
                f"Archive: the index of shard {self.shard_key(shard)!r} fails its checksum: "
                "the object is corrupt."
            )
        return np.frombuffer(body, "<u8").reshape(self.rows, self.per_shard, 2)

    def get_shard(self, shard: int) -> tuple[np.ndarray, bytes] | None:
        """`(index, the whole object)`, or None if the shard was never written."""
        data = self.objects.get(self.shard_key(shard))
        if data is None:
            return None
        return self.parse_index(shard, data[-self.index_bytes :]), data

    def get_chunks(
        self, shard: int, which: Sequence[tuple[int, int]], complete: bool
    ) -> list[bytes | None]:
        """The encoded chunks `(row, chunk in the shard)` of `which` (None: not stored),
        reading only the index (unless cached) and those bytes, from one version of the
        shard: one open file; on a store, where ranged reads are separate requests, ranged
        GETs only for a `complete` shard (never replaced), else one GET of it whole."""
        key = self.shard_key(shard)
        none: list[bytes | None] = [None] * len(which)
        index = self.indexes.get(shard)
        if self.objects.root is not None:
            try:
                fd = os.open(os.path.join(self.objects.root, key), os.O_RDONLY)
            except FileNotFoundError:
                return none
            try:
                if index is None:
                    size = os.fstat(fd).st_size
                    raw = os.pread(fd, self.index_bytes, size - self.index_bytes)
                    index = self.parse_index(shard, raw)
                spans = [(int(index[r, j, 0]), int(index[r, j, 1])) for r, j in which]
                out = [None if o == _EMPTY else os.pread(fd, n, o) for o, n in spans]
            finally:
                os.close(fd)
        elif complete:
            if index is None:
                got = self.objects.get_ranges(key, [(-self.index_bytes, 0)])
                if got is None:
                    return none
                index = self.parse_index(shard, got[0])
            spans = [(int(index[r, j, 0]), int(index[r, j, 1])) for r, j in which]
            got = self.objects.get_ranges(key, [(o, o + n) for o, n in spans if o != _EMPTY])
            if got is None:
                return none
            data = iter(got)
            out = [None if o == _EMPTY else next(data) for o, _ in spans]
        else:
            whole = self.get_shard(shard)
            if whole is None:
                return none
            index, blob = whole
            spans = [(int(index[r, j, 0]), int(index[r, j, 1])) for r, j in which]
            out = [None if o == _EMPTY else blob[o : o + n] for o, n in spans]
        if complete:
            self.indexes[shard] = index
        return out

    def put_shard(self, shard: int, chunks: dict[tuple[int, int], Any]) -> None:
        """Replace one shard atomically by the encoded `chunks` keyed `(row, chunk)`."""
        index = np.full((self.rows, self.per_shard, 2), _EMPTY, "<u8")
        parts, offset = [], 0
        for (r, j), data in sorted(chunks.items()):
            n = memoryview(data).nbytes
            index[r, j] = offset, n
            parts.append(data)
            offset += n
        import google_crc32c

        body = index.tobytes()
        parts.append(body + google_crc32c.value(body).to_bytes(4, "little"))
        self.objects.put(self.shard_key(shard), parts)


class Archive:
    """A zarr v3 archive of a buffer's experience that grows along time without bound: the
    on-disk (or object-storage) dataset for offline RL on more than fits in memory.

    Each leaf of the experience tree is stored as one array `(rows, time, *leaf)`; `write`
    appends exactly the steps added to a buffer since the last write, so a training loop
    calls it every so often (at least once every `max_length` steps, or steps are lost, which
    is never silent). Reads give NumPy arrays back, fill a buffer, or sample random windows
    reading only the chunks they touch.

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
    then the commit rewritten, without a round trip through zarr's event loop on a local
    directory: about 4 ms per call for small leaves on a local disk, measured), plus the
    data: every chunk the new steps touch is encoded, and every shard they touch is written
    whole. The last shard is usually partial, so each write also rewrites it (its committed
    chunks as stored, its partial chunk completed; the writer keeps both from its previous
    write, so only a reopened writer reads them back): a write of few steps costs about as
    much as rewriting up to a whole shard (`shard_steps` steps of every row, ~16 MiB raw by
    default). Measured (`benchmarks/README.md`, `(32, 32, 3)` uint8, 8 rows, default shards
    of 512 steps): 8 ms per write of 1 step, 8.5 ms per write of 16 steps (46 MB/s), 18 ms
    per write of 256 steps (340 MB/s), against 520 to 580 MB/s for writes of 2048 steps; 7
    ms per write of 1 or 16 steps with `shard_steps=0` (one object per chunk). So write in
    blocks of hundreds of steps or more where you can (once every `max_length` steps is the
    natural rhythm); for frequent small writes choose a small `shard_steps` (or `0`), whose
    rewrite is cheaper. `write_async` takes all of it but the copy of the new steps off the
    training loop (12 ms instead of 94 ms per write of 2048 steps of 8 uint8 frames).

    This is host-side I/O: call it outside `jit`.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp, numpy as np, tempfile

        buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(3)}, add_batch_size=2, max_length=16,
                                     sequence_length=4)
        path = tempfile.mkdtemp() + "/run.zarr"
        with eb.Archive(path, buffer) as archive:
            for _ in range(5):
                buffer = buffer.add({"obs": jnp.ones((2, 10, 3))})
                archive.write(buffer)                    # the 10 new steps
            assert len(archive) == 50
            obs = archive.read(40, 50)["obs"]            # (2, 10, 3) NumPy array
            windows = archive.sample(np.random.default_rng(0), 32, sequence_length=4)
        reader = eb.Archive(path, mode="r")              # any number of readers
        ```
    """

    _progress_delay: float = 1.0  # seconds before a progress bar appears

    def __init__(
        self,
        store: Any,
        like: Any = None,
        *,
        mode: Literal["a", "r"] = "a",
        compression: Compression = "zstd",
        chunk_steps: int | None = None,
        shard_steps: int | None = None,
        on_lost: OnLost = "raise",
        progress: bool = True,
        break_lock: bool = False,
        fsync: bool = False,
        storage_options: dict | None = None,
    ):
        """**Arguments:**

        - `store`: where the archive lives: a local directory path (the default kind), a URL
            such as `"s3://bucket/run.zarr"` (through `obstore` if installed, else fsspec;
            credentials and endpoint in `storage_options`), a `.zip` file (read-only), or any
            `zarr.abc.store.Store` (e.g. `zarr.storage.MemoryStore()`).
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
            process (see the class docstring). Costs 3 to 5% of write throughput in the
            measured case (class docstring); off by default.
        - `storage_options`: options for a URL store (e.g. obstore's `endpoint`,
            `access_key_id`, `secret_access_key`, `region`, `client_options`).
        """
        where = "Archive()"
        if mode not in ("a", "r"):
            raise ValueError(f"{where}: `mode` must be 'a' (write) or 'r' (read), got {mode!r}.")
        if on_lost not in ("raise", "warn"):
            raise ValueError(f"{where}: `on_lost` must be 'raise' or 'warn', got {on_lost!r}.")
        self.read_only = mode == "r"
        self.on_lost: OnLost = on_lost
        self.progress = bool(progress)
        self.fsync = bool(fsync)
        self.store = _open_store(store, storage_options, self.read_only)
        self._where = repr(os.fspath(store)) if isinstance(store, str | os.PathLike) else "store"
        self._token: str | None = None
        self._finalizer: Any = None
        # Background writes (`write_async`): one writer thread, the futures not yet waited
        # for, the commit they lead to, and the error of one that failed.
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[int]] = []
        self._planned: _Commit | None = None
        self._failed: BaseException | None = None
        storage = None if like is None else _storage_of(like, where)
        self._treedef = None
        record = _get_json(self.store, "zarr.json")
        meta = None if record is None else record.get("attributes", {}).get(_ATTR)
        if meta is None and (self.read_only or storage is None):
            what = "no archive" if record is None else "a zarr group that is not an archive"
            hint = "" if self.read_only else " (pass a buffer as `like` to create one)"
            raise FileNotFoundError(f"{where}: there is {what} at {self._where}{hint}.")
        if not self.read_only:
            self._lock(break_lock)
            record = _get_json(self.store, "zarr.json")
            meta = None if record is None else record.get("attributes", {}).get(_ATTR)
        try:
            if meta is None:
                assert storage is not None
                meta = self._create(storage, compression, chunk_steps, shard_steps)
            elif not self.read_only:
                self._clean_partial()
            self._load_meta(meta)
            if storage is not None:
                leaves, self._treedef = _schema_of(storage)
                diff = _schema_diff(self.leaves, self.rows, leaves, storage.rows)
                if diff:
                    raise ValueError(
                        f"{where}: the buffer does not match the archive at {self._where}: "
                        + "; ".join(diff)
                        + "."
                    )
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------- opening

    def _lock(self, break_lock: bool) -> None:
        token = uuid.uuid4().hex
        info = {
            "token": token,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        lock = {"zarr_format": 3, "node_type": "group", "attributes": {_ATTR + "_lock": info}}
        other = None
        for attempt in range(2):
            _put_json(self.store, _LOCK_KEY, lock, exclusive=True)
            held = _get_json(self.store, _LOCK_KEY)
            other = None if held is None else held["attributes"][_ATTR + "_lock"]
            if other is not None and other["token"] == token:
                self._token = token
                # Released by close() or at exit (not on garbage collection, which may run on
                # zarr's event-loop thread, where no store call can be made).
                self._finalizer = functools.partial(_release, self.store, token)
                atexit.register(self._finalizer)
                return
            stale = (
                other is not None
                and other["host"] == info["host"]
                and not _pid_alive(int(other["pid"]))
            )
            if attempt == 0 and (stale or break_lock or other is None):
                sync(self.store.delete(_LOCK_KEY))
                continue
            break
        assert other is not None
        raise ArchiveLockedError(
            f"Archive(): {self._where} is already open for writing by process {other['pid']} "
            f"on host {other['host']!r} (since {other['since']}); one writer at a time. Open "
            "it with mode='r' to read; if that writer is gone (and the lock is stale), pass "
            f"break_lock=True, or delete the key {_LOCK_KEY!r}."
        )

    def _create(
        self,
        storage: RingStorage,
        compression: str,
        chunk_steps: int | None,
        shard_steps: int | None,
    ) -> dict:
        where = "Archive()"
        codecs = _codecs(compression)
        leaves, _ = _schema_of(storage)
        rows = storage.rows
        step_bytes = max(
            int(np.prod(leaf.shape)) * np.dtype(leaf.stored).itemsize for leaf in leaves
        )
        if chunk_steps is None:
            chunk_steps = min(_MAX_CHUNK_STEPS, _pow2_floor(_CHUNK_BYTES / step_bytes))
        chunk_steps = check_positive_int(where, "chunk_steps", chunk_steps)
        if shard_steps is None:
            shard_steps = chunk_steps * _pow2_floor(
                _SHARD_BYTES / (rows * chunk_steps * step_bytes)
            )
        elif shard_steps == 0:
            shard_steps = None
        else:
            shard_steps = check_positive_int(where, "shard_steps", shard_steps)
        if shard_steps is not None and shard_steps % chunk_steps:
            raise ValueError(
                f"{where}: shard_steps={shard_steps} must be a multiple of "
                f"chunk_steps={chunk_steps}."
            )
        group = zarr.open_group(self.store, mode="a", zarr_format=3)
        for leaf in leaves:
            group.create_array(
                leaf.name,
                shape=(rows, 0, *leaf.shape),
                dtype=leaf.stored,
                chunks=(1, chunk_steps, *leaf.shape),
                shards=None if shard_steps is None else (rows, shard_steps, *leaf.shape),
                compressors=codecs,
                fill_value=0,
                # One folder per leaf holding every chunk (not one folder per chunk).
                chunk_key_encoding={"name": "default", "separator": "."},
                dimension_names=(
                    "row",
                    "time",
                    *(f"{leaf.name}_{i}" for i in range(len(leaf.shape))),
                ),
                attributes={_ATTR: {"path": leaf.path, "dtype": leaf.dtype}},
                overwrite=True,
            )
        meta = {
            "format_version": FORMAT_VERSION,
            "rows": rows,
            "chunk_steps": chunk_steps,
            "shard_steps": shard_steps,
            "compression": compression,
            "leaves": [leaf.as_json() for leaf in leaves],
            "committed": _Commit().as_json(),
        }
        group.update_attributes({_ATTR: meta})  # written last: marks the archive complete
        return meta

    def _load_meta(self, meta: dict) -> None:
        version = int(meta["format_version"])
        if version > FORMAT_VERSION:
            raise ValueError(
                f"Archive(): {self._where} has format version {version}, newer than this "
                f"equibuffer reads ({FORMAT_VERSION}); upgrade equibuffer."
            )
        self.rows: int = int(meta["rows"])
        self.chunk_steps: int = int(meta["chunk_steps"])
        shard = meta["shard_steps"]
        self.shard_steps: int | None = None if shard is None else int(shard)
        self.compression: str = meta["compression"]
        self.leaves = [
            _Leaf(d["path"], d["name"], tuple(d["shape"]), d["dtype"], d["stored_dtype"])
            for d in meta["leaves"]
        ]
        step_bytes = max(
            int(np.prod(leaf.shape)) * np.dtype(leaf.stored).itemsize for leaf in self.leaves
        )
        # Steps per block of a long read or an iteration: about 32 MiB, whole shards.
        unit = self.shard_steps or self.chunk_steps
        self.block_steps: int = unit * _pow2_floor(_BLOCK_BYTES / (self.rows * unit * step_bytes))
        self._meta = meta
        self._commit = _Commit.from_json(meta["committed"])
        self._open_arrays()

    def _open_arrays(self) -> None:
        mode = "r" if self.read_only else "r+"
        self._arrays = {
            leaf.name: zarr.open_array(self.store, path=leaf.name, mode=mode, zarr_format=3)
            for leaf in self.leaves
        }
        # Every chunk (or shard) is read and written by this module itself.
        self._objects = objects = _Objects(self.store, self.fsync)
        # A writer's copies of the metadata documents it rewrites (read when first needed).
        self._records: dict[str, dict | None] | None = None
        self._group_record: dict | None = None
        # `(length, data)`: the partly filled chunks (or shard) the last write ended with.
        self._tail: tuple[int, Any] | None = None
        self._next_tail: tuple[int, Any] | None = None
        self._chunks: list[Any] = []
        for leaf in self.leaves:
            array = self._arrays[leaf.name]
            how = _direct_codecs(array)
            if how is not None and how[1] is None and self.shard_steps is None:
                self._chunks.append(
                    _Chunks(objects, leaf, self.chunk_steps, how[0], _separator(array))
                )
            elif (
                how is not None
                and how[1] is not None
                and self.shard_steps is not None
                and tuple(how[1].chunk_shape) == (1, self.chunk_steps, *leaf.shape)
                and tuple(array.shards or ()) == (self.rows, self.shard_steps, *leaf.shape)
            ):
                self._chunks.append(
                    _Shards(
                        objects,
                        leaf,
                        self.rows,
                        self.chunk_steps,
                        self.shard_steps,
                        how[0],
                        _separator(array),
                    )
                )
            else:
                raise ValueError(
                    f"Archive(): the array {leaf.name!r} at {self._where} does not have the "
                    "layout its archive metadata describes (chunks, shards or codecs changed "
                    f"by another tool: {getattr(array.metadata, 'codecs', None)}); equibuffer "
                    "cannot read it."
                )

    def _clean_partial(self) -> None:
        """Remove the temporary files a killed writer may have left in a local directory."""
        if isinstance(self.store, zarr.storage.LocalStore):
            for p in self.store.root.rglob("*.partial"):
                p.unlink(missing_ok=True)

    def refresh(self) -> int:
        """Move this reader's snapshot to the newest committed state; returns the length.
        (A writer's own state is always the newest; for one, this first waits for its
        background writes, as `flush` does.)

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=16, sequence_length=1)
            path = tempfile.mkdtemp() + "/run.zarr"
            with eb.Archive(path, buffer) as writer:
                reader = eb.Archive(path, mode="r")
                writer.write(buffer.add({"x": jnp.arange(4.0)[None]}))
                assert len(reader) == 0  # its snapshot is from before the write
                assert reader.refresh() == 4 and len(reader) == 4
            ```
        """
        if not self.read_only:
            self.flush()
        record = _get_json(self.store, "zarr.json")
        assert record is not None
        self._meta = record["attributes"][_ATTR]
        self._commit = _Commit.from_json(self._meta["committed"])
        self._open_arrays()
        return self._commit.length

    def close(self) -> None:
        """Finish the background writes (raising the error of one that failed), then release
        the writer lock (also done at exit); reads still work afterwards.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=16, sequence_length=1)
            path = tempfile.mkdtemp() + "/run.zarr"
            archive = eb.Archive(path, buffer)
            archive.write(buffer.add({"x": jnp.arange(4.0)[None]}))
            archive.close()  # another writer may open it now
            assert archive.read()["x"].tolist() == [[0.0, 1.0, 2.0, 3.0]]
            with eb.Archive(path, buffer) as again:
                assert len(again) == 4
            ```
        """
        try:
            self.flush()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None
            if self._finalizer is not None:
                atexit.unregister(self._finalizer)
                self._finalizer()
                self._finalizer = None
            self._token = None

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------- counters

    def __len__(self) -> int:
        """The number of committed time steps (per row) in this snapshot."""
        return self._commit.length

    @property
    def source_steps(self) -> int:
        """The source buffer's count of steps added that this archive has accounted for
        (written or lost): the next `write` starts there."""
        return self._commit.source_steps

    @property
    def steps_lost(self) -> int:
        """How many of the source's steps were overwritten before being written."""
        return self._commit.source_steps - self._commit.length

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Archive index ranges `[start, stop)` contiguous in the source (one unless steps
        were lost with `on_lost="warn"`)."""
        return self._commit.segments()

    def source_step(self, index: int | np.integer) -> int:
        """The source buffer's absolute step stored at archive time index `index`.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile, warnings

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=4, sequence_length=1)
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
        self._check_range("source_step()", index, index + 1)
        return self._commit.source_step(index)

    def nbytes(self) -> tuple[int, int]:
        """`(raw, stored)`: the bytes of the committed data and the bytes the store holds.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(64, jnp.uint8)}, add_batch_size=2,
                                         max_length=1024, sequence_length=1)
            buffer = buffer.add({"obs": jnp.zeros((2, 1024, 64), jnp.uint8)})
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                archive.write(buffer)
                raw, stored = archive.nbytes()
            assert raw == 2 * 1024 * 64  # rows * steps * bytes per step
            assert 0 < stored < raw  # zeros compress well
            ```
        """
        raw = (
            self._commit.length
            * self.rows
            * sum(int(np.prod(leaf.shape)) * np.dtype(leaf.stored).itemsize for leaf in self.leaves)
        )
        stored = sum(int(a.nbytes_stored()) for a in self._arrays.values())
        return raw, stored

    def compression_ratio(self) -> float:
        """Raw bytes over stored bytes of the committed data.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(64, jnp.uint8)}, add_batch_size=2,
                                         max_length=1024, sequence_length=1)
            buffer = buffer.add({"obs": jnp.zeros((2, 1024, 64), jnp.uint8)})
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                archive.write(buffer)
                raw, stored = archive.nbytes()
                assert archive.compression_ratio() == raw / stored > 10
            ```
        """
        raw, stored = self.nbytes()
        return raw / stored if stored else float("nan")

    # ------------------------------------------------------------------------------ writing

    def _check_writable(self, where: str) -> None:
        if self.read_only:
            raise PermissionError(f"{where}: the archive was opened with mode='r' (read-only).")
        if self._token is None:
            raise PermissionError(f"{where}: the archive was closed; open it again to write.")
        raw = self._objects.get(_LOCK_KEY)
        held = None if raw is None else json.loads(raw)
        other = None if held is None else held["attributes"][_ATTR + "_lock"]
        if other is None or other["token"] != self._token:
            self._token = None
            raise ArchiveLockedError(
                f"{where}: this writer's lock on {self._where} was broken (by another writer "
                "with break_lock=True, or deleted); nothing was written. Open it again."
            )

    def write(self, buffer: Any, *, on_lost: OnLost | None = None) -> int:
        """Append the steps added to `buffer` since the last write (to this archive, by any
        process), for every row, and commit them.

        **Arguments:**

        - `buffer`: a buffer (or `RingStorage`) of the archive's schema whose count of steps
            added is at least `source_steps`.
        - `on_lost`: overrides the archive's `on_lost` for this call.

        **Returns:**

        The number of time steps written (per row). Steps the ring overwrote before they
        were written raise `StepsLostError`, or with `on_lost="warn"` are reported with a
        `StepsLostWarning` and recorded as a gap. Writes started by `write_async` are
        finished first (and their error, if one failed, raised).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=16, sequence_length=1)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                buffer = buffer.add({"x": jnp.arange(3.0)[None]})
                assert archive.write(buffer) == 3  # the 3 new steps
                assert archive.write(buffer) == 0  # nothing new since
                buffer = buffer.add({"x": jnp.arange(3.0, 5.0)[None]})
                assert archive.write(buffer) == 2
                assert len(archive) == archive.source_steps == 5
                assert archive.read()["x"].tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0]]
            ```
        """
        self.flush()
        plan = self._plan(buffer, on_lost, "Archive.write()", copy=False)
        return 0 if plan is None else self._apply(plan)

    def write_async(
        self, buffer: Any, *, on_lost: OnLost | None = None
    ) -> concurrent.futures.Future[int]:
        """`write`, with the encoding and the I/O on a background thread, so that a training
        loop goes on while the steps are written.

        The new steps are copied to host memory before this returns (so the buffer may be
        donated or changed right away), and the steps lost by the ring are checked here, as
        `write` does (raising, or warning, now). The rest runs on one writer thread, in the
        order of the calls, each write committed as `write` commits it. At most two writes
        wait at a time: a third call first waits for the oldest to finish, so a loop that
        writes faster than the disk keeps up with it instead of piling up copies.
        `len(archive)` and `source_steps` count what is committed.

        **Returns:**

        A `concurrent.futures.Future` of the number of steps written. If a background write
        fails, it and every later one fail with its error (nothing after the gap is
        committed), and `flush()`, `write()` or `close()` raise it.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=4, sequence_length=1)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                for t in range(3):
                    buffer = buffer.add({"x": jnp.full((1, 4), t, jnp.float32)})
                    archive.write_async(buffer)  # returns once the steps are copied
                archive.flush()  # wait for the writes (close() does too)
                assert len(archive) == 12
            ```
        """
        where = "Archive.write_async()"
        # Back-pressure: at most `_MAX_PENDING` writes (and their copies of the steps) wait.
        self._pending = [f for f in self._pending if not f.done()]
        while len(self._pending) >= _MAX_PENDING:
            concurrent.futures.wait(self._pending[:1])
            self._pending = [f for f in self._pending if not f.done()]
        if self._failed is not None:
            self.flush()  # waits for the writes after the one that failed; raises its error
        plan = self._plan(buffer, on_lost, where, copy=True)
        if plan is None:
            done: concurrent.futures.Future[int] = concurrent.futures.Future()
            done.set_result(0)
            return done
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, "equibuffer-archive")
        self._planned = plan.commit
        future = self._writer.submit(self._apply_in_background, plan)
        self._pending.append(future)
        return future

    def flush(self) -> None:
        """Wait for every write started by `write_async`; raise the error of one that
        failed (once: the archive is then back at its last commit, and writes may go on).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=16, sequence_length=1)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                buffer = buffer.add({"x": jnp.arange(4.0)[None]})
                future = archive.write_async(buffer)
                archive.flush()  # wait for the background write
                assert future.done() and future.result() == 4
                assert len(archive) == 4
            ```
        """
        pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)
        self._planned = None
        failed, self._failed = self._failed, None
        if failed is not None:
            raise RuntimeError(
                "Archive: a background write (write_async) failed, so it and the writes after "
                "it were not committed; the archive holds its last commit. Write again to "
                "write those steps (if the ring still holds them)."
            ) from failed

    def _plan(self, buffer: Any, on_lost: OnLost | None, where: str, copy: bool) -> "_Plan | None":
        """What a write of `buffer` appends (host copies of the new steps when `copy`, else
        views where possible) and the commit it leads to, counted from the last commit or
        the last planned one: None when there is nothing new."""
        self._check_writable(where)
        policy = self.on_lost if on_lost is None else on_lost
        storage = _storage_of(buffer, where)
        leaves, _ = _schema_of(storage)
        diff = _schema_diff(self.leaves, self.rows, leaves, storage.rows)
        if diff:
            raise ValueError(f"{where}: the buffer does not match the archive: {'; '.join(diff)}.")
        total = storage.steps_added()
        c = self._commit if self._planned is None else self._planned
        if total > _INT64_MAX:
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
        head, fill, length = int(storage.head), int(storage.fill), storage.length
        keep = min(new, fill)
        lost = new - keep
        if lost:
            msg = (
                f"{where}: {lost} of the {new} steps added since the last write were overwritten "
                f"by the ring (max_length={length}) before being written"
            )
            if policy == "raise":
                raise StepsLostError(
                    msg + "; call write() at least every max_length steps, or pass "
                    "on_lost='warn' to write the rest and record the gap."
                )
            warnings.warn(
                msg + "; the rest is written and the gap recorded.", StepsLostWarning, stacklevel=3
            )
        start = (head - keep) % length
        pieces = [(start, min(start + keep, length))]
        if start + keep > length:
            pieces.append((0, start + keep - length))
        host = []
        for leaf, x in zip(self.leaves, jax.tree.leaves(storage.data), strict=True):
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
        gaps = c.gaps
        first = c.first_step
        if lost and c.length == 0:
            first = c.source_steps + lost
        elif lost:
            gaps = (*gaps, (c.length, lost))
        return _Plan(host, c.length, keep, _Commit(c.length + keep, total, first, gaps))

    def _apply(self, plan: "_Plan") -> int:
        """Write and commit a planned write; returns the steps written."""
        if self._commit.length != plan.base:
            raise RuntimeError(
                f"Archive: a write planned after {plan.base} committed steps found "
                f"{self._commit.length}; nothing was written."
            )
        self._next_tail = None
        self._append(plan.host)
        self._commit_state(plan.commit)
        self._tail = self._next_tail  # kept only once committed
        return plan.keep

    def _apply_in_background(self, plan: "_Plan") -> int:
        if self._failed is not None:
            raise RuntimeError("an earlier background write failed") from self._failed
        try:
            self._check_writable("Archive.write_async()")
            return self._apply(plan)
        except BaseException as error:
            self._failed = error
            raise

    def _append(self, host: list[np.ndarray]) -> None:
        """Write `host` (per leaf `(rows, k, *leaf)`) after the committed length. Nothing is
        visible until `_commit_state`."""
        old = self._commit.length
        k = host[0].shape[1]
        new = old + k
        # What the last write left of a partly filled chunk or shard, if it ended at `old`;
        # dropped now, so that a write that fails midway leaves none behind.
        tail, self._tail = self._tail, None
        tail = tail[1] if tail is not None and tail[0] == old else None
        self._resize(new)
        if self.shard_steps is None:
            self._append_chunks(host, old, new, tail)
        else:
            self._append_shards(host, old, new, tail)

    def _resize(self, length: int) -> None:
        """Set every leaf array's time length in its metadata document (what zarr's `resize`
        writes for growth, without its per-array round trips): the documents read once, then
        replaced with the new shape only."""
        if self._records is None:
            self._records = {
                leaf.name: _get_json(self.store, f"{leaf.name}/zarr.json") for leaf in self.leaves
            }
        items = []
        for leaf in self.leaves:
            record = self._records[leaf.name]
            assert record is not None
            record["shape"] = [self.rows, length, *leaf.shape]
            items.append((f"{leaf.name}/zarr.json", json.dumps(record).encode()))
        self._objects.put_many(items)

    def _append_chunks(self, host: list[np.ndarray], old: int, new: int, tail: dict | None) -> None:
        """Unsharded: encode and put every chunk that steps `[old, new)` touch, concurrently.
        A chunk already holding committed steps is completed and replaced whole: its steps
        come from `tail` (`(leaf, row) -> the chunk`, kept by the previous write of this
        writer) or are read back."""
        cs = self.chunk_steps
        tasks = [
            (li, r, c)
            for li in range(len(self._chunks))
            for r in range(self.rows)
            for c in range(old // cs, -(-new // cs))
        ]
        keep: dict[tuple[int, int], np.ndarray] = {}

        def put(task: tuple[int, int, int]) -> int:
            li, r, c = task
            chunks, block = self._chunks[li], host[li]
            a, b = max(old, c * cs), min(new, (c + 1) * cs)
            if a == c * cs and b == (c + 1) * cs:
                x = block[r, a - old : b - old]
            else:
                x = np.zeros(chunks.shape, chunks.dtype)
                if a > c * cs:
                    prev = tail[(li, r)] if tail is not None else chunks.get(r, c)
                    if prev is not None:
                        x[: a - c * cs] = prev[: a - c * cs]
                x[a - c * cs : b - c * cs] = block[r, a - old : b - old]
                if b < (c + 1) * cs:
                    keep[(li, r)] = x  # the new partial chunk (a copy: never the ring's)
            chunks.put(r, c, x)
            return b - a

        self._run_writes(put, tasks, (new - old) * self.rows * len(self.leaves), host)
        self._next_tail = (new, keep) if new % cs else None

    def _append_shards(
        self, host: list[np.ndarray], old: int, new: int, tail: tuple | None
    ) -> None:
        """Sharded: encode the chunks that steps `[old, new)` touch concurrently (one task per
        leaf, shard and row) and write each shard once, whole, as soon as its chunks are
        encoded. The shard already holding committed steps keeps their encoded chunks as
        stored (a chunk holding some is decoded, completed and encoded again); both come
        from `tail` (kept by this writer's previous write) or are read back."""
        assert self.shard_steps is not None
        shards_of: list[_Shards] = self._chunks
        cs, ss = self.chunk_steps, self.shard_steps
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
                for r in range(self.rows):
                    for j in range(per):
                        c = first * per + j
                        off, n = int(index[r, j, 0]), int(index[r, j, 1])
                        if off == _EMPTY or c * cs >= old:
                            continue
                        if (c + 1) * cs <= old:
                            kept[li][(r, j)] = data[off : off + n]
                        else:
                            prefix[li][r] = shards.decode(data[off : off + n])
        lock = threading.Lock()
        pending: dict[tuple[int, int], int] = {}
        encoded: dict[tuple[int, int], dict[tuple[int, int], Any]] = {}
        tasks = []
        for s in range(first, last):
            for li in range(len(shards_of)):
                pending[(li, s)] = self.rows
                encoded[(li, s)] = dict(kept[li]) if s == first else {}
                tasks.extend((li, s, r) for r in range(self.rows))

        def encode(task: tuple[int, int, int]) -> int:
            li, s, r = task
            shards, block = shards_of[li], host[li]
            mine = {}
            done = 0
            for c in range(max(s * per, old // cs), min((s + 1) * per, -(-new // cs))):
                a, b = max(old, c * cs), min(new, (c + 1) * cs)
                if a == c * cs and b == (c + 1) * cs:
                    x = block[r, a - old : b - old]
                else:
                    x = np.zeros(shards.shape, shards.dtype)
                    if a > c * cs and r in prefix[li]:
                        x[: a - c * cs] = prefix[li][r][: a - c * cs]
                    x[a - c * cs : b - c * cs] = block[r, a - old : b - old]
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

        # The complete chunks and the partial chunk of the last shard, if it is partial.
        next_kept: list[dict[tuple[int, int], Any]] = [
            dict(kept[li]) if last - 1 == first else {} for li in range(len(shards_of))
        ]
        next_prefix: list[dict[int, np.ndarray]] = [{} for _ in shards_of]
        self._run_writes(encode, tasks, (new - old) * self.rows * len(self.leaves), host)
        self._next_tail = (new, (next_kept, next_prefix)) if new % ss else None

    def _run_writes(
        self, work: Callable[[Any], int], tasks: Any, total: int, host: list[np.ndarray]
    ) -> None:
        """Run `work` over `tasks` on the I/O thread pool (in this thread for a write of less
        than `_INLINE_BYTES`, where handing tasks to threads costs more than it saves), a
        progress bar counting the steps each returns."""
        small = sum(x.nbytes for x in host) < _INLINE_BYTES
        with tqdm(
            total=total,
            unit="step",
            desc="archive write",
            disable=not self.progress,
            delay=self._progress_delay,
        ) as bar:
            for done in map(work, tasks) if small else _pool().map(work, tasks):
                bar.update(done)

    def _commit_state(self, commit: _Commit) -> None:
        meta = dict(self._meta, committed=commit.as_json())
        root = self._objects.root
        if self.fsync and root is not None:
            # Everything the commit covers reaches the disk first: the objects, the arrays'
            # metadata documents included (each flushed as written, before its rename), then
            # their directory entries (the renames).
            for folder in self._objects.dirs:
                _fsync_path(folder)
        # The group's document, read once by this writer (the only one: nothing else changes
        # it), replaced whole with the new commit: one atomic object write (a renamed file,
        # flushed first with fsync; one PUT on a store).
        if self._group_record is None:
            self._group_record = _get_json(self.store, "zarr.json")
        record = self._group_record
        assert record is not None
        record.setdefault("attributes", {})[_ATTR] = meta
        self._objects.put("zarr.json", [json.dumps(record).encode()])
        if self.fsync and root is not None:
            _fsync_path(str(root))
        self._meta, self._commit = meta, commit

    # ------------------------------------------------------------------------------ reading

    def _check_range(self, where: str, start: int, stop: int) -> None:
        n = self._commit.length
        if not 0 <= start <= stop <= n:
            raise IndexError(
                f"{where}: steps [{start}, {stop}) are out of range: the archive holds "
                f"{n} committed steps (indices 0 to {n - 1}); call refresh() to see newer ones."
            )

    def _rows_index(self, where: str, rows: Any) -> Any:
        if rows is None:
            return slice(None)
        if isinstance(rows, slice):
            return rows
        idx = np.atleast_1d(np.asarray(rows))
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise TypeError(f"{where}: `rows` must be None, a slice or ints, got {rows!r}.")
        if idx.size and not (-self.rows <= idx.min() and idx.max() < self.rows):
            raise IndexError(f"{where}: `rows` {rows!r} out of range for {self.rows} rows.")
        return idx % self.rows

    def _unflatten(self, arrays: list[np.ndarray]) -> Any:
        out = [
            a.view(np.dtype(leaf.dtype)) if leaf.dtype != leaf.stored else a
            for leaf, a in zip(self.leaves, arrays, strict=True)
        ]
        if self._treedef is not None:
            return jax.tree.unflatten(self._treedef, out)
        return {leaf.name: a for leaf, a in zip(self.leaves, out, strict=True)}

    def _read_raw(
        self, start: int, stop: int, rows: Any, outs: list[np.ndarray] | None = None
    ) -> list[np.ndarray]:
        """Steps `[start, stop)` of `rows`, per leaf `(rows, stop - start, *leaf)` in the
        stored dtype, written into `outs` if given (C-contiguous arrays of that shape)."""
        row_ids = range(self.rows)[rows] if isinstance(rows, slice) else [int(r) for r in rows]
        if outs is None:
            outs = [
                np.empty((len(row_ids), stop - start, *leaf.shape), np.dtype(leaf.stored))
                for leaf in self.leaves
            ]
        if self.shard_steps is None:
            self._read_chunks(start, stop, list(row_ids), outs)
        else:
            self._read_shards(start, stop, list(row_ids), outs)
        return outs

    def _read_chunks(self, start: int, stop: int, row_ids: list[int], outs: list) -> None:
        """Unsharded: get and decode every touched chunk concurrently, straight into place."""
        cs = self.chunk_steps
        tasks = [
            (chunks, out, i, r, c)
            for chunks, out in zip(self._chunks, outs, strict=True)
            for i, r in enumerate(row_ids)
            for c in range(start // cs, -(-stop // cs))
        ]

        def get(task: tuple[_Chunks, np.ndarray, int, int, int]) -> None:
            chunks, out, i, r, c = task
            a, b = max(start, c * cs), min(stop, (c + 1) * cs)
            data = chunks.data(r, c)
            chunks.decode_into(data, out[i, a - start : b - start], a - c * cs)

        for _ in _pool().map(get, tasks):
            pass

    def _read_shards(self, start: int, stop: int, row_ids: list[int], outs: list) -> None:
        """Sharded: one task per (leaf, shard, row) reads that row's chunks of the shard
        (the whole shard once, when all rows are read) and decodes them into place."""
        assert self.shard_steps is not None
        shards_of: list[_Shards] = self._chunks
        cs, ss = self.chunk_steps, self.shard_steps
        per = ss // cs
        n = self._commit.length
        whole = len(row_ids) == self.rows
        lock = threading.Lock()
        cache: dict[tuple[int, int], Any] = {}  # (leaf, shard) -> (index, bytes) or None

        def fetch(li: int, s: int) -> Any:
            with lock:
                if (li, s) not in cache:
                    cache[(li, s)] = threading.Event()
                    mine = True
                else:
                    mine = False
                got = cache[(li, s)]
            if mine:
                event = got
                result = shards_of[li].get_shard(s)
                with lock:
                    cache[(li, s)] = (result,)
                event.set()
                return result
            if isinstance(got, threading.Event):
                got.wait()
                with lock:
                    got = cache[(li, s)]
            return got[0]

        def get(task: tuple[int, int, int, int]) -> None:
            li, s, i, r = task
            shards, out = shards_of[li], outs[li]
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
                        datas.append(None if off == _EMPTY else memoryview(blob)[off : off + size])
            else:
                datas = shards.get_chunks(s, which, complete=(s + 1) * ss <= n)
            for c, data in zip(range(cs0, cs1), datas, strict=True):
                a, b = max(start, c * cs), min(stop, (c + 1) * cs)
                shards.decode_into(data, out[i, a - start : b - start], a - c * cs)

        tasks = [
            (li, s, i, r)
            for s in range(start // ss, -(-stop // ss))
            for li in range(len(shards_of))
            for i, r in enumerate(row_ids)
        ]
        for _ in _pool().map(get, tasks):
            pass

    def read(
        self, start: int = 0, stop: int | None = None, *, rows: Any = None
    ) -> PyTree[np.ndarray]:
        """Time steps `[start, stop)` (negative counts from the end, like Python) of the
        selected `rows` (None: all; an int sequence; or a slice), as NumPy arrays
        `(rows, stop - start, *leaf)` in the buffer's tree structure (a dict by leaf name
        without `like`). Asking beyond the committed length raises an `IndexError` that
        says how many steps there are.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(3)}, add_batch_size=2, max_length=16,
                                         sequence_length=1)
            path = tempfile.mkdtemp() + "/run.zarr"
            with eb.Archive(path, buffer) as archive:
                archive.write(buffer.add({"obs": jnp.arange(60.0).reshape(2, 10, 3)}))
                obs = archive.read(-2)["obs"]  # the last 2 steps of both rows
                assert obs.shape == (2, 2, 3) and obs[0, 0, 0] == 24.0
                assert archive.read(0, 5, rows=[1])["obs"].shape == (1, 5, 3)
            reader = eb.Archive(path, mode="r")  # without `like`: a dict by leaf name
            assert reader.read()["obs"].shape == (2, 10, 3)
            ```
        """
        where = "Archive.read()"
        n = self._commit.length
        start = start + n if start < 0 else start
        stop = n if stop is None else (stop + n if stop < 0 else stop)
        self._check_range(where, start, stop)
        rsel = self._rows_index(where, rows)
        if stop - start > 4 * self.block_steps and self.progress:
            # Block by block (for the progress bar), each straight into its place.
            count = len(range(self.rows)[rsel]) if isinstance(rsel, slice) else len(rsel)
            outs = [
                np.empty((count, stop - start, *leaf.shape), np.dtype(leaf.stored))
                for leaf in self.leaves
            ]
            for _ in self._iter_raw(start, stop, rsel, self.block_steps, outs):
                pass
            return self._unflatten(outs)
        return self._unflatten(self._read_raw(start, stop, rsel))

    def _iter_raw(
        self, start: int, stop: int, rows: Any, steps: int, outs: list | None = None
    ) -> Iterator[tuple[int, list]]:
        with tqdm(
            total=stop - start,
            unit="step",
            desc="archive read",
            disable=not self.progress,
            delay=self._progress_delay,
        ) as bar:
            for a in range(start, stop, steps):
                b = min(a + steps, stop)
                into = None if outs is None else [o[:, a - start : b - start] for o in outs]
                yield a, self._read_raw(a, b, rows, into)
                bar.update(b - a)

    def iter(
        self,
        steps: int | None = None,
        *,
        start: int = 0,
        stop: int | None = None,
        rows: Any = None,
    ) -> Iterator[tuple[int, PyTree[np.ndarray]]]:
        """Iterate over `[start, stop)` in blocks of `steps` time steps (default
        `block_steps`: about 32 MiB, or a shard), yielding `(index of the block's first step,
        data)` with data as in `read`. The snapshot is the one current when iteration starts.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=16, sequence_length=1)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                archive.write(buffer.add({"x": jnp.arange(10.0)[None]}))
                blocks = list(archive.iter(4))
            assert [start for start, _ in blocks] == [0, 4, 8]
            assert [data["x"].shape for _, data in blocks] == [(1, 4), (1, 4), (1, 2)]
            assert blocks[2][1]["x"].tolist() == [[8.0, 9.0]]
            ```
        """
        where = "Archive.iter()"
        steps = self.block_steps if steps is None else check_positive_int(where, "steps", steps)
        n = self._commit.length
        stop = n if stop is None else stop
        self._check_range(where, start, stop)
        rsel = self._rows_index(where, rows)
        for a, raw in self._iter_raw(start, stop, rsel, steps):
            yield a, self._unflatten(raw)

    # --------------------------------------------------------------------- into a buffer

    def load(
        self, buffer: Any, start: int | None = None, stop: int | None = None, *, rows: Any = None
    ) -> Any:
        """Return `buffer` holding archive steps `[start, stop)` (default: the newest that fit
        in its ring, within the last contiguous segment), with its counters set as if the
        source had added steps up to `stop`: ready for offline training with its own
        `sample`. The steps must fit in `max_length` and not cross a gap of lost steps.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=16, sequence_length=1)
            path = tempfile.mkdtemp() + "/run.zarr"
            with eb.Archive(path, buffer) as archive:
                archive.write(buffer.add({"x": jnp.arange(10.0)[None]}))
            small = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1, max_length=4,
                                        sequence_length=2)
            small = eb.Archive(path, small, mode="r").load(small, 2, 6)  # archive steps 2 to 5
            assert small.storage.steps_added() == 6  # as if the source had added 6 steps
            assert sorted(small.storage.data["x"][0].tolist()) == [2.0, 3.0, 4.0, 5.0]
            assert small.sample(jax.random.key(0), batch_size=8).experience["x"].shape == (8, 2)
            ```
        """
        where = "Archive.load()"
        storage = _storage_of(buffer, where)
        seg_start = self._commit.segments()[-1][0] if self._commit.length else 0
        stop = self._commit.length if stop is None else stop
        if start is None:
            start = max(stop - storage.length, seg_start if stop > seg_start else 0)
        self._check_range(where, start, stop)
        if stop - start > storage.length:
            raise ValueError(
                f"{where}: {stop - start} steps do not fit in the buffer's "
                f"max_length={storage.length}; load fewer steps or use a larger buffer."
            )
        for a, b in self._commit.segments():
            if a < stop and start < b and not (a <= start and stop <= b):
                raise ValueError(
                    f"{where}: steps [{start}, {stop}) cross a gap of lost steps at {b}; "
                    f"load within one segment of {self.segments}."
                )
        rsel = self._rows_index(where, rows)
        sel_rows = len(range(self.rows)[rsel]) if isinstance(rsel, slice) else len(rsel)
        leaves, _ = _schema_of(storage)
        diff = _schema_diff(self.leaves, sel_rows, leaves, storage.rows)
        if diff:
            raise ValueError(f"{where}: the buffer does not match the archive: {'; '.join(diff)}.")
        raw = self._read_raw(start, stop, rsel)
        data = [a.view(np.dtype(leaf.dtype)) for leaf, a in zip(self.leaves, raw, strict=True)]
        c = self._commit
        total = c.source_step(stop - 1) + 1 if stop > 0 else c.first_step
        new_storage = ring_holding(storage, data, total)
        if storage is buffer:
            return new_storage
        return eqx.tree_at(lambda b: b.storage, buffer, new_storage)

    def restore(self, buffer: Any) -> Any:
        """Return `buffer` holding the newest steps of the archive (as many as fit, after the
        last gap), with its count of steps added equal to `source_steps`, so that a resumed
        run continues where the archive stopped and `write` never writes a step twice.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                         max_length=16, sequence_length=1)
            path = tempfile.mkdtemp() + "/run.zarr"
            with eb.Archive(path, buffer) as archive:
                archive.write(buffer.add({"x": jnp.arange(10.0)[None]}))
            with eb.Archive(path, buffer) as archive:  # a resumed run, with an empty buffer
                buffer = archive.restore(buffer)
                assert buffer.storage.steps_added() == archive.source_steps == 10
                buffer = buffer.add({"x": jnp.arange(10.0, 12.0)[None]})
                assert archive.write(buffer) == 2  # only the new steps
            ```
        """
        storage = _storage_of(buffer, "Archive.restore()")
        n = self._commit.length
        start = max(n - storage.length, self._commit.segments()[-1][0] if n else 0)
        return self.load(buffer, start, n)

    # ----------------------------------------------------------------------------- sampling

    def sample(
        self,
        rng: np.random.Generator | int,
        batch_size: int,
        sequence_length: int,
        *,
        period: int = 1,
        rows: Sequence[int] | None = None,
    ) -> ArchiveSample:
        """Draw `batch_size` windows of `sequence_length` consecutive steps straight from the
        archive, reading each touched chunk once (concurrently).

        The distribution: uniform with replacement over every `(row, start)` with `row` in
        `rows` (default all), `start` a multiple of `period` (archive time index), and the
        window inside the committed length and inside one contiguous segment (never across a
        gap of lost steps). Raises `ValueError` when there is no such window.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, numpy as np, tempfile

            buffer = eb.TrajectoryBuffer({"t": jnp.float32(0)}, add_batch_size=2, max_length=16,
                                         sequence_length=1)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                archive.write(buffer.add({"t": jnp.tile(jnp.arange(16.0), (2, 1))}))  # t at t
                batch = archive.sample(np.random.default_rng(0), 8, sequence_length=4, period=2)
            assert batch.experience["t"].shape == (8, 4)
            assert (batch.starts % 2 == 0).all() and (batch.starts <= 12).all()
            assert (batch.experience["t"] == batch.starts[:, None] + np.arange(4)).all()
            ```
        """
        where = "Archive.sample()"
        batch_size = check_positive_int(where, "batch_size", batch_size)
        seq = check_positive_int(where, "sequence_length", sequence_length)
        period = check_positive_int(where, "period", period)
        rng = np.random.default_rng(rng)
        row_ids = np.arange(self.rows) if rows is None else self._rows_index(where, rows)
        firsts, counts = [], []
        for a, b in self._commit.segments():
            first = -(-a // period) * period
            count = (b - seq - first) // period + 1 if b - seq >= first else 0
            if count > 0:
                firsts.append(first)
                counts.append(count)
        per_row = int(sum(counts))
        if per_row == 0 or len(row_ids) == 0:
            raise ValueError(
                f"{where}: no window of sequence_length={seq} (period={period}) fits in the "
                f"{self._commit.length} committed steps; write more or shorten the window."
            )
        u = rng.integers(0, len(row_ids) * per_row, size=batch_size)
        r = row_ids[u // per_row]
        k = u % per_row
        cum = np.cumsum([0, *counts])
        seg = np.searchsorted(cum, k, side="right") - 1
        starts = np.asarray(firsts)[seg] + (k - cum[seg]) * period
        return ArchiveSample(self._gather(r, starts, seq), r, starts)

    def _gather(self, rows: np.ndarray, starts: np.ndarray, seq: int) -> Any:
        """Every chunk the windows touch is read and decoded once (concurrently), then each
        window is gathered from the decoded chunks."""
        cs = self.chunk_steps
        steps = starts[:, None] + np.arange(seq)
        per_row = -(-self._commit.length // cs)
        ids = (rows[:, None] * per_row + steps // cs).ravel()
        needed, which = np.unique(ids, return_inverse=True)
        row_of, chunk_of = np.divmod(needed, per_row)
        stacks = [np.empty((len(needed), *c.shape), c.dtype) for c in self._chunks]
        if self.shard_steps is None:
            self._decode_chunks(row_of, chunk_of, stacks)
        else:
            self._decode_shards(row_of, chunk_of, stacks)
        which, offsets = which.reshape(steps.shape), steps % cs
        out = [
            stack[which, offsets].view(np.dtype(leaf.stored))
            for stack, leaf in zip(stacks, self.leaves, strict=True)
        ]
        return self._unflatten(out)

    def _decode_chunks(self, row_of: np.ndarray, chunk_of: np.ndarray, stacks: list) -> None:
        """Unsharded: chunk `(row_of[k], chunk_of[k])` of every leaf into `stacks[leaf][k]`,
        one task per chunk."""
        tasks = [
            (chunks, stack, k)
            for chunks, stack in zip(self._chunks, stacks, strict=True)
            for k in range(len(row_of))
        ]

        def get(task: tuple[_Chunks, np.ndarray, int]) -> None:
            chunks, stack, k = task
            data = chunks.data(int(row_of[k]), int(chunk_of[k]))
            chunks.decode_into(data, stack[k])

        for _ in _pool().map(get, tasks):
            pass

    def _decode_shards(self, row_of: np.ndarray, chunk_of: np.ndarray, stacks: list) -> None:
        """Sharded: one task per (leaf, shard) touched reads the index (cached for complete
        shards) and only the chunks needed, each once, into `stacks[leaf][k]`."""
        assert self.shard_steps is not None
        shards_of: list[_Shards] = self._chunks
        ss = self.shard_steps
        per, n = ss // self.chunk_steps, self._commit.length
        s_of = chunk_of // per
        order = np.lexsort((row_of, s_of))  # the needed chunks grouped by shard
        groups = np.split(order, np.flatnonzero(np.diff(s_of[order])) + 1)

        def get(task: tuple[int, np.ndarray]) -> None:
            li, group = task
            shards, stack = shards_of[li], stacks[li]
            s = int(s_of[group[0]])
            which = [(int(row_of[k]), int(chunk_of[k]) - s * per) for k in group]
            datas = shards.get_chunks(s, which, complete=(s + 1) * ss <= n)
            for k, data in zip(group, datas, strict=True):
                shards.decode_into(data, stack[k])

        tasks = [(li, g) for g in groups for li in range(len(shards_of))]
        for _ in _pool().map(get, tasks):
            pass


def as_jax(tree: PyTree[np.ndarray]) -> PyTree[Shaped[Array, "..."]]:
    """NumPy leaves to JAX arrays (a convenience for feeding archive reads to jitted code)."""
    return jax.tree.map(jnp.asarray, tree)
