"""What every import reads from: a `Source` of steps in the archive's layout, and the import
itself (`import_source`), which streams a source into an `Archive` in blocks of bounded
size, resumably. One module a format beside it (`_minari`, `_d4rl`, `_vault`) says how its
files map to a `Source`.

The layout of an imported data set (decided in issue 39, see docs/offline_data.md): the
episodes go back to back along the time axis of the archive's rows (one row for Minari and
D4RL, the Vault's own rows for a Vault), never padded. Each step is one observation and what
followed it: `observation`, `action`, `reward`, `terminated`, `truncated` (the action taken
there, its reward, and whether the episode terminated or was truncated on it), plus the
boolean `episode_end`, true on the last step of each episode. An episode of `T` actions whose
`T + 1` observations the source holds (Minari; D4RL with `next_observations`) is `T + 1`
steps: its last step holds the final observation with a zero action and reward and false
flags, so a transition from every one of its `T` steps, the last one included, pairs it with
the true next observation, and no window reaches into the next episode.
"""

import abc
import concurrent.futures
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, cast

import jax
import numpy as np
from jaxtyping import PyTree

from .._archive._archive import Archive
from .._archive._format import schema_diff, schema_of, StepSchema, storage_of
from .._archive._reader import progress_bar
from .._checks import check_positive_int
from .._episodes import top_level
from .._frames import as_frames, expected_older, frame_at, Frames, leaf_position


MIN_MEMORY = 1 << 20  # the smallest staging bound accepted (bytes)
DEFAULT_MEMORY = 1 << 30
# While a block is written it is held about twice (as read, then as the chunks encoded from
# it), and the next block is read meanwhile (itself, and what the source reads it from): at
# most about four blocks at once, so a block takes this fraction of the bound.
_BLOCK_SHARE = 0.2


class SourceError(ValueError):
    """A data set that cannot be imported as asked (a missing field, a space that does not
    match `like=`, a file that is not of the format): raised before anything is written.

    !!! example

        ```python
        import equibuffer as eb, tempfile

        try:
            eb.from_d4rl(tempfile.mkdtemp() + "/missing.hdf5", tempfile.mkdtemp() + "/a.zarr")
        except FileNotFoundError as error:
            assert "missing.hdf5" in str(error)
        assert issubclass(eb.SourceError, ValueError)
        ```
    """


class Source(abc.ABC):
    """Steps of a data set in the archive's layout, read in blocks of time.

    A subclass sets `where` (the import's name, for messages), `example` (one step: a pytree
    of NumPy arrays of the leaves' shapes and dtypes), `rows`, `steps` (time steps per row in
    all), `metadata` (JSON: what the archive keeps beside the data) and `identity` (JSON:
    what must match for a second run to carry on an import), and implements `read`."""

    where: str
    example: PyTree[np.ndarray]
    rows: int
    steps: int
    metadata: dict[str, Any]
    identity: dict[str, Any]

    @abc.abstractmethod
    def read(self, start: int, stop: int) -> PyTree[np.ndarray]:
        """Time steps `[start, stop)` of every row: the example's tree of `(rows, stop -
        start, *leaf)` arrays."""

    def close(self) -> None:  # noqa: B027 (a source that holds no file needs none)
        """Release the files the source holds open."""

    def step_bytes(self) -> int:
        """Bytes of one time step of every row."""
        return self.rows * sum(x.nbytes for x in jax.tree.leaves(self.example))


@dataclasses.dataclass
class ImportOptions:
    """What every import takes beside its source (see `from_minari`)."""

    memory: int = DEFAULT_MEMORY
    like: Any = None
    progress: bool = True
    compression: Any = "zstd"
    chunk_steps: int | None = None
    shard_steps: int | None = None
    storage_options: dict[str, Any] | None = None
    frames: Frames | None = None


class FramesSource(Source):
    """A source whose observation leaf holds stacked frames, imported one frame per step
    (`frames=` on an import): each step keeps its stack's newest frame, after checking that
    the frame before it is the previous step's newest (or, at an episode's first step, the
    padding), as a buffer's `add` checks it. What `eb.ArchiveLoader(..., frames=)` stacks
    again."""

    def __init__(self, inner: Source, frames: Frames):
        where = inner.where
        ends = "episode_end" if top_level(inner.example, "episode_end") is not None else None
        self.frames = frames.checked(where, inner.example, ends)
        self.inner = inner
        self.where, self.rows, self.steps = where, inner.rows, inner.steps
        self._i = leaf_position(inner.example, self.frames.leaf)
        leaves, treedef = jax.tree.flatten(inner.example)
        leaves[self._i] = frame_at(leaves[self._i][None], 1, self.frames.axis, 0)[0]
        self.example = jax.tree.unflatten(treedef, leaves)
        f = self.frames
        said = {"leaf": f.leaf, "k": f.k, "axis": f.axis, "padding": f.padding}
        self.metadata = {**inner.metadata, "frames": {**said, "episode_end": str(f.episode_end)}}
        self.identity = {**inner.identity, "frames": said}

    def read(self, start: int, stop: int) -> PyTree[np.ndarray]:
        f, i = self.frames, self._i
        first = max(0, start - 1)  # (the step before, whose frame the first stack holds)
        steps = self.inner.read(first, stop)
        leaves, treedef = jax.tree.flatten(steps)
        stacks = np.asarray(leaves[i])
        newest = frame_at(stacks, 2, f.axis, f.k - 1)
        if f.k > 1:
            older = frame_at(stacks, 2, f.axis, f.k - 2)
            ends = np.asarray(f.ends_of(steps, 2))  # (rows, time)
            # The first step read starts an episode if it is the data set's first; otherwise
            # it is the step before `start`, read for its frame only (its own check unused).
            start_0 = np.full(ends.shape[0], first == 0)
            expected = expected_older(f, newest, newest[:, 0], start_0, ends, np)
            lo = start - first  # (the step before `start` was only read for its frame)
            bad = np.any((older != expected).reshape(*older.shape[:2], -1), axis=-1)[:, lo:]
            if bad.any():
                row, t = (int(x[0]) for x in np.nonzero(bad))
                raise SourceError(
                    f"{self.where}: the data set's stacked observations [{f.leaf!r}] disagree "
                    f"at step {start + t} of row {row}: frame {f.k - 2} of its stack (k={f.k}, "
                    f"axis={f.axis}) is not the previous step's newest frame (nor, at an "
                    f"episode's first step, the padding={f.padding!r} frame). Give the axis "
                    "and padding the data set was stacked with, or import it whole (no "
                    "`frames=`)."
                )
        leaves = [x[:, start - first :] for x in leaves]
        leaves[i] = newest[:, start - first :]
        return jax.tree.unflatten(treedef, leaves)

    def close(self) -> None:
        self.inner.close()


