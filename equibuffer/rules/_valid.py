"""The valid-window rule, defined once and shared by every sampling rule.

A window is `sequence_length` consecutive steps of one row. It is valid when it lies inside the
steps the ring still holds (so it never spans the write head or an unwritten slot) and starts at
an absolute step that is a multiple of `period`. Counting from the oldest step held, valid
windows start at offsets `first, first + period, ...`, `count` of them per row; all of it is a
function of the ring's counters only, never of the stored data.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray, Shaped

from .._custom_types import Indices, IntScalar, Steps
from .._ring import RingStorage
from ._request import Window


def span_layout(phase: Any, held: Any, sequence_length: int, period: int, xp: Any = jnp) -> Any:
    """The valid-window rule itself, for any run of `held` consecutive steps whose oldest
    step's absolute number is `phase` modulo `period`: `(first, count)`, the offset from the
    oldest step of the first window start on the period, and the number of windows of
    `sequence_length` steps that fit in the run. Written once for the ring's counters inside
    jit (`xp=jax.numpy`, `window_layout`) and for an archive's committed segments on the host
    (`xp=numpy`, `segment_starts`)."""
    first = (period - phase) % period
    span = held - sequence_length
    count = xp.where(span >= first, (span - first) // period + 1, 0)
    return first, count


def segment_starts(start: int, end: int, sequence_length: int, period: int) -> tuple[int, int]:
    """`(first, count)` for the steps `[start, end)` of one row (absolute step numbers, on
    the host): the absolute step of the first window start and the number of windows of
    `sequence_length` steps in the segment (the archive's sampler and loader)."""
    first, count = span_layout(start % period, end - start, sequence_length, period, np)
    return start + int(first), int(count)


def window_layout(
    storage: RingStorage, sequence_length: int, period: int
) -> tuple[IntScalar, IntScalar]:
    """`(first, count)`: the offset from the oldest held step of the first valid window start,
    and the number of valid windows per row (`span_layout` of the ring's held steps)."""
    oldest_phase = (storage.count_mod(period) - storage.fill % period) % period
    b = storage.lookback
    if b == 0:
        return span_layout(oldest_phase, storage.fill, sequence_length, period)
    # A ring that stacks frames: once it has written over a step, the oldest `b` held steps
    # may have lost frames of their stacks, and no window starts there (a function of the
    # counters, as `can_sample()` must be). Before, every held step has its frames: the
    # first step ever starts an episode.
    wrapped = (storage.count_hi != 0) | (storage.count_lo != storage.fill.astype(jnp.uint32))
    skip = jnp.where(wrapped, b, 0)
    first, count = span_layout(
        (oldest_phase + skip) % period, storage.fill - skip, sequence_length, period
    )
    return first + skip, count


def window_at(
    storage: RingStorage, row: Int[Array, "*b"], offset: Int[Array, "*b"]
) -> tuple[Int[Array, "*b"], Shaped[Array, "*b"]]:
    """Flat index `row * length + slot` and absolute start step (mod 2**32) of the window that
    starts `offset` steps after the oldest held step of `row`."""
    return row * storage.length + offset_slots(storage, offset), start_steps(storage, offset)


def window_offsets(storage: RingStorage, indices: Indices) -> Int[Array, " batch"]:
    """The offset, from the oldest held step of its row, of the step at each flat index
    (`row * length + slot`); `fill` or more for a slot not written yet."""
    slot = indices % storage.length
    return (slot - storage.head + storage.fill) % storage.length


def start_steps(storage: RingStorage, offset: Int[Array, "*b"]) -> Shaped[Array, "*b"]:
    """The absolute step (mod 2**32) held `offset` steps after the oldest held step."""
    return storage.count_lo - storage.fill.astype(jnp.uint32) + offset.astype(jnp.uint32)


def held_on_period(
    storage: RingStorage, offsets: Int[Array, "*b"], sequence_length: int, period: int
) -> tuple[Bool[Array, "*b"], Bool[Array, "*b"]]:
    """For the window starting `offsets` steps after the oldest held step (any integer:
    negative or past the fill is not held): whether its start is held and on the period
    (`aligned`; what the episode rule's `pad` mode starts from), and whether it is also
    complete (`whole`: valid by the counters). The one statement of the rule
    `window_layout` counts."""
    first, count = window_layout(storage, sequence_length, period)
    rel = offsets - first
    aligned = (offsets >= 0) & (rel >= 0)
    if period == 1:  # (static: no integer division, a dozen ops each on CPU)
        return aligned & (offsets < storage.fill), aligned & (rel < count)
    aligned = aligned & (rel % period == 0)
    return aligned & (offsets < storage.fill), aligned & (rel // period < count)


def windows_held(
    storage: RingStorage, offsets: Int[Array, "*b"], sequence_length: int, period: int
) -> Bool[Array, "*b"]:
    """Whether the window starting `offsets` steps after the oldest held step is valid by the
    counters: held, complete and starting at a multiple of `period` (see `held_on_period`)."""
    return held_on_period(storage, offsets, sequence_length, period)[1]


def count_held(storage: RingStorage, window: Window) -> IntScalar:
    """The number of windows valid by the counters, over all rows."""
    return window_layout(storage, window.length, window.period)[1] * storage.rows


def held_starts(storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
    """Whether the window starting at each slot is valid by the counters, in every row."""
    offsets = window_offsets(storage, jnp.arange(storage.length, dtype=jnp.int32))
    held = windows_held(storage, offsets, window.length, window.period)
    return jnp.broadcast_to(held, (storage.rows, storage.length))


def still_held(storage: RingStorage, indices: Indices, steps: Steps) -> Bool[Array, " batch"]:
    """Whether the window at each flat index still starts at the absolute step `steps` (the
    ring has not written over it since it was drawn or planned): the test of every
    `set_priorities` and of every epoch batch."""
    offset = window_offsets(storage, indices)
    return (offset < storage.fill) & (start_steps(storage, offset) == steps)


def changed_offsets(storage: RingStorage, keep: int, sequence_length: int) -> Int[Array, " m"]:
    """The offsets, oldest first, of the window starts whose status an add of `keep` steps per
    row may have changed (`storage` is the ring after the add): those at the steps just
    written (new data) and at the `sequence_length - 1` steps before them (complete only now),
    capped at `length` so that no slot is named twice. The last `keep` are the new steps."""
    m = min(keep + sequence_length - 1, storage.length)
    return storage.fill - m + jnp.arange(m, dtype=jnp.int32)


def lookback_offsets(storage: RingStorage, changed: Int[Array, " m"]) -> Int[Array, " f"]:
    """The offsets of the window starts whose status an add may have changed besides the
    `changed` ones (`changed_offsets`), when the ring stacks frames: the `frames.k - 1`
    slots after the newest step (the oldest held steps once the ring is full: an add that
    writes over steps takes their frames from the stacks of the steps after them), at
    their true offsets, capped so that no slot is named twice. Empty without frames."""
    f = min(storage.lookback, storage.length - changed.shape[0])
    return (storage.fill + jnp.arange(f, dtype=jnp.int32)) % storage.length


def offset_slots(storage: RingStorage, offsets: Int[Array, "*b"]) -> Int[Array, "*b"]:
    """The slot of the step `offsets` steps after the oldest held step."""
    return (storage.head - storage.fill + storage.length + offsets) % storage.length


def uniform_windows(
    storage: RingStorage,
    key: PRNGKeyArray,
    batch_size: int,
    sequence_length: int,
    period: int,
    blocks: int = 1,
) -> tuple[Indices, Steps]:
    """Draw `batch_size` windows uniformly (with replacement) over all valid windows; with
    `blocks > 1` (dividing `rows` and `batch_size`), the rows are cut into that many equal
    blocks and the `b`-th `batch_size / blocks` draws are uniform over block `b`'s windows."""
    first, count = window_layout(storage, sequence_length, period)
    per_row = jnp.maximum(count, 1)
    rows = storage.rows // blocks
    u = jax.random.randint(key, (batch_size,), 0, rows * per_row, dtype=jnp.int32)
    row = u // per_row
    if blocks > 1:
        block = jnp.arange(batch_size, dtype=jnp.int32) // (batch_size // blocks)
        row = row + block * rows
    return window_at(storage, row, first + (u % per_row) * period)


def flat_indices(rows: int, length: int, slots: Int[Array, " m"]) -> Int[Array, " rows_m"]:
    """The flat index `row * length + slot` of every row and slot, row-major."""
    return (jnp.arange(rows, dtype=jnp.int32)[:, None] * length + slots[None, :]).reshape(-1)


def window_steps(
    length: int, indices: Indices, sequence_length: int
) -> Int[Array, "batch sequence"]:
    """The flat index (`row * length + slot`) of step `j` of the window starting at each flat
    index, for `j < sequence_length`, wrapping around the row's ring."""
    row, slot = indices // length, indices % length
    steps = (slot[:, None] + jnp.arange(sequence_length, dtype=slot.dtype)[None, :]) % length
    return row[:, None] * length + steps
