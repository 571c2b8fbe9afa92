"""A sample-to-insert rate limiter (Reverb's `SampleToInsertRatio`) kept as counters in a module
that wraps any buffer, so a jitted training loop asks `can_add()` / `can_sample()` when to act
and when to learn."""

import math
from typing import Any, NoReturn

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from ._axes import in_blocks, on_auto_axes
from ._buffers._epochs import no_epochs
from ._buffers._samples import AbstractSample
from ._checks import check_positive_int, host_float, refuse_flashbax_only
from ._custom_types import BoolScalar, ExperienceBatch, StepCount
from ._errors import error_if, recorded
from ._protocol import AbstractPrioritisedSource, AbstractReplayBuffer
from ._ring import RingStorage


# Every increment (`samples_per_insert * rows * T`, `batch_size`) and the tolerance must stay
# below `_LIMIT`; the credit's integer part must stay within `+-_GUARD`. Then one update moves
# the integer part by at most `_LIMIT + 1`, so nothing computed here ever passes int32.
_LIMIT = 2**28
_GUARD = 2**30


def _split(x: float) -> tuple[int, np.float32]:
    """`x` as `(whole, fraction)` with `whole` an int and `fraction` a float32 in `[0, 1)`."""
    whole = math.floor(x)
    fraction = np.float32(x - whole)
    if fraction >= 1:  # `x - whole` just below 1 rounds up to 1 in float32
        return whole + 1, np.float32(0)
    return whole, fraction


