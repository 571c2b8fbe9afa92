"""The layout of a sum tree's nodes in one flat array (a `SumTree`, and the `SumTrees` of
several trees laid end to end): the levels' sizes and offsets, and reads of a level's rows.
What every other file of the package builds on; it imports none of them."""

import functools
import math
from typing import Protocol, runtime_checkable

import jax
from jaxtyping import Array, Float, Int


# Picked by measurement (`python -m benchmarks.bench_prioritised`, CPU, batch 256, one jitted
# call per operation, capacities 1e3 to 1e7): a plain 8-ary tree up to the root. Wider nodes
# (16, 32) or a wide top level searched against every query cost more per level than the
# levels they save: see `bench_layouts` there and benchmarks/README.md.
DEFAULT_FANOUT = 8
DEFAULT_TOP = 8


@functools.cache
def node_layout(capacity: int, fanout: int, top: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
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


def level_slice(
    nodes: Float[Array, " nodes"], level: int, sizes: tuple[int, ...], offsets: tuple[int, ...]
) -> Float[Array, " size"]:
    """Level `level` of the flat `nodes` (a static slice). A gather reads its rows from the
    level rather than from `nodes`: XLA:CPU splits an operation across threads by the size
    of what it reads, and a hand-off to another thread costs more than the few rows a batch
    reads (each gather from the upper levels of a large tree was split so)."""
    return nodes[offsets[level] : offsets[level] + sizes[level]]


def level_of_trees(
    nodes: Float[Array, " nodes"],
    level: int,
    sizes: tuple[int, ...],
    offsets: tuple[int, ...],
    trees: int,
) -> Float[Array, " size"]:
    """Level `level` of each of the `trees` trees laid end to end in `nodes`, end to end
    (tree `t`'s node `i` of the level at `t * sizes[level] + i`): `level` of a single
    tree."""
    if trees == 1:
        return level_slice(nodes, level, sizes, offsets)
    grid = nodes.reshape(trees, -1)
    return grid[:, offsets[level] : offsets[level] + sizes[level]].reshape(-1)


def in_tree(index: Int[Array, " batch"], tree: Int[Array, " batch"] | None, width: int) -> Array:
    """`index` inside tree `tree` of trees `width` apart laid end to end (`index` itself for
    a single tree, `tree` None)."""
    return index if tree is None else tree * width + index


def node_rows(nodes: Float[Array, " n"], starts: Int[Array, " b"], k: int) -> Float[Array, "b k"]:
    """`nodes[starts[i] : starts[i] + k]` for each `i` (one gather of contiguous rows)."""
    return jax.vmap(lambda s: jax.lax.dynamic_slice(nodes, (s,), (k,)))(starts)


@runtime_checkable
class Nodes(Protocol):
    """What the search reads of a `SumTree` or a `SumTrees`: the shape of one tree, and the
    node array with the number of trees laid end to end in it."""

    @property
    def capacity(self) -> int: ...
    @property
    def fanout(self) -> int: ...
    @property
    def top(self) -> int: ...
    def node_array(self) -> tuple[Float[Array, " nodes"], int]: ...
    def node_grid(self) -> Float[Array, "*trees nodes"]: ...
