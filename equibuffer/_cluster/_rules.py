"""The rules of a clustered buffer: the state a draw needs (uniform, or in proportion to
the priorities inside each cluster), and the draws of clusters and items."""

import abc
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._barriers import read_once
from .._custom_types import Steps
from .._errors import error_if
from .._sumtree import SumTrees
from ..rules._by_priority import (
    check_draw,
    check_priority_update,
    importance_weights,
    set_by_priority,
)
from ..rules._request import Update
from ._storage import ClusterStorage, Routed


def cluster_draw(
    key: PRNGKeyArray, shares: Float[Array, " clusters"], batch_size: int
) -> Int[Array, " batch"]:
    """`batch_size` clusters drawn independently in proportion to `shares` (a zero share is
    never drawn; all zero: meaningless, the caller raises)."""
    return jax.random.categorical(key, jnp.log(shares), shape=(batch_size,)).astype(jnp.int32)


def cluster_draw_blocks(
    key: PRNGKeyArray, shares: Float[Array, "blocks clusters"], per: int
) -> Int[Array, "blocks per"]:
    """`per` clusters drawn independently for each block `d`, in proportion to
    `shares[d]`."""
    logits = jnp.log(shares)[:, None, :]
    return jax.random.categorical(key, logits, shape=(shares.shape[0], per)).astype(jnp.int32)


def _nothing_held(where: str, blocks: int = 1) -> str:
    if blocks > 1:
        return (
            f"{where}: in one of the row_blocks={blocks} blocks of slots, no cluster of "
            "positive weight holds an item yet (block d is the d-th of row_blocks equal runs "
            "of every cluster's slots, and a cluster fills its slots from the first: the "
            "last blocks hold items once the clusters are that full). Add data first, or "
            "sample with fewer row_blocks."
        )
    return (
        f"{where}: no cluster of positive weight holds an item yet. Add data first, or check "
        "`buffer.can_sample()` and the weights."
    )


class ClusterRequest(NamedTuple):
    """What a clustered buffer asks of its rule's `draw`: `batch_size` items drawn with `key`,
    clusters in proportion to `shares`; errors start with `where`; with `blocks > 1` the
    `d`-th `batch_size / blocks` items come from block `d` of the slots; a prioritised rule
    weights by the importance exponent `beta`."""

    key: PRNGKeyArray
    batch_size: int
    shares: Float[Array, " clusters"]
    where: str
    blocks: int = 1
    beta: Float[Array, ""] | None = None


def _in_block(values: Array, cluster: Int[Array, "blocks per"]) -> Array:
    """`values[d, cluster[d, i]]` for `values` shaped `(blocks, clusters)`."""
    return jnp.take_along_axis(values, cluster, axis=1)


class AbstractClusterRule(eqx.Module):
    """What a clustered buffer keeps besides its items, kept in step by `added`."""

    @abc.abstractmethod
    def added(self, storage: ClusterStorage, routed: Routed) -> Any:
        """The rule after an add (`storage` is the storage after it)."""


