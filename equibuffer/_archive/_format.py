"""The archive's format: its layout (chunks and shards), the schema of its leaves, the records
kept in the root group's attribute (the format, the schema and the commit), and the codecs.

Plain zarr v3: one array per leaf of the experience tree, `(rows, time, *leaf)`, chunked
`(1, chunk_steps, *leaf)` inside shards `(rows, shard_steps, *leaf)` (zarr's sharding codec),
or one object per chunk with `shard_steps=None`; `dimension_names` `("row", "time", ...)`. The
root group's attribute `"equibuffer"` holds the format version, the schema and the committed
state (how many time steps are visible, and which steps of the source buffer they are).
"""

import dataclasses
import json
import re
import threading
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable, TypeAlias

import jax
import numpy as np
import zarr
import zarr.codecs
from jaxtyping import Int
from zarr.abc.store import Store

from .._checks import check_positive_int, keystr
from .._cluster import AbstractClusteredBuffer
from .._mixer import Mixer
from .._ratelimit import RateLimited
from .._ring import RingStorage


FORMAT_VERSION = 1
ATTR = "equibuffer"  # the root group's attribute holding the archive's records
TWO_32 = 1 << 32
INT64_MAX = (1 << 63) - 1
CHUNK_BYTES = 1 << 17  # target uncompressed bytes of one chunk (one row)
SHARD_BYTES = 16 << 20  # target uncompressed bytes of one shard (all rows)
BLOCK_BYTES = 32 << 20  # target uncompressed bytes of one read block (all rows)
MAX_CHUNK_STEPS = 1 << 14

Compression = Literal["zstd", "lz4", "none"]
OnLost = Literal["raise", "warn"]


@runtime_checkable
class HasStorage(Protocol):
    """A buffer: anything that holds its steps in a `RingStorage` field `storage`."""

    @property
    def storage(self) -> RingStorage: ...