def _check_number(where: str, name: str, value: Any, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{where}: `{name}` must be a Python float, got {value!r}.")
    value = host_float(value)
    bound = "> 0" if positive else ">= 0"
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{where}: `{name}` must be finite and {bound}, got {value}.")
    if value > _LIMIT:
        raise ValueError(f"{where}: `{name}` must be at most 2**28, got {value}.")
    return value


def add_unless(
    buffer: AbstractReplayBuffer, batch: ExperienceBatch, refused: Bool[Array, ""]
) -> AbstractReplayBuffer:
    """`buffer.add(batch)` where the 0-d bool `refused` is false, and `buffer` as it was
    where it is true: in place for the library's buffers (their `_add`); for a buffer of
    your own, by a choice of every leaf (a pass over the buffer)."""
    own = getattr(buffer, "_add", None)
    if own is not None:
        return own(batch, refused)
    added = buffer.add(batch)
    old, new = eqx.filter(buffer, eqx.is_array), eqx.filter(added, eqx.is_array)
    chosen = jax.tree.map(lambda o, n: jnp.where(refused, o, n), old, new)
    return eqx.combine(chosen, added)


def _count_words(buffer: Any) -> Array | None:
    """The words that count the steps `buffer` took (an add moves them, a refused one leaves
    them): a ring's count, a clustered buffer's count per cluster; None for a buffer of
    another kind, whose `_add` refuses through `refused` alone."""
    storage = getattr(buffer, "storage", None)
    if isinstance(storage, RingStorage):
        return storage.counters[2:4]
    count = getattr(storage, "count", None)
    return count if isinstance(count, jax.Array) else None


class RateLimited(eqx.Module):
    """A buffer with a **sample-to-insert rate limiter**: a target number of sampled windows
    per inserted step, kept within a tolerance (Reverb's `SampleToInsertRatio`), so that a
    jitted training loop asks `can_add()` when to act and `can_sample(batch_size)` when to
    learn. It is a module holding the wrapped buffer and the limiter's counter; `add` and
    `sample` return an updated copy, as every buffer does.

    **The counter.** One number, the `credit()`:

    `credit = samples_per_insert * (steps inserted, counted) - (windows sampled)`

    where a step counts once per row (an `add` of `T` steps to `add_batch_size` rows inserts
    `add_batch_size * T` steps) and a sample of `batch_size` windows counts `batch_size`.

    - **Warm-up.** An `add`'s steps are counted if and only if the wrapped buffer can be
        sampled after it (`buffer.can_sample()`,
                          i.e. it holds its `min_length_time_axis` steps per row and
        a window). The adds that fill the buffer up to its minimum do not count, except the one
        that makes it sampleable, which counts all its steps. While the buffer cannot be
        sampled, `can_add()` is always true and `can_sample()` always false.
    - **Acting.** `can_add(T)` is `~buffer.can_sample() | (credit + spi * add_batch_size * T
        <= tolerance)`: the add would not put the learner more than `tolerance` windows behind.
    - **Learning.** `can_sample(B)` is `buffer.can_sample() & (credit - B >= -tolerance)`: the
        sample would not put the learner more than `tolerance` windows ahead.

    A loop that acts only when `can_add(T)` and learns only when `can_sample(B)` keeps
    `-tolerance <= credit <= tolerance`: a sample leaves `credit >= -tolerance` and a counted
    add `credit <= tolerance`. The one exception is an add made while the buffer could not be
    sampled (the add that ends the warm-up, or one made while a buffer's `can_sample()` is
    false again, as with `period > max_length_time_axis - sequence_length + 1`), which may
    leave up to `tolerance + spi * add_batch_size * T`. So after the warm-up `windows sampled =
    samples_per_insert * steps inserted` up to `tolerance` (plus that one add): the achieved
    ratio tends to `samples_per_insert`. (For a [`equibuffer.TrajectoryBuffer`][] each
    window holds `sequence_length` steps, so each step is seen in about `samples_per_insert *
    sequence_length` windows.)

    **Deadlock.** Both predicates are false when `tolerance - spi * add_batch_size * T < credit
    < B - tolerance`, which is possible if and only if `2 * tolerance < B + spi *
    add_batch_size * T`. `can_sample(B)` (assuming one-step adds) and `can_add(T)` (assuming
    a batch of at least 1) raise a `ValueError` at trace time in that case, naming the
    smallest tolerance that works; `min_tolerance(B, T)` gives it for a loop that adds `T`
    steps and samples `B` windows. With `2 * tolerance >= B + spi * add_batch_size * T`,
    one of the two is always true once the buffer can be sampled.

    **Batched use.** Both predicates depend only on counters (the buffer's and the credit,
    which moves only when the loop adds or samples), never on stored data, so
    `lax.cond(limited.can_sample(B), learn, skip)` inside a `jax.vmap` over seeds stays a cond.

    **Precision.** The credit is kept exactly as an int32 whole part plus a float32 fraction in
    `[0, 1)` (`credit_whole`, `credit_fraction`): whole numbers of windows are never rounded,
    and when `spi * add_batch_size * T` is not a whole number only its fraction carries
    float32 rounding (a relative error of about 1e-7 on the ratio; none at all for dyadic
    values such as 0.25 or 1.5). `add` and `sample` never refuse: the limiter advises, the loop
    decides. A loop that ignores the advice moves the credit without bound; `add` and `sample`
    raise (inside jit: recorded, raised by [`equibuffer.check`][] or [`equibuffer.filter_jit`][])
    before its whole part would leave `[-2**30, 2**30]`, instead of overflowing, and change
    nothing then. A loop that follows the limiter never gets near
    that bound: `tolerance`, `spi * add_batch_size * T` and `batch_size` are each limited to
    2**28.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=4, capacity=64)
        limited = eb.RateLimited(buffer, samples_per_insert=2.0, tolerance=8.0)
        assert bool(limited.can_add()) and not bool(limited.can_sample(8))
        limited = limited.add({"x": jnp.ones((4, 2))})      # credit 2 * 4 = 8
        assert float(limited.credit()) == 8.0
        assert not bool(limited.can_add())                  # 8 + 8 > tolerance
        limited, sample = limited.sample(jax.random.key(0), batch_size=8)   # credit 0
        assert sample.experience["x"].shape == (8, 2)
        assert bool(limited.can_add()) and bool(limited.can_sample(8))      # 0 - 8 >= -8
        ```
    """

    buffer: AbstractReplayBuffer
    credit_whole: Int[Array, ""]
    credit_fraction: Float[Array, ""]
    samples_per_insert: float = eqx.field(static=True)
    tolerance: float = eqx.field(static=True)

    @refuse_flashbax_only
    def __init__(
        self,
        buffer: AbstractReplayBuffer,
        samples_per_insert: float,
        tolerance: float,
    ):
        """**Arguments:**

        - `buffer`: the buffer to limit, any [`equibuffer.AbstractReplayBuffer`][]: a ring
            buffer (uniform, prioritised, episode-aware) or a clustered one (whose items
            count as steps). Its `can_sample()` ends the warm-up (for a ring buffer, its
            `min_size`): nothing is counted before it can be sampled. Counting starts
            here, at a credit of 0, whatever it already holds.
        - `samples_per_insert`: the target number of windows sampled per step inserted (per
            row), a Python float `> 0`.
        - `tolerance`: how far, in windows, the count of samples may run ahead of or behind
            the target, a Python float `>= 0`. It must be at least `min_tolerance(batch_size,
            steps)` = `(batch_size + samples_per_insert * add_batch_size * steps) / 2` for
            the loop's batch size and steps per add, or the loop can deadlock (checked when
            `can_sample`/`can_add` are traced).
        """
        where = "RateLimited()"
        if not isinstance(buffer, AbstractReplayBuffer):
            raise TypeError(
                f"{where}: `buffer` must be a replay buffer (an equibuffer.AbstractReplayBuffer "
                "such as TrajectoryBuffer, PrioritisedTransitionBuffer or ClusteredBuffer), got "
                f"{type(buffer).__name__}. (A Queue has its own `can_add`/`can_sample` and "
                "needs no rate limiter.)"
            )
        self.samples_per_insert = _check_number(
            where, "samples_per_insert", samples_per_insert, positive=True
        )
        self.tolerance = _check_number(where, "tolerance", tolerance, positive=False)
        self.buffer = buffer
        self._increment(where, 1)  # checks samples_per_insert * add_batch_size
        self.credit_whole = jnp.array(0, jnp.int32)
        self.credit_fraction = jnp.array(0.0, jnp.float32)

    def credit(self) -> Float[Array, ""]:
        """`samples_per_insert * (steps inserted, counted) - (windows sampled)`, as a 0-d
        float32 (exact below 2**24 in magnitude for dyadic `samples_per_insert`; the limiter
        itself compares the exact whole and fractional parts).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=2, capacity=16)
            limited = eb.RateLimited(buffer, samples_per_insert=0.75, tolerance=4.0)
            assert float(limited.credit()) == 0.0
            limited = limited.add({"x": jnp.zeros((2, 2))})  # 0.75 * 2 rows * 2 steps
            assert float(limited.credit()) == 3.0
            limited, _ = limited.sample(jax.random.key(0), batch_size=2)  # 3 - 2
            limited = limited.add({"x": jnp.zeros(2)})  # + 0.75 * 2 rows * 1 step
            assert float(limited.credit()) == 2.5
            ```
        """
        return self.credit_whole.astype(jnp.float32) + self.credit_fraction

    def min_tolerance(self, batch_size: int, steps: int = 1) -> float:
        """The smallest `tolerance` without deadlock for a loop that samples `batch_size`
        windows and adds `steps` steps at a time: `(batch_size + samples_per_insert *
        add_batch_size * steps) / 2` (a Python float).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=8, capacity=64)
            limited = eb.RateLimited(buffer, samples_per_insert=4.0, tolerance=100.0)
            assert limited.min_tolerance(batch_size=32) == (32 + 4 * 8) / 2
            ```
        """
        where = f"{type(self).__name__}.min_tolerance()"
        batch_size = check_positive_int(where, "batch_size", batch_size)
        steps = check_positive_int(where, "steps", steps)
        return (batch_size + self.samples_per_insert * self.buffer.add_batch_size * steps) / 2

    def steps_added(self) -> StepCount:
        """The limited buffer's count of steps ever added per row (see
        [`equibuffer.AbstractReplayBuffer.steps_added`][]), readable inside jit.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=2, capacity=8)
            limited = eb.RateLimited(buffer, samples_per_insert=1.0, tolerance=4.0)
            assert int(limited.add({"x": jnp.zeros(2)}).steps_added()) == 1
            ```
        """
        return self.buffer.steps_added()

    def can_add(self, steps: int = 1) -> BoolScalar:
        """Whether the loop may add `steps` steps (to every row) now: the buffer is still
        warming up, or the credit after the add stays within `tolerance` (0-d bool, a
        function of the counters only).

        **Arguments:**

        - `steps`: the number of steps per row of the coming add (static, default 1).

        Raises a `ValueError` when `2 * tolerance < spi * add_batch_size * steps + 1`: no
        batch size avoids a deadlock then.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=2, capacity=16)
            limited = eb.RateLimited(buffer, samples_per_insert=1.0, tolerance=4.0)
            assert bool(limited.can_add())  # warming up: always true
            limited = limited.add({"x": jnp.zeros((2, 2))})  # credit 1.0 * 2 * 2 = 4
            assert not bool(limited.can_add())  # 4 + 2 > tolerance
            limited, _ = limited.sample(jax.random.key(0), batch_size=2)  # credit 2
            assert bool(limited.can_add()) and not bool(limited.can_add(steps=2))  # 2 + 2, 2 + 4
            ```
        """
        where = f"{type(self).__name__}.can_add()"
        steps = check_positive_int(where, "steps", steps)
        increment = self._increment(where, steps)
        self._check_deadlock(where, 1, steps, f"steps={steps}, and a batch_size of at least 1")
        return ~self.buffer.can_sample() | self._at_most(self.tolerance - increment)

    def epoch(self, key: PRNGKeyArray, batch_size: int) -> NoReturn:
        """Refused (`TypeError`): an epoch reads every window once, outside the
        sample-to-insert ratio the limiter keeps. Plan it on the wrapped buffer (the limiter
        does not count what it reads).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            items = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=2, capacity=8)
            limited = eb.RateLimited(items, samples_per_insert=1.0, tolerance=8.0)
            limited = limited.add({"x": jnp.ones((2, 3, 2))})
            epoch = limited.buffer.epoch(jax.random.key(0), batch_size=4)  # 6 items
            assert int(epoch.num_batches()) == 2 and float(limited.credit()) == 6.0  # unchanged
            ```
        """
        no_epochs(
            f"{type(self).__name__}.epoch()",
            (
                "an epoch reads every window once, outside the sample-to-insert ratio that the "
                "limiter keeps: plan it on the wrapped buffer, `limited.buffer.epoch(key, "
                "batch_size)` (the limiter does not count what an epoch reads)."
            ),
        )

    def can_sample(self, batch_size: int) -> BoolScalar:
        """Whether the loop may sample `batch_size` windows now: the buffer can be sampled
        and the credit after the sample stays at or above `-tolerance` (0-d bool, a function
        of the counters only).

        **Arguments:**

        - `batch_size`: the number of windows the coming `sample` draws (static).

        Raises a `ValueError` when `2 * tolerance < batch_size + spi * add_batch_size`: the
        loop can deadlock even with one-step adds.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=2, capacity=16)
            limited = eb.RateLimited(buffer, samples_per_insert=1.0, tolerance=3.0)
            assert not bool(limited.can_sample(4))  # the buffer is empty
            limited = limited.add({"x": jnp.zeros((2, 2))})  # credit 4
            assert bool(limited.can_sample(4))  # 4 - 4 >= -3
            limited, _ = limited.sample(jax.random.key(0), batch_size=4)  # credit 0
            assert not bool(limited.can_sample(4))  # 0 - 4 < -3
            assert bool(limited.can_sample(3))  # 0 - 3 >= -3
            ```
        """
        where = f"{type(self).__name__}.can_sample()"
        batch_size = self._batch_size(where, batch_size)
        self._check_deadlock(where, batch_size, 1, f"batch_size={batch_size} and one-step adds")
        return self.buffer.can_sample() & self._at_least(batch_size - self.tolerance)

    @on_auto_axes()
    @recorded
    def add(self, batch: ExperienceBatch) -> "RateLimited":
        """Return the limiter with `batch` added to the buffer and, if the buffer can be
        sampled after it, `samples_per_insert * add_batch_size * T` added to the credit.

        **Arguments:**

        - `batch`: as for the wrapped buffer's `add`: leaves `(add_batch_size, *leaf)` for
            one step or `(add_batch_size, T, *leaf)` for `T` steps.

        **Returns:**

        The updated limiter (the limiter advises and never refuses an add: check
        `can_add(T)` first). Fails (inside jit: recorded, raised by [`equibuffer.check`][] or
        [`equibuffer.filter_jit`][]) if the credit would pass 2**30, which only a loop that
        keeps adding without sampling reaches: that add is refused, and the buffer and the
        credit stay as they were.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            example = {"x": jnp.zeros(())}
            buffer = eb.TrajectoryBuffer(example, add_batch_size=2, sequence_length=3,
                                         max_length_time_axis=8)
            limited = eb.RateLimited(buffer, samples_per_insert=1.0, tolerance=8.0)
            limited = limited.add({"x": jnp.zeros((2, 2))})  # 2 steps per row: no window yet
            assert float(limited.credit()) == 0.0  # warm-up: not counted
            limited = limited.add({"x": jnp.zeros(2)})  # sampleable now: counts 1.0 * 2 * 1
            assert float(limited.credit()) == 2.0 and int(limited.buffer.size()) == 6
            ```
        """
        return self._add(batch)

    def _add(self, batch: ExperienceBatch, refused: Any = None) -> "RateLimited":
        """`add`, also refused where the 0-d bool `refused` is true (a wrapper's check)."""
        where = f"{type(self).__name__}.add()"
        t = self.buffer.steps_in(batch, where)
        t = 1 if t is None else t
        whole, fraction = _split(self._increment(where, t))
        # Whether the buffer can be sampled after the add, from the counters alone: the
        # add itself is made once the credit is known to allow it (XLA drops the rest).
        counted = self.buffer.add(batch).can_sample()
        total = self.credit_fraction + jnp.where(counted, fraction, np.float32(0))
        carry = total >= 1
        new_fraction = jnp.where(carry, total - np.float32(1), total)
        new_whole = self.credit_whole + jnp.where(counted, whole, 0) + carry.astype(jnp.int32)
        over = new_whole > _GUARD
        new_whole = error_if(
            new_whole,
            over,
            f"{where}: the rate limiter's credit passed 2**30 windows: the loop keeps adding "
            "far more than samples_per_insert asks it to sample. Add only when `can_add()` is "
            "true (or sample more).",
        )
        refused = over if refused is None else over | refused
        buffer = add_unless(self.buffer, batch, refused)
        # The wrapped buffer's own checks (a stack disagreeing with its frames, a cluster id
        # out of range) refuse the whole add too: nothing is credited then either.
        before, after = _count_words(self.buffer), _count_words(buffer)
        if before is not None and after is not None:
            refused = refused | jnp.all(before == after)
        new_whole = jnp.where(refused, self.credit_whole, new_whole)
        new_fraction = jnp.where(refused, self.credit_fraction, new_fraction)
        return eqx.tree_at(
            lambda r: (r.buffer, r.credit_whole, r.credit_fraction),
            self,
            (buffer, new_whole, new_fraction),
        )

    @on_auto_axes(split=in_blocks)
    @recorded
    def sample(
        self, key: PRNGKeyArray, batch_size: int, *, row_blocks: int = 1, **kwargs: Any
    ) -> tuple["RateLimited", AbstractSample]:
        """Sample the wrapped buffer and take `batch_size` off the credit.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of windows drawn (static).
        - `row_blocks`: passed on to the buffer's `sample` (static): with `n > 1` each of
            `n` blocks of the sample is drawn from its own block of rows (or, for a
            clustered buffer, of every cluster's slots), the per-device sampling of a
            sharded buffer (see [Scaling](../scaling.md)); the buffer checks what `n` must
            divide. The credit still drops by the whole `batch_size`: the limiter counts
            windows, wherever they come from.
        - `**kwargs`: passed on to the buffer's `sample` (e.g. `beta=0.4` for a prioritised
            buffer).

        **Returns:**

        `(limited, sample)`: the limiter with the new credit, and what the buffer's `sample`
        returns. A sample is never refused by the limiter (check `can_sample(batch_size)`
        first); the buffer fails as usual when it cannot be sampled at all. Fails (inside jit:
        recorded, raised by [`equibuffer.check`][] or [`equibuffer.filter_jit`][]) if the
        credit would fall below -2**30, which only a loop that keeps sampling without adding
        reaches: the credit then stays as it was and the sample's floating leaves are NaN.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=2, capacity=16)
            limited = eb.RateLimited(buffer, samples_per_insert=2.0, tolerance=12.0)
            limited = limited.add({"x": jnp.ones((2, 3, 2))})  # credit 2 * 2 * 3 = 12
            limited, sample = limited.sample(jax.random.key(0), batch_size=5)
            assert sample.experience["x"].shape == (5, 2) and sample.indices.shape == (5,)
            assert float(limited.credit()) == 7.0
            ```
        """
        where = f"{type(self).__name__}.sample()"
        batch_size = self._batch_size(where, batch_size)
        sample = self.buffer.sample(key, batch_size, row_blocks=row_blocks, **kwargs)
        under = self.credit_whole - batch_size < -_GUARD
        new_whole = error_if(
            jnp.where(under, self.credit_whole, self.credit_whole - batch_size),
            under,
            f"{where}: the rate limiter's credit fell below -2**30 windows: the loop keeps "
            "sampling far more than samples_per_insert allows. Sample only when "
            "`can_sample(batch_size)` is true (or add more).",
        )
        return eqx.tree_at(lambda r: r.credit_whole, self, new_whole), sample

    @on_auto_axes()
    @recorded
    def set_priorities(
        self, sample: AbstractSample, priorities: Float[ArrayLike, " batch"], **kwargs: Any
    ) -> "RateLimited":
        """Return the limiter with the wrapped buffer's `set_priorities(sample, priorities,
        **kwargs)` applied (the credit is unchanged). Only for a prioritised buffer (an
        [`equibuffer.AbstractPrioritisedSource`][]).

        !!! example

            ```python
            import equibuffer as eb, equinox as eqx, jax, jax.numpy as jnp

            buffer = eb.PrioritisedItemBuffer({"x": jnp.zeros(())}, add_batch_size=2,
                                              capacity=16)
            limited = eb.RateLimited(buffer, samples_per_insert=1.0, tolerance=4.0)

            @eqx.filter_jit
            def step(limited, key):
                limited = limited.add({"x": jnp.ones(2)})
                limited, sample = limited.sample(key, batch_size=2, beta=0.4)
                return limited.set_priorities(sample, jnp.array([3.0, 1.0]))

            limited = step(limited, jax.random.key(0))
            assert float(limited.buffer.max_priority) == 3.0
            assert float(limited.credit()) == 0.0  # 1.0 * 2 inserted - 2 sampled
            ```
        """
        if not isinstance(self.buffer, AbstractPrioritisedSource):
            raise TypeError(
                f"{type(self).__name__}.set_priorities(): the wrapped "
                f"{type(self.buffer).__name__} has no priorities; wrap a prioritised buffer "
                "(an equibuffer.AbstractPrioritisedSource, e.g. PrioritisedTransitionBuffer) "
                "to set them."
            )
        buffer = self.buffer.set_priorities(sample, priorities, **kwargs)
        return eqx.tree_at(lambda r: r.buffer, self, buffer)

    # Internals.

    def _increment(self, where: str, steps: int) -> float:
        """`samples_per_insert * add_batch_size * steps`, after checking its size."""
        rows = self.buffer.add_batch_size
        increment = self.samples_per_insert * rows * steps
        if increment > _LIMIT:
            raise ValueError(
                f"{where}: samples_per_insert * add_batch_size * steps = "
                f"{self.samples_per_insert} * {rows} * {steps} = {increment} is above 2**28 "
                "windows per add; add fewer steps at a time or lower samples_per_insert."
            )
        return increment

    @staticmethod
    def _batch_size(where: str, batch_size: Any) -> int:
        batch_size = check_positive_int(where, "batch_size", batch_size)
        if batch_size > _LIMIT:
            raise ValueError(f"{where}: `batch_size` must be at most 2**28, got {batch_size}.")
        return batch_size

    def _check_deadlock(self, where: str, batch_size: int, steps: int, assuming: str) -> None:
        need = self.min_tolerance(batch_size, steps)
        if self.tolerance < need:
            spi, rows = self.samples_per_insert, self.buffer.add_batch_size
            raise ValueError(
                f"{where}: tolerance={self.tolerance} can deadlock: with "
                f"samples_per_insert={spi}, add_batch_size={rows}, {assuming}, there are "
                "credits at which neither can_add() nor can_sample() is true (that needs "
                f"2 * tolerance < batch_size + samples_per_insert * add_batch_size * steps = "
                f"{batch_size} + {spi} * {rows} * {steps}). Raise tolerance to at least "
                f"{need}."
            )

    def _at_least(self, threshold: float) -> BoolScalar:
        """`credit >= threshold`, compared on the exact whole and fractional parts."""
        whole, fraction = _split(threshold)
        d = self.credit_whole - whole
        return (d > 0) | ((d == 0) & (self.credit_fraction >= fraction))

    def _at_most(self, threshold: float) -> BoolScalar:
        """`credit <= threshold`, compared on the exact whole and fractional parts."""
        whole, fraction = _split(threshold)
        d = self.credit_whole - whole
        return (d < 0) | ((d == 0) & (self.credit_fraction <= fraction))