class UniformInCluster(AbstractClusterRule):
    """Uniform inside the drawn cluster: no state at all."""

    def added(self, storage: ClusterStorage, routed: Routed) -> "UniformInCluster":
        return self

    def draw(
        self, storage: ClusterStorage, request: ClusterRequest
    ) -> tuple[Int[Array, " batch"], Int[Array, " batch"], Steps]:
        """`(cluster, slot, number)` of `batch_size` items: a cluster among those holding
        items by `shares`, then an item uniformly in it. With `blocks > 1` the `d`-th
        `batch_size / blocks` items are drawn so inside block `d` of the slots."""
        if request.blocks > 1:
            return self._draw_blocks(storage, request)
        key, batch_size, shares, where, _, _ = request
        cap = storage.cluster_capacity
        w = jnp.where(storage.fill > 0, shares, 0.0)
        key_c, key_i = jax.random.split(key)
        cluster = cluster_draw(key_c, w, batch_size)
        cluster = error_if(cluster, ~(jnp.sum(w) > 0), _nothing_held(where))
        fill = storage.fill[cluster]
        u = jax.random.uniform(key_i, (batch_size,), jnp.float32)
        j = jnp.minimum((u * fill.astype(jnp.float32)).astype(jnp.int32), fill - 1)
        slot = (storage.head[cluster] - fill + j + cap) % cap
        number = storage.count[cluster] - fill.astype(jnp.uint32) + j.astype(jnp.uint32)
        return cluster, slot, number

    def _draw_blocks(
        self, storage: ClusterStorage, request: ClusterRequest
    ) -> tuple[Int[Array, " batch"], Int[Array, " batch"], Steps]:
        key, batch_size, shares, where, blocks, _ = request
        held = storage.held_in_blocks(blocks)
        w = jnp.where(held > 0, shares[None, :], 0.0)
        key_c, key_i = jax.random.split(key)
        per = batch_size // blocks
        cluster = cluster_draw_blocks(key_c, w, per)
        cluster = error_if(cluster, ~jnp.all(jnp.sum(w, axis=1) > 0), _nothing_held(where, blocks))
        n = _in_block(held, cluster)
        u = jax.random.uniform(key_i, (blocks, per), jnp.float32)
        j = jnp.minimum((u * n.astype(jnp.float32)).astype(jnp.int32), n - 1)
        width = storage.cluster_capacity // blocks
        slot = (jnp.arange(blocks, dtype=jnp.int32) * width)[:, None] + j
        cluster, slot = cluster.reshape(-1), slot.reshape(-1)
        _, number = storage.numbers(cluster, slot)
        return cluster, slot, number


class ClusterDrawn(NamedTuple):
    """What a cluster rule's draw gives the buffer: the cluster and slot of each item, its
    number (absolute count), and its probability and importance weight."""

    cluster: Int[Array, " batch"]
    slot: Int[Array, " batch"]
    number: Steps
    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]


