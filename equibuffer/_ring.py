"""Ring storage: a `(rows, length)` ring of a pytree, the state every buffer is built on."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from equinox.internal import unvmap_all, unvmap_any
from jaxtyping import Array, ArrayLike, Bool, Int, PyTree, Shaped, UInt32

from ._checks import (
    as_example,
    as_example_leaf,
    BARRIER_EXPANDED,
    check_dtype,
    check_fits,
    check_positive_int,
    check_representable,
    check_structure,
    keystr,
)
from ._custom_types import Count, ExampleTree, ExperienceBatch, IntScalar, StepCount
from ._errors import cleared, error_if, first_failure, raise_recorded
from ._frames import (
    as_frames,
    expected_older,
    frame_at,
    Frames,
    leaf_position,
    stack_sources,
)


_TWO_32 = 1 << 32


class Appended(NamedTuple):
    """What a write tells the sampling rules: the steps it kept and where they went.

    - `keep`: the number of steps written per row (static): `min(T, length)`.
    - `start`: the slot of the first of them (0-d int32); they fill slots
        `start, start + 1, ...` modulo `length`.
    - `steps`: the kept steps, leaves `(rows, keep, *leaf)`.
    - `refused`: whether a check refused the add (0-d bool, or `False`): the storage is then
        as it was, `steps` what the slots held, and a rule keeps its state as it was too.
    """

    keep: int
    start: Int[Array, ""]
    steps: ExperienceBatch
    refused: Bool[ArrayLike, ""] = False


def stored_steps(
    where: str, example: ExampleTree, frames: Frames | None
) -> tuple[Any, list[jax.ShapeDtypeStruct], Frames | None]:
    """What a ring stores of one step of `example`: the tree's structure, each leaf's shape
    and dtype (the frame leaf without its stack axis when `frames` is given), and `frames`
    checked against the example."""
    example = as_example(example)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(example)
    if not leaves:
        raise ValueError(f"{where}: `example` has no array leaves.")
    frames = as_frames(where, frames)
    if frames is not None:
        frames = frames.checked(where, example)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(frames.stored(example))
    return treedef, [as_example_leaf(path, leaf) for path, leaf in leaves], frames


class RingStorage(eqx.Module):
    """A ring of `length` time steps for each of `rows` rows, holding a pytree of arrays.

    Every row is written at the same time step (an `add` brings one or more steps for every
    row), so one write head, one fill count and one count of steps ever added describe all
    rows. The count is kept as two `uint32` words (`count_hi * 2**32 + count_lo`), so it never
    wraps in practice (2**64 steps).

    This is the storage layer shared by every buffer; most users never touch it directly, but
    `buffer.storage.data` is the place to look at what is stored.

    **Arguments:**

    - `example`: one step of experience, a pytree whose leaves are arrays (or
        `jax.ShapeDtypeStruct`s; Python and NumPy numbers and NumPy arrays are taken as
        `jnp.asarray` takes them); the storage allocates zeros shaped `(rows, length, *leaf)`.
    - `rows`: the number of rows (typically the number of parallel environments).
    - `length`: the number of time steps kept per row.
    - `frames`: an [`equibuffer.Frames`][] (its `episode_end` given), to store one frame per
        step of a stacked observation leaf and build the stacks when steps are read
        ([`equibuffer.RingStorage.take`][]); `example` then holds the stacked observation.

    !!! example

        ```python
        storage = RingStorage({"obs": jnp.zeros(3)}, rows=2, length=5)
        storage = storage.write({"obs": jnp.ones((2, 4, 3))})  # 4 steps for both rows
        assert int(storage.fill) == 4 and int(storage.head) == 4
        ```
    """

    data: PyTree[Shaped[Array, "rows length ..."]]
    # `[head, fill, count_lo, count_hi, error]` in one array: each leaf of a buffer costs a
    # jitted call from Python about 1 us to flatten and rebuild (see the properties below).
    counters: UInt32[Array, "5"]
    rows: int = eqx.field(static=True)
    length: int = eqx.field(static=True)
    frames: Frames | None = eqx.field(static=True)

    def __init__(
        self, example: ExampleTree, rows: int, length: int, *, frames: Frames | None = None
    ):
        where = f"{type(self).__name__}()"
        self.rows = check_positive_int(where, "rows", rows)
        self.length = check_positive_int(where, "length", length)
        if self.length >= 2**30:
            raise ValueError(f"{where}: `length` must be below 2**30, got {length}.")
        treedef, structs, self.frames = stored_steps(where, example, frames)
        given = f"`rows`={self.rows} and `length`={self.length}"
        check_fits(where, given, self.rows, self.length, structs)
        # Each leaf is its own allocation: donation refuses one buffer donated twice.
        self.data = jax.tree_util.tree_unflatten(
            treedef, [jnp.zeros((self.rows, self.length, *s.shape), s.dtype) for s in structs]
        )
        self.counters = jnp.zeros(5, jnp.uint32)

    @property
    def head(self) -> Int[Array, ""]:
        """The slot the next step of every row goes to (0-d int32)."""
        return self.counters[0].astype(jnp.int32)

    @property
    def fill(self) -> Int[Array, ""]:
        """The number of steps held per row, at most `length` (0-d int32)."""
        return self.counters[1].astype(jnp.int32)

    @property
    def count_lo(self) -> Count:
        """The low `uint32` word of the count of steps ever added per row."""
        return self.counters[2]

    @property
    def count_hi(self) -> Count:
        """The high `uint32` word of the count of steps ever added per row."""
        return self.counters[3]

    @property
    def error(self) -> UInt32[Array, "*stacked"]:
        """The failure recorded by a check inside jit (0-d `uint32`, 0 for none; one per
        buffer of a stack of them, as `vmap` or `per_device` make): raised by
        [`equibuffer.check`][] and at the buffer's next eager use (see
        [Troubleshooting](../troubleshooting.md))."""
        return self.counters[..., 4]

    def with_error(self, word: UInt32[Array, "*stacked"]) -> "RingStorage":
        """The storage with failure `word` recorded, unless one is recorded already (the
        first failure is kept)."""
        counters = self.counters.at[..., 4].set(first_failure(self.counters[..., 4], word))
        return eqx.tree_at(lambda s: s.counters, self, counters)

    def without_error(self, word: int) -> "RingStorage":
        """The storage with recorded failure `word` cleared (in each buffer of a stack that
        holds it; another failure stays): what the checked step (`eb.filter_jit`) hands back
        in `error.output` once it has raised that failure, the refused operation having
        changed nothing."""
        counters = self.counters.at[..., 4].set(cleared(self.counters[..., 4], word))
        return eqx.tree_at(lambda s: s.counters, self, counters)

    def with_counters(
        self,
        *,
        head: int | None = None,
        fill: int | None = None,
        steps_added: int | None = None,
    ) -> "RingStorage":
        """The storage with its write head, fill or count of steps added replaced (host
        side; `None` keeps the current value), the data unchanged: for restoring a ring whose
        data was put back in place, or for testing long runs without running them. Put it
        back into a buffer with `buffer.with_storage(storage)`, which rebuilds the state the
        buffer's rule keeps beside the ring (episode flags, priorities); `eqx.tree_at` alone
        would leave that state out of step with the ring.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            storage = eb.RingStorage({"x": jnp.zeros(())}, rows=1, length=4)
            storage = storage.with_counters(head=3, fill=4, steps_added=2**32 + 7)
            assert storage.steps_added() == 2**32 + 7 and int(storage.head) == 3
            ```
        """
        where = f"{type(self).__name__}.with_counters()"
        new = [int(c) for c in jax.device_get(self.counters)]
        if head is not None:
            if not 0 <= int(head) < self.length:
                raise ValueError(f"{where}: head={head} is not a slot of length={self.length}.")
            new[0] = int(head)
        if fill is not None:
            if not 0 <= int(fill) <= self.length:
                raise ValueError(f"{where}: fill={fill} is not in [0, length={self.length}].")
            new[1] = int(fill)
        if steps_added is not None:
            if not 0 <= int(steps_added) < 1 << 64:
                raise ValueError(f"{where}: steps_added={steps_added} is not in [0, 2**64).")
            new[2], new[3] = int(steps_added) % _TWO_32, int(steps_added) // _TWO_32
        counters = jax.device_put(jnp.asarray(new, jnp.uint32), self.counters.sharding)
        return eqx.tree_at(lambda s: s.counters, self, counters)

    def example(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The shape and dtype of one step, as `jax.ShapeDtypeStruct`s.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"obs": jnp.zeros(3), "done": jnp.zeros((), bool)}
            spec = eb.RingStorage(example, rows=2, length=5).example()
            assert spec["obs"].shape == (3,) and spec["obs"].dtype == jnp.float32
            assert spec["done"].shape == () and spec["done"].dtype == jnp.bool_
            ```
        """
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), self.data)

    def stacked_example(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The shape and dtype of one step as it is read ([`equibuffer.RingStorage.take`][],
        a sample): [`equibuffer.RingStorage.example`][], with the stack of `frames.k`
        frames in place of the one stored frame when the ring stacks frames.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"obs": jnp.zeros((84, 84, 4), jnp.uint8), "done": jnp.bool_(False)}
            frames = eb.Frames("obs", k=4, episode_end="done")
            ring = eb.RingStorage(example, rows=2, length=8, frames=frames)
            assert ring.example()["obs"].shape == (84, 84)  # one frame stored per step
            assert ring.stacked_example()["obs"].shape == (84, 84, 4)
            ```
        """
        example = self.example()
        return example if self.frames is None else self.frames.stacked(example)

    @property
    def lookback(self) -> int:
        """The number of earlier steps a step's read needs besides its own: `frames.k - 1`
        when the ring stacks frames, else 0."""
        return 0 if self.frames is None else self.frames.lookback

    def take(self, flat: Int[Array, "*b"]) -> PyTree[Shaped[Array, "..."]]:
        """The steps at the flat indices `row * length + slot` (any shape `*b`), leaves
        `(*b, *leaf)`: every view's read of the ring. When the ring stacks frames, the
        frames leaf of each step is the stack of its episode's last `k` frames
        (see [`equibuffer.Frames`][]), `(*b, *stacked)`.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
            ring = eb.RingStorage(example, rows=1, length=8,
                                  frames=eb.Frames("obs", k=2, episode_end="done"))
            done = jnp.array([[False, True, False]])  # episodes: steps 0-1, then 2
            ring = ring.write({"obs": jnp.arange(3.0)[None], "done": done})  # single frames
            obs = ring.take(jnp.array([1, 2]))["obs"]  # (2 steps, k=2)
            assert obs.tolist() == [[0.0, 1.0], [2.0, 2.0]]  # step 2 starts its episode
            ```
        """

        def plain(leaf: Array, at: Array) -> Array:
            return leaf.reshape(-1, *leaf.shape[2:]).at[at].get(mode="promise_in_bounds")

        frames = self.frames
        if frames is None:
            return jax.tree.map(lambda leaf: plain(leaf, flat), self.data)
        flat = jnp.asarray(flat, jnp.int32)  # (indices of a ring are int32, also under x64)
        length = self.length
        row, slot = flat // length, flat % length
        leaves, treedef = jax.tree.flatten(self.data)
        i = leaf_position(self.data, frames.leaf)
        out = [None if j == i else plain(leaf, flat) for j, leaf in enumerate(leaves)]
        if frames.k == 1:
            stacks = jnp.expand_dims(plain(leaves[i], flat), flat.ndim + frames.axis)
        else:
            back = jnp.arange(1, frames.k, dtype=flat.dtype).reshape(*(1,) * flat.ndim, -1)
            before = row[..., None] * length + (slot[..., None] - back) % length
            ends = frames.ends_of(jax.tree.map(lambda x: plain(x, before), self.data), before.ndim)
            offset = (slot - self.head + self.fill) % length
            slots, inside = stack_sources(frames, slot, offset, ends)
            stacks = plain(leaves[i], row[..., None] * length + slots % length)
            if frames.padding == "zeros":
                keep = inside.reshape(*inside.shape, *(1,) * (stacks.ndim - inside.ndim))
                stacks = jnp.where(keep, stacks, jnp.zeros((), stacks.dtype))
            stacks = jnp.moveaxis(stacks, flat.ndim, flat.ndim + frames.axis)
        out[i] = stacks
        return jax.tree.unflatten(treedef, out)

    def steps_added(self) -> int:
        """The count of steps ever added to each row, as a Python int (host side, not in jit).

        !!! example

            ```python
            storage = RingStorage({"x": jnp.zeros(())}, rows=1, length=2)
            assert storage.write({"x": jnp.zeros((1, 3))}).steps_added() == 3
            ```
        """
        return host_counters(self)[2]

    def count(self) -> StepCount:
        """The count of steps ever added to each row as a 0-d array, usable inside jit:
        `uint64` with `jax_enable_x64` (exact), else `uint32` (a count of `2**32` or more
        raises, through `eqx.error_if`). [`steps_added`][equibuffer.RingStorage.steps_added]
        is exact at any count, outside jit.

        !!! example

            ```python
            storage = RingStorage({"x": jnp.zeros(())}, rows=1, length=2)
            assert int(storage.write({"x": jnp.zeros((1, 3))}).count()) == 3
            ```
        """
        if jax.config.read("jax_enable_x64"):
            hi = self.count_hi.astype(jnp.uint64)
            return hi * jnp.uint64(_TWO_32) + self.count_lo.astype(jnp.uint64)
        return error_if(
            self.count_lo,
            self.count_hi > 0,
            "the count of steps added per row is 2**32 or more, more than a uint32 holds: "
            "enable jax_enable_x64 for an exact uint64 count, or read "
            "`buffer.storage.steps_added()` outside jit.",
        )

    def steps_in(self, batch: ExperienceBatch, where: str = "add()") -> int | None:
        """Check `batch` against the stored tree and return its number of steps.

        Returns `None` for a single step (leaves `(rows, *leaf)`), else `T` for leaves
        `(rows, T, *leaf)`. Raises a `ValueError`/`TypeError` naming the first bad leaf.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            storage = eb.RingStorage({"obs": jnp.zeros(3)}, rows=2, length=5)
            assert storage.steps_in({"obs": jnp.zeros((2, 3))}) is None  # one step
            assert storage.steps_in({"obs": jnp.zeros((2, 7, 3))}) == 7  # T steps (any T >= 1)
            try:
                storage.steps_in({"obs": jnp.zeros((3, 3))}, where="my_add()")  # 3 rows, not 2
            except ValueError as error:
                assert str(error).startswith("my_add(): leaf")
            else:
                raise AssertionError("not refused")
            ```
        """
        return self._incoming(batch, where)[2]

    def _incoming(self, batch: ExperienceBatch, where: str) -> tuple[Any, Any, int | None]:
        """`(batch, older, T)`: the batch as stored (the newest frame of stacked
        observations), the frame before it in each stack (None when the frames came single,
        or none are stacked), and the steps per row, as `steps_in` returns them."""
        frames = self.frames
        if frames is None:
            return batch, None, check_batch(where, self.data, self.rows, batch)
        got = check_structure(where, jax.tree.structure(self.data), batch)
        i = leaf_position(self.data, frames.leaf)
        path, x = got[i]
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return batch, None, check_batch(where, self.data, self.rows, batch)
        stored = self.example()
        frame = tuple(jax.tree.leaves(stored)[i].shape)
        stack = tuple(jax.tree.leaves(frames.stacked(stored))[i].shape)
        rows, shape = self.rows, tuple(x.shape)
        fits = []
        for stacked, leaf in ((True, stack), (False, frame)):
            if shape == (rows, *leaf):
                fits.append((stacked, None))
            elif len(shape) == len(leaf) + 2 and shape[0] == rows and shape[2:] == leaf:
                fits.append((stacked, shape[1]))
        if not fits:

            def at(t: str, leaf: tuple) -> str:
                return (
                    str((rows, *t.split(), *leaf))
                    .replace("'", "")
                    .replace("(", "(add_batch_size=", 1)
                )

            raise ValueError(
                f"{where}: leaf {keystr(path)} has shape {shape}, expected stacked observations "
                f"{at('', stack)} or {at('T', stack)}, or single frames {at('', frame)} or "
                f"{at('T', frame)} (eb.Frames: one frame per step is stored)."
            )
        if len(fits) > 1:  # (ambiguous shapes: the other leaves say how many steps)
            others = [
                (tuple(y.shape), tuple(s.shape))
                for j, ((_, y), s) in enumerate(zip(got, jax.tree.leaves(stored), strict=True))
                if j != i and hasattr(y, "shape")
            ]
            if others:
                y, s = others[0]
                t_other = None if y == (rows, *s) else (y[1] if len(y) > 1 else None)
                fits = [f for f in fits if f[1] == t_other] or fits
        stacked, t = fits[0]
        older = None
        if stacked:
            dims = 1 if t is None else 2
            newest = frame_at(x, dims, frames.axis, frames.k - 1)
            if frames.k > 1:
                older = frame_at(x, dims, frames.axis, frames.k - 2)
            leaves, treedef = jax.tree.flatten(batch)
            leaves[i] = newest
            batch = jax.tree.unflatten(treedef, leaves)
        return batch, older, check_batch(where, self.data, self.rows, batch)

    def _stale(self, batch: Any, older: Array, where: str) -> Bool[Array, ""]:
        """Whether the frame before the newest in any added stack (`older`, `(rows, T,
        *frame)`) differs from the one the ring holds for that row: its newest frame before
        the batch (or the batch's previous step), or the episode's padding at an episode's
        first step."""
        frames = self.frames
        assert frames is not None
        i = leaf_position(self.data, frames.leaf)
        newest = jnp.asarray(jax.tree.leaves(batch)[i])
        last = (self.head - 1) % self.length
        held = jax.tree.map(lambda x: x[:, last], self.data)
        first = (self.count_lo == 0) & (self.count_hi == 0)
        ends = frames.ends_of(jax.tree.map(jnp.asarray, batch), 2)
        start = frames.ends_of(held, 1) | first
        expected = expected_older(frames, newest, jax.tree.leaves(held)[i], start, ends)
        # Compared bit for bit, reduced by a max of the xor as unsigned integers (on the CPU
        # 3x faster than `any(older != expected)`, whose booleans are reduced unvectorised).
        differ = jnp.max(_bits(jnp.asarray(older)) ^ _bits(expected))
        return unvmap_any(differ != 0)

    def write(self, batch: ExperienceBatch, where: str = "add()") -> "RingStorage":
        """Append one step (leaves `(rows, *leaf)`) or `T` steps (leaves `(rows, T, *leaf)`)
        to every row, overwriting the oldest steps once the ring is full. When `T > length`
        only the newest `length` steps are kept (the count of steps added still grows by `T`).
        A batch that does not fit is refused as `steps_in` refuses it, its error starting
        with `where`.

        Under `eqx.filter_jit(donate=...)` the write is in place: its cost is that of the data
        added, not of the ring.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            storage = eb.RingStorage({"x": jnp.zeros(())}, rows=1, length=3)
            storage = storage.write({"x": jnp.array([[1.0, 2.0]])})  # 2 steps: slots 0 and 1
            storage = storage.write({"x": jnp.array([[3.0, 4.0]])})  # 3 to slot 2, 4 wraps to 0
            assert storage.data["x"].tolist() == [[4.0, 2.0, 3.0]]
            assert int(storage.head) == 1 and int(storage.fill) == 3 and storage.steps_added() == 4
            storage = storage.write({"x": jnp.array([5.0])})  # one step: leaves (rows, *leaf)
            assert storage.data["x"].tolist() == [[4.0, 5.0, 3.0]]
            ```
        """
        return self.append(batch, where)[0]

    def append(
        self,
        batch: ExperienceBatch,
        where: str = "add()",
        *,
        refused: Bool[ArrayLike, ""] | None = None,
    ) -> tuple["RingStorage", Appended]:
        """`write`, also returning what the sampling rules need to keep in step: the
        [`equibuffer.RingStorage`][]'s one add path (the batch is checked once, here).

        **Arguments:**

        - `batch`, `where`: as for `write`.
        - `refused`: a 0-d bool, for an add that a check refused (a full `Queue`, ...):
            where true nothing changes, neither a stored step nor a counter, and the
            appended steps are those the slots already held (so a rule that rewrites its
            state from them leaves it as it was). At the cost of reading the slots written.

        **Returns:**

        `(storage, appended)`: the updated storage, and an `Appended` record of the number
        of steps kept per row (`keep`, static), the slot of the first (`start`) and the kept
        steps themselves, leaves `(rows, keep, *leaf)`.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            storage = eb.RingStorage({"x": jnp.zeros(())}, rows=1, length=3)
            storage, appended = storage.append({"x": jnp.array([[1.0, 2.0, 3.0, 4.0]])})
            assert appended.keep == 3 and int(appended.start) == 1  # steps 2, 3, 4 kept
            assert appended.steps["x"].tolist() == [[2.0, 3.0, 4.0]]
            ```
        """
        batch, older, t = self._incoming(batch, where)
        if t is None:
            batch = jax.tree.map(lambda x: jnp.asarray(x)[:, None], batch)
            older = None if older is None else jnp.asarray(older)[:, None]
            t = 1
        stale = None
        if older is not None:
            stale = self._stale(batch, older, where)
            f = self.frames
            assert f is not None
            stale = error_if(
                stale,
                stale,
                f"{where}: the stacked observations [{f.leaf!r}] disagree with the frames the "
                f"buffer holds: frame {f.k - 2} of a stack (k={f.k}, axis={f.axis}) is not the "
                "row's previous frame (nor, at an episode's first step, the padding="
                f"{f.padding!r} frame). Stack the leaf that holds the frames, add the rows in "
                "the same order every time, give the episode ends the environment saw, and the "
                "padding it uses; or add single frames. The add was refused: nothing stored "
                "changed.",
            )
            refused = stale if refused is None else jnp.asarray(refused) | stale
        length = self.length
        keep = min(t, length)
        start = (self.head + (t - keep)) % length

        batch = jax.tree.map(lambda x: jnp.asarray(x)[:, t - keep :], batch)
        if refused is not None:
            slots = (start + jnp.arange(keep, dtype=jnp.int32)) % length
            batch = jax.tree.map(
                lambda x, stored: jnp.where(refused, jnp.take(stored, slots, axis=1), x),
                batch,
                self.data,
            )

        def contiguous(data: Any, new: Any) -> Any:
            def put(stored: Array, x: Array) -> Array:
                return jax.lax.dynamic_update_slice_in_dim(stored, x, start, axis=1)

            return jax.tree.map(put, data, new)

        def wrapping(data: Any, new: Any) -> Any:
            slots = (start + jnp.arange(keep, dtype=jnp.int32)) % length

            def put(stored: Array, x: Array) -> Array:
                return stored.at[:, slots].set(x, unique_indices=True, mode="promise_in_bounds")

            return jax.tree.map(put, data, new)

        def on_cpu(data: Any, new: Any) -> Any:
            # A block that does not run past the end of the ring is one dynamic_update_slice
            # (a memcpy, ~5x faster on CPU than the scatter, which is kept for the write that
            # wraps). The predicate is reduced over vmapped axes, so the cond never becomes a
            # select of both branches over the whole ring.
            fits = unvmap_all(start + keep <= length)
            return jax.lax.cond(fits, contiguous, wrapping, data, new)

        if keep == 1:
            data = contiguous(self.data, batch)
        else:
            # On a GPU a cond costs a copy of its predicate to the host and a wait (~12 us on
            # an H100, more than the scatter itself): the scatter alone is faster there.
            # Chosen when the program is lowered, so neither platform runs a branch.
            # (XLA before jax 0.11 copies the whole storage around the cond's branches: there
            # the scatter, in place, on every platform.)
            if BARRIER_EXPANDED:
                data = wrapping(self.data, batch)
            else:
                data = jax.lax.platform_dependent(self.data, batch, cpu=on_cpu, default=wrapping)
        head = (self.head + t % length) % length
        fill = jnp.minimum(self.fill + keep, length)
        lo = self.count_lo + jnp.uint32(t % _TWO_32)
        hi = self.count_hi + jnp.uint32(t // _TWO_32) + (lo < self.count_lo).astype(jnp.uint32)
        counters = jnp.stack(
            [head.astype(jnp.uint32), fill.astype(jnp.uint32), lo, hi, self.counters[4]]
        )
        if refused is not None:
            counters = jnp.where(refused, self.counters, counters)
        storage = eqx.tree_at(lambda s: (s.data, s.counters), self, (data, counters))
        refusal = False if refused is None else jnp.asarray(refused)
        return storage, Appended(keep, start.astype(jnp.int32), batch, refusal)

    def count_mod(self, modulus: int) -> IntScalar:
        """`steps_added mod modulus` (exact for any count, computed in 32-bit words).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            storage = eb.RingStorage({"x": jnp.zeros(())}, rows=1, length=4)
            storage = storage.write({"x": jnp.zeros((1, 10))})  # 10 steps added
            assert int(storage.count_mod(4)) == 2 and int(storage.count_mod(3)) == 1
            assert int(storage.count_mod(100_000)) == 10
            ```
        """
        m = int(modulus)
        if m == 1:
            return jnp.array(0, jnp.int32)
        lo, hi = self.count_lo, self.count_hi
        if m & (m - 1) == 0:
            return (lo & jnp.uint32(m - 1)).astype(jnp.int32)
        if m < 1 << 16:
            r = jnp.uint32(_TWO_32 % m)
            return (((hi % m) * r + lo % m) % m).astype(jnp.int32)
        # Large moduli: Horner's rule one bit at a time keeps every value below 2**32.
        acc = jnp.uint32(0)
        for word in (hi, lo):
            for bit in range(31, -1, -1):
                acc = (acc * jnp.uint32(2) + ((word >> bit) & jnp.uint32(1))) % m
        return acc.astype(jnp.int32)


def _bits(x: Array) -> Array:
    """`x` as unsigned integers of its width (its bits; bools as uint8)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    return x if x.dtype == unsigned else jax.lax.bitcast_convert_type(x, unsigned)


def check_batch(
    where: str, data: PyTree[Shaped[Array, "rows length ..."]], rows: int, batch: ExperienceBatch
) -> int | None:
    """`batch` checked against `data` (leaves `(rows, length, *leaf)`): the add-batch check
    of [`equibuffer.RingStorage.steps_in`][], for any storage whose adds bring `rows` rows.
    Returns `None` for a single step (leaves `(rows, *leaf)`), else `T` for leaves
    `(rows, T, *leaf)`; raises a `ValueError`/`TypeError` naming the first bad leaf, its
    message starting with `where`."""
    got = check_structure(where, jax.tree.structure(data), batch)
    steps: int | None = None
    first_path: Any = None
    for (path, x), stored in zip(got, jax.tree.leaves(data), strict=True):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(
                f"{where}: leaf {keystr(path)} is {type(x).__name__}, expected an array "
                f"of shape (add_batch_size={rows}, *{stored.shape[2:]})."
            )
        leaf = tuple(stored.shape[2:])
        shape = tuple(x.shape)
        if shape == (rows, *leaf):
            t = None
        elif len(shape) == len(leaf) + 2 and shape[0] == rows and shape[2:] == leaf:
            t = shape[1]
            if t == 0:
                raise ValueError(f"{where}: leaf {keystr(path)} has 0 time steps.")
        else:
            one = str((rows, *leaf)).replace("(", "(add_batch_size=", 1)
            many = str((rows, "T", *leaf)).replace("(", "(add_batch_size=", 1)
            raise ValueError(
                f"{where}: leaf {keystr(path)} has shape {shape}, expected {one} for one "
                f"step or {many} for T steps.".replace("'T'", "T")
            )
        if first_path is not None and t != steps:
            a = "one step" if steps is None else f"{steps} steps"
            b = "one step" if t is None else f"{t} steps"
            raise ValueError(
                f"{where}: leaf {keystr(path)} holds {b} but leaf {keystr(first_path)} "
                f"holds {a}; all leaves must hold the same number of steps."
            )
        # A NumPy array enters JAX as the dtype JAX makes of it (float64 -> float32 and
        # int64 -> int32 unless jax_enable_x64): check that one, so an eager call accepts
        # exactly what a jitted one does (where JAX has converted it before the check).
        dtype = x.dtype if isinstance(x, jax.Array) else jax.dtypes.canonicalize_dtype(x.dtype)
        check_dtype(where, path, dtype, stored.dtype)
        check_representable(where, path, x, stored.dtype)
        steps, first_path = t, path
    return steps


def check_like(where: str, ring: RingStorage, other: Any) -> RingStorage:
    """`other` checked to be a `RingStorage` with the rows, length and steps (structure,
    shapes and dtypes of the leaves) of `ring`; errors start with `where` and name the first
    leaf that differs."""
    if not isinstance(other, RingStorage):
        raise TypeError(f"{where}: expected an eb.RingStorage, got {type(other).__name__}.")
    if (other.rows, other.length) != (ring.rows, ring.length):
        raise ValueError(
            f"{where}: the storage has rows={other.rows} and length={other.length}, the buffer "
            f"add_batch_size={ring.rows} and max_length_time_axis={ring.length}; give a "
            "storage of the buffer's own sizes (e.g. one made from `buffer.storage`)."
        )
    if other.frames != ring.frames:
        raise ValueError(
            f"{where}: the storage stacks frames as {other.frames!r}, the buffer as "
            f"{ring.frames!r}; give a storage made with the buffer's own `frames`."
        )
    got = check_structure(where, jax.tree.structure(ring.data), other.data)
    for (path, x), stored in zip(got, jax.tree.leaves(ring.data), strict=True):
        if (x.shape, x.dtype) != (stored.shape, stored.dtype):
            raise ValueError(
                f"{where}: leaf {keystr(path)} of the storage has shape {tuple(x.shape)} and "
                f"dtype {jnp.dtype(x.dtype).name}, the buffer's {tuple(stored.shape)} and "
                f"{jnp.dtype(stored.dtype).name}."
            )
    return other


def host_counters(storage: RingStorage) -> tuple[int, int, int]:
    """`(head, fill, steps_added)` of `storage` as Python ints, from one host copy of its
    counters (outside jit): no JAX operation is dispatched (each would be compiled at its
    first use in a process, ~20 ms, and cost a dispatch afterwards). A failure recorded in
    the storage (see `equibuffer.check`) is raised: this is a use on the host."""
    head, fill, lo, hi, error = (int(c) for c in jax.device_get(storage.counters))
    raise_recorded(error)
    return head, fill, hi * _TWO_32 + lo
