"""Writes into a sum tree's nodes (of one tree, or of several laid end to end): the leaves
set, and every node above them recomputed, by scatters level by level or, for a few
entries on the CPU, one entry after the other; repeated leaves resolved so the last wins."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._checks import BARRIER_EXPANDED
from ._layout import in_tree, level_of_trees, node_rows


# A write of at most this many leaves goes over the levels in a `fori_loop` (see
# `SumTree.write`): XLA:CPU's estimate of a one-step `add` of 8 rows of transitions (16 leaves)
# stays under the 1,000 flops below which it runs a program in the calling thread, that of
# 32 leaves is above it whichever way the levels go.
SMALL_WRITE = 24
# Up to this many entries, a write on the CPU goes one entry after the other
# (`write_in_turn`): 3 to 30 times faster there than by scatters at 10**3 to 10**7 leaves
# (a write of 2 entries at 10**6: 0.05 against 8 us; of 32: 1.1 against 3.1 us), about even
# at 64.
IN_TURN = 32
# Up to this many entries, a write goes one entry after the other on the CPU too when its
# node array is of `SPLIT_BYTES` or more: XLA:CPU splits a scatter into such an array (its
# output is the whole array) across two threads (`outer_dimension_partitions`), and a
# jitted call from Python then waits for the second thread to wake, about 40 us per call on
# a 2-core machine, more than the whole write. Measured (`write_nodes` donated, 2 cores, scatters
# against one entry after the other), 256 entries: 72 against 31 us per call at 5 * 10**5
# leaves, 69 against 21 at 10**7, and 8.3 against 5.3 / 8.8 against 6.1 us inside a
# `lax.scan`; 1024 entries: 96 against 51 us per call, 31 against 22 in a scan (5 * 10**5);
# 4096: the scatters are faster in a scan (60 against 82 us). Below the split (10**5 leaves)
# the scatters stay faster in a scan from 256 entries (3.7 against 4.9 us).
IN_TURN_SPLIT = 1024
# XLA:CPU's ParallelTaskAssigner gives a memory-bound loop fusion one task per 256 KiB of
# output (at most ceil(sqrt(cores)) of them): it is split from 512 KiB.
SPLIT_BYTES = 2 * 256 * 1024
# Up to this many entries, a write finds the repeated leaves by comparing every pair of
# entries; above, by marking the leaves (see `last_of_each`).
PAIRWISE = 64


def flush_subnormal(values: Float[Array, " batch"]) -> Float[Array, " batch"]:
    """`values` as float32, with every value below the smallest normal float32 set to 0 (the
    sums would count it as 0 on CPU anyway: the stored leaf agrees with them everywhere)."""
    values = values.astype(jnp.float32)
    return jnp.where(values < jnp.finfo(jnp.float32).tiny, jnp.float32(0), values)


def write_nodes(
    nodes: Float[Array, " nodes"],
    layout: tuple[tuple[int, ...], tuple[int, ...]],
    k: int,
    indices: Int[Array, " batch"],
    values: Float[Array, " batch"],
    mask: Bool[Array, " batch"] | None,
    unique_indices: bool,
    tree: Int[Array, " batch"] | None = None,
    trees: int = 1,
) -> Float[Array, " nodes"]:
    """`SumTree.write` on the flat `nodes` of `trees` trees of one layout laid end to end
    (each entry in its tree `tree`; None: a single tree), with every node above recomputed
    (the roots included)."""
    indices = indices.astype(jnp.int32)
    if mask is not None:
        # A skipped entry may name any leaf, or tree (a refused write's: out of range, from
        # another buffer's sample). Both ways below recompute the nodes above every entry's
        # leaf, skipped or not, so a skipped entry is sent to leaf 0 of tree 0, whose path it
        # recomputes unchanged: out of range, its path ran through other nodes (or, clamped,
        # another tree's) and wrote sums of the wrong children there.
        indices = jnp.where(mask, indices, 0)
        tree = None if tree is None else jnp.where(mask, tree, 0)
    writes = Writes(indices, flush_subnormal(values), mask, tree)
    split = nodes.size * nodes.dtype.itemsize >= SPLIT_BYTES
    if indices.shape[0] <= max(IN_TURN, IN_TURN_SPLIT if split else 0) and not BARRIER_EXPANDED:
        # On the CPU one entry after the other; elsewhere by scatters, as below (a loop over
        # the entries there would run each level's few flops as a kernel of its own). Before
        # jax 0.11, by scatters everywhere (see `write_in_turn`; XLA then also copied a
        # donated array around a `cond` whose branches update it).
        in_turn = functools.partial(write_in_turn, layout=layout, k=k)
        by_level = functools.partial(
            write_by_level, layout=layout, k=k, unique_indices=unique_indices, trees=trees
        )
        return jax.lax.platform_dependent(nodes, writes, cpu=in_turn, default=by_level)
    return write_by_level(nodes, writes, layout, k, unique_indices, trees)


class Writes(NamedTuple):
    """The entries of one `write_nodes`: leaf `indices[i]` (of tree `tree[i]`; None: the only
    one) set to `values[i]` where `mask[i]` (None: everywhere)."""

    indices: Int[Array, " batch"]
    values: Float[Array, " batch"]
    mask: Bool[Array, " batch"] | None
    tree: Int[Array, " batch"] | None


def write_by_level(
    nodes: Float[Array, " nodes"],
    writes: Writes,
    layout: tuple[tuple[int, ...], tuple[int, ...]],
    k: int,
    unique_indices: bool,
    trees: int,
) -> Float[Array, " nodes"]:
    """`write_nodes` by one scatter per level."""
    indices, values, mask, tree = writes
    sizes, offsets = layout
    per = offsets[-1]
    end = trees * per  # (an index past the end: dropped by a scatter)
    at = in_tree(indices, tree, per)
    target = at if mask is None else jnp.where(mask, at, end)
    if not unique_indices:
        nodes, target = last_of_each(nodes, sizes[0] if tree is None else end, at, target, end)
    nodes = nodes.at[target].set(values, mode="drop", unique_indices=True)
    # Recompute the touched node of each level above from its children. A skipped entry
    # recomputes its (unchanged) nodes too, which is harmless; entries sharing a node
    # write the same sum (so their order does not matter). The lower levels, where the
    # batch touches few of the nodes (of all the trees): one gather of the children and one
    # scatter of their sums each; the levels above, which a batch touches about everywhere:
    # recomputed whole (one dense sum each).
    batch = indices.shape[0]
    sparse = sum(1 for n in sizes[:-2] if batch * k < trees * n)  # a prefix of the levels

    def level_up(level: Int[Array, ""] | int, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        nodes, node = carry
        node = jax.lax.div(node, jnp.int32(k))  # (indices are non-negative)
        if isinstance(level, int):  # the children read from their own level (`level`)
            below = level_of_trees(nodes, level - 1, sizes, offsets, trees)
            children = node_rows(below, in_tree(node * k, tree, sizes[level - 1]), k)
            at = in_tree(offsets[level] + node, tree, per)
        else:
            starts = jnp.asarray(offsets, jnp.int32)
            children = node_rows(nodes, in_tree(starts[level - 1] + node * k, tree, per), k)
            at = in_tree(starts[level] + node, tree, per)
        return nodes.at[at].set(children.sum(axis=1), mode="promise_in_bounds"), node

    if batch <= SMALL_WRITE:
        # A `fori_loop` over the levels keeps a small write (the few leaves of a one-step
        # `add`) under XLA:CPU's estimate for running a program in the calling thread,
        # which counts a loop's body once. (On the CPU this way is taken by such writes only
        # before jax 0.11: see `write_in_turn`.)
        nodes, _ = jax.lax.fori_loop(1, sparse + 1, level_up, (nodes, indices))
    else:
        carry = (nodes, indices)
        for level in range(1, sparse + 1):
            carry = level_up(level, carry)
        nodes = carry[0]
    for level in range(sparse + 1, len(sizes) - 1):
        # A scatter to the level's nodes that have children, in every tree. (Written as a
        # `dynamic_update_slice`, XLA fused the sum of the level below into it and then
        # copied the whole array twice: with one tree of 8**n leaves and a batch of 64 or
        # more, 2**21 leaves took 190 to 230 us per write of 64 to 256 leaves instead of 9 to
        # 19; with a `(trees, nodes)` view, at every size.)
        sums = level_of_trees(nodes, level - 1, sizes, offsets, trees).reshape(-1, k).sum(axis=1)
        m = sums.shape[0] // trees
        at = np.arange(trees)[:, None] * per + offsets[level] + np.arange(m)
        at = jnp.asarray(at.reshape(-1), jnp.int32)
        nodes = nodes.at[at].set(sums, mode="promise_in_bounds", unique_indices=True)
    return with_roots(nodes, offsets, trees)


def write_in_turn(
    nodes: Float[Array, " nodes"], writes: Writes, layout: tuple[tuple[int, ...], ...], k: int
) -> Float[Array, " nodes"]:
    """`write_nodes` of a few entries, one after the other: each writes its leaf (a skipped one
    writes the leaf's own value back) and recomputes its path up to its tree's root, so the
    last entry of a leaf wins by order. Every write is of one element at a computed place,
    which XLA makes a dynamic-update-slice in place. (A scatter of 2 entries into a tree of
    10**6 leaves, as a one-step `add` makes, was split by XLA:CPU across two threads by the
    size of the array it updates: 6.3 us per add, against 0.3 us for Flashbax's one-element
    updates.)"""
    indices, values, mask, tree = writes
    sizes, offsets = layout
    per = offsets[-1]

    def entry(i: Int[Array, ""] | int, nodes: Float[Array, " nodes"]) -> Float[Array, " nodes"]:
        base = jnp.int32(0) if tree is None else tree[i] * per
        node = indices[i]
        value = values[i] if mask is None else jnp.where(mask[i], values[i], nodes[base + node])
        nodes = jax.lax.dynamic_update_slice(nodes, value[None], (base + node,))
        for level in range(1, len(sizes) - 1):
            node = jax.lax.div(node, jnp.int32(k))  # (non-negative)
            children = jax.lax.dynamic_slice(nodes, (base + offsets[level - 1] + node * k,), (k,))
            where = base + offsets[level] + node
            nodes = jax.lax.dynamic_update_slice(nodes, children.sum()[None], (where,))
        # (Without the barrier XLA fused the last update into the root's read of the top
        # level, which then read the tree from before it: two copies of the whole tree. XLA
        # before jax 0.11 removes the barrier: this way is not taken there.)
        nodes = jax.lax.optimization_barrier(nodes)
        top = jax.lax.dynamic_slice(nodes, (base + offsets[-3],), (sizes[-2],))
        return jax.lax.dynamic_update_slice(nodes, top.sum()[None], (base + offsets[-2],))

    return jax.lax.fori_loop(0, indices.shape[0], entry, nodes)


def with_roots(
    nodes: Float[Array, " nodes"], offsets: tuple[int, ...], trees: int = 1
) -> Float[Array, " nodes"]:
    """`nodes` (`trees` trees laid end to end) with each root recomputed as the sum of its
    top level."""
    if trees == 1:
        return nodes.at[-1].set(jnp.sum(nodes[offsets[-3] : offsets[-2]]))
    sums = jnp.sum(nodes.reshape(trees, -1)[:, offsets[-3] : offsets[-2]], axis=1)
    roots = jnp.arange(1, trees + 1, dtype=jnp.int32) * offsets[-1] - 1
    return nodes.at[roots].set(sums, mode="promise_in_bounds", unique_indices=True)


def last_of_each(
    nodes: Float[Array, " nodes"],
    leaves: int,
    indices: Int[Array, " batch"],
    target: Int[Array, " batch"],
    end: int,
) -> tuple[Float[Array, " nodes"], Int[Array, " batch"]]:
    """For a scatter of a batch to the leaves `target` (`end` where an entry is skipped,
    `indices` otherwise; `leaves`: the size of the leaf level): `target` with `end` at every
    entry that a later one not skipped overrides (the same leaf), so that the last one wins,
    as in NumPy, whatever order the platform's scatter takes; and `nodes` as the scatter of
    the values must start from.

    Up to `PAIRWISE` entries, every pair is compared (`batch**2` comparisons, no access to
    the tree). Above, each entry writes its mark `-(i + 1)` by a scatter-min (whose result
    does not depend on the order; every leaf is non-negative, so a mark replaces it), and
    the entries that read their own mark back are the last of their leaf: O(batch) work, two
    more accesses of the batch's leaves. Every marked leaf has exactly one such entry, whose
    value then replaces the mark; the marks are exact in float32 (`batch` below 2**24)."""
    batch = indices.shape[0]
    if batch <= PAIRWISE:
        position = jnp.arange(batch, dtype=jnp.int32)
        later = (target[:, None] == target[None, :]) & (position[:, None] > position[None, :])
        return nodes, jnp.where(jnp.any(later, axis=0), end, target)
    if batch >= 2**24:
        raise ValueError(f"SumTree.write(): a batch of {batch} entries; at most 2**24 - 1.")
    mark = -jnp.arange(1, batch + 1, dtype=jnp.float32)
    nodes = nodes.at[target].min(mark, mode="drop")
    last = nodes[:leaves].at[indices].get(mode="promise_in_bounds") == mark
    return nodes, jnp.where(last, target, end)