# What the archive takes where it says "a buffer": a buffer or its ring.
BufferLike: TypeAlias = HasStorage | RingStorage
# A selection of rows: all (None), a slice, or row indices (negative from the end).
Rows: TypeAlias = slice | Sequence[int | np.integer] | Int[np.ndarray, " n"] | None


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of the experience tree as the archive stores it."""

    path: str  # keystr of the leaf path, e.g. "['obs']"
    name: str  # zarr array name
    shape: tuple[int, ...]
    dtype: str  # dtype of the leaf as the buffer holds it
    stored: str  # dtype zarr stores (a same-size unsigned int for dtypes zarr lacks)

    @property
    def step_bytes(self) -> int:
        """Bytes of one time step of one row."""
        return int(np.prod(self.shape)) * np.dtype(self.stored).itemsize

    def as_json(self) -> dict:
        return {
            "path": self.path,
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "stored_dtype": self.stored,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Leaf":
        return cls(d["path"], d["name"], tuple(d["shape"]), d["dtype"], d["stored_dtype"])


@dataclasses.dataclass(frozen=True)
class Commit:
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
    def from_json(cls, d: dict) -> "Commit":
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

    def after(self, source_steps: int, keep: int) -> "Commit":
        """The commit once the source has added `source_steps` steps in all, of which the
        newest `keep` are appended (the others, if any, lost and recorded as a gap)."""
        lost = source_steps - self.source_steps - keep
        first, gaps = self.first_step, self.gaps
        if lost and self.length == 0:
            first = self.source_steps + lost
        elif lost:
            gaps = (*gaps, (self.length, lost))
        return Commit(self.length + keep, source_steps, first, gaps)


# ------------------------------------------------------------------------------- schema


def stored_dtype(dtype: np.dtype) -> np.dtype:
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


class StepSchema(NamedTuple):
    """The schema of steps given without a buffer (what an import creates an archive from):
    `data` a pytree of arrays or `jax.ShapeDtypeStruct`s shaped `(rows, 1, *leaf)` of any
    NumPy dtype (a ring's would be JAX's, where float64 is float32 unless x64 is on)."""

    data: Any
    rows: int


def schema_of(storage: RingStorage | StepSchema) -> tuple[list[Leaf], Any]:
    """The leaves of a ring (one zarr array name each, unique) and its tree structure."""
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
            Leaf(keystr(path), name, tuple(x.shape[2:]), dtype.name, stored_dtype(dtype).name)
        )
    return leaves, treedef


def schema_diff(stored: list[Leaf], rows: int, new: list[Leaf], new_rows: int) -> list[str]:
    """Every difference between the archive's schema and a buffer's, in words."""
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


def storage_of(like: Any, where: str) -> RingStorage:
    """The `RingStorage` of a buffer (or the ring itself); the kinds an archive cannot hold
    are refused with the reason and what to archive instead."""
    storage = getattr(like, "storage", like)
    if isinstance(storage, RingStorage):
        return storage
    name = type(like).__name__
    if isinstance(like, RateLimited):
        raise TypeError(
            f"{where}: a RateLimited is not archived itself: give the archive the buffer it "
            "wraps, `limited.buffer` (to resume: `limited = eqx.tree_at(lambda l: l.buffer, "
            "limited, archive.restore(limited.buffer))`; the limiter's credit is not "
            "archived, so the limiter keeps its own)."
        )
    if isinstance(like, Mixer):
        raise TypeError(
            f"{where}: a Mixer draws from several buffers, each with its own steps and "
            "counters: give each of `mixer.buffers` its own archive and restore each into its "
            "place, `mixer = eqx.tree_at(lambda m: m.buffers[i], mixer, archive_i.restore("
            "mixer.buffers[i]))`."
        )
    if isinstance(like, AbstractClusteredBuffer):
        raise TypeError(
            f"{where}: a {name} routes every item to one cluster's own ring, so its rows share "
            "no time axis, which is what an archive stores. Archive the items as they are "
            "added (an eb.ItemBuffer of the same example and add_batch_size, written "
            "alongside) and rebuild the clustered buffer by adding them back, `buffer = "
            "buffer.add(items)` for each block of `archive.iter()`: `add` rebuilds its "
            "clusters and their trees."
        )
    raise TypeError(
        f"{where}: expected a buffer (e.g. eb.TrajectoryBuffer) or an eb.RingStorage, got {name}."
    )


# ------------------------------------------------------------------------------- layout


def compressor(compression: str) -> Any:
    """The zarr codec of a `compression` name (None: no compression)."""
    if compression == "zstd":
        return zarr.codecs.ZstdCodec(level=1)
    if compression == "lz4":
        return zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    if compression == "none":
        return None
    raise ValueError(
        f"Archive(): `compression` must be 'zstd', 'lz4' or 'none', got {compression!r}."
    )


def pow2_floor(x: float) -> int:
    return 1 << max(0, int(np.floor(np.log2(max(x, 1.0)))))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an archive is cut: its rows and leaves, time steps per chunk and per shard (None:
    one object per chunk), and the steps per block of a long read."""

    rows: int
    leaves: tuple[Leaf, ...]
    chunk_steps: int
    shard_steps: int | None
    compression: str
    block_steps: int

    @classmethod
    def from_meta(cls, meta: dict, location: str) -> "Layout":
        version = int(meta["format_version"])
        if version > FORMAT_VERSION:
            raise ValueError(
                f"Archive(): {location} has format version {version}, newer than this "
                f"equibuffer reads ({FORMAT_VERSION}); upgrade equibuffer."
            )
        rows, chunk_steps = int(meta["rows"]), int(meta["chunk_steps"])
        shard = meta["shard_steps"]
        shard_steps = None if shard is None else int(shard)
        leaves = tuple(Leaf.from_json(d) for d in meta["leaves"])
        step_bytes = max(leaf.step_bytes for leaf in leaves)
        # Steps per block of a long read or an iteration: about 32 MiB, whole shards.
        unit = shard_steps or chunk_steps
        block_steps = unit * pow2_floor(BLOCK_BYTES / (rows * unit * step_bytes))
        return cls(rows, leaves, chunk_steps, shard_steps, meta["compression"], block_steps)


