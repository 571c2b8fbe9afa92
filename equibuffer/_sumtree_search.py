"""The layout of a sum tree's nodes in one flat array (`SumTree`, and the `SumTrees` of
several trees laid end to end), its levels, and the search from the top level down to the
leaves that `sample`, `find` and the draws by priority make."""

import functools
import math
from typing import Any, TYPE_CHECKING

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._checks import BARRIER_EXPANDED, check_positive_int


if TYPE_CHECKING:
    from ._sumtree import SumTree
    from ._sumtrees import SumTrees


# Picked by measurement (`python -m benchmarks.bench_prioritised`, CPU, batch 256, one jitted
# call per operation, capacities 1e3 to 1e7): a plain 8-ary tree up to the root. Wider nodes
# (16, 32) or a wide top level searched against every query cost more per level than the
# levels they save: see `bench_layouts` there and benchmarks/README.md.
_DEFAULT_FANOUT = 8
_DEFAULT_TOP = 8


@functools.cache
def _layout(capacity: int, fanout: int, top: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(sizes, offsets)` of the levels inside the flat node array: the leaves first, each
    level above with one node per `fanout` nodes below, up to the first level of at most `top`
    nodes (the top level); every level padded with zeros to whole groups of `fanout`; then the
    root (1 node, the sum of the top level)."""
    real = [capacity]
    while real[-1] > top:
        real.append(math.ceil(real[-1] / fanout))
    sizes = [math.ceil(n / fanout) * fanout for n in real] + [1]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return tuple(sizes), tuple(offsets)


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
    return _sorted_together(arrays, blocks) if BARRIER_EXPANDED else arrays


def _sorted_together(arrays: Any, blocks: int) -> Any:
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


def _level(
    nodes: Float[Array, " nodes"], level: int, sizes: tuple[int, ...], offsets: tuple[int, ...]
) -> Float[Array, " size"]:
    """Level `level` of the flat `nodes` (a static slice). A gather reads its rows from the
    level rather than from `nodes`: XLA:CPU splits an operation across threads by the size
    of what it reads, and a hand-off to another thread costs more than the few rows a batch
    reads (each gather from the upper levels of a large tree was split so)."""
    return nodes[offsets[level] : offsets[level] + sizes[level]]


def _levels(
    nodes: Float[Array, " nodes"],
    level: int,
    sizes: tuple[int, ...],
    offsets: tuple[int, ...],
    trees: int,
) -> Float[Array, " size"]:
    """Level `level` of each of the `trees` trees laid end to end in `nodes`, end to end
    (tree `t`'s node `i` of the level at `t * sizes[level] + i`): `_level` of a single
    tree."""
    if trees == 1:
        return _level(nodes, level, sizes, offsets)
    grid = nodes.reshape(trees, -1)
    return grid[:, offsets[level] : offsets[level] + sizes[level]].reshape(-1)


def _plus(index: Int[Array, " batch"], tree: Int[Array, " batch"] | None, width: int) -> Array:
    """`index` inside tree `tree` of trees `width` apart laid end to end (`index` itself for
    a single tree, `tree` None)."""
    return index if tree is None else tree * width + index


def _descend_from(
    tree: "SumTree | SumTrees",
    level: int,
    node: Int[Array, " batch"],
    u: Float[Array, " batch"],
    value: Float[Array, " batch"],
    trees: Int[Array, " batch"] | None = None,
) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
    """From `node` of `level` (of value `value`) and the prefix `u` inside it, down to the
    leaf holding it, and its value (in tree `trees[i]` of a `SumTrees`)."""
    k = tree.fanout
    sizes, offsets = _layout(tree.capacity, tree.fanout, tree.top)
    nodes, count = tree._flat()
    barrier = jax.lax.optimization_barrier if level > 1 else lambda x: x
    node, u = barrier((node, u))
    for below in reversed(range(level)):
        level_nodes = _levels(nodes, below, sizes, offsets, count)
        children = barrier(_rows(level_nodes, _plus(node * k, trees, sizes[below]), k))
        child, before, value = _descend(children, u)
        node, u = barrier((node * k + child, u - before))
    return jnp.minimum(node, tree.capacity - 1), value


def _block_runs(tree: "SumTree | SumTrees", blocks: int) -> tuple[int, Array, Array]:
    """The lowest level whose nodes each lie in one of `blocks` equal blocks of leaves, the
    run of its nodes in each block (`(blocks, width)`, `(trees, blocks, width)` for a
    `SumTrees`), and their running sums along each run (made non-decreasing)."""
    where = f"{type(tree).__name__}.search_blocks()"
    blocks = check_positive_int(where, "blocks", blocks)
    if tree.capacity % blocks:
        raise ValueError(
            f"{where}: {blocks} blocks do not divide the capacity {tree.capacity} evenly."
        )
    sizes, offsets = _layout(tree.capacity, tree.fanout, tree.top)
    leaves, level = tree.capacity // blocks, 0
    while level < len(sizes) - 2 and leaves % tree.fanout == 0:
        leaves, level = leaves // tree.fanout, level + 1
    grid = tree._grid()
    runs = grid[..., offsets[level] : offsets[level] + blocks * leaves]
    runs = runs.reshape(*grid.shape[:-1], blocks, leaves)
    axis = runs.ndim - 1
    running = jax.lax.cummax(jax.lax.associative_scan(jnp.add, runs, axis=axis), axis=axis)
    return level, runs, running


def _enter_runs(
    runs: Float[Array, "rows width"], running: Float[Array, "rows width"], u: Float[Array, "rows b"]
) -> tuple[Int[Array, "rows b"], Float[Array, "rows b"], Float[Array, "rows b"]]:
    """For prefixes `u[r]` inside the run of nodes `runs[r]` (of running sums `running[r]`):
    the node of the run each enters, the running sum before it and its value. The node is
    the first whose running sum passes `u`, moved on to the first positive node at or after
    it (or back to the run's last positive node): a zero node is never entered, whatever
    order the running sums were added in."""
    width = runs.shape[1]
    count = jax.vmap(lambda r, q: jnp.searchsorted(r, q, side="right"))(running, u)
    index = jnp.arange(width, dtype=jnp.int32)
    positive = runs > 0
    upcoming = jax.lax.cummin(jnp.where(positive, index, width), axis=1, reverse=True)
    last = jnp.max(jnp.where(positive, index, 0), axis=1, keepdims=True)
    start = jnp.minimum(count, width - 1).astype(jnp.int32)
    child = jnp.take_along_axis(upcoming, start, axis=1)
    child = jnp.where(child < width, child, last)
    before = jnp.take_along_axis(running, jnp.maximum(child - 1, 0), axis=1)
    before = jnp.where(child > 0, before, 0.0)
    value = jnp.take_along_axis(runs, child, axis=1)
    return child, before, value


def _rows(nodes: Float[Array, " n"], starts: Int[Array, " b"], k: int) -> Float[Array, "b k"]:
    """`nodes[starts[i] : starts[i] + k]` for each `i` (one gather of contiguous rows)."""
    return jax.vmap(lambda s: jax.lax.dynamic_slice(nodes, (s,), (k,)))(starts)


# Up to this many children per node, `_descend` works on them one column at a time.
_COLUMNS = 32


def _sums_in_order(columns: list[Float[Array, " b"]]) -> list[Float[Array, " b"]]:
    """The running sums of `columns`, added one after the other (elementwise, so XLA fuses
    them into what reads them). Float addition of non-negative numbers is monotone: they
    never decrease."""
    sums = [columns[0]]
    for column in columns[1:]:
        sums.append(sums[-1] + column)
    return sums


def _descend(
    children: Float[Array, "b n"], u: Float[Array, " batch"]
) -> tuple[Int[Array, " batch"], Float[Array, " batch"], Float[Array, " batch"]]:
    """For one node's children (`b` is the batch, or 1 when shared by the batch) and a prefix
    `u` inside that node: the child holding `u`, the running sum before it, and the child's
    value.

    The child is the count of running sums `<= u`, not counting those equal to the last
    (so a `u` at or past the node's sum, from float rounding, lands on the last positive
    child, and a child of zero is never picked while the node is positive); the sum before
    it is the largest of the counted ones, exactly the running sum of the children before
    it (or 0), so the remainder `u - before` is never negative. The counted ones are a
    prefix (the running sums never decrease), so the child is the first one not counted.

    Up to `_COLUMNS` children (the tree's usual fan-outs) this is elementwise work over the
    columns, the running sums added in order: a few fused kernels, against a running-sum
    kernel and a variadic reduction (measured 0.77x the search time at 5e5 leaves, in a
    scan). Wider, running sums (by `cumsum`, made monotone by `cummax`, for a wide top
    level shared by the batch; added in order otherwise) and one variadic reduction."""
    n = children.shape[1]
    if n <= _COLUMNS:
        cols = [children[:, j] for j in range(n)]
        sums = _sums_in_order(cols)
        below = [(s <= u) & (s < sums[-1]) for s in sums]
        child = sum(b.astype(jnp.int32) for b in below)
        before = jnp.zeros_like(u)
        value = jnp.zeros_like(u)
        previous = jnp.ones_like(below[0])
        for col, s, b in zip(cols, sums, below, strict=True):
            before = jnp.maximum(before, jnp.where(b, s, 0.0))
            value = value + jnp.where(~b & previous, col, 0.0)
            previous = b
        return jnp.broadcast_to(child, u.shape), before, value
    if children.shape[0] == 1:  # a wide top level, shared by the batch: summed once
        running = jax.lax.cummax(jnp.cumsum(children, axis=1), axis=1)
    else:  # (on CPU a cumsum is a window reduction, quadratic in the row's length)
        running = jnp.stack(_sums_in_order([children[:, j] for j in range(n)]), axis=1)
    below = (running <= u[:, None]) & (running < running[:, -1:])
    first = ~below & jnp.pad(below[:, :-1], ((0, 0), (1, 0)), constant_values=True)
    below_sums = jnp.where(below, running, 0.0)
    shape = below_sums.shape
    below = jnp.broadcast_to(below, shape).astype(jnp.int32)
    chosen = jnp.where(first, jnp.broadcast_to(children, shape), 0.0)
    child, before, value = jax.lax.reduce(
        (below, below_sums, chosen),
        (jnp.int32(0), jnp.float32(0.0), jnp.float32(0.0)),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1]), a[2] + b[2]),
        (1,),
    )
    return child, before, value
