import abc
from collections.abc import Callable
from typing import Any, Generic, TypeAlias, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree, Shaped

from .._axes import in_blocks, on_auto_axes
from .._checks import check_key, check_positive_int, check_row_blocks, check_structure, keystr
from .._custom_types import BoolScalar, ExperienceBatch, IntScalar, StepCount
from .._errors import branched_error_if, error_if, record, recorded
from .._protocol import AbstractReplayBuffer
from .._ring import check_like, RingStorage
from ..rules._base import AbstractPrioritisedRule, AbstractRule, AbstractUniformRule
from ..rules._by_priority import check_priority
from ..rules._episode_ends import EpisodeEnds
from ..rules._request import Drawn, Request, Window
from ..rules._valid import count_held, still_held
from ..views._base import AbstractView, gather_by_blocks
from ._epochs import check_epoch, Epoch, epoch_batch_windows, plan_epoch
from ._samples import AbstractSample, EpisodeSample, Sample


_Buffer = TypeVar("_Buffer", bound="AbstractBuffer")
_Holder = TypeVar("_Holder", bound="AbstractRingHolder")
_R = TypeVar("_R", bound=AbstractRule)


class AbstractRingHolder(eqx.Module):
    """Anything built on one [`equibuffer.RingStorage`][] (every buffer, and the `Queue`):
    the sizes it reports are the ring's."""

    storage: eqx.AbstractVar[RingStorage]

    @property
    def add_batch_size(self) -> int:
        """The number of rows; every `add` brings one or more steps for each row."""
        return self.storage.rows

    @property
    def max_length_time_axis(self) -> int:
        """The number of steps held per row (Flashbax's name)."""
        return self.storage.length

    @property
    def capacity(self) -> int:
        """The number of steps held in total, `add_batch_size * max_length_time_axis` (the
        `capacity` asked for, rounded up to whole rows)."""
        return self.storage.rows * self.storage.length

    def steps_added(self) -> StepCount:
        """The number of steps ever added to each row (overwritten ones included), inside jit
        as well as outside.

        A 0-d array: `uint64` with `jax_enable_x64`, else `uint32`, which holds counts below
        `2**32` steps per row (inside jit a larger count raises, through `eqx.error_if`;
        outside, `int(buffer.storage.steps_added())` is exact at any count).

        !!! example

            ```python
            import equibuffer as eb, equinox as eqx, jax.numpy as jnp

            buffer = eb.TrajectoryBuffer({"x": jnp.zeros(())}, add_batch_size=2,
                                         max_length_time_axis=4, sequence_length=2)
            add = eqx.filter_jit(lambda b, x: b.add(x))
            buffer = add(buffer, {"x": jnp.zeros((2, 6))})
            assert int(buffer.steps_added()) == 6  # per row; 4 of them still held
            assert int(eqx.filter_jit(lambda b: b.steps_added())(buffer)) == 6
            ```
        """
        return self.storage.count()

    def steps_in(self, batch: ExperienceBatch, where: str = "add()") -> int | None:
        """Check `batch` as `add` does and return its number of steps per row: `None` for
        leaves `(add_batch_size, *leaf)`, else `T` for `(add_batch_size, T, *leaf)` (see
        [`equibuffer.RingStorage.steps_in`][]). Errors start with `where`.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(3)}, add_batch_size=2, capacity=8)
            assert buffer.steps_in({"x": jnp.zeros((2, 3))}) is None
            assert buffer.steps_in({"x": jnp.zeros((2, 5, 3))}) == 5
            ```
        """
        return self.storage.steps_in(batch, where)

    @abc.abstractmethod
    def with_storage(
        self: _Holder, storage: RingStorage, *, priority: float | None = None
    ) -> _Holder:
        """Return this buffer holding `storage` (its steps and its counters), with every
        piece of state kept beside the ring rebuilt from it, by the kind's policy where the
        ring does not hold it (see [`equibuffer.AbstractBuffer.with_storage`][] and
        [`equibuffer.Queue.with_storage`][])."""


