"""Sampling random windows straight from an archive: uniform over every `(row, start)` whose
window lies inside one contiguous segment of the committed steps, each touched chunk read
once; and the samples as JAX arrays (`as_jax`)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Key, PyTree, Shaped, UInt32

from .._checks import check_positive_int
from ..rules._valid import segment_starts
from ._chunks import Chunks, LeafIO, Shards
from ._reader import Reader
from ._store import run_all


class ArchiveSample(NamedTuple):
    """Windows sampled from an archive: `experience` leaves `(batch, sequence_length, *leaf)`
    (NumPy), and for each window its `rows` and the archive time index `starts` of its first
    step. `eb.as_jax(sample)` gives the same sample as JAX arrays.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp, zarr

        buffer = eb.ItemBuffer({"t": jnp.float32(0)}, add_batch_size=2, capacity=32)
        buffer = buffer.add({"t": jnp.tile(jnp.arange(16.0), (2, 1))})  # step t holds t
        with eb.Archive(zarr.storage.MemoryStore(), buffer) as archive:
            archive.write(buffer)
            sample = archive.sample(jax.random.key(0), batch_size=8, sequence_length=3)
        assert isinstance(sample, eb.ArchiveSample)
        assert sample.experience["t"].shape == (8, 3) and sample.rows.shape == (8,)
        assert (sample.experience["t"][:, 0] == sample.starts).all()
        ```
    """

    experience: PyTree[np.ndarray]
    rows: Int[np.ndarray, " batch"]
    starts: Int[np.ndarray, " batch"]


Seed = Key[Array, ""] | UInt32[Array, "2"] | np.random.Generator | int | np.integer


def generator(where: str, key: Any) -> np.random.Generator:
    """A NumPy generator from a JAX PRNG key (the same key, the same draws), a generator
    (used as it is) or an int seed."""
    if isinstance(key, np.random.Generator):
        return key
    if isinstance(key, int | np.integer) and not isinstance(key, bool):
        return np.random.default_rng(int(key))
    if isinstance(key, jax.Array):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            data = jax.random.key_data(key)
        elif key.dtype == jnp.uint32 and key.shape == (2,):  # a raw key, jax.random.PRNGKey
            data = key
        else:
            raise ValueError(
                f"{where}: expected one PRNG key (e.g. jax.random.key(0)), got an array of "
                f"shape {key.shape} and dtype {key.dtype}; split a batch of keys and pass one."
            )
        return np.random.default_rng(np.asarray(data, np.uint32))
    raise TypeError(
        f"{where}: `key` must be a JAX PRNG key (jax.random.key(0)), a numpy Generator or an "
        f"int seed, got {type(key).__name__}."
    )


def sample_arguments(
    where: str, key: Seed, batch_size: int, sequence_length: int, period: int
) -> tuple[np.random.Generator, int, int, int]:
    """The arguments of an archive's `sample` checked (errors start with `where`): the
    generator `key` gives, `batch_size`, `sequence_length` and `period`."""
    batch_size = check_positive_int(where, "batch_size", batch_size)
    seq = check_positive_int(where, "sequence_length", sequence_length)
    period = check_positive_int(where, "period", period)
    return generator(where, key), batch_size, seq, period


def sample(
    reader: Reader,
    key: Seed,
    batch_size: int,
    sequence_length: int,
    period: int,
    rows: Any,
) -> ArchiveSample:
    """`batch_size` windows drawn uniformly with replacement (see `Archive.sample`)."""
    where = "Archive.sample()"
    rng, batch_size, seq, period = sample_arguments(where, key, batch_size, sequence_length, period)
    row_ids = np.asarray(reader.row_ids(reader.rows_index(where, rows)), np.int64)
    firsts, counts = window_starts(reader, seq, period)
    per_row = int(sum(counts))
    if per_row == 0 or len(row_ids) == 0:
        raise ValueError(
            f"{where}: no window of sequence_length={seq} (period={period}) fits in the "
            f"{reader.commit.length} committed steps; write more or shorten the window."
        )
    u = rng.integers(0, len(row_ids) * per_row, size=batch_size)
    r = row_ids[u // per_row]
    k = u % per_row
    cum = np.cumsum([0, *counts])
    seg = np.searchsorted(cum, k, side="right") - 1
    starts = np.asarray(firsts)[seg] + (k - cum[seg]) * period
    return ArchiveSample(gather(reader, r, starts, seq), r, starts)


def window_starts(reader: Reader, seq: int, period: int) -> tuple[list[int], list[int]]:
    """Per contiguous segment of the committed steps, the first start (a multiple of
    `period`) and the number of windows of `seq` steps in it, for one row."""
    firsts, counts = [], []
    for a, b in reader.commit.segments():
        first, count = segment_starts(a, b, seq, period)
        if count > 0:
            firsts.append(first)
            counts.append(count)
    return firsts, counts


def gather(reader: Reader, rows: np.ndarray, starts: np.ndarray, seq: int) -> Any:
    """The windows `[start, start + seq)` of `rows`: every chunk they touch read and decoded
    once (concurrently), then each window gathered from the decoded chunks."""
    layout = reader.layout
    if reader.io is None:
        return reader.unflatten(_gather_zarr(reader, rows, starts, seq))
    cs = layout.chunk_steps
    steps = starts[:, None] + np.arange(seq)
    per_row = -(-reader.commit.length // cs)
    ids = (rows[:, None] * per_row + steps // cs).ravel()
    needed, which = np.unique(ids, return_inverse=True)
    row_of, chunk_of = np.divmod(needed, per_row)
    stacks = [np.empty((len(needed), *c.shape), c.dtype) for c in reader.io]
    if layout.shard_steps is None:
        _decode_chunks(reader.io, row_of, chunk_of, stacks)
    else:
        _decode_shards(reader, reader.io, row_of, chunk_of, stacks)
    which, offsets = which.reshape(steps.shape), steps % cs
    out = [
        stack[which, offsets].view(np.dtype(leaf.stored))
        for stack, leaf in zip(stacks, layout.leaves, strict=True)
    ]
    return reader.unflatten(out)


def _gather_zarr(reader: Reader, rows: np.ndarray, starts: np.ndarray, seq: int) -> list:
    """zarr's own path: one slice of each array per window."""
    out = []
    for leaf in reader.layout.leaves:
        array = reader.arrays[leaf.name]
        stack = np.empty((len(rows), seq, *leaf.shape), np.dtype(leaf.stored))
        for i, (r, a) in enumerate(zip(rows.tolist(), starts.tolist(), strict=True)):
            stack[i] = array[r, a : a + seq]
        out.append(stack)
    return out


def _decode_chunks(
    io: list[LeafIO], row_of: np.ndarray, chunk_of: np.ndarray, stacks: list
) -> None:
    """Unsharded: chunk `(row_of[k], chunk_of[k])` of every leaf into `stacks[leaf][k]`,
    one task per chunk."""
    tasks = [
        (chunks, stack, k)
        for chunks, stack in zip(io, stacks, strict=True)
        for k in range(len(row_of))
    ]

    def get(task: tuple[Chunks, np.ndarray, int]) -> None:
        chunks, stack, k = task
        data = chunks.data(int(row_of[k]), int(chunk_of[k]))
        chunks.decode_into(data, stack[k])

    for _ in run_all(get, tasks):
        pass


def _decode_shards(
    reader: Reader, io: list[LeafIO], row_of: np.ndarray, chunk_of: np.ndarray, stacks: list
) -> None:
    """Sharded: one task per (leaf, shard) touched reads the index (cached for complete
    shards) and only the chunks needed, each once, into `stacks[leaf][k]`."""
    shards_of: list[Any] = io
    ss = reader.layout.shard_steps
    assert ss is not None
    per, n = ss // reader.layout.chunk_steps, reader.commit.length
    s_of = chunk_of // per
    order = np.lexsort((row_of, s_of))  # the needed chunks grouped by shard
    groups = np.split(order, np.flatnonzero(np.diff(s_of[order])) + 1)

    def get(task: tuple[int, np.ndarray]) -> None:
        li, group = task
        shards: Shards = shards_of[li]
        stack = stacks[li]
        s = int(s_of[group[0]])
        which = [(int(row_of[k]), int(chunk_of[k]) - s * per) for k in group]
        datas = shards.get_chunks(s, which, complete=(s + 1) * ss <= n)
        for k, data in zip(group, datas, strict=True):
            shards.decode_into(data, stack[k])

    tasks = [(li, g) for g in groups for li in range(len(shards_of))]
    for _ in run_all(get, tasks):
        pass


def as_jax(
    tree: PyTree[np.ndarray | Array],
    device: Any = None,
) -> PyTree[Shaped[Array, "..."]]:
    """The NumPy leaves of an archive's results (an `ArchiveSample`, a `read`, a block of
    `iter`) as JAX arrays, ready for jitted code: one transfer of every leaf together to
    `device` (a device or a sharding; the default device by default), the tree's structure
    kept (an `ArchiveSample` stays one). 64-bit integers (a sample's `rows` and `starts`)
    become 32-bit unless 64-bit mode is on, as with `jnp.asarray`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp, tempfile

        buffer = eb.ItemBuffer({"obs": jnp.zeros(3)}, add_batch_size=2, capacity=32)
        buffer = buffer.add({"obs": jnp.ones((2, 16, 3))})
        with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
            archive.write(buffer)
            sample = eb.as_jax(archive.sample(jax.random.key(0), 32, sequence_length=4))
        assert isinstance(sample, eb.ArchiveSample)
        assert isinstance(sample.experience["obs"], jax.Array)
        assert sample.experience["obs"].shape == (32, 4, 3)
        loss = jax.jit(lambda obs: (obs**2).mean())(sample.experience["obs"])
        assert float(loss) == 1.0
        ```
    """
    return jax.device_put(tree, device)
