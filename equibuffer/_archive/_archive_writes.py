"""The write methods of `Archive` (`write`, `write_async`, `flush`), inherited by it: each
hands the call to the archive's `Writer` (`_writer`), refusing it on an archive opened
read-only. Kept apart from the class so that the archive's surface stays one concern per
module; the state they use (`_writer`) is set by `Archive.__init__`."""

import concurrent.futures

from jaxtyping import ArrayLike, PyTree

from ._format import BufferLike, OnLost
from ._writer import Writer


class ArchiveWrites:
    """The writing half of [`equibuffer.Archive`][]'s methods (see there)."""

    _writer: Writer | None

    # ------------------------------------------------------------------------- writing

    def _writing(self, where: str) -> Writer:
        if self._writer is None:
            raise PermissionError(f"{where}: the archive was opened with mode='r' (read-only).")
        return self._writer

    def write(self, buffer: BufferLike, *, on_lost: OnLost | None = None) -> int:
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

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=16)
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
        return self._writing("Archive.write()").write(buffer, on_lost)

    def write_async(
        self, buffer: BufferLike, *, on_lost: OnLost | None = None
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

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                for t in range(3):
                    buffer = buffer.add({"x": jnp.full((1, 4), t, jnp.float32)})
                    archive.write_async(buffer)  # returns once the steps are copied
                archive.flush()  # wait for the writes (close() does too)
                assert len(archive) == 12
            ```
        """
        return self._writing("Archive.write_async()").write_async(buffer, on_lost)

    def append(self, steps: PyTree[ArrayLike]) -> int:
        """Append steps given as arrays, without a buffer: `steps` holds each leaf as
        `(rows, k, *leaf)` (NumPy or JAX), in the archive's tree structure (or, for an archive
        opened without `like`, a dict by leaf name, as `read` returns). The `k` steps are
        committed as the source's next `k` (`source_steps` grows by `k`), as `write` commits
        a buffer's new steps: what an import from another format writes.

        **Returns:**

        `k`. A leaf missing, extra, or of another shape or dtype raises a `ValueError` that
        names it, and nothing is written.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, numpy as np, zarr

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=2, capacity=4)
            with eb.Archive(zarr.storage.MemoryStore(), buffer) as archive:
                assert archive.append({"x": np.ones((2, 3), np.float32)}) == 3
                assert len(archive) == archive.source_steps == 3
            ```
        """
        return self._writing("Archive.append()").append_steps(steps, "Archive.append()")

    def flush(self) -> None:
        """Wait for every write started by `write_async`; raise the error of one that
        failed (once: the archive is then back at its last commit, and writes may go on).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp, tempfile

            buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=16)
            with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
                buffer = buffer.add({"x": jnp.arange(4.0)[None]})
                future = archive.write_async(buffer)
                archive.flush()  # wait for the background write
                assert future.done() and future.result() == 4
                assert len(archive) == 4
            ```
        """
        if self._writer is not None:
            self._writer.flush()