class AbstractRowBlocked(eqx.Module):
    """Anything whose `sample` draws by blocks of rows (`row_blocks`): the ring buffers and
    the clustered ones check the arguments of `sample` and `epoch` the same way."""

    @abc.abstractmethod
    def _row_blocks(self, where: str, row_blocks: int, batch_size: int) -> int:
        """`row_blocks` checked against what the buffer splits into blocks."""

    def _keyed_arguments(self, method: str, key: PRNGKeyArray, batch_size: int) -> tuple[str, int]:
        """The name for errors of the buffer's `method` (`sample`, `epoch`), and its `key`
        and `batch_size` checked."""
        where = f"{type(self).__name__}.{method}()"
        check_key(where, key)
        return where, check_positive_int(where, "batch_size", batch_size)

    def _sample_arguments(
        self, key: PRNGKeyArray, batch_size: int, row_blocks: int
    ) -> tuple[str, int, int]:
        """`sample`'s name for errors, and its `key`, `batch_size` and `row_blocks` checked."""
        where, batch_size = self._keyed_arguments("sample", key, batch_size)
        return where, batch_size, self._row_blocks(where, row_blocks, batch_size)


class AbstractBuffer(AbstractRingHolder, AbstractRowBlocked, AbstractReplayBuffer, Generic[_R]):
    """The interface every ring buffer shares: a [`equibuffer.RingStorage`][] plus a rule
    saying which windows of `sequence_length` steps may be sampled. Every ring buffer is an
    [`equibuffer.AbstractReplayBuffer`][] (a `Mixer` source, wrapped by `RateLimited`).

    Generic in the kind of its rule: [`equibuffer.AbstractUniformBuffer`][] (a uniform rule)
    and [`equibuffer.AbstractPrioritisedBuffer`][] (a prioritised one) are its two kinds.
    Concrete buffers (`Buffer`, `TrajectoryBuffer`, ..., `PrioritisedBuffer`, ...) are final:
    each holds its fields and its `__init__`; they differ only in their configuration and in
    the shape of what `sample` returns.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.TrajectoryBuffer({"x": jnp.zeros(2)}, add_batch_size=2, max_length_time_axis=8,
                                     sequence_length=3)
        assert isinstance(buffer, eb.AbstractBuffer) and not buffer.can_sample()
        buffer = buffer.add({"x": jnp.ones((2, 3, 2))})
        assert buffer.can_sample() and int(buffer.size()) == 6
        assert buffer.sample(jax.random.key(0), batch_size=4).experience["x"].shape == (4, 3, 2)
        ```
    """

    storage: eqx.AbstractVar[RingStorage]
    rule: eqx.AbstractVar[_R]
    view: eqx.AbstractVar[AbstractView]
    period: eqx.AbstractVar[int]
    min_length_time_axis: eqx.AbstractVar[int]

    @property
    def min_size(self) -> int:
        """The number of steps held in total before `can_sample()` may be true,
        `add_batch_size * min_length_time_axis` (the `min_size` asked for, rounded up to
        whole rows, and at least one window per row)."""
        return self.storage.rows * self.min_length_time_axis

    @property
    def sequence_length(self) -> int:
        """The number of consecutive steps one sampled element spans (its window)."""
        return self.view.window_length

    @property
    def window(self) -> Window:
        """The window the sampling rule draws: its length, period and name in errors."""
        return Window(self.view.window_length, self.period, self.view.window_name)

    @on_auto_axes()
    @recorded
    def add(self: _Buffer, batch: ExperienceBatch) -> _Buffer:
        """Return the buffer with `batch` appended to every row.

        **Arguments:**

        - `batch`: a tree of the example's structure, with leaves `(add_batch_size, *leaf)`
            for one step or `(add_batch_size, T, *leaf)` for `T >= 1` steps (`T` may exceed
            `max_length_time_axis`: only the newest steps are kept). Dtypes must match exactly.

        **Returns:**

        The updated buffer. Under `eqx.filter_jit(donate="all")` the write is in place.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(3)}, add_batch_size=2, max_length_time_axis=4)
            buffer = buffer.add({"x": jnp.ones((2, 3))})  # one step per row
            assert int(buffer.size()) == 2
            buffer = buffer.add({"x": jnp.ones((2, 5, 3))})  # 5 more per row: the newest 4 are kept
            assert int(buffer.size()) == 8 == buffer.capacity
            ```
        """
        return self._add(batch)

    def _add(self: _Buffer, batch: ExperienceBatch, refused: Any = None) -> _Buffer:
        """`add`, refused where the 0-d bool `refused` is true (by a wrapper's check, as
        `RateLimited`'s): nothing changes then, in the ring or in the rule's state."""
        where = f"{type(self).__name__}.add()"
        storage, appended = self.storage.append(batch, where, refused=refused)
        return self._with(storage, self.rule.added(storage, appended, self.window))

    def num_windows(self) -> IntScalar:
        """The number of windows that can be sampled now (0-d int32); depends only on the
        counters, so it stays unbatched when a training run is vmapped over seeds.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TrajectoryBuffer({"x": jnp.zeros(2)}, add_batch_size=2,
                                         max_length_time_axis=16,
                                         sequence_length=4, period=2)
            buffer = buffer.add({"x": jnp.ones((2, 10, 2))})
            # in each row, windows start at steps 0, 2, 4 and 6 (the last one ends at step 9)
            assert int(buffer.num_windows()) == 8 and buffer.num_windows().dtype == jnp.int32
            ```
        """
        return count_held(self.storage, self.window)

    def can_sample(self) -> BoolScalar:
        """Whether `sample` may be called: at least `min_length_time_axis` steps are held per
        row and there is at least one valid window (0-d bool, a function of the counters only).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TrajectoryBuffer({"x": jnp.zeros(2)}, add_batch_size=1,
                                         max_length_time_axis=8,
                                         sequence_length=3)
            buffer = buffer.add({"x": jnp.ones((1, 2, 2))})
            assert not buffer.can_sample()  # 2 steps per row, fewer than sequence_length
            buffer = buffer.add({"x": jnp.ones((1, 2))})
            assert buffer.can_sample() and buffer.can_sample().dtype == jnp.bool_
            ```
        """
        return (self.storage.fill >= self.min_length_time_axis) & (self.num_windows() > 0)

    def size(self) -> IntScalar:
        """The number of steps held, over all rows (0-d int32).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(3)}, add_batch_size=2, max_length_time_axis=4)
            assert int(buffer.size()) == 0
            buffer = buffer.add({"x": jnp.ones((2, 3, 3))})
            assert int(buffer.size()) == 6 and buffer.size().dtype == jnp.int32
            buffer = buffer.add({"x": jnp.ones((2, 3, 3))})
            assert int(buffer.size()) == 8  # full: 4 steps per row
            ```
        """
        return self.storage.fill * self.storage.rows

    def num_valid_windows(self) -> IntScalar:
        """The number of windows that can be drawn now (0-d int32). For a buffer whose
        validity is a function of the counters it is `num_windows()`; with an episode rule it
        depends on the stored episode ends (so it is batched under `vmap`: for branching use
        `can_sample()`).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            buffer = eb.EpisodeTrajectoryBuffer({"done": jnp.bool_(False)}, add_batch_size=1,
                                                max_length_time_axis=8, sequence_length=3)
            buffer = buffer.add({"done": jnp.array([[True, False, False, False, False]])})
            assert int(buffer.num_windows()) == 3  # by the counters: starts 0, 1 and 2
            assert int(buffer.num_valid_windows()) == 2  # inside an episode: steps 1-3 and 2-4
            ```
        """
        return self.rule.count_valid(self.storage, self.window)

    def _not_ready(self, where: str) -> str:
        return (
            f"{where}: the buffer cannot be sampled yet: it needs "
            f"{self.view.needs(self.min_length_time_axis)}. Check `buffer.can_sample()` first."
        )

    def _row_blocks(self, where: str, row_blocks: int, batch_size: int) -> int:
        """`row_blocks` checked: a positive int dividing the rows and `batch_size`."""
        sizes = {"add_batch_size": self.storage.rows, "batch_size": batch_size}
        return check_row_blocks(where, row_blocks, sizes, "each block of rows")

    def _experience(
        self, drawn: Drawn, blocks: int = 1
    ) -> tuple[Any, Bool[Array, "batch window"] | None]:
        """The view's experience of the drawn windows, padded past episode ends where the
        rule says, and the rule's mask (None without episodes). With `blocks > 1` the
        windows were drawn by blocks of rows, and each block gathers from its own rows."""
        mask = self.rule.mask(self.storage, drawn.indices, self.window)
        if blocks == 1:
            experience = self.view.gather(self.storage, drawn.indices, mask)
        else:
            experience = gather_by_blocks(self.view, self.storage, drawn.indices, mask, blocks)
        if mask is not None:
            experience = self.view.padded(experience, mask)
        return experience, mask

    @on_auto_axes()
    def update(self: _Buffer, fn: "UpdateFn") -> _Buffer:
        """Return the buffer with `fn` applied to every stored step (reward relabelling,
        recomputing a field, ...). Slots not written yet are left untouched.

        **Arguments:**

        - `fn`: a function of one step (a tree like the example, leaves `(*leaf)`) returning a
            tree of the same structure, shapes and dtypes (checked at trace time; the error
            names the leaf). It is vmapped over every `(row, slot)` of the storage.

        **Returns:**

        The updated buffer (same shapes and dtypes, so a jitted step does not retrace). The
        cost is that of `fn` over the whole capacity.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            buffer = eb.ItemBuffer({"reward": jnp.float32(0)}, add_batch_size=2, capacity=8)
            buffer = buffer.add({"reward": jnp.ones(2, jnp.float32)})
            buffer = buffer.update(lambda step: {"reward": 2 * step["reward"]})
            assert buffer.storage.data["reward"][:, 0].tolist() == [2.0, 2.0]
            assert buffer.storage.data["reward"][:, 1].tolist() == [0.0, 0.0]  # unwritten
            ```
        """
        storage = update_storage(self.storage, fn, type(self).__name__)
        return self._with(storage, self.rule.updated(storage, self.window))

    @on_auto_axes()
    def with_storage(
        self: _Buffer, storage: RingStorage, *, priority: float | None = None
    ) -> _Buffer:
        """Return this buffer holding `storage` (its steps and its counters), with every
        piece of state kept beside the ring rebuilt from it: how `Archive.restore` and
        `Archive.load` fill a buffer, and how to put back a ring whose steps or counters
        were replaced by hand (`RingStorage.with_counters`), which `eqx.tree_at` alone
        would leave out of step with the buffer's rule.

        What the held steps and the counters determine is recomputed: which windows are
        valid, and the episode flags (from the stored episode-end leaf, or the
        `episode_end` function of each step). What they do not hold, the priorities of a
        prioritised buffer, is set by one policy: every valid window enters at
        `priority` when it is given, which also becomes `max_priority`, else at the
        buffer's own `max_priority` (1 for a new buffer): as a window an `add` makes valid
        enters, since its priority is not known yet. The restored windows are drawn
        uniformly among themselves (importance weights of 1) until `set_priorities` gives
        each its own.

        **Arguments:**

        - `storage`: a [`equibuffer.RingStorage`][] of the buffer's `add_batch_size`,
            `max_length_time_axis` and leaves (shapes and dtypes); one that differs is
            refused with an error naming what differs.
        - `priority`: prioritised buffers only, a positive finite float: the priority of
            every valid window. Default: the buffer's `max_priority`.

        **Returns:**

        The buffer, of the same kind, shapes and dtypes (a jitted step does not retrace).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            example = {"x": jnp.float32(0)}
            ring = eb.RingStorage(example, rows=1, length=8).write({"x": jnp.arange(4.0)[None]})
            buffer = eb.PrioritisedItemBuffer(example, add_batch_size=1, capacity=8, alpha=1.0)
            buffer = buffer.with_storage(ring, priority=2.0)  # 4 items, each at priority 2
            assert float(buffer.max_priority) == 2.0 and float(buffer.tree.total()) == 8.0
            sample = buffer.sample(jax.random.key(0), batch_size=4)
            assert jnp.allclose(sample.probabilities, 0.25)
            ```
        """
        where = f"{type(self).__name__}.with_storage()"
        storage = check_like(where, self.storage, storage)
        rule = self.rule
        if priority is not None:
            if not isinstance(rule, AbstractPrioritisedRule):
                raise TypeError(
                    f"{where}: `priority` sets the priority of a prioritised buffer's windows; "
                    f"a {type(self).__name__} draws its windows uniformly: drop `priority`."
                )
            top = jnp.asarray(check_priority(where, priority), jnp.float32)
            rule = eqx.tree_at(lambda r: r.max_priority, rule, top)
        return self._with(storage, rule.updated(storage, self.window, restored=True))

    @on_auto_axes()
    @recorded
    def epoch(self, key: PRNGKeyArray, batch_size: int) -> Epoch:
        """Plan an epoch: every window valid now, once each, in a uniformly random order,
        cut into batches of `batch_size` (the last one short). Fetch batch `i` with
        [`equibuffer.AbstractBuffer.epoch_batch`][]. Works inside jit (the plan has static
        shapes: one entry per candidate window, `add_batch_size * max_length_time_axis`),
        under `vmap` and with donation.

        The windows are those `sample` draws from, with the same view (windows, pairs,
        n-step transitions, items) and episode rule; a prioritised buffer's priorities play
        no part (an epoch visits every valid window once, whatever its priority, 0 included).
        Make a new plan for each epoch: the windows that adds made valid since are in the
        next one.

        **Arguments:**

        - `key`: a JAX PRNG key; two keys give two independent orders.
        - `batch_size`: the windows per batch (static), at least 1.

        **Returns:**

        An [`equibuffer.Epoch`][]. Fails (inside jit: recorded in the plan and in every
        batch fetched with it, raised by [`equibuffer.check`][]) when `can_sample()` is
        false, or when no window is valid (an episode-aware buffer whose episodes are all
        shorter than the window).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TransitionBuffer({"t": jnp.int32(0)}, add_batch_size=1, capacity=16)
            buffer = buffer.add({"t": jnp.arange(6, dtype=jnp.int32)[None]})
            epoch = buffer.epoch(jax.random.key(0), batch_size=2)  # 5 pairs: 0-1, ..., 4-5
            firsts = []
            for i in range(int(epoch.num_batches())):
                sample, valid = buffer.epoch_batch(epoch, i)
                firsts += sample.experience.first["t"][valid].tolist()
            assert sorted(firsts) == [0, 1, 2, 3, 4]  # each pair once
            ```
        """
        where, batch_size = self._keyed_arguments("epoch", key, batch_size)
        valid = self.rule.valid_starts(self.storage, self.window)
        epoch = plan_epoch(self.storage, valid, key, batch_size)
        ready = self.can_sample()
        episodes = getattr(self.rule, "episodes", None)
        no_window = (
            episodes.no_window_message(where, self.window)
            if isinstance(episodes, EpisodeEnds)
            else f"{where}: no valid window."
        )
        count = branched_error_if(
            epoch.count,
            ~ready | (epoch.count == 0),
            jnp.where(ready, 1, 0),
            [self._not_ready(where), no_window],
        )
        return eqx.tree_at(lambda e: e.count, epoch, count)

    @on_auto_axes()
    @recorded
    def epoch_batch(
        self, epoch: Epoch, i: Int[ArrayLike, ""]
    ) -> tuple[Sample | EpisodeSample, Bool[Array, " batch"]]:
        """Batch `i` of an epoch planned by [`equibuffer.AbstractBuffer.epoch`][]: the
        windows at positions `i * batch_size` to `(i + 1) * batch_size - 1` of its order.

        **Arguments:**

        - `epoch`: an [`equibuffer.Epoch`][] of this buffer (one made by a buffer of another
            size is refused).
        - `i`: the batch number, a 0-d integer (a Python int, or the counter of a
            `lax.fori_loop` / `lax.scan`).

        **Returns:**

        `(sample, valid)`: `sample` is what `sample` returns for a uniform buffer of this
        kind (a [`equibuffer.Sample`][], or an [`equibuffer.EpisodeSample`][] with its
        episode mask; no probabilities or weights: an epoch is not drawn by priority), of
        `batch_size` windows; its `indices` and `steps` may be given to `set_priorities`.
        `valid`: `(batch_size,)` bool, true at the windows of the epoch. It is false at the
        end of the last batch, which runs short (those places repeat windows from the start
        of the epoch: real data, to be masked out of the loss), and everywhere in a batch
        `i` outside `[0, epoch.num_batches())`.

        The buffer may grow between `epoch` and `epoch_batch`: the plan keeps its windows,
        and data added since is not in it (plan a new epoch). When adds have written over a
        window of the batch since the plan was made (the ring wrapped over it), the batch
        fails (inside jit: recorded in the sample, raised by [`equibuffer.check`][]): plan
        epochs after the adds, or add fewer steps than the ring has room for while an epoch
        runs. `update` between the two is not checked: a batch holds the data as it is now.

        !!! example

            ```python
            import equibuffer as eb, equinox as eqx, jax, jax.numpy as jnp
            from jax import lax

            buffer = eb.TrajectoryBuffer({"x": jnp.float32(0)}, add_batch_size=2,
                                         max_length_time_axis=64, sequence_length=4)
            buffer = buffer.add({"x": jnp.ones((2, 20))})  # 17 windows per row

            @eqx.filter_jit
            def epoch_sum(buffer, key):
                epoch = buffer.epoch(key, batch_size=8)

                def body(i, total):
                    sample, valid = buffer.epoch_batch(epoch, i)
                    per_window = sample.experience["x"].sum(axis=1)  # a stand-in for a loss
                    return total + jnp.sum(jnp.where(valid, per_window, 0.0))

                return lax.fori_loop(0, epoch.num_batches(), body, jnp.float32(0))

            assert float(epoch_sum(buffer, jax.random.key(0))) == 34 * 4.0  # each window once
            ```
        """
        where = f"{type(self).__name__}.epoch_batch()"
        candidates = self.storage.rows * self.storage.length
        check_epoch(where, epoch, candidates, "add_batch_size * max_length_time_axis")
        record(epoch.error)  # a failure recorded while planning goes on to every batch
        indices, steps, valid = epoch_batch_windows(epoch, i, where)
        indices = error_if(
            indices,
            jnp.any(valid & ~still_held(self.storage, indices, steps)),
            f"{where}: a window of this epoch was written over by adds made after "
            f"`epoch()` planned it (the ring holds max_length_time_axis="
            f"{self.storage.length} steps per row). Plan the epoch after the adds, or add "
            "fewer steps while an epoch runs.",
        )
        experience, mask = self._experience(Drawn(indices, steps))
        if mask is None:
            return Sample(experience=experience, indices=indices, steps=steps), valid
        sample = EpisodeSample(experience=experience, indices=indices, steps=steps, mask=mask)
        return sample, valid

    def _with(self: _Buffer, storage: RingStorage, rule: Any) -> _Buffer:
        """The buffer with `storage` and `rule` (a rule without state, `Uniform`, returns
        itself from `added`/`updated`: only the storage is replaced then)."""
        if rule is self.rule:
            return eqx.tree_at(lambda b: b.storage, self, storage)
        return eqx.tree_at(lambda b: (b.storage, b.rule), self, (storage, rule))

    @abc.abstractmethod
    def sample(self, key: PRNGKeyArray, batch_size: int, *, row_blocks: int = 1) -> AbstractSample:
        """Draw `batch_size` windows (with replacement) by the buffer's rule; see the
        concrete buffers. With `row_blocks=n`, each of `n` equal blocks of rows gets its
        own `batch_size / n` draws (see [Scaling](../scaling.md))."""
        ...