class PrioritisedInCluster(AbstractClusterRule):
    """In proportion to `priority ** alpha` inside the drawn cluster: a `SumTrees` of one
    tree per cluster (leaf = slot) holding `p ** alpha` for every item held, and the largest
    priority set so far, at which new items enter."""

    trees: SumTrees
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def added(self, storage: ClusterStorage, routed: Routed) -> "PrioritisedInCluster":
        fresh = jnp.broadcast_to(self.max_priority**self.alpha, routed.slot.shape)
        # (the items kept have distinct (cluster, slot) pairs)
        trees = self.trees.write(
            (routed.cluster, routed.slot), fresh, mask=routed.kept, unique_indices=True
        )
        return eqx.tree_at(lambda r: r.trees, self, trees)

    def totals(self) -> Float[Array, " clusters"]:
        return self.trees.totals()

    def draw(self, storage: ClusterStorage, request: ClusterRequest) -> ClusterDrawn:
        """A cluster among those holding an item of positive priority, by `shares`; then an
        item of it in proportion to its leaf. One check for the three ways to fail. With
        `blocks > 1` the `d`-th `batch_size / blocks` items are drawn so inside block `d` of
        the slots, with that block's probabilities and weights."""
        if request.blocks > 1:
            return self._draw_blocks(storage, request)
        key, batch_size, shares, where, _, beta = request
        assert beta is not None  # (the prioritised clustered buffer passes its own)
        totals = self.totals()
        held = jnp.where(storage.fill > 0, shares, 0.0)
        w = jnp.where(totals > 0, held, 0.0)
        key_c, key_i = jax.random.split(key)
        cluster = cluster_draw(key_c, w, batch_size)
        u = jax.random.uniform(key_i, (batch_size,), jnp.float32)
        # One search per draw, inside the drawn cluster's tree only: it never leaves it.
        slot, leaf = self.trees.search(cluster, u * totals[cluster])
        slot, leaf, totals, w = read_once(slot, leaf, totals, w)
        failure = jnp.where(jnp.sum(held) > 0, jnp.where(jnp.sum(w) > 0, 2, 1), 0)
        cluster = check_draw(
            cluster,
            failure,
            beta,
            where,
            [
                _nothing_held(where),
                f"{where}: every item held in the clusters of positive weight has priority 0, "
                "so there is nothing to draw (`can_sample()` only looks at the counters). "
                "Give some items a positive priority with `set_priorities`, or add data (new "
                "items enter at the largest priority seen).",
            ],
        )
        within = leaf / totals[cluster]
        probabilities = w[cluster] / jnp.sum(w) * within
        # (n_c P(i | c))^-beta / max_j (n_c P(j | c))^-beta.
        weights = importance_weights(storage.fill[cluster].astype(jnp.float32) * within, beta)
        _, number = storage.numbers(cluster, slot)
        return ClusterDrawn(cluster, slot, number, probabilities, weights)

    def _draw_blocks(self, storage: ClusterStorage, request: ClusterRequest) -> ClusterDrawn:
        key, batch_size, shares, where, blocks, beta = request
        assert beta is not None  # (the prioritised clustered buffer passes its own)
        # (blocks, clusters): each cluster's items and total `p ** alpha` in each block.
        items = storage.held_in_blocks(blocks)
        totals = self.trees.block_totals(blocks).T
        held = jnp.where(items > 0, shares[None, :], 0.0)
        w = jnp.where(totals > 0, held, 0.0)
        key_c, key_i = jax.random.split(key)
        per = batch_size // blocks
        cluster = cluster_draw_blocks(key_c, w, per)
        u = jax.random.uniform(key_i, (blocks, per), jnp.float32)
        # As for one block: one search per draw, in the drawn cluster's tree (inside the
        # block).
        slot, leaf = self.trees.search_blocks(cluster, u * _in_block(totals, cluster))
        slot, leaf, totals, w = read_once(slot, leaf, totals, w, blocks=blocks)
        every_held = jnp.all(jnp.sum(held, axis=1) > 0)
        failure = jnp.where(every_held, jnp.where(jnp.all(jnp.sum(w, axis=1) > 0), 2, 1), 0)
        cluster = check_draw(
            cluster,
            failure,
            beta,
            where,
            [
                _nothing_held(where, blocks),
                f"{where}: in one of the row_blocks={blocks} blocks of slots, every item held "
                "in the clusters of positive weight has priority 0, so there is nothing to "
                "draw there. Give some of its items a positive priority with "
                "`set_priorities`, add data (new items enter at the largest priority seen), "
                "or sample with fewer row_blocks.",
            ],
        )
        within = leaf / _in_block(totals, cluster)
        probabilities = _in_block(w, cluster) / jnp.sum(w, axis=1, keepdims=True) * within
        weights = importance_weights(_in_block(items, cluster).astype(jnp.float32) * within, beta)
        cluster, slot, probabilities, weights = (
            x.reshape(-1) for x in (cluster, slot, probabilities, weights)
        )
        _, number = storage.numbers(cluster, slot)
        return ClusterDrawn(cluster, slot, number, probabilities, weights)

    def reprioritised(self, storage: ClusterStorage, update: Update) -> "PrioritisedInCluster":
        """The rule with the priorities of `update` applied (indices
        `cluster * cluster_capacity + slot`), as a ring buffer's prioritised rule applies
        them: checked, an item overwritten since it was drawn dropped, the last of repeated
        updates winning, the largest priority applied kept."""
        cap = storage.cluster_capacity
        indices, steps, new, accepted = check_priority_update(
            update, storage.num_clusters * cap, bound="num_clusters * cluster_capacity"
        )
        cluster, slot = indices // cap, indices % cap
        held, number = storage.numbers(cluster, slot)
        trees, largest = set_by_priority(
            lambda values, mask: self.trees.write((cluster, slot), values, mask=mask),
            self.max_priority,
            self.alpha,
            new,
            held & (number == steps) & accepted,
        )
        return PrioritisedInCluster(trees=trees, max_priority=largest, alpha=self.alpha)
