"""Prioritised replay (Schaul et al., 2016, proportional variant): the ring storage and the
valid-window rule of the uniform buffers, with a `SumTree` holding one leaf per window start."""

import abc
import math
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._checks import check_positive_int
from .._custom_types import BoolScalar, ExampleTree, ExperienceBatch, Indices, Steps
from .._ring import RingStorage
from .._sumtree import SumTree
from .._windows import flat_indices, gather, gather_steps, window_layout
from ._base import AbstractBuffer, check_window_config, resolve_length, Sample, Transition


class PrioritisedSample(Sample):
    """What a prioritised buffer's `sample` returns: a [`equibuffer.Sample`][] (`experience`,
    `indices`, `steps`) plus

    - `probabilities`: `(batch,)` float32, the probability `P(i) = p_i**alpha / sum_k p_k**alpha`
        with which each window was drawn.
    - `weights`: `(batch,)` float32, the importance-sampling weights
        `(N * P(i)) ** -beta / max_j (N * P(j)) ** -beta` over the batch (so the largest is 1),
        ready to multiply the per-sample losses.

    Pass the whole sample back to `set_priorities`: its `steps` tell which windows have been
    overwritten since, and their updates are dropped.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8,
                                          alpha=1.0)
        buffer = buffer.add({"x": jnp.arange(4.0)[None]})
        slots = jnp.arange(4)  # one row: item x sits in slot x, added at step x
        steps = slots.astype(jnp.uint32)
        buffer = buffer.set_priorities(slots, jnp.arange(1.0, 5.0), steps=steps)  # x + 1
        sample = buffer.sample(jax.random.key(1), batch_size=8, beta=1.0)
        assert jnp.allclose(sample.probabilities, (sample.experience["x"] + 1) / 10)
        assert sample.weights.dtype == jnp.float32 and float(sample.weights.max()) == 1.0
        ```
    """

    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]


_Prioritised = TypeVar("_Prioritised", bound="AbstractPrioritisedBuffer")