class AbstractUniformBuffer(AbstractBuffer[AbstractUniformRule]):
    """A buffer whose rule draws its valid windows uniformly: [`equibuffer.Buffer`][] and
    the named uniform buffers (`TrajectoryBuffer`, `TransitionBuffer`, `ItemBuffer`,
    `EpisodeTrajectoryBuffer`), each final.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp

        buffer = eb.TrajectoryBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=8,
                                     sequence_length=2)
        assert isinstance(buffer, eb.AbstractUniformBuffer)
        assert not isinstance(buffer, eb.Buffer)  # the same composition, its own final class
        ```
    """

    @on_auto_axes(split=in_blocks)
    @recorded
    def sample(
        self, key: PRNGKeyArray, batch_size: int, *, row_blocks: int = 1
    ) -> Sample | EpisodeSample:
        """Draw `batch_size` windows uniformly, with replacement, over all valid windows.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of windows drawn (static).
        - `row_blocks`: `n >= 1` dividing `add_batch_size` and `batch_size` (static). The rows
            are cut into `n` equal blocks of consecutive rows, the blocks `shard_rows` puts
            on the `n` devices of a mesh axis, and the `b`-th `batch_size / n` windows are
            drawn uniformly over the valid windows of block `b` only: each device samples
            its own batch from its own rows (the `pmap` pattern; see
            [Scaling](../scaling.md)). The default, 1, draws over all rows.

        Fails inside jit (recorded, raised by [`equibuffer.check`][]) when `can_sample()` is false.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TrajectoryBuffer({"t": jnp.int32(0)}, add_batch_size=1,
                                         max_length_time_axis=8,
                                         sequence_length=2)
            buffer = buffer.add({"t": jnp.arange(5, dtype=jnp.int32)[None]})
            t = buffer.sample(jax.random.key(0), batch_size=6).experience["t"]
            assert t.shape == (6, 2) and (t[:, 1] == t[:, 0] + 1).all()
            ```
        """
        where, batch_size, blocks = self._sample_arguments(key, batch_size, row_blocks)
        request = Request(key, batch_size, self.can_sample(), self._not_ready(where), where, blocks)
        drawn = self.rule.draw(self.storage, self.window, request)
        experience, mask = self._experience(drawn, blocks)
        if mask is None:
            return Sample(experience=experience, indices=drawn.indices, steps=drawn.steps)
        return EpisodeSample(
            experience=experience, indices=drawn.indices, steps=drawn.steps, mask=mask
        )


