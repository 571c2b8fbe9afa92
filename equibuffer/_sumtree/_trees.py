"""`trees` sum trees of one layout in one array, for the clustered buffers: each write,
search and block search names the tree of each entry."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._checks import check_positive_int
from . import _search as search
from ._layout import DEFAULT_FANOUT, DEFAULT_TOP, level_of_trees, node_layout, node_rows
from ._tree import SumTree
from ._writes import write_nodes


class SumTrees(eqx.Module):
    """`trees` sum trees of one capacity and layout (those of [`equibuffer.SumTree`][]) in
    one flat array, the node arrays of the trees end to end (tree `t`'s node `i` at `t *
    nodes + i`, `nodes` the size of one tree's), for the clustered buffers (one tree per
    cluster, leaf = slot): a batch of writes addressed by `(tree, leaf)` is one scatter, and
    each draw descends its own tree only, whatever the number of trees. (Flat rather than
    `(trees, nodes)`: XLA copied a donated 2-d array on a write through its flat view.)

    The operations are `SumTree`'s, run on the trees laid end to end: a write recomputes
    the touched nodes of every tree level by level with one gather and one scatter per level
    (the batch's trees mixed), the levels a batch touches about everywhere (over all the
    trees) densely; a search gathers each query's children from its own tree, one level per
    step, so each query costs what it costs in a `SumTree` and never leaves its tree,
    whatever the float rounding.

    **Arguments:**

    - `trees`: the number of trees, any positive int.
    - `capacity`, `fanout`, `top`: as for `SumTree`, the same for every tree.
    """

    nodes: Float[Array, " trees_times_nodes"]
    capacity: int = eqx.field(static=True)
    fanout: int = eqx.field(static=True)
    top: int = eqx.field(static=True)

    def __init__(
        self,
        trees: int,
        capacity: int,
        fanout: int = DEFAULT_FANOUT,
        top: int = DEFAULT_TOP,
    ):
        one = SumTree(capacity, fanout, top)  # (its arguments checked)
        trees = check_positive_int("SumTrees()", "trees", trees)
        self.capacity, self.fanout, self.top = one.capacity, one.fanout, one.top
        if trees * one.nodes.shape[0] >= 2**31:
            raise ValueError(
                f"SumTrees(): {trees} trees of capacity {capacity} have more nodes than int32 "
                "indexes (about 2**31); use fewer or smaller trees."
            )
        self.nodes = jnp.zeros(trees * one.nodes.shape[0], jnp.float32)

    @property
    def trees(self) -> int:
        """The number of trees."""
        return self.nodes.shape[0] // node_layout(self.capacity, self.fanout, self.top)[1][-1]

    def tree(self, t: int) -> SumTree:
        """Tree `t` as a `SumTree` (a copy of its nodes)."""
        one = SumTree(self.capacity, self.fanout, self.top)
        return eqx.tree_at(lambda tree: tree.nodes, one, self.node_grid()[t])

    def totals(self) -> Float[Array, " trees"]:
        """The total of each tree (its root)."""
        return self.node_grid()[:, -1]

    def values(self) -> Float[Array, "trees capacity"]:
        """The leaves of every tree."""
        return self.node_grid()[:, : self.capacity]

    def write(
        self,
        indices: tuple[Int[Array, " batch"], Int[Array, " batch"]],
        values: Float[Array, " batch"],
        *,
        mask: Bool[Array, " batch"] | None = None,
        unique_indices: bool = False,
    ) -> "SumTrees":
        """`SumTree.write` of leaf `leaf[i]` of tree `tree[i]`, for `indices = (tree, leaf)`
        (unchecked: trees in `[0, trees)`, leaves in `[0, capacity)`, values non-negative and
        finite): one batch for all the trees, the same rules (the last entry not skipped wins
        for a repeated `(tree, leaf)`, on every platform, unless `unique_indices` promises
        there is none)."""
        tree, leaf = indices
        nodes, trees = self.node_array()
        layout = node_layout(self.capacity, self.fanout, self.top)
        tree = tree.astype(jnp.int32)
        nodes = write_nodes(
            nodes, layout, self.fanout, leaf, values, mask, unique_indices, tree, trees
        )
        return eqx.tree_at(lambda t: t.nodes, self, nodes)

    def search(
        self, tree: Int[Array, " batch"], prefix: Float[Array, " batch"]
    ) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
        """`SumTree.search` of each `prefix[i]` in tree `tree[i]` (in `[0, totals()[tree[i]])`):
        the leaf of that tree found, and its value."""
        sizes, offsets = node_layout(self.capacity, self.fanout, self.top)
        nodes, trees = self.node_array()
        # (the trees through a barrier: XLA computes them once, not in each gather's indices)
        tree, u = jax.lax.optimization_barrier((tree.astype(jnp.int32), prefix.astype(jnp.float32)))
        top = len(sizes) - 2
        children = node_rows(
            level_of_trees(nodes, top, sizes, offsets, trees), tree * sizes[top], sizes[top]
        )
        node, before, value = search.descend(children, u)
        return search.descend_from(self, top, node, u - before, value, tree)

    def block_totals(self, blocks: int) -> Float[Array, "trees blocks"]:
        """`SumTree.block_totals` of every tree."""
        return search.block_runs(self, blocks)[2][..., -1]

    def search_blocks(
        self, tree: Int[Array, "blocks per_block"], prefix: Float[Array, "blocks per_block"]
    ) -> tuple[Int[Array, "blocks per_block"], Float[Array, "blocks per_block"]]:
        """`SumTree.search_blocks` of each `prefix[b, i]` in block `b` of tree `tree[b, i]`
        (in `[0, block_totals(blocks)[tree[b, i], b])`): the leaf found, and its value. Each
        query reads the run of nodes of its own tree's block (`SumTree.search_blocks`' first
        level), then descends that tree."""
        blocks, per = prefix.shape
        level, runs, running = search.block_runs(self, blocks)
        width = runs.shape[-1]
        tree, u = jax.lax.optimization_barrier((tree.astype(jnp.int32), prefix.astype(jnp.float32)))
        block = jnp.arange(blocks, dtype=jnp.int32)[:, None]
        row = (tree * blocks + block).reshape(-1)  # (the tree's run of block b)
        runs, running = (x.reshape(-1, width)[row] for x in (runs, running))
        child, before, value = search.enter_runs(runs, running, u.reshape(-1, 1))
        node = child.reshape(blocks, per) + block * width
        remainder = jnp.maximum(u.reshape(-1) - before.reshape(-1), 0.0)
        leaves, values = search.descend_from(
            self, level, node.reshape(-1), remainder, value.reshape(-1), tree.reshape(-1)
        )
        return leaves.reshape(blocks, per), values.reshape(blocks, per)

    def node_array(self) -> tuple[Float[Array, " nodes"], int]:
        """The node arrays of every tree, end to end, and their number."""
        return self.nodes, self.trees

    def node_grid(self) -> Float[Array, "trees nodes"]:
        """The nodes, one row per tree."""
        return self.nodes.reshape(self.trees, -1)
