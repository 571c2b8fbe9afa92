"""The valid-window rule, defined once and shared by every sampling rule.

A window is `sequence_length` consecutive steps of one row. It is valid when it lies inside the
steps the ring still holds (so it never spans the write head or an unwritten slot) and starts at
an absolute step that is a multiple of `period`. Counting from the oldest step held, valid
windows start at offsets `first, first + period, ...`, `count` of them per row; all of it is a
function of the ring's counters only, never of the stored data.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PRNGKeyArray, PyTree, Shaped

from ._custom_types import Indices, IntScalar, Steps
from ._ring import RingStorage


def window_layout(
    storage: RingStorage, sequence_length: int, period: int
) -> tuple[IntScalar, IntScalar]:
    """`(first, count)`: the offset from the oldest held step of the first valid window start,
    and the number of valid windows per row."""
    oldest_phase = (storage.count_mod(period) - storage.fill % period) % period
    first = (period - oldest_phase) % period
    span = storage.fill - sequence_length
    count = jnp.where(span >= first, (span - first) // period + 1, 0)
    return first, count


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


def windows_held(
    storage: RingStorage, offsets: Int[Array, "*b"], sequence_length: int, period: int
) -> Bool[Array, "*b"]:
    """Whether the window starting `offsets` steps after the oldest held step (any integer:
    negative or past the fill is not held) is valid by the counters: held, complete and
    starting at a multiple of `period`. The one statement of the rule `window_layout` counts."""
    first, count = window_layout(storage, sequence_length, period)
    rel = offsets - first
    valid = (offsets >= 0) & (rel >= 0)
    if period == 1:  # (static: no integer division, a dozen ops each on CPU)
        return valid & (rel < count)
    return valid & (rel % period == 0) & (rel // period < count)


def changed_offsets(storage: RingStorage, keep: int, sequence_length: int) -> Int[Array, " m"]:
    """The offsets, oldest first, of the window starts whose status an add of `keep` steps per
    row may have changed (`storage` is the ring after the add): those at the steps just
    written (new data) and at the `sequence_length - 1` steps before them (complete only now),
    capped at `length` so that no slot is named twice. The last `keep` are the new steps."""
    m = min(keep + sequence_length - 1, storage.length)
    return storage.fill - m + jnp.arange(m, dtype=jnp.int32)


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


def gather(
    storage: RingStorage, indices: Indices, sequence_length: int
) -> PyTree[Shaped[Array, "batch sequence ..."]]:
    """The `sequence_length` steps starting at each flat window index, leaves
    `(batch, sequence_length, *leaf)`."""
    flat = window_steps(storage.length, indices, sequence_length)

    def take(leaf: Array) -> Array:
        return leaf.reshape(-1, *leaf.shape[2:]).at[flat].get(mode="promise_in_bounds")

    return jax.tree.map(take, storage.data)


def gather_steps(
    storage: RingStorage, indices: Indices, sequence_length: int
) -> list[PyTree[Shaped[Array, "batch ..."]]]:
    """Step `j` of the window at each flat index, for `j < sequence_length`: one tree with
    leaves `(batch, *leaf)` per step, each gathered straight from the ring (no
    `(batch, sequence_length, *leaf)` intermediate to slice, which costs a copy)."""
    length = storage.length
    row, slot = indices // length, indices % length

    def step(j: int) -> PyTree[Shaped[Array, "batch ..."]]:
        flat = row * length + (slot + j) % length
        return jax.tree.map(
            lambda leaf: leaf.reshape(-1, *leaf.shape[2:]).at[flat].get(mode="promise_in_bounds"),
            storage.data,
        )

    return [step(j) for j in range(sequence_length)]


def gather_slots(
    storage: RingStorage, slots: Int[Array, " sequence"]
) -> PyTree[Shaped[Array, "rows sequence ..."]]:
    """The steps at `slots` of every row, leaves `(rows, len(slots), *leaf)`: a gather
    batched over the rows, each row indexing its own steps. With the rows split over devices
    (`shard_rows`) every device reads its own rows and the result stays split like them (a
    flat `gather` of the same windows is combined across devices); on one device it is one
    gather of the same elements. The slots are broadcast to every row on purpose: unbatched,
    they would make the rows a pass-through axis of the gather, which comes out time-major
    and costs a transposing copy."""
    per_row = jnp.broadcast_to(slots, (storage.rows, *slots.shape))

    def take(leaf: Array) -> Array:
        return jax.vmap(lambda row, i: row.at[i].get(mode="promise_in_bounds"))(leaf, per_row)

    return jax.tree.map(take, storage.data)
