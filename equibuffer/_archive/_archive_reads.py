"""The read methods of `Archive` (`read`, `iter`, `load`, `restore`) and its sampling
(`sample`), inherited by it: each hands the call to the archive's `Reader` (`_reader`), or
to `_sampler.sample`, on the snapshot the archive holds. Kept apart from the class so that
the archive's surface stays one concern per module; the state they use (`_reader`) is set by
`Archive.__init__`."""

from collections.abc import Iterator
from typing import TypeVar

import numpy as np
from jaxtyping import PyTree

from .._frames import Frames
from ._format import BufferLike, Rows
from ._reader import Reader
from ._sampler import ArchiveSample, sample, Seed


B = TypeVar("B", bound=BufferLike)


class ArchiveReads:
    """The reading and sampling half of [`equibuffer.Archive`][]'s methods (see there)."""

    _reader: Reader

    # ------------------------------------------------------------------------- reading

    def read(
        self,
        start: int = 0,
        stop: int | None = None,
        *,
        rows: Rows = None,
        frames: Frames | None = None,
    ) -> PyTree[np.ndarray]:
        """Time steps `[start, stop)` (negative counts from the end, like Python) of the
        selected `rows` (None: all; an int sequence; or a slice), as NumPy arrays
        `(rows, stop - start, *leaf)` in the buffer's tree structure (a dict by leaf name
        without `like`). Asking beyond the committed length raises an `IndexError` that
        says how many steps there are.

        `frames`: an [`equibuffer.Frames`][] (its `episode_end` the name of the archive's
        bool episode-end leaf), for an archive of one frame per step (of a buffer with
        `frames=`): the frames leaf comes back as the stacks the frame-stacking wrapper
        returned at each step, built from the `k - 1` steps before it as well, as every
        sample of the buffer returns them. A step fewer than `k - 1` steps after steps the
        archive lost (or after its first step, unless that was its source's first) has
        frames that are not held, and is refused with a `ValueError` that says where to read
        from.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.ItemBuffer({"obs": jnp.zeros(3)}, add_batch_size=2, capacity=32)
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
        if frames is not None:
            return self._reader.read_stacked(start, stop, rows, frames)
        return self._reader.read(start, stop, rows)

    def iter(
        self,
        steps: int | None = None,
        *,
        start: int = 0,
        stop: int | None = None,
        rows: Rows = None,
    ) -> Iterator[tuple[int, PyTree[np.ndarray]]]:
        """Iterate over `[start, stop)` in blocks of `steps` time steps (default
        `block_steps`: about 32 MiB, or a shard), yielding `(index of the block's first step,
        data)` with data as in `read`. The snapshot is the one current when iteration starts.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=16)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                archive.write(buffer.add({"x": jnp.arange(10.0)[None]}))
                blocks = list(archive.iter(4))
            assert [start for start, _ in blocks] == [0, 4, 8]
            assert [data["x"].shape for _, data in blocks] == [(1, 4), (1, 4), (1, 2)]
            assert blocks[2][1]["x"].tolist() == [[8.0, 9.0]]
            ```
        """
        return self._reader.iter(steps, start, stop, rows)

    def load(
        self,
        buffer: B,
        start: int | None = None,
        stop: int | None = None,
        *,
        rows: Rows = None,
        priority: float | None = None,
    ) -> B:
        """Return `buffer` holding archive steps `[start, stop)` (default: the newest that fit
        in its ring, within the last contiguous segment), with its counters set as if the
        source had added steps up to `stop`: ready for offline training with its own
        `sample`. The steps must fit in `max_length_time_axis` and not cross a gap of lost
        steps.

        The buffer is a working one of its kind: every piece of state kept beside the ring
        is rebuilt from the steps loaded, by the buffer's `with_storage` (see
        [`equibuffer.AbstractBuffer.with_storage`][]). Episode flags are recomputed from the
        stored steps; the priorities, which the archive does not hold, are set by one
        policy: every window enters at `priority` if given (it also becomes
        `max_priority`), else at the buffer's `max_priority` (1 for a new buffer), as new
        windows do; a `Queue`'s loaded steps all count as read.

        **Arguments:**

        - `buffer`: a buffer of the archive's schema (any ring buffer, a `Queue`, or a
            `RingStorage`); its steps and state are replaced. A `Mixer`, `RateLimited` or
            clustered buffer is refused with what to load instead.
        - `start`, `stop`: archive time indices.
        - `rows`: the rows to load (default all): as many as the buffer has.
        - `priority`: prioritised buffers only: the priority of every loaded window.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp, tempfile

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=16)
            path = tempfile.mkdtemp() + "/run.zarr"
            with eb.Archive(path, buffer) as archive:
                archive.write(buffer.add({"x": jnp.arange(10.0)[None]}))
            small = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                        max_length_time_axis=4,
                                        sequence_length=2)
            small = eb.Archive(path, small, mode="r").load(small, 2, 6)  # archive steps 2 to 5
            assert small.storage.steps_added() == 6  # as if the source had added 6 steps
            assert sorted(small.storage.data["x"][0].tolist()) == [2.0, 3.0, 4.0, 5.0]
            assert small.sample(jax.random.key(0), batch_size=8).experience["x"].shape == (8, 2)
            prioritised = eb.PrioritisedTrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                                         max_length_time_axis=4,
                                                         sequence_length=2, alpha=1.0)
            reader = eb.Archive(path, prioritised, mode="r")
            prioritised = reader.load(prioritised, 2, 6, priority=3.0)
            # windows starting at steps 2, 3 and 4, each at priority 3
            assert float(prioritised.tree.total()) == 9.0 == 3 * float(prioritised.max_priority)
            ```
        """
        return self._reader.load(buffer, start, stop, rows, priority)

    def restore(self, buffer: B, *, priority: float | None = None) -> B:
        """Return `buffer` holding the newest steps of the archive (as many as fit, after the
        last gap), with its count of steps added equal to `source_steps`, so that a resumed
        run continues where the archive stopped and `write` never writes a step twice.

        The buffer is a working one of its kind, rebuilt as `load` rebuilds it: episode
        flags recomputed from the stored steps; every valid window of a prioritised buffer
        at `priority`, or by default at the buffer's `max_priority` (1 for a new buffer),
        as new windows enter, since the archive holds steps, not priorities (they change
        at every learning step); a `Queue`'s restored steps all count as read. Pass
        `priority=` to restore at the scale of the priorities the run had reached (which
        then also becomes `max_priority`).

        **Arguments:**

        - `buffer`: a buffer of the archive's schema, typically a new one (any ring
            buffer, a `Queue`, or a `RingStorage`).
        - `priority`: prioritised buffers only: the priority of every restored window, a
            positive finite float.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp, tempfile

            def new_buffer():
                return eb.PrioritisedTrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=1,
                                                      max_length_time_axis=16,
                                                      sequence_length=2)
            buffer = new_buffer()
            path = tempfile.mkdtemp() + "/run.zarr"
            with eb.Archive(path, buffer) as archive:
                archive.write(buffer.add({"x": jnp.arange(10.0)[None]}))
            with eb.Archive(path, new_buffer()) as archive:  # a resumed run, a new buffer
                buffer = archive.restore(new_buffer())
                assert buffer.storage.steps_added() == archive.source_steps == 10
                sample = buffer.sample(jax.random.key(0), batch_size=4)  # 9 windows, each
                assert jnp.allclose(sample.probabilities, 1 / 9)  # at priority 1
                buffer = buffer.set_priorities(sample, jnp.full(4, 2.0))
                buffer = buffer.add({"x": jnp.arange(10.0, 12.0)[None]})
                assert archive.write(buffer) == 2  # only the new steps
            ```
        """
        return self._reader.restore(buffer, priority)

    # ------------------------------------------------------------------------ sampling

    def sample(
        self,
        key: Seed,
        batch_size: int,
        sequence_length: int,
        *,
        period: int = 1,
        rows: Rows = None,
    ) -> ArchiveSample:
        """Draw `batch_size` windows of `sequence_length` consecutive steps straight from the
        archive, reading each touched chunk once (concurrently).

        **Arguments:**

        - `key`: a JAX PRNG key (`jax.random.key(0)`, as every buffer's `sample` takes; the
            same key draws the same windows), a NumPy `Generator` (advanced by the draw) or
            an int seed.
        - `batch_size`: the number of windows.
        - `sequence_length`: the steps of each window.
        - `period`: windows start at archive time indices that are multiples of it.
        - `rows`: the rows to draw from (default all).

        **Returns:**

        An `ArchiveSample` of NumPy arrays (`eb.as_jax(sample)` for JAX arrays). The
        distribution: uniform with replacement over every `(row, start)` with `row` in
        `rows`, `start` a multiple of `period`, and the window inside the committed length
        and inside one contiguous segment (never across a gap of lost steps). Raises
        `ValueError` when there is no such window.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp, numpy as np, tempfile

            buffer = eb.ItemBuffer({"t": jnp.float32(0)}, add_batch_size=2, capacity=32)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                archive.write(buffer.add({"t": jnp.tile(jnp.arange(16.0), (2, 1))}))  # t at t
                batch = archive.sample(jax.random.key(0), 8, sequence_length=4, period=2)
                again = archive.sample(jax.random.key(0), 8, sequence_length=4, period=2)
            assert batch.experience["t"].shape == (8, 4)
            assert (batch.starts % 2 == 0).all() and (batch.starts <= 12).all()
            assert (batch.experience["t"] == batch.starts[:, None] + np.arange(4)).all()
            assert (again.starts == batch.starts).all()  # the same key, the same windows
            ```
        """
        return sample(self._reader, key, batch_size, sequence_length, period, rows)
