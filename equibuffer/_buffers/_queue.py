"""A FIFO queue of trajectories, for on-policy algorithms: the ring storage plus a count of the
steps not yet read."""

from typing import NoReturn, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from .._axes import on_auto_axes
from .._checks import check_positive_int
from .._custom_types import BoolScalar, ExampleTree, ExperienceBatch, IntScalar
from .._errors import error_if, recorded
from .._frames import as_frames, Frames
from .._ring import check_like, RingStorage
from ..views._gather import gather_slots
from ._base import AbstractRingHolder, Sample, update_storage, UpdateFn
from ._epochs import no_epochs
from ._sizes import SizeArgs, Sizes


class Queue(AbstractRingHolder):
    """A first-in first-out queue of trajectories (for on-policy algorithms such as PPO).

    `add` appends one or more steps to every row; `sample` returns the oldest
    `sequence_length` unread steps of every row, in order, and a queue that no longer holds
    them. Nothing is ever overwritten or invented: adding to a queue without room for the new
    steps, or sampling one with fewer than `sequence_length` unread steps per row, fails
    (inside jit: recorded, raised by [`equibuffer.check`][]). `can_add(steps)` and
    `can_sample()` say in advance, from the counters only.

    It is a [`equibuffer.RingStorage`][] plus one 0-d counter, `unread`: the number of steps
    per row added and not yet sampled (at most `max_length_time_axis`). With
    `sequence_length=1` it is a queue of items.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp

        queue = eb.Queue({"obs": jnp.zeros(3)}, add_batch_size=2, max_length_time_axis=8,
                         sequence_length=4)
        queue = queue.add({"obs": jnp.ones((2, 4, 3))})   # 4 steps for both rows
        assert bool(queue.can_sample()) and bool(queue.can_add(4))
        queue, sample = queue.sample()
        assert sample.experience["obs"].shape == (2, 4, 3)  # (add_batch_size, sequence_length)
        assert not bool(queue.can_sample())
        ```
    """

    storage: RingStorage
    unread: Int[Array, ""]
    sequence_length: int = eqx.field(static=True)
    add_sequence_length: int | None = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        sequence_length: int,
        add_sequence_length: int | None = None,
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`: one step of experience, a pytree of arrays (numbers and NumPy arrays
            are taken as `jnp.asarray` takes them).
        - `add_batch_size`: the number of rows each `add` writes (e.g. parallel environments).
        - `sequence_length`: the number of steps of every row that `sample` returns.
        - `add_sequence_length`: optional, Flashbax's name: the steps per row every `add`
            brings. When given, `add` refuses batches of any other length and `can_add()`
            answers for it; when not, `add` takes any length and `can_add(steps)` needs the
            length of the next add.
        - `**sizes`: `capacity` (steps held in total, alias `max_size`) or
            `max_length_time_axis` (per row, Flashbax's name), as [`equibuffer.Sizes`][] says;
            at least `sequence_length` per row. A queue has no minimum: `can_sample()` is true
            once every row holds `sequence_length` unread steps.
        - `frames`: an [`equibuffer.Frames`][], to store one frame per step of a stacked
            observation leaf and return the stacks (see [Pixels](../pixels.md)). The queue
            then also keeps the `k - 1` steps before its oldest unread one, whose frames that
            step's stack holds: an add that would overwrite them is refused as a full
            queue's is (`can_add` says so).
        """
        where = "Queue()"
        given = SizeArgs.of(where, sizes)
        for name in ("min_size", "min_length", "min_length_time_axis"):
            if getattr(given, name) is not None:
                raise TypeError(
                    f"{where}: `{name}` is not taken: a queue has no minimum size, "
                    "`can_sample()` is true once every row holds `sequence_length` unread steps."
                )
        frames = as_frames(where, frames)
        self.storage = given.storage(where, example, add_batch_size, flat=False, frames=frames)
        length = self.storage.length
        self.sequence_length = check_positive_int(where, "sequence_length", sequence_length)
        if self.sequence_length + self.storage.lookback > length:
            frames_note = (
                f" plus the k - 1 = {self.storage.lookback} steps before them that the frames' "
                "stacks read"
                if self.storage.lookback
                else ""
            )
            raise ValueError(
                f"{where}: sequence_length={sequence_length}{frames_note} is larger than the "
                f"queue (max_length_time_axis={length} steps per row); raise the size (capacity "
                "or max_length_time_axis) or shorten sequence_length."
            )
        if add_sequence_length is not None:
            add_sequence_length = check_positive_int(
                where, "add_sequence_length", add_sequence_length
            )
            if add_sequence_length > length:
                raise ValueError(
                    f"{where}: add_sequence_length={add_sequence_length} is larger than the "
                    f"queue (max_length_time_axis={length} steps per row)."
                )
        self.add_sequence_length = add_sequence_length
        self.unread = jnp.array(0, jnp.int32)

    @on_auto_axes()
    def with_storage(self, storage: RingStorage, *, priority: float | None = None) -> "Queue":
        """Return the queue holding `storage` (its steps and counters), as `Archive.restore`
        and `Archive.load` fill it. The ring does not say which steps a learner had read,
        so every held step counts as read (`unread` is 0): the next `add` has room and the
        next `sample` returns steps added after this call, never a rollout the learner may
        already have used.

        **Arguments:**

        - `storage`: a [`equibuffer.RingStorage`][] of the queue's `add_batch_size`,
            `max_length_time_axis` and leaves (shapes and dtypes).
        - `priority`: refused (a queue has no priorities); it is there because every
            buffer's `with_storage` takes it.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"x": jnp.float32(0)}
            ring = eb.RingStorage(example, rows=1, length=4).write({"x": jnp.arange(3.0)[None]})
            queue = eb.Queue(example, add_batch_size=1, max_length_time_axis=4, sequence_length=2)
            queue = queue.with_storage(ring)
            assert queue.storage.steps_added() == 3 and not bool(queue.can_sample())
            queue, sample = queue.add({"x": jnp.array([[3.0, 4.0]])}).sample()
            assert sample.experience["x"].tolist() == [[3.0, 4.0]]
            ```
        """
        where = "Queue.with_storage()"
        storage = check_like(where, self.storage, storage)
        if priority is not None:
            raise TypeError(f"{where}: a Queue has no priorities: drop `priority`.")
        unread = jnp.zeros_like(self.unread)  # every held step counts as read
        return eqx.tree_at(lambda q: (q.storage, q.unread), self, (storage, unread))

    def can_add(self, steps: int | None = None) -> BoolScalar:
        """Whether an add of `steps` more steps per row fits without overwriting unread ones
        (0-d bool). `steps` defaults to the queue's `add_sequence_length`; a queue without
        one needs it said.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"x": jnp.zeros(())}
            queue = eb.Queue(example, add_batch_size=2, max_length_time_axis=4,
                             sequence_length=2)
            queue = queue.add({"x": jnp.zeros((2, 3))})  # 3 of the 4 slots per row unread
            assert bool(queue.can_add(1)) and not bool(queue.can_add(2))
            queue, _ = queue.sample()  # 1 unread
            assert bool(queue.can_add(3))

            fixed = eb.Queue(example, add_batch_size=2, max_length_time_axis=4,
                             sequence_length=2, add_sequence_length=2)
            fixed = fixed.add({"x": jnp.zeros((2, 2))})
            assert bool(fixed.can_add()) and not bool(fixed.add({"x": jnp.zeros((2, 2))}).can_add())
            ```
        """
        if steps is None:
            if self.add_sequence_length is None:
                raise TypeError(
                    "Queue.can_add(): say how many steps per row the next add brings, "
                    "`queue.can_add(steps)`, or give the queue an `add_sequence_length` for "
                    "`can_add()` to answer for."
                )
            steps = self.add_sequence_length
        steps = check_positive_int("Queue.can_add()", "steps", steps)
        return self.unread + steps + self.storage.lookback <= self.storage.length

    def epoch(self, key: PRNGKeyArray, batch_size: int) -> NoReturn:
        """Refused (`TypeError`): a `Queue` already returns each step exactly once, in order
        of arrival (`sample()`). For several epochs over a rollout, add it to a buffer and
        plan epochs there.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            rollout = {"x": jnp.arange(8.0).reshape(2, 4)}  # 2 environments, 4 steps
            items = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=2, capacity=8)
            items = items.add(rollout)
            for seed in range(3):  # 3 epochs over the rollout, each in its own order
                epoch = items.epoch(jax.random.key(seed), batch_size=4)
                assert int(epoch.count) == 8
            ```
        """
        no_epochs(
            f"{type(self).__name__}.epoch()",
            (
                "a Queue already returns each step exactly once, in order of arrival "
                "(`queue.sample()`); for several epochs over a rollout, add it to an ItemBuffer "
                "or TrajectoryBuffer and plan epochs there."
            ),
        )

    def can_sample(self) -> BoolScalar:
        """Whether every row holds at least `sequence_length` unread steps (0-d bool).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"x": jnp.zeros(())}
            queue = eb.Queue(example, add_batch_size=2, max_length_time_axis=4, sequence_length=2)
            queue = queue.add({"x": jnp.zeros(2)})  # one step per row: fewer than sequence_length
            assert not bool(queue.can_sample())
            queue = queue.add({"x": jnp.zeros(2)})
            assert bool(queue.can_sample())
            ```
        """
        return self.unread >= self.sequence_length

    def size(self) -> IntScalar:
        """The number of unread steps, over all rows (0-d int32).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"x": jnp.zeros(())}
            queue = eb.Queue(example, add_batch_size=3, max_length_time_axis=8, sequence_length=2)
            queue = queue.add({"x": jnp.zeros((3, 5))})
            assert int(queue.size()) == 15  # 5 unread steps in each of 3 rows
            queue, _ = queue.sample()
            assert int(queue.size()) == 9
            ```
        """
        return self.unread * self.storage.rows

    @on_auto_axes()
    @recorded
    def add(self, batch: ExperienceBatch) -> "Queue":
        """Return the queue with `batch` appended to every row.

        **Arguments:**

        - `batch`: leaves `(add_batch_size, *leaf)` for one step or
            `(add_batch_size, T, *leaf)` for `T` steps, dtypes as in the example.

        **Returns:**

        The updated queue. Fails (inside jit: recorded, raised by [`equibuffer.check`][] or
        [`equibuffer.filter_jit`][]) when the queue has no room for `T` more steps per row
        (`can_add(T)` is false): the add is then refused, and the queue returned holds
        every step it held, unread steps included, with the failure recorded. Under
        `eqx.filter_jit(donate="all")` the write is in place.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"x": jnp.zeros(())}
            queue = eb.Queue(example, add_batch_size=2, max_length_time_axis=4, sequence_length=2)
            queue = queue.add({"x": jnp.array([1.0, 2.0])})  # one step: leaves (rows,)
            queue = queue.add({"x": jnp.array([[3.0, 5.0], [4.0, 6.0]])})  # 2 steps: (rows, 2)
            assert int(queue.size()) == 6 and bool(queue.can_add(1)) and not bool(queue.can_add(2))
            queue, sample = queue.sample()
            assert sample.experience["x"].tolist() == [[1.0, 3.0], [2.0, 4.0]]
            ```
        """
        t = self.storage.steps_in(batch, "Queue.add()")
        t = 1 if t is None else t
        length = self.storage.length
        if self.add_sequence_length is not None and t != self.add_sequence_length:
            raise ValueError(
                f"Queue.add(): the batch holds {t} steps per row but the queue was built with "
                f"add_sequence_length={self.add_sequence_length}."
            )
        if t > length:
            raise ValueError(
                f"Queue.add(): the batch holds {t} steps per row but the queue holds at most "
                f"max_length_time_axis={length}; add fewer steps at a time or raise the size "
                "(capacity or max_length_time_axis)."
            )
        lookback = self.storage.lookback
        full = self.unread + t + lookback > length
        kept = f" or the k - 1 = {lookback} steps before them (their frames)" if lookback else ""
        unread = error_if(
            jnp.where(full, self.unread, self.unread + t),
            full,
            f"Queue.add(): the queue is full: adding {t} steps per row would overwrite unread "
            f"steps{kept} (max_length_time_axis={length}). Sample first, or check "
            f"`queue.can_add({t})`.",
        )
        # Refused (the queue full, or a stack disagreeing with the frames held): as it was.
        storage, appended = self.storage.append(batch, "Queue.add()", refused=full)
        unread = jnp.where(appended.refused, self.unread, unread)
        return eqx.tree_at(lambda q: (q.storage, q.unread), self, (storage, unread))

    @on_auto_axes(split=lambda queue: queue.add_batch_size)
    @recorded
    def sample(self) -> tuple["Queue", Sample]:
        """Take the oldest `sequence_length` unread steps of every row.

        **Returns:**

        `(queue, sample)`: the queue without those steps, and a [`equibuffer.Sample`][]
        whose `experience` leaves are `(add_batch_size, sequence_length, *leaf)`, row `i` of
        the batch being row `i` of the queue, steps in time order. `indices` are the flat
        indices `row * max_length_time_axis + slot` of each row's first step, `steps` their absolute
        step (mod 2**32). Fails (inside jit: recorded, raised by [`equibuffer.check`][])
        when `can_sample()` is false: nothing is invented (the sample's floating leaves are
        NaN) and nothing is taken (the queue keeps its unread steps).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"x": jnp.zeros(())}
            queue = eb.Queue(example, add_batch_size=1, max_length_time_axis=4, sequence_length=2)
            queue = queue.add({"x": jnp.array([[1.0, 2.0, 3.0]])})
            queue, first = queue.sample()  # the oldest 2 unread steps
            assert first.experience["x"].tolist() == [[1.0, 2.0]] and int(queue.size()) == 1
            queue = queue.add({"x": jnp.array([[4.0]])})
            queue, second = queue.sample()  # in order, across the end of the ring
            assert second.experience["x"].tolist() == [[3.0, 4.0]] and second.steps.tolist() == [2]
            ```
        """
        storage, s = self.storage, self.sequence_length
        length = storage.length
        short = self.unread < s
        unread = error_if(
            self.unread,
            short,
            f"Queue.sample(): the queue holds fewer than sequence_length={s} unread steps per "
            "row. Add more first, or check `queue.can_sample()`.",
        )
        slot = (storage.head - unread + length) % length
        rows = jnp.arange(storage.rows, dtype=jnp.int32)
        indices = rows * length + slot
        step = storage.count_lo - unread.astype(jnp.uint32)
        steps = jnp.broadcast_to(step, (storage.rows,))

        # The same `s` slots of every row: `(rows, s, *leaf)`, and on a mesh each device reads
        # its own rows (the result stays split like the storage). On the CPU, slots that do
        # not cross the end of the ring are one slice of each row (1.3-1.4x faster than the
        # gather), those that do a gather row by row; elsewhere the gather alone, since a
        # branch chosen by data makes a GPU wait for the host. Chosen when lowered.
        def sliced(data: ExperienceBatch) -> ExperienceBatch:
            return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, s, 1), data)

        def gathered(data: ExperienceBatch) -> ExperienceBatch:
            slots = (slot + jnp.arange(s, dtype=jnp.int32)) % length
            return gather_slots(eqx.tree_at(lambda r: r.data, storage, data), slots)

        def on_cpu(data: ExperienceBatch) -> ExperienceBatch:
            return jax.lax.cond(slot <= length - s, sliced, gathered, data)

        if storage.frames is not None:  # (the stacks read the steps before each one)
            slots = (slot + jnp.arange(s, dtype=jnp.int32)) % length
            experience = storage.take(rows[:, None] * length + slots[None, :])
        else:
            experience = jax.lax.platform_dependent(storage.data, cpu=on_cpu, default=gathered)
        queue = eqx.tree_at(lambda q: q.unread, self, jnp.where(short, unread, unread - s))
        return queue, Sample(experience=experience, indices=indices, steps=steps)

    @on_auto_axes()
    def update(self, fn: UpdateFn) -> "Queue":
        """Return the queue with `fn` applied to every stored step, as
        [`equibuffer.AbstractBuffer.update`][] does (unwritten slots untouched).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            example = {"r": jnp.float32(0)}
            queue = eb.Queue(example, add_batch_size=2, max_length_time_axis=4, sequence_length=1)
            queue = queue.add({"r": jnp.array([1.0, 2.0])})
            queue = queue.update(lambda step: {"r": step["r"] + 10})  # one step at a time
            assert queue.storage.data["r"][:, 1].tolist() == [0.0, 0.0]  # unwritten slots untouched
            queue, sample = queue.sample()
            assert sample.experience["r"].tolist() == [[11.0], [12.0]]
            ```
        """
        return eqx.tree_at(lambda q: q.storage, self, update_storage(self.storage, fn, "Queue"))