def _check_alpha(where: str, alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise TypeError(f"{where}: `alpha` must be a Python float, got {alpha!r}.")
    alpha = float(alpha)
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(
            f"{where}: `alpha` must be finite and >= 0 (0 samples uniformly, 1 fully in "
            f"proportion to the priorities), got {alpha}."
        )
    return alpha


class AbstractPrioritisedBuffer(AbstractBuffer):
    """A buffer whose windows are drawn with probability proportional to `priority ** alpha`.

    It is a [`equibuffer.RingStorage`][] plus the valid-window rule of the uniform buffers,
    plus a [`equibuffer.SumTree`][] with one leaf per possible window start (leaf
    `row * max_length + slot`, the same flat index as `Sample.indices`). A leaf holds
    `priority ** alpha` while its window is valid and 0 otherwise, so windows that were
    overwritten or that would span the write head are never drawn.

    - New windows enter at the largest priority ever set (1 before any `set_priorities`),
        raised to `alpha` like every other priority.
    - A priority of 0 excludes a window at any `alpha` (also `alpha=0`, which is otherwise
        uniform over the windows of positive priority).
    - `can_sample()` depends only on the counters, as for the uniform buffers; a state with
        ready counters but no window of positive priority makes `sample` raise.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8)
        assert isinstance(buffer, eb.AbstractPrioritisedBuffer)
        buffer = buffer.add({"x": jnp.arange(4.0)[None]})
        slots = jnp.arange(4)  # one row: item x sits in slot x, added at step x
        only_2 = jnp.array([0.0, 0.0, 1.0, 0.0])
        buffer = buffer.set_priorities(slots, only_2, steps=slots.astype(jnp.uint32))
        assert (buffer.sample(jax.random.key(1), batch_size=8).experience["x"] == 2).all()
        ```
    """

    tree: eqx.AbstractVar[SumTree]
    max_priority: eqx.AbstractVar[Float[Array, ""]]
    alpha: eqx.AbstractVar[float]

    @abc.abstractmethod
    def _experience(self, indices: Indices) -> Any:
        """Gather the windows starting at `indices`, shaped as `sample` returns them for this
        kind of buffer."""

    def add(self: _Prioritised, batch: ExperienceBatch) -> _Prioritised:
        """Return the buffer with `batch` appended to every row, and the priorities kept in
        step: windows whose first step was overwritten get priority 0, windows that became
        complete get the largest priority seen so far.

        **Arguments:**

        - `batch`: a tree of the example's structure, with leaves `(add_batch_size, *leaf)`
            for one step or `(add_batch_size, T, *leaf)` for `T >= 1` steps. Dtypes must
            match exactly.

        **Returns:**

        The updated buffer. The priority bookkeeping touches
        `add_batch_size * min(T + sequence_length - 1, max_length)` leaves, never the whole
        tree; under `eqx.filter_jit(donate="all")` the write is in place.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8,
                                              alpha=1.0)
            buffer = buffer.add({"x": jnp.zeros((1, 2))})
            slots = jnp.arange(2)  # one row: slots 0 and 1, added at steps 0 and 1
            buffer = buffer.set_priorities(slots, jnp.full(2, 3.0), steps=slots.astype(jnp.uint32))
            buffer = buffer.add({"x": jnp.ones(1)})  # enters at the largest priority set, 3
            assert jnp.allclose(buffer.sample(jax.random.key(1), batch_size=6).probabilities, 1 / 3)
            ```
        """
        where = f"{type(self).__name__}.add()"
        t = self.storage.steps_in(batch, where)
        storage = self.storage.write(batch)
        rows, length = storage.rows, storage.length
        keep = min(1 if t is None else t, length)
        # The only windows whose status can change are those starting at one of the `keep`
        # steps just written (new data: valid or not from scratch) or at one of the
        # `sequence_length - 1` steps before them (complete only now). Capped at `length`
        # slots, so no slot is named twice.
        m = min(keep + self.sequence_length - 1, length)
        first, count = window_layout(storage, self.sequence_length, self.period)
        offset = storage.fill - m + jnp.arange(m, dtype=jnp.int32)  # from the oldest held step
        rel = offset - first
        valid = (offset >= 0) & (rel >= 0)
        if self.period == 1:  # (static: no integer division, a dozen ops each on CPU)
            valid = valid & (rel < count)
        else:
            valid = valid & (rel % self.period == 0) & (rel // self.period < count)
        fresh = self.max_priority**self.alpha
        values = jnp.broadcast_to(jnp.where(valid, fresh, 0.0), (rows, m)).reshape(-1)
        if rows == 1:
            # One row: the leaves are one block of slots, wrapping the ring's end as the tree's
            # (a block write is contiguous slices only: no per-level scatter and gather).
            start = jax.lax.rem(storage.head - m + length, jnp.int32(length))  # (non-negative)
            tree = self.tree.write_block(start, values)
        else:
            slots = (storage.head - m + jnp.arange(m, dtype=jnp.int32)) % length
            tree = self.tree.write(flat_indices(rows, length, slots), values)
        return eqx.tree_at(lambda b: (b.storage, b.tree), self, (storage, tree))

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        beta: float | Float[ArrayLike, ""] = 1.0,
    ) -> PrioritisedSample:
        """Draw `batch_size` windows, each with probability `P(i) = p_i**alpha / sum_k
        p_k**alpha` over the valid windows (stratified: the total is cut into `batch_size`
        equal segments and one window is drawn in each).

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of windows drawn (static).
        - `beta`: the importance-sampling exponent, `>= 0` (a float or a 0-d array, so it
            may be annealed without retracing). 0 gives weights of 1, 1 corrects the bias of
            prioritised sampling fully.

        **Returns:**

        A [`equibuffer.PrioritisedSample`][]: `experience`, `indices`, `steps`,
        `probabilities` and `weights`.

        Raises inside jit (through `eqx.error_if`) when `can_sample()` is false, or when it is
        true but every valid window has priority 0.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedTrajectoryBuffer({"obs": jnp.zeros(2)}, add_batch_size=2,
                                                    max_length=16, sequence_length=4)
            buffer = buffer.add({"obs": jnp.ones((2, 8, 2))})
            sample = buffer.sample(jax.random.key(0), batch_size=8, beta=0.4)
            assert sample.experience["obs"].shape == (8, 4, 2)
            # equal priorities: each of the 2 * 5 windows has probability 1/10, every weight is 1
            assert jnp.allclose(sample.probabilities, 0.1) and jnp.allclose(sample.weights, 1.0)
            ```
        """
        where = f"{type(self).__name__}.sample()"
        batch_size = check_positive_int(where, "batch_size", batch_size)
        if isinstance(beta, int | float) and not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"{where}: `beta` must be finite and >= 0, got {beta}.")
        exponent = jnp.asarray(beta, jnp.float32)
        if exponent.shape != ():
            raise ValueError(f"{where}: `beta` must be a scalar, got shape {exponent.shape}.")
        # The barrier keeps XLA from fusing the tree search into the gather of the windows
        # (which would redo the search for every gathered element).
        indices, leaves = jax.lax.optimization_barrier(self.tree.sample_values(key, batch_size))
        total = self.tree.total()
        none_valid, no_window = self._no_valid_window(where)
        # One check (one conditional in the compiled step) for the four ways to fail.
        failure = jnp.where(total > 0, 3, jnp.where(none_valid, 2, 1))
        failure = jnp.where(~self.can_sample(), 0, failure)
        indices = eqx.branched_error_if(
            indices,
            (failure < 3) | (exponent < 0) | ~jnp.isfinite(exponent),
            failure,
            [
                f"{where}: the buffer cannot be sampled yet: it needs at least "
                f"min_length={self.min_length} steps per row and one window of "
                f"sequence_length={self.sequence_length}. Check `buffer.can_sample()` first.",
                f"{where}: every valid window has priority 0, so there is nothing to draw "
                "(`can_sample()` only looks at the counters). Give some windows a positive "
                "priority with `set_priorities`, or add data (new windows enter at the largest "
                "priority seen).",
                no_window,
                f"{where}: `beta` must be finite and >= 0.",
            ],
        )
        probabilities = leaves / total
        # (N P(i))^-beta / max_j (N P(j))^-beta, written so that it neither over- nor
        # underflows: every sampled P(i) > 0, and the ratio to the smallest is >= 1.
        weights = (probabilities / jnp.min(probabilities)) ** -exponent
        offset, _ = self._offsets(indices)
        steps = self.storage.count_lo - self.storage.fill.astype(jnp.uint32)
        steps = steps + offset.astype(jnp.uint32)
        return PrioritisedSample(
            experience=self._experience(indices),
            indices=indices,
            steps=steps,
            probabilities=probabilities,
            weights=weights,
        )

    def set_priorities(
        self: _Prioritised,
        sample: Sample | Int[ArrayLike, " batch"],
        priorities: Float[ArrayLike, " batch"],
        *,
        steps: Steps | None = None,
    ) -> _Prioritised:
        """Return the buffer with new priorities for sampled windows.

        **Arguments:**

        - `sample`: the [`equibuffer.Sample`][] the priorities are for (the least
            error-prone), or its `indices` together with `steps=sample.steps`.
        - `priorities`: `(batch,)` non-negative finite priorities, before the exponent `alpha`
            (e.g. `|td_error| + 1e-6`). Negative, NaN or infinite values raise inside jit
            through `eqx.error_if`.
        - `steps`: only when `sample` is an index array: the absolute start steps
            `sample.steps`.

        **Returns:**

        The updated buffer. An update is **dropped** when its window is no longer what was
        sampled: its first step was overwritten since (its slot now holds another absolute
        step) or it is no longer a valid window. When an index appears more than once, one
        of its updates is applied, unspecified which (the same window sampled twice normally
        gets the same priority; deduplicate first if not). The largest priority given for a
        current window (duplicates included) raises the priority at which
        new windows enter.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8)
            buffer = buffer.add({"x": jnp.arange(4.0)[None]})
            sample = buffer.sample(jax.random.key(0), batch_size=4)
            updated = buffer.set_priorities(sample, jnp.full(4, 5.0))
            assert float(updated.max_priority) == 5.0  # new items will enter at priority 5
            overwritten = buffer.add({"x": jnp.zeros((1, 8))})  # every sampled item replaced
            stale = overwritten.set_priorities(sample, jnp.full(4, 5.0))
            assert float(stale.max_priority) == 1.0  # the updates were dropped
            ```
        """
        where = f"{type(self).__name__}.set_priorities()"
        if isinstance(sample, Sample):
            if steps is not None:
                raise TypeError(
                    f"{where}: `steps` is taken from the sample; pass either a Sample, or "
                    "indices with `steps=`."
                )
            indices, steps = sample.indices, sample.steps
        else:
            indices = sample
            if steps is None:
                raise TypeError(
                    f"{where}: pass the whole sample (`buffer.set_priorities(sample, "
                    "priorities)`) or the indices with `steps=sample.steps`: the steps tell "
                    "which windows were overwritten since they were sampled."
                )
        indices = jnp.asarray(indices)
        steps = jnp.asarray(steps)
        new = jnp.asarray(priorities)
        if indices.ndim != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(
                f"{where}: `indices` must be a 1-d integer array, got shape {indices.shape} "
                f"and dtype {indices.dtype}."
            )
        for name, x in (("priorities", new), ("steps", steps)):
            if x.shape != indices.shape:
                raise ValueError(
                    f"{where}: `{name}` has shape {x.shape} but `indices` has shape "
                    f"{indices.shape}; give one per sampled window."
                )
        if steps.dtype != jnp.uint32:
            raise TypeError(f"{where}: `steps` must be uint32 (`sample.steps`), got {steps.dtype}.")
        new = new.astype(jnp.float32)
        indices = indices.astype(jnp.int32)
        out_of_range = jnp.any((indices < 0) | (indices >= self.tree.capacity))
        new = eqx.branched_error_if(
            new,
            out_of_range | jnp.any((new < 0) | ~jnp.isfinite(new)),
            jnp.where(out_of_range, 0, 1),
            [
                f"{where}: every index must be in [0, add_batch_size * max_length="
                f"{self.tree.capacity}); pass `sample.indices`.",
                f"{where}: every priority must be non-negative and finite (a negative, NaN or "
                "infinite priority was given).",
            ],
        )
        offset, valid = self._offsets(indices)
        held_step = self.storage.count_lo - self.storage.fill.astype(jnp.uint32)
        held_step = held_step + offset.astype(jnp.uint32)
        current = valid & (held_step == steps)
        values = jnp.where(new > 0, new**self.alpha, 0.0)
        tree = self.tree.write(indices, values, mask=current)
        applied = jnp.max(jnp.where(current, new, 0.0))
        max_priority = jnp.maximum(self.max_priority, applied)
        return eqx.tree_at(lambda b: (b.tree, b.max_priority), self, (tree, max_priority))

    def _no_valid_window(self, where: str) -> tuple[BoolScalar, str]:
        """Whether no window is valid although the counters say the buffer can be sampled, and
        the message `sample` raises then. Never, for a buffer whose valid windows are a
        function of the counters; a buffer with a narrower rule (episodes) says when."""
        return jnp.array(False), f"{where}: no valid window."

    def _offsets(self, indices: Indices) -> tuple[Int[Array, " batch"], Bool[Array, " batch"]]:
        """Offset of each window start from the oldest held step of its row, and whether the
        window is valid now."""
        storage = self.storage
        slot = indices % storage.length
        offset = (slot - storage.head + storage.fill) % storage.length
        first, count = window_layout(storage, self.sequence_length, self.period)
        rel = offset - first
        valid = (offset < storage.fill) & (rel >= 0) & (rel % self.period == 0)
        return offset, valid & (rel // self.period < count)


def _init(
    where: str,
    example: ExampleTree,
    add_batch_size: int,
    max_length: int | None,
    capacity: int | None,
    max_size: int | None,
    sequence_length: int,
    period: int,
    min_length: int | None,
    alpha: float,
) -> tuple[RingStorage, int, int, int, SumTree, Float[Array, ""], float]:
    rows = check_positive_int(where, "add_batch_size", add_batch_size)
    length = resolve_length(where, rows, max_length, capacity, max_size)
    sequence_length, period, min_length = check_window_config(
        where, length, sequence_length, period, min_length
    )
    alpha = _check_alpha(where, alpha)
    storage = RingStorage(example, rows, length)
    tree = SumTree(rows * length)
    return (storage, sequence_length, period, min_length, tree, jnp.array(1.0, jnp.float32), alpha)


class PrioritisedTrajectoryBuffer(AbstractPrioritisedBuffer):
    """A [`equibuffer.TrajectoryBuffer`][] that draws windows in proportion to their
    priority: windows of `sequence_length` consecutive steps of one row, starting at absolute
    steps that are multiples of `period`, each drawn with probability
    `p**alpha / sum_k p_k**alpha`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedTrajectoryBuffer({"obs": jnp.zeros(4)}, add_batch_size=2,
                                                max_length=100, sequence_length=8, alpha=0.6)
        buffer = buffer.add({"obs": jnp.ones((2, 10, 4))})
        sample = buffer.sample(jax.random.key(0), batch_size=32, beta=0.4)
        assert sample.experience["obs"].shape == (32, 8, 4)
        buffer = buffer.set_priorities(sample, jnp.abs(jnp.arange(32.0) - 16) + 1e-3)
        ```
    """

    storage: RingStorage
    sequence_length: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length: int = eqx.field(static=True)
    tree: SumTree
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        sequence_length: int,
        period: int = 1,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
        alpha: float = 0.6,
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `sequence_length`, `period`, `max_length`, `capacity`
            (alias `max_size`), `min_length`: as for [`equibuffer.TrajectoryBuffer`][].
        - `alpha`: the priority exponent, `>= 0`: 0 is uniform over windows of positive
            priority, 1 fully proportional. Default 0.6 (Schaul et al.).
        """
        (
            self.storage,
            self.sequence_length,
            self.period,
            self.min_length,
            self.tree,
            self.max_priority,
            self.alpha,
        ) = _init(
            "PrioritisedTrajectoryBuffer()",
            example,
            add_batch_size,
            max_length,
            capacity,
            max_size,
            sequence_length,
            period,
            min_length,
            alpha,
        )

    def _experience(self, indices: Indices) -> Any:
        return gather(self.storage, indices, self.sequence_length)


class PrioritisedTransitionBuffer(AbstractPrioritisedBuffer):
    """A [`equibuffer.TransitionBuffer`][] that draws consecutive pairs `(first, second)` in
    proportion to their priority.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedTransitionBuffer({"obs": jnp.zeros(4)}, add_batch_size=8,
                                                capacity=1_000)
        buffer = buffer.add({"obs": jnp.ones((8, 3, 4))})
        sample = buffer.sample(jax.random.key(0), batch_size=32, beta=0.4)
        assert sample.experience.first["obs"].shape == (32, 4)
        buffer = buffer.set_priorities(sample, sample.weights)
        ```
    """

    storage: RingStorage
    sequence_length: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length: int = eqx.field(static=True)
    tree: SumTree
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
        alpha: float = 0.6,
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `max_length`, `capacity` (alias `max_size`),
            `min_length`: as for [`equibuffer.TransitionBuffer`][].
        - `alpha`: the priority exponent, `>= 0` (default 0.6).
        """
        (
            self.storage,
            self.sequence_length,
            self.period,
            self.min_length,
            self.tree,
            self.max_priority,
            self.alpha,
        ) = _init(
            "PrioritisedTransitionBuffer()",
            example,
            add_batch_size,
            max_length,
            capacity,
            max_size,
            2,
            1,
            min_length,
            alpha,
        )

    def _experience(self, indices: Indices) -> Any:
        # Each step gathered on its own: slicing a gathered (batch, 2, ...) pair costs a copy.
        first, second = gather_steps(self.storage, indices, 2)
        return Transition(first=first, second=second)


class PrioritisedItemBuffer(AbstractPrioritisedBuffer):
    """A [`equibuffer.ItemBuffer`][] that draws items in proportion to their priority.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.zeros(3)}, add_batch_size=4, capacity=100)
        buffer = buffer.add({"x": jnp.ones((4, 3))})
        sample = buffer.sample(jax.random.key(0), batch_size=16)
        assert sample.experience["x"].shape == (16, 3)
        ```
    """

    storage: RingStorage
    sequence_length: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length: int = eqx.field(static=True)
    tree: SumTree
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
        alpha: float = 0.6,
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `max_length`, `capacity` (alias `max_size`),
            `min_length`: as for [`equibuffer.ItemBuffer`][].
        - `alpha`: the priority exponent, `>= 0` (default 0.6).
        """
        (
            self.storage,
            self.sequence_length,
            self.period,
            self.min_length,
            self.tree,
            self.max_priority,
            self.alpha,
        ) = _init(
            "PrioritisedItemBuffer()",
            example,
            add_batch_size,
            max_length,
            capacity,
            max_size,
            1,
            1,
            min_length,
            alpha,
        )

    def _experience(self, indices: Indices) -> Any:
        return gather_steps(self.storage, indices, 1)[0]
