"""The storage of a clustered buffer: `num_clusters` rings of `cluster_capacity` items, and
where an add routes its items."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from equinox.internal import unvmap_all
from jaxtyping import Array, Bool, Int, PyTree, Shaped, UInt32

from .._custom_types import ExampleTree, ExperienceBatch, Steps
from .._errors import cleared, error_if, first_failure
from .._ring import check_batch, RingStorage


class Routed(NamedTuple):
    """Where an add put its items (flattened time-major, rows in order within a step): each
    item's cluster and slot, and whether it was written (an add that brings more than
    `cluster_capacity` items to a cluster keeps only its newest ones)."""

    cluster: Int[Array, " items"]
    slot: Int[Array, " items"]
    kept: Bool[Array, " items"]


class ClusterStorage(eqx.Module):
    """`num_clusters` rings of `cluster_capacity` items: one array per leaf shaped
    `(num_clusters, cluster_capacity, *leaf)`, and per cluster a write head, a fill count and
    a count of the items ever routed to it (`uint32`, mod 2**32). `added` says whether any
    add was made (whatever the routing, so it stays unbatched under `vmap`); `error` is the
    failure a check recorded inside jit, as a ring's (see `equibuffer.check`)."""

    data: PyTree[Shaped[Array, "clusters capacity ..."]]
    head: Int[Array, " clusters"]
    fill: Int[Array, " clusters"]
    count: UInt32[Array, " clusters"]
    added: Bool[Array, ""]
    error: UInt32[Array, "*stacked"]
    rows: int = eqx.field(static=True)
    num_clusters: int = eqx.field(static=True)
    cluster_capacity: int = eqx.field(static=True)

    def __init__(self, example: ExampleTree, rows: int, num_clusters: int, cluster_capacity: int):
        self.rows, self.num_clusters = rows, num_clusters
        self.cluster_capacity = cluster_capacity
        # A (clusters, capacity) ring allocates and checks the example the usual way.
        self.data = RingStorage(example, num_clusters, cluster_capacity).data
        self.head = jnp.zeros(num_clusters, jnp.int32)
        self.fill = jnp.zeros(num_clusters, jnp.int32)
        self.count = jnp.zeros(num_clusters, jnp.uint32)
        self.added = jnp.array(False)
        self.error = jnp.zeros((), jnp.uint32)

    def with_error(self, word: UInt32[Array, "*stacked"]) -> "ClusterStorage":
        """The storage with failure `word` recorded, unless one is recorded already."""
        return eqx.tree_at(lambda s: s.error, self, first_failure(self.error, word))

    def without_error(self, word: int) -> "ClusterStorage":
        """The storage with recorded failure `word` cleared (another stays): what the checked
        step hands back once it has raised it (see `RingStorage.without_error`)."""
        return eqx.tree_at(lambda s: s.error, self, cleared(self.error, word))

    def item(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The shape and dtype of one item."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), self.data)

    def steps_in(self, batch: ExperienceBatch, where: str) -> int | None:
        return check_batch(where, self.data, self.rows, batch)

    def append(
        self,
        batch: ExperienceBatch,
        cluster_fn: Callable[[Any], Any],
        where: str,
        *,
        refused: Any = None,
    ) -> tuple["ClusterStorage", Routed]:
        """Route every item of `batch` to its cluster and append it there; `O(N * K)` integer
        work for `N` items (a running count per cluster gives each its slot), one scatter.
        Where `refused` (a 0-d bool) is true, or `cluster_fn` gives an id out of range, the
        add is refused: nothing is written or counted."""
        t = self.steps_in(batch, where)

        def flatten(x: Any) -> Array:
            x = jnp.asarray(x)
            if t is None:
                return x
            return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])  # time-major

        items = jax.tree.map(flatten, batch)
        k, cap = self.num_clusters, self.cluster_capacity
        ids = jax.vmap(cluster_fn)(items).astype(jnp.int32)
        out_of_range = jnp.any((ids < 0) | (ids >= k))
        ids = error_if(
            ids,
            out_of_range,
            f"{where}: `cluster_fn` returned a cluster id outside [0, num_clusters={k}).",
        )
        bad = out_of_range if refused is None else out_of_range | refused
        # A refused add routes every item to no cluster: nothing is written or counted.
        onehot = (ids[:, None] == jnp.arange(k, dtype=jnp.int32)[None, :]) & ~bad
        onehot = onehot.astype(jnp.int32)
        counts = jnp.sum(onehot, axis=0, dtype=jnp.int32)
        running = jnp.cumsum(onehot, axis=0, dtype=jnp.int32)
        rank = jnp.take_along_axis(running, ids[:, None], axis=1)[:, 0] - 1
        kept = (rank >= counts[ids] - cap) & ~bad  # only the newest `cap` items of one cluster
        slot = (self.head[ids] + rank) % cap
        target = jnp.where(kept, ids, k)  # out of range: dropped by the scatter
        data = jax.tree.map(
            lambda d, x: d.at[target, slot].set(x, mode="drop", unique_indices=True),
            self.data,
            items,
        )
        head = (self.head + counts) % cap
        fill = jnp.minimum(self.fill + counts, cap)
        count = self.count + counts.astype(jnp.uint32)
        storage = eqx.tree_at(
            lambda s: (s.data, s.head, s.fill, s.count, s.added),
            self,
            # (`added` stays unbatched under vmap, as `can_sample()` reads it: refused only
            # when every batch element refused)
            (data, head, fill, count, self.added | ~unvmap_all(bad)),
        )
        return storage, Routed(ids, slot, kept)

    def gather(self, cluster: Int[Array, " batch"], slot: Int[Array, " batch"]) -> Any:
        return jax.tree.map(lambda d: d.at[cluster, slot].get(mode="promise_in_bounds"), self.data)

    def gather_blocks(
        self, cluster: Int[Array, " batch"], slot: Int[Array, " batch"], blocks: int
    ) -> Any:
        """`gather` of items drawn by blocks of slots (the `d`-th `batch / blocks` items all
        in block `d`, see `held_in_blocks`): one gather batched over the blocks, each
        reading its own run of every cluster's slots, so with the slots split over devices
        (`shard_rows`) every device gathers its block from the slots it holds and nothing
        crosses devices."""
        width = self.cluster_capacity // blocks
        cluster, slot = cluster.reshape(blocks, -1), slot.reshape(blocks, -1)
        local = slot - (jnp.arange(blocks, dtype=jnp.int32) * width)[:, None]
        where = jnp.stack([cluster, local], axis=-1)

        def take(x: Array) -> Array:
            x = x.reshape(self.num_clusters, blocks, width, *x.shape[2:])
            numbers = jax.lax.GatherDimensionNumbers(
                offset_dims=tuple(range(2, x.ndim - 1)),
                collapsed_slice_dims=(0, 2),
                start_index_map=(0, 2),
                operand_batching_dims=(1,),
                start_indices_batching_dims=(0,),
            )
            out = jax.lax.gather(
                x,
                where,
                numbers,
                (1, 1, 1, *x.shape[3:]),
                mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
            )
            return out.reshape(-1, *out.shape[2:])

        return jax.tree.map(take, self.data)

    def held_in_blocks(self, blocks: int) -> Int[Array, "blocks clusters"]:
        """The number of items each cluster holds in each of `blocks` equal runs of its
        slots (block `d`: slots `[d * w, (d + 1) * w)`, `w = cluster_capacity / blocks`).
        A cluster's ring fills from slot 0 and wraps only once full (its head is its fill
        until then), so the slots it holds are always `[0, fill)`."""
        width = self.cluster_capacity // blocks
        start = (jnp.arange(blocks, dtype=jnp.int32) * width)[:, None]
        return jnp.clip(self.fill[None, :] - start, 0, width)

    def numbers(
        self, cluster: Int[Array, " batch"], slot: Int[Array, " batch"]
    ) -> tuple[Bool[Array, " batch"], Steps]:
        """Whether each slot holds an item, and that item's number in its cluster's order of
        arrival (mod 2**32)."""
        cap = self.cluster_capacity
        fill, head = self.fill[cluster], self.head[cluster]
        offset = (slot - head + fill + cap) % cap  # from the oldest item held
        number = self.count[cluster] - fill.astype(jnp.uint32) + offset.astype(jnp.uint32)
        return offset < fill, number
