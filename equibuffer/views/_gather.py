"""Gathers of windows from the ring: the reads every view makes of the steps a rule drew."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PyTree, Shaped

from .._custom_types import Indices
from .._ring import RingStorage
from ..rules._valid import window_steps


def gather(
    storage: RingStorage, indices: Indices, sequence_length: int
) -> PyTree[Shaped[Array, "batch sequence ..."]]:
    """The `sequence_length` steps starting at each flat window index, leaves
    `(batch, sequence_length, *leaf)`."""
    return storage.take(window_steps(storage.length, indices, sequence_length))


def gather_steps(
    storage: RingStorage, indices: Indices, sequence_length: int
) -> list[PyTree[Shaped[Array, "batch ..."]]]:
    """Step `j` of the window at each flat index, for `j < sequence_length`: one tree with
    leaves `(batch, *leaf)` per step, each gathered straight from the ring (no
    `(batch, sequence_length, *leaf)` intermediate to slice, which costs a copy)."""
    length = storage.length
    row, slot = indices // length, indices % length

    return [storage.take(row * length + (slot + j) % length) for j in range(sequence_length)]


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
