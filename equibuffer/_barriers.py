"""Barriers: how the library keeps XLA from reordering or fusing what it must not (a read
of an array that a donated update then writes). The ground floor: used by the rules, the
clusters and the sum tree; it imports nothing of the library but its configuration."""

from typing import Any

import jax
import jax.numpy as jnp

from ._checks import BARRIER_EXPANDED


def read_once(*arrays: Any, blocks: int = 1) -> Any:
    """`arrays` through one `optimization_barrier`: each output depends on every input, and
    what is computed from an output reads it, never what the input was read from.

    This keeps a donated buffer's updates in place. XLA writes an array in place only where
    every read of it is ordered before the write, and only data dependencies order them; a
    read that the write does not depend on makes XLA copy the whole array (twice) to keep
    it. So a draw passes everything it reads from a tree (the leaves drawn, their values,
    the totals) through one barrier: `set_priorities` depends on the drawn indices, and so,
    through them, on every read, also those that only the importance weights use (say the
    total in `leaf / total`, fused into a weighted loss). An update that reads an array it
    then writes passes the read with the values written.

    With `blocks > 1` every array has a leading axis of `blocks` (a draw by row blocks, one
    block per device on a mesh): block `d`'s outputs depend on block `d`'s inputs only, so
    nothing crosses devices."""
    arrays = jax.lax.optimization_barrier(arrays)
    # Without the barrier (`BARRIER_EXPANDED`), XLA copies the producers of the drawn values
    # (the whole tree search) into every consumer: a weighted loss would read the tree
    # after the write. One sort keeps them together instead.
    return sorted_together(arrays, blocks) if BARRIER_EXPANDED else arrays


def sorted_together(arrays: Any, blocks: int) -> Any:
    """`arrays`, the same values, out of one sort on an already-ordered key: every output
    depends on every input (as through the barrier), and XLA never fuses a sort into its
    consumers, so what is computed from an output reads the sort's result. The sort runs
    along each of the `blocks` rows, so a sharded leading axis stays where it is."""
    leaves, treedef = jax.tree.flatten(arrays)
    shapes = [jnp.shape(x) for x in leaves]
    rows = [jnp.asarray(x).reshape(blocks, -1) for x in leaves]
    # One length for all, at least 2 (XLA drops a sort of one element); the padding is
    # sorted with the values and cut off after.
    length = max(2, *(x.shape[1] for x in rows))
    key = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (blocks, length))
    operands = [jnp.pad(x, ((0, 0), (0, length - x.shape[1]))) for x in rows]
    out = jax.lax.sort((key, *operands), dimension=1, num_keys=1)[1:]
    return treedef.unflatten(
        [o[:, : x.shape[1]].reshape(s) for o, x, s in zip(out, rows, shapes, strict=True)]
    )