def create(
    store: Store,
    storage: RingStorage | StepSchema,
    compression: str,
    chunk_steps: int | None,
    shard_steps: int | None,
    metadata: dict | None = None,
) -> dict:
    """Create the archive's arrays for the schema of `storage`, then the root group's record
    (written last: it marks the archive complete); returns the record."""
    where = "Archive()"
    codec = compressor(compression)
    leaves, _ = schema_of(storage)
    rows = storage.rows
    step_bytes = max(leaf.step_bytes for leaf in leaves)
    if chunk_steps is None:
        chunk_steps = min(MAX_CHUNK_STEPS, pow2_floor(CHUNK_BYTES / step_bytes))
    chunk_steps = check_positive_int(where, "chunk_steps", chunk_steps)
    if shard_steps is None:
        shard_steps = chunk_steps * pow2_floor(SHARD_BYTES / (rows * chunk_steps * step_bytes))
    elif shard_steps == 0:
        shard_steps = None
    else:
        shard_steps = check_positive_int(where, "shard_steps", shard_steps)
    if shard_steps is not None and shard_steps % chunk_steps:
        raise ValueError(
            f"{where}: shard_steps={shard_steps} must be a multiple of chunk_steps={chunk_steps}."
        )
    group = zarr.open_group(store, mode="a", zarr_format=3)
    for leaf in leaves:
        create_leaf_array(group, leaf, rows, chunk_steps, shard_steps, codec)
    meta = {
        "format_version": FORMAT_VERSION,
        "rows": rows,
        "chunk_steps": chunk_steps,
        "shard_steps": shard_steps,
        "compression": compression,
        "leaves": [leaf.as_json() for leaf in leaves],
        "committed": Commit().as_json(),
    }
    if metadata is not None:
        meta["metadata"] = metadata
    group.update_attributes({ATTR: meta})
    return meta


def create_leaf_array(
    group: Any, leaf: Leaf, rows: int, chunk_steps: int, shard_steps: int | None, codec: Any
) -> None:
    """(Re)create the empty array of one leaf in the archive's root `group`."""
    group.create_array(
        leaf.name,
        shape=(rows, 0, *leaf.shape),
        dtype=leaf.stored,
        chunks=(1, chunk_steps, *leaf.shape),
        shards=None if shard_steps is None else (rows, shard_steps, *leaf.shape),
        compressors=codec,
        fill_value=0,
        # One folder per leaf holding every chunk (not one folder per chunk).
        chunk_key_encoding={"name": "default", "separator": "."},
        dimension_names=("row", "time", *(f"{leaf.name}_{i}" for i in range(len(leaf.shape)))),
        attributes={ATTR: {"path": leaf.path, "dtype": leaf.dtype}},
        overwrite=True,
    )


# A leaf whose chunks the codec shrinks by less than this ratio is stored without it: decoding
# costs more than the bytes saved (measured: float32 noise, ratio 1.08 under zstd level 1,
# decodes at 0.39 GB/s per core, where a copy of raw bytes runs at tens of GB/s).
WORTH_COMPRESSING = 1.2
SAMPLE_BYTES = 1 << 20  # the bytes of a leaf's first write the decision compresses, at most
JUDGED_CHUNKS = 64  # the chunks it compresses, at most
# The least a part of a chunk must hold to be judged: the codec's frame (9 to 16 bytes for
# zstd and blosc) is then at most 1.6% of it. A few steps of a bool leaf are less than their
# frame, and looked incompressible (though such a leaf compresses several-fold).
JUDGED_BYTES = 1 << 10


