"""Epochs without replacement: every valid window once, in a random order, in mini-batches.

An `Epoch` is a plan made once per epoch from a buffer and a key (`buffer.epoch(key,
batch_size)`), inside jit as well as outside: a random permutation of every window start the
buffer could hold (`add_batch_size * max_length_time_axis` candidates, a static size), the
windows valid when the plan was made first, and their traced count. Batch `i` is the
`batch_size` windows at positions `i * batch_size, ...` of that order
(`buffer.epoch_batch(epoch, i)`); the last one runs short, and its places past the end hold
windows from the start of the order (real data, never drawn twice in the real places), masked
out. The plan keeps each window's start step, so a batch fetched after adds that overwrote a
planned window is refused (see `AbstractBuffer.epoch_batch`).
"""

from typing import Any, NoReturn

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, UInt32

from .._custom_types import Indices, IntScalar, Steps
from .._errors import first_failure
from .._ring import RingStorage
from ..rules._valid import start_steps, window_offsets


class Epoch(eqx.Module):
    """The plan of one epoch over a buffer: every window valid when it was made, once each,
    in a random order, cut into batches of `batch_size`. Made by
    [`equibuffer.AbstractBuffer.epoch`][]; batch `i` is
    [`equibuffer.AbstractBuffer.epoch_batch`][]`(epoch, i)`.

    - `indices`: `(add_batch_size * max_length_time_axis,)` int32, flat window indices
        (`row * max_length_time_axis + slot`, as `Sample.indices`): the first `count` are the valid
        windows in a uniformly random order, the rest the other candidate slots.
    - `steps`: the same shape, uint32: the absolute start step (mod 2**32) of each, as
        `Sample.steps`; a batch checks that its windows still start there.
    - `count`: 0-d int32, the number of valid windows (batched under `vmap` for an
        episode-aware buffer, whose validity depends on the stored episode ends).
    - `error`: 0-d uint32, a failure recorded while planning inside jit (0 when none), passed
        on to every batch; [`equibuffer.check`][] raises it.
    - `batch_size`: static, the windows per batch.

    The plan costs 8 bytes per candidate window (`indices` and `steps`) and one shuffle of
    them (a sort); it does not copy any experience.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.ItemBuffer({"x": jnp.int32(0)}, add_batch_size=1, capacity=8)
        buffer = buffer.add({"x": jnp.arange(5, dtype=jnp.int32)[None]})
        epoch = buffer.epoch(jax.random.key(0), batch_size=2)
        assert isinstance(epoch, eb.Epoch) and int(epoch.count) == 5
        assert epoch.max_batches == 4 and int(epoch.num_batches()) == 3  # 2 + 2 + 1
        assert sorted(epoch.indices[:5].tolist()) == [0, 1, 2, 3, 4]
        ```
    """

    indices: Int[Array, " windows"]
    steps: UInt32[Array, " windows"]
    count: Int[Array, ""]
    batch_size: int = eqx.field(static=True)
    error: UInt32[Array, ""] = eqx.field(
        default_factory=lambda: jnp.zeros((), jnp.uint32), kw_only=True
    )

    @property
    def max_batches(self) -> int:
        """The most batches an epoch of this buffer can have (static): every candidate
        window valid, `ceil(add_batch_size * max_length_time_axis / batch_size)`. A loop
        over a static number of batches (`lax.scan`) runs this many, with the mask all false
        past `num_batches()`."""
        return -(-self.indices.shape[-1] // self.batch_size)

    def num_batches(self) -> IntScalar:
        """The number of batches holding at least one window of this epoch,
        `ceil(count / batch_size)` (0-d int32): the bound of a `lax.fori_loop` over the
        epoch.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TrajectoryBuffer({"x": jnp.zeros(())}, add_batch_size=2,
                                         max_length_time_axis=16, sequence_length=4)
            buffer = buffer.add({"x": jnp.ones((2, 10))})  # 7 windows per row
            epoch = buffer.epoch(jax.random.key(0), batch_size=4)
            assert int(epoch.count) == 14 and int(epoch.num_batches()) == 4
            assert epoch.max_batches == 8  # 32 candidate windows
            ```
        """
        return (self.count + self.batch_size - 1) // self.batch_size

    def with_error(self, word: UInt32[Array, ""]) -> "Epoch":
        """The plan with failure `word` recorded, unless one is recorded already."""
        return eqx.tree_at(lambda e: e.error, self, first_failure(self.error, word))


def epoch_batch_windows(
    epoch: Epoch, i: Int[ArrayLike, ""], where: str
) -> tuple[Indices, Steps, Bool[Array, " batch"]]:
    """The flat indices, start steps and mask of batch `i` of `epoch` (a 0-d integer,
    traced or not): positions `i * batch_size + k` of the order, wrapped to the start of the
    order past `count` (masked out there), and all masked out for `i` outside
    `[0, num_batches())`."""
    i = jnp.asarray(i)
    if i.shape != () or not jnp.issubdtype(i.dtype, jnp.integer):
        raise TypeError(
            f"{where}: the batch number `i` must be a 0-d integer (a Python int or the "
            f"loop counter), got shape {i.shape} and dtype {i.dtype}."
        )
    batch_size = epoch.batch_size
    j = i.astype(jnp.int32) * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
    mask = (j >= 0) & (j < epoch.count)
    position = j % jnp.maximum(epoch.count, 1)
    take = lambda x: x.at[position].get(mode="promise_in_bounds")  # noqa: E731
    return take(epoch.indices), take(epoch.steps), mask


def shuffle_valid(
    valid: Bool[Array, " candidates"], key: PRNGKeyArray
) -> tuple[Int[Array, " candidates"], Int[Array, ""]]:
    """A uniformly random permutation of every flat index `0, ..., candidates - 1`, stably
    partitioned so that the `valid` ones come first (the order they keep is then uniform
    among themselves), and their count."""
    n = valid.shape[0]
    order = jax.random.permutation(key, n).astype(jnp.int32)
    chosen = valid.at[order].get(mode="promise_in_bounds")
    rank = jnp.cumsum(chosen, dtype=jnp.int32) - 1
    count = rank[-1] + 1
    rank_rest = jnp.cumsum(~chosen, dtype=jnp.int32) - 1
    place = jnp.where(chosen, rank, count + rank_rest)
    indices = (
        jnp.zeros(n, jnp.int32).at[place].set(order, unique_indices=True, mode="promise_in_bounds")
    )
    return indices, count


def plan_epoch(
    storage: RingStorage, valid: Bool[Array, "rows length"], key: PRNGKeyArray, batch_size: int
) -> Epoch:
    """The plan of an epoch over the windows whose start slot is `valid` (see
    `shuffle_valid`)."""
    indices, count = shuffle_valid(valid.reshape(-1), key)
    steps = start_steps(storage, window_offsets(storage, indices))
    return Epoch(indices=indices, steps=steps, count=count, batch_size=batch_size)


def check_epoch(where: str, epoch: Any, candidates: int, sizes: str) -> Epoch:
    """`epoch` checked to be an `Epoch` planned over `candidates` windows (`sizes`: the
    product of the buffer's sizes that gives that number, for the message)."""
    if not isinstance(epoch, Epoch):
        raise TypeError(
            f"{where}: `epoch` must be an equibuffer.Epoch made by `buffer.epoch(key, "
            f"batch_size)`, got {type(epoch).__name__}."
        )
    if epoch.indices.shape != (candidates,):
        raise ValueError(
            f"{where}: the epoch plans {epoch.indices.shape[-1]} candidate windows, but "
            f"this buffer has {sizes} = {candidates}; plan the epoch with this buffer's "
            "`epoch`."
        )
    return epoch


def no_epochs(where: str, why: str) -> NoReturn:
    """Refuse an epoch on a kind that does not offer one, saying why and what to use."""
    raise TypeError(f"{where}: {why}")