def check_like(where: str, example: PyTree[np.ndarray], like: Any) -> None:
    """`like` (a buffer or `RingStorage`) holds steps of exactly the source's leaves, shapes
    and dtypes; else a `SourceError` naming each field that differs and what it expected."""
    storage = storage_of(like, where)
    want, _ = schema_of(StepSchema(_staged(example, 1), 1))
    got, _ = schema_of(storage)
    diff = schema_diff(want, 1, got, 1)
    if diff:
        said = "; ".join(d.replace("the archive", "the data set") for d in diff)
        raise SourceError(f"{where}: the data set's steps do not match `like`: {said}.")


def _staged(example: PyTree[np.ndarray], rows: int) -> PyTree[jax.ShapeDtypeStruct]:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows, 1, *np.shape(x)), np.asarray(x).dtype), example
    )


def block_steps(where: str, source: Source, memory: int) -> int:
    """Time steps per staged block: `_BLOCK_SHARE` of `memory`, at least one step."""
    memory = check_positive_int(where, "memory", memory, limit=None)
    step = source.step_bytes()
    if memory < max(MIN_MEMORY, math.ceil(step / _BLOCK_SHARE)):
        need = max(MIN_MEMORY, math.ceil(step / _BLOCK_SHARE))
        raise ValueError(
            f"{where}: memory={memory} bytes is too small: a step of every row is {step} "
            f"bytes, and the import needs at least {need} bytes to stage one."
        )
    return max(1, int(memory * _BLOCK_SHARE) // step)


def _blocks(start: int, stop: int, size: int) -> Iterator[tuple[int, int]]:
    for a in range(start, stop, size):
        yield a, min(stop, a + size)


def _stream(source: Source, archive: Archive, blocks: list[tuple[int, int]], bar: Any) -> None:
    """Append the source's `blocks` in order, each read on a thread of its own while the one
    before is written (the source read by that one thread only, block after block)."""
    with concurrent.futures.ThreadPoolExecutor(1, "equibuffer-import") as reader:
        ahead = reader.submit(source.read, *blocks[0]) if blocks else None
        for i, (a, b) in enumerate(blocks):
            assert ahead is not None
            steps = ahead.result()
            ahead = reader.submit(source.read, *blocks[i + 1]) if i + 1 < len(blocks) else None
            archive.append(steps)
            del steps  # (before the next block is waited for: two at most are held)
            bar.update((b - a) * source.rows)


def import_source(source: Source, store: Any, options: ImportOptions) -> Archive:
    """Stream `source` into the archive at `store` (created, or carried on where an earlier
    run of the same import stopped), in blocks of bounded size, and close the source; returns
    the archive opened read-only. With `options.frames`, one frame per step of the stacked
    observation leaf (`FramesSource`)."""
    try:
        frames = as_frames(source.where, options.frames)
        if frames is not None:
            source = FramesSource(source, frames)
        return _import(source, store, options)
    finally:
        source.close()


def _import(source: Source, store: Any, options: ImportOptions) -> Archive:
    where = source.where
    if options.like is not None:
        check_like(where, source.example, options.like)
    size = block_steps(where, source, options.memory)
    meta = {"source": source.identity, **source.metadata}
    schema = StepSchema(_staged(source.example, source.rows), source.rows)
    archive = Archive(
        store,
        cast(Any, schema),
        compression=options.compression,
        chunk_steps=options.chunk_steps,
        shard_steps=options.shard_steps,
        progress=False,
        storage_options=options.storage_options,
        metadata=meta,
    )
    with archive:
        held = archive.metadata.get("source")
        if held != source.identity:
            raise SourceError(
                f"{where}: the archive at {store} holds "
                + ("no import" if held is None else f"an import of {held}")
                + f", not of {source.identity}: give the import a new path (or remove it)."
            )
        done = len(archive)
        with progress_bar()(
            total=source.steps * source.rows,
            initial=done * source.rows,
            unit="step",
            unit_scale=True,
            desc=where,
            disable=not options.progress,
            leave=False,
        ) as bar:
            _stream(source, archive, list(_blocks(done, source.steps, size)), bar)
    return Archive(
        store,
        cast(Any, schema),
        mode="r",
        progress=options.progress,
        storage_options=options.storage_options,
    )