def worth_compressing(codec: Any, steps: np.ndarray, chunk_steps: int) -> bool:
    """Whether `codec` (a numcodecs codec) shrinks a leaf's chunks by at least
    `WORTH_COMPRESSING`, judged on its first written steps `(rows, k, *leaf)` cut as the
    archive stores them: one row's `chunk_steps` steps, each piece encoded on its own (the
    codec's frame included), up to `JUDGED_CHUNKS` pieces (`SAMPLE_BYTES`) taken evenly over
    time and rows. A first write shorter than a chunk is judged on its part of the first
    chunk of each row when that holds at least `JUDGED_BYTES`; with less there is too
    little to judge, and the codec is kept."""
    rows, k = steps.shape[:2]
    step_bytes = max(1, steps[0, 0].nbytes)
    span = min(k, chunk_steps)  # the steps of one piece
    if span < chunk_steps and span * step_bytes < JUDGED_BYTES:
        return True
    pieces = rows * (k // span)  # time-major: piece `i` is row `i % rows`, chunk `i // rows`
    count = min(pieces, JUDGED_CHUNKS, max(1, SAMPLE_BYTES // (span * step_bytes)))
    raw = encoded = 0
    for i in np.unique(np.linspace(0, pieces - 1, count).round().astype(np.int64)):
        row, chunk = int(i) % rows, int(i) // rows
        piece = np.ascontiguousarray(steps[row, chunk * span : (chunk + 1) * span])
        raw += piece.nbytes
        encoded += len(memoryview(codec.encode(piece)).cast("B"))
    return raw >= WORTH_COMPRESSING * encoded


def document(record: dict) -> bytes:
    """A metadata document (`zarr.json`) as the archive rewrites it: compact JSON (Python's C
    encoder; zarr's indentation goes through the pure-Python one, 0.23 ms per document,
    about 9% of a write of 16 steps), the same content as zarr writes."""
    return json.dumps(record).encode()


# ------------------------------------------------------------------------------- codecs


class Zstd:
    """numcodecs' `Zstd` (zarr's zstd codec), encoding and decoding through contexts kept by
    each thread (python-zstandard's `ZstdCompressor` and `ZstdDecompressor`) instead of ones
    set up for every call: the same frames (checked in tests/test_archive.py against
    numcodecs and zarr's own path), a 1 KiB chunk encoded in 1.7 us instead of 16 and decoded
    in 1.4 us instead of 12 (a 96 KiB one in 5.4 instead of 14), where an archive with small
    leaves beside a wide one codes tens of thousands of such chunks per GB and a random
    window decodes a chunk of every leaf. A frame that does not record its decoded size
    (another writer's) is decoded by numcodecs."""

    def __init__(self, level: int, checksum: bool):
        import numcodecs

        self.numcodec = numcodecs.Zstd(level=level, checksum=checksum)
        self.level, self.checksum = level, checksum
        self.local = threading.local()

    def __reduce__(self) -> tuple:  # (pickled without its threads' contexts)
        return Zstd, (self.level, self.checksum)

    def encode(self, x: np.ndarray) -> bytes:
        compressor = getattr(self.local, "compressor", None)
        if compressor is None:
            import zstandard

            compressor = zstandard.ZstdCompressor(level=self.level, write_checksum=self.checksum)
            self.local.compressor = compressor
        return compressor.compress(np.ascontiguousarray(x).data.cast("B"))

    def decode(self, data: Any, out: np.ndarray | None = None) -> Any:
        import zstandard

        decompressor = getattr(self.local, "decompressor", None)
        if decompressor is None:
            decompressor = self.local.decompressor = zstandard.ZstdDecompressor()
        try:
            raw = decompressor.decompress(data)
        except zstandard.ZstdError:  # (no decoded size in the frame's header)
            return self.numcodec.decode(data, out=out)
        if out is None:
            return raw
        if len(raw) != out.nbytes:
            raise ValueError(
                f"a zstd chunk decodes to {len(raw)} bytes where {out.nbytes} were expected"
            )
        out[...] = np.frombuffer(raw, out.dtype).reshape(out.shape)
        return out


def numcodec(codec: Any) -> Any:
    """The numcodecs twin of a zarr v3 compressor (same bytes; zstd's encoding through `Zstd`),
    None for no compressor, or `False` for one the archive does not encode itself (zarr's own
    path is used then)."""
    import numcodecs

    if codec is None:
        return None
    if isinstance(codec, zarr.codecs.ZstdCodec):
        return Zstd(level=codec.level, checksum=codec.checksum)
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


def direct_codecs(array: Any) -> tuple[Any, Any] | None:
    """`(compressor, sharding)` when the archive can read and write `array`'s chunks itself:
    the `bytes` codec (little endian) then at most one zstd/blosc compressor, either
    unsharded or in zarr's default shard layout (index at the end: `(offset, nbytes)` uint64
    pairs in C order over the shard's chunks, then its crc32c). None otherwise."""
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
    codec = numcodec(codecs[1] if len(codecs) == 2 else None)
    return None if codec is False else (codec, sharding)


def separator(array: Any) -> str:
    """The separator of an array's chunk keys."""
    encoding = getattr(array.metadata, "chunk_key_encoding", None)
    return getattr(encoding, "separator", "/")