UpdateFn: TypeAlias = Callable[[PyTree[Shaped[Array, "..."]]], PyTree[Shaped[Array, "..."]]]


def update_storage(storage: RingStorage, fn: UpdateFn, owner: str) -> RingStorage:
    """`storage` with `fn` (one step -> one step, same structure, shapes, dtypes) applied to
    every written slot; unwritten slots keep their values."""
    where = f"{owner}.update()"
    example = storage.example()
    out = jax.eval_shape(fn, example)
    got = check_structure(where, jax.tree.structure(example), out)
    for (path, o), e in zip(got, jax.tree.leaves(example), strict=True):
        if (tuple(o.shape), jnp.dtype(o.dtype)) != (tuple(e.shape), jnp.dtype(e.dtype)):
            raise ValueError(
                f"{where}: `fn` returns leaf {keystr(path)} with shape {tuple(o.shape)} and "
                f"dtype {jnp.dtype(o.dtype).name}, expected shape {tuple(e.shape)} and dtype "
                f"{jnp.dtype(e.dtype).name} (the stored step's); `fn` must keep shapes and dtypes."
            )
    rows, length = storage.rows, storage.length
    flat = jax.tree.map(lambda x: x.reshape(rows * length, *x.shape[2:]), storage.data)
    new = jax.vmap(fn)(flat)
    slots = jnp.arange(length, dtype=jnp.int32)
    written = (slots - storage.head + storage.fill + length) % length < storage.fill

    def keep(old: Array, new: Array) -> Array:
        new = new.reshape(old.shape)
        mask = written.reshape(1, length, *(1,) * (old.ndim - 2))
        return jnp.where(mask, new, old)

    data = jax.tree.map(keep, storage.data, new)
    return eqx.tree_at(lambda s: s.data, storage, data)
