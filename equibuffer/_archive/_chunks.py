"""The archive's own encoding and I/O of chunks and shards, byte for byte what zarr writes:
the `bytes` codec (little endian), then the compressor (numcodecs, the same bytes as zarr's
codecs), in zarr's shard format; every chunk full-sized (a tail chunk padded with the fill
value 0). A long write encodes concurrently and writes each shard once, a long read moves
whole shards, and random windows read one shard index and the chunks they touch; zarr's own
path is slower at each (measured in `benchmarks/README.md`) and is kept as the reference
(`Archive._direct_io = False`), tested to write the same objects.
"""

import functools
import os
from collections.abc import Sequence
from typing import Any

import google_crc32c
import numpy as np

from ._format import direct_codecs, Layout, Leaf, separator
from ._store import Objects


EMPTY = (1 << 64) - 1  # the shard index's mark of a chunk that is not stored


class LeafIO:
    """The archive's own I/O of one leaf array: the encoding of its chunks (`Chunks` stores
    each chunk as an object, `Shards` packs them into shards). Abstract: the two are final
    and set every field."""

    objects: Objects
    name: str
    shape: tuple[int, ...]  # one chunk: `(chunk_steps, *leaf)`
    dtype: np.dtype
    sep: str
    tail: str
    codec: Any

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
        return x.data.cast("B") if self.codec is None else self.codec.encode(x)


def _fields(io: LeafIO, objects: Objects, leaf: Leaf, chunk_steps: int, codec: Any, sep: str):
    io.objects = objects
    io.name = leaf.name
    io.shape = (chunk_steps, *leaf.shape)
    io.dtype = np.dtype(leaf.stored).newbyteorder("<")
    io.sep = sep
    io.tail = f"{sep}0" * len(leaf.shape)
    io.codec = codec


class Chunks(LeafIO):
    """Direct I/O of the chunks of one unsharded leaf array: key `name/c.row.chunk.0...` (or
    with the array's own separator), one object each."""

    def __init__(self, objects: Objects, leaf: Leaf, chunk_steps: int, codec: Any, separator: str):
        _fields(self, objects, leaf, chunk_steps, codec, separator)

    def data(self, row: int, chunk: int) -> Any:
        """The encoded chunk, or None if it was never written."""
        return self.objects.get(self.key(row, chunk))

    def get(self, row: int, chunk: int) -> np.ndarray | None:
        """The decoded chunk (read-only), or None if it was never written."""
        data = self.data(row, chunk)
        return None if data is None else self.decode(data)

    def put(self, row: int, chunk: int, x: np.ndarray) -> None:
        """Replace one chunk atomically."""
        self.objects.put(self.key(row, chunk), [self.encode(x)])


@functools.cache
def morton_ranks(shape: tuple[int, int]) -> dict[tuple[int, int], int]:
    """The rank of each chunk `(row, chunk)` of a shard of `shape` chunks in Morton (Z)
    order, the order in which zarr's sharding codec lays chunks out by default: the
    coordinates' bits interleaved, lowest first, each dimension taking the bits its size
    needs."""
    bits = [(c - 1).bit_length() for c in shape]
    coords = np.indices(shape).reshape(len(shape), -1)
    code = np.zeros(coords.shape[1], np.int64)
    out = 0
    for b in range(max(bits, default=0)):
        for d, n in enumerate(bits):
            if b < n:
                code |= ((coords[d] >> b) & 1) << out
                out += 1
    order = np.argsort(code, kind="stable")
    return {(int(r), int(j)): k for k, (r, j) in enumerate(coords.T[order])}


class Shards(LeafIO):
    """Direct I/O of one leaf array stored in shards `(rows, shard_steps, *leaf)` of chunks
    `(1, chunk_steps, *leaf)`, byte for byte zarr's sharding codec: the shard object
    `name/c.0.shard.0...` holds the encoded chunks back to back in Morton order, then the
    index (an `(offset, nbytes)` pair of little-endian uint64 per chunk, C order over
    `(row, chunk)`, `2**64 - 1` twice for a chunk not stored) and the crc32c of the index.

    A long read or write moves whole shards (few, large objects); random windows read the
    index and only the chunks they need (the index of a complete shard is cached: such a
    shard is never rewritten)."""

    def __init__(
        self,
        objects: Objects,
        leaf: Leaf,
        rows: int,
        chunk_steps: int,
        shard_steps: int,
        codec: Any,
        separator: str,
    ):
        _fields(self, objects, leaf, chunk_steps, codec, separator)
        self.rows = rows
        self.per_shard = shard_steps // chunk_steps  # chunks per row in a shard
        self.index_bytes = 16 * rows * self.per_shard + 4
        self.indexes: dict[int, np.ndarray] = {}  # complete shards' indexes
        self.order = morton_ranks((rows, self.per_shard))

    def shard_key(self, shard: int) -> str:
        return self.key(0, shard)

    def parse_index(self, shard: int, raw: Any) -> np.ndarray:
        """`(rows, per_shard, 2)` offsets and sizes, checked against the crc32c."""
        raw = bytes(raw)
        body, crc = raw[:-4], raw[-4:]
        if google_crc32c.value(body) != int.from_bytes(crc, "little"):
            raise OSError(
                f"Archive: the index of shard {self.shard_key(shard)!r} fails its checksum: "
                "the object is corrupt."
            )
        return np.frombuffer(body, "<u8").reshape(self.rows, self.per_shard, 2)

    def get_shard(self, shard: int) -> tuple[np.ndarray, memoryview] | None:
        """`(index, the whole object)`, or None if the shard was never written."""
        data = self.objects.get(self.shard_key(shard))
        if data is None:
            return None
        return self.parse_index(shard, data[-self.index_bytes :]), data

    def get_chunks(self, shard: int, which: Sequence[tuple[int, int]], complete: bool) -> list[Any]:
        """The encoded chunks `(row, chunk in the shard)` of `which` (None: not stored),
        reading only the index (unless cached) and those bytes, from one version of the
        shard: one open file on a local directory; on a store, where ranged reads are
        separate requests, ranged reads only for a `complete` shard (never replaced), else
        the whole object, once."""
        key = self.shard_key(shard)
        none: list[Any] = [None] * len(which)
        index = self.indexes.get(shard)
        if self.objects.root is not None:
            try:
                fd = os.open(os.path.join(self.objects.root, key), os.O_RDONLY)
            except FileNotFoundError:
                return none
            try:
                if index is None:
                    size = os.fstat(fd).st_size
                    index = self.parse_index(
                        shard, os.pread(fd, self.index_bytes, size - self.index_bytes)
                    )
                spans = [(int(index[r, j, 0]), int(index[r, j, 1])) for r, j in which]
                out = [None if o == EMPTY else os.pread(fd, n, o) for o, n in spans]
            finally:
                os.close(fd)
        elif complete:
            if index is None:
                got = self.objects.get_ranges(key, [(-self.index_bytes, 0)])
                if got is None:
                    return none
                index = self.parse_index(shard, got[0])
            spans = [(int(index[r, j, 0]), int(index[r, j, 1])) for r, j in which]
            ranges = [(o, o + n) for o, n in spans if o != EMPTY]
            got = self.objects.get_ranges(key, ranges) if ranges else []
            if got is None:
                return none
            data = iter(got)
            out = [None if o == EMPTY else next(data) for o, _ in spans]
        else:
            whole = self.get_shard(shard)
            if whole is None:
                return none
            index, blob = whole
            spans = [(int(index[r, j, 0]), int(index[r, j, 1])) for r, j in which]
            out = [None if o == EMPTY else blob[o : o + n] for o, n in spans]
        if complete:
            self.indexes[shard] = index
        return out

    def put_shard(self, shard: int, chunks: dict[tuple[int, int], Any]) -> None:
        """Replace one shard atomically by the encoded `chunks` keyed `(row, chunk)`."""
        index = np.full((self.rows, self.per_shard, 2), EMPTY, "<u8")
        parts, offset = [], 0
        for r, j in sorted(chunks, key=self.order.__getitem__):
            data = chunks[(r, j)]
            n = memoryview(data).nbytes
            index[r, j] = offset, n
            parts.append(data)
            offset += n
        body = index.tobytes()
        parts.append(body + google_crc32c.value(body).to_bytes(4, "little"))
        self.objects.put(self.shard_key(shard), parts)


def direct_io(array: Any, leaf: Leaf, layout: Layout, objects: Objects) -> LeafIO | None:
    """The archive's own I/O of a leaf's array (`Shards` when sharded), or None when the
    array's codecs or chunks are not the ones its layout describes (changed by another tool:
    zarr's own path reads and writes it then)."""
    how = direct_codecs(array)
    if how is None:
        return None
    codec, sharding = how
    if sharding is None and layout.shard_steps is None:
        return Chunks(objects, leaf, layout.chunk_steps, codec, separator(array))
    if (
        sharding is not None
        and layout.shard_steps is not None
        and tuple(sharding.chunk_shape) == (1, layout.chunk_steps, *leaf.shape)
        and tuple(array.shards or ()) == (layout.rows, layout.shard_steps, *leaf.shape)
    ):
        return Shards(
            objects,
            leaf,
            layout.rows,
            layout.chunk_steps,
            layout.shard_steps,
            codec,
            separator(array),
        )
    return None
