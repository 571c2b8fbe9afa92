"""The two clustered buffers: items routed at `add` time to one of K clusters, each its own
ring; a draw picks a cluster (uniformly or by `weights`, among those it can draw from), then an
item inside it, uniformly (`ClusteredBuffer`) or in proportion to `priority ** alpha`
(`PrioritisedClusteredBuffer`).

Both are final over `AbstractClusteredBuffer` (`_base.py`: `add`, `can_sample`, `size`,
epochs), each holding its fields, its `__init__` and its `sample`.
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float, Int, PRNGKeyArray

from .._axes import in_blocks, on_auto_axes
from .._buffers._prioritised import RulePriorities
from .._buffers._samples import AbstractSample, priority_update
from .._checks import refuse_flashbax_only
from .._custom_types import Beta, ExampleTree, Steps
from .._errors import recorded
from .._protocol import AbstractPrioritisedSource
from .._sumtree import SumTree, SumTrees
from ..rules._by_priority import check_alpha, check_beta
from ._base import AbstractClusteredBuffer, configure_clusters
from ._rules import ClusterRequest, PrioritisedInCluster, UniformInCluster
from ._samples import ClusteredSample, PrioritisedClusteredSample
from ._storage import ClusterStorage


class ClusteredBuffer(AbstractClusteredBuffer[UniformInCluster]):
    """Clustered replay, uniform inside each cluster: `sample` draws a cluster uniformly (or
    by `weights`) among those holding items, then an item uniformly inside it. So item `i` of
    cluster `c` is drawn with probability `w_c / sum_{c' held} w_c' * 1 / n_c` (`n_c` the
    items cluster `c` holds).

    Storage is one array per leaf shaped `(num_clusters, cluster_capacity, *leaf)`, with a
    write head, a fill count and a count of items ever routed per cluster
    (`buffer.storage`). An `add` of `N` items costs `O(N * num_clusters)` integer work (a
    running count per cluster gives each item its slot) plus one scatter of the `N` items; a
    `sample` of `B` items costs one gather of `B` items.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(2), "ret": jnp.float32(0)}
        buffer = eb.ClusteredBuffer(example, add_batch_size=4, num_clusters=2,
                                    cluster_capacity=16,
                                    cluster_fn=lambda item: (item["ret"] > 0).astype(jnp.int32))
        buffer = buffer.add({"obs": jnp.zeros((4, 2)),
                             "ret": jnp.array([1.0, -1.0, 2.0, 3.0])})
        assert buffer.cluster_sizes().tolist() == [1, 3]
        sample = buffer.sample(jax.random.key(0), batch_size=8)
        assert sample.experience["obs"].shape == (8, 2)
        ```
    """

    storage: ClusterStorage
    rule: UniformInCluster
    cluster_fn: Callable[[Any], Any] = eqx.field(static=True)
    weights: tuple[float, ...] | None = eqx.field(static=True)

    @refuse_flashbax_only
    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        num_clusters: int,
        cluster_capacity: int,
        cluster_fn: Callable[[Any], Any],
        weights: Sequence[float] | None = None,
        frames: Any = None,
    ):
        """**Arguments:**

        - `example`: one item, a pytree of arrays (numbers and NumPy arrays are taken as
            `jnp.asarray` takes them).
        - `add_batch_size`: the number of rows each `add` brings (leaves `(add_batch_size,
            *leaf)`, or `(add_batch_size, T, *leaf)` for `T` items per row).
        - `num_clusters`: the number of clusters `K`.
        - `cluster_capacity`: the number of items each cluster holds.
        - `cluster_fn`: a function of one item returning its cluster id, a 0-d integer in
            `[0, num_clusters)`; an id out of range fails (inside jit: recorded, raised by
            [`equibuffer.check`][]).
        - `weights`: the probability of drawing each cluster (non-negative, summing to 1),
            renormalised over the clusters holding items; default uniform over them.
        - `frames`: refused, saying why: a cluster keeps no time order, so frames cannot be
            stored once here (see [`equibuffer.Frames`][]).
        """
        self.storage, self.weights = configure_clusters(
            "ClusteredBuffer()",
            example,
            add_batch_size,
            num_clusters,
            cluster_capacity,
            cluster_fn,
            weights,
            frames,
        )
        self.cluster_fn = cluster_fn
        self.rule = UniformInCluster()

    @on_auto_axes(split=in_blocks)
    @recorded
    def sample(self, key: PRNGKeyArray, batch_size: int, *, row_blocks: int = 1) -> ClusteredSample:
        """Draw `batch_size` items (with replacement, independently): for each, a cluster
        among those holding items, uniformly or by `weights` (renormalised over them), then an
        item uniformly in that cluster.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of items drawn (static).
        - `row_blocks`: `n >= 1` dividing `cluster_capacity` and `batch_size` (static).
            Every cluster's slots are cut into `n` equal runs, block `d` being the `d`-th run
            of every cluster (what `shard_rows` puts on device `d` of an `n`-device mesh
            axis), and the `d`-th `batch_size / n` items are drawn by the rule above
            restricted to block `d`: a cluster among those holding items in it, by
            `weights` renormalised over them, then uniformly among that cluster's items in
            it (see [Scaling](../scaling.md)). Default 1: all slots.

        Fails (inside jit: recorded, raised by [`equibuffer.check`][]) when no cluster of
        positive weight holds an item (with `row_blocks`, in one of the blocks).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=4, num_clusters=2,
                                        cluster_capacity=8, weights=(0.0, 1.0),
                                        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.array([-1.0, 2.0, -3.0, 4.0])})
            sample = buffer.sample(jax.random.key(0), batch_size=16)
            assert sample.experience["x"].shape == (16,) and (sample.experience["x"] > 0).all()
            ```
        """
        where, batch_size, blocks = self._sample_arguments(key, batch_size, row_blocks)
        request = ClusterRequest(key, batch_size, self._shares(), where, blocks)
        cluster, slot, number = self.rule.draw(self.storage, request)
        return ClusteredSample(
            experience=self._gather(cluster, slot, blocks),
            indices=cluster * self.cluster_capacity + slot,
            steps=number,
            cluster=cluster,
        )


class PrioritisedClusteredBuffer(
    AbstractClusteredBuffer[PrioritisedInCluster], RulePriorities, AbstractPrioritisedSource
):
    """Prioritised clustered replay: items routed to clusters as in
    [`equibuffer.ClusteredBuffer`][], drawn by cluster first, then by priority inside the
    cluster. The clusters keep the shares they are given; priorities decide which items of a
    cluster are replayed.

    **The sampling law.** Item `i` of cluster `c` is drawn with probability

    `P(i) = w_c / sum_{c' in D} w_c'  *  p_i**alpha / sum_{j in c} p_j**alpha`

    where `w` are the cluster `weights` (uniform by default) and `D` the clusters of positive
    weight that hold an item of positive priority (an empty cluster's share, or that of a
    cluster whose items all have priority 0, goes to the others). Draws are independent.

    - New items enter at the largest priority set so far (1 before any `set_priorities`),
        raised to `alpha` like every other priority. A priority of 0 excludes an item.
    - **Importance weights** correct the priorities' bias inside each cluster, not the
        clusters' shares (choosing those is the point of clustering, and with `alpha=0` the
        weights are all 1, as for the uniform `ClusteredBuffer`): `(n_c * P(i | c)) ** -beta`
        divided by the largest in the batch, with `P(i | c)` the second factor above and `n_c`
        the number of items cluster `c` holds.
    - `set_priorities(sample, priorities)` routes each priority to the item's own cluster;
        an update for an item overwritten since it was sampled is dropped (the sample's
        `steps` number the items of each cluster).
    - `can_sample()` depends only on the counters (any add made); `sample` raises when no
        cluster of positive weight holds an item, or when every item of those has priority 0.

    Each cluster has its own sum tree (`trees[c]`, leaf = slot), all of them in one array
    end to end: an add or a `set_priorities` writes them all at once, and a draw descends only
    its drawn cluster's tree (`O(B * log(cluster_capacity))` for `B` elements, whatever the
    number of clusters), so it never leaves its cluster, whatever the float rounding.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(2), "ret": jnp.float32(0)}
        buffer = eb.PrioritisedClusteredBuffer(
            example, add_batch_size=4, num_clusters=2, cluster_capacity=16, alpha=1.0,
            cluster_fn=lambda item: (item["ret"] > 0).astype(jnp.int32))
        buffer = buffer.add({"obs": jnp.zeros((4, 2)), "ret": jnp.array([1.0, -1.0, 2.0, 3.0])})
        sample = buffer.sample(jax.random.key(0), batch_size=8, beta=0.4)
        buffer = buffer.set_priorities(sample, jnp.arange(1.0, 9.0))  # |TD error| + eps, say
        assert sample.experience["obs"].shape == (8, 2) and float(buffer.max_priority) <= 8.0
        ```
    """

    storage: ClusterStorage
    rule: PrioritisedInCluster
    cluster_fn: Callable[[Any], Any] = eqx.field(static=True)
    weights: tuple[float, ...] | None = eqx.field(static=True)

    @refuse_flashbax_only
    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        num_clusters: int,
        cluster_capacity: int,
        cluster_fn: Callable[[Any], Any],
        weights: Sequence[float] | None = None,
        alpha: float = 0.6,
        frames: Any = None,
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `num_clusters`, `cluster_capacity`, `cluster_fn`,
            `weights`, `frames`: as for [`equibuffer.ClusteredBuffer`][]; a cluster's weight is
            renormalised over the clusters holding an item of positive priority.
        - `alpha`: the priority exponent, `>= 0`: 0 is uniform over each cluster's items of
            positive priority, 1 fully proportional. Default 0.6 (Schaul et al.).
        """
        where = "PrioritisedClusteredBuffer()"
        self.storage, self.weights = configure_clusters(
            where,
            example,
            add_batch_size,
            num_clusters,
            cluster_capacity,
            cluster_fn,
            weights,
            frames,
        )
        self.cluster_fn = cluster_fn
        self.rule = PrioritisedInCluster(
            trees=SumTrees(num_clusters, self.storage.cluster_capacity),
            max_priority=jnp.array(1.0, jnp.float32),
            alpha=check_alpha(where, alpha),
        )

    @property
    def trees(self) -> tuple[SumTree, ...]:
        """One [`equibuffer.SumTree`][] per cluster, leaf `slot` holding `priority ** alpha`
        of the item in that slot (0 for an empty slot): a copy of the cluster's tree from
        the buffer's batched trees (`rule.trees`, every cluster's tree in one array)."""
        return tuple(self.rule.trees.tree(c) for c in range(self.num_clusters))

    @on_auto_axes(split=in_blocks)
    @recorded
    def sample(
        self, key: PRNGKeyArray, batch_size: int, beta: Beta = 1.0, *, row_blocks: int = 1
    ) -> PrioritisedClusteredSample:
        """Draw `batch_size` items (with replacement, independently) by the law in the class
        docstring: a cluster by `weights` among those holding an item of positive priority,
        then an item of it in proportion to `priority ** alpha`.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of items drawn (static).
        - `beta`: the importance-sampling exponent, `>= 0` (a float or a 0-d array).
        - `row_blocks`: `n >= 1` dividing `cluster_capacity` and `batch_size` (static).
            Every cluster's slots are cut into `n` equal runs, block `d` being the `d`-th run
            of every cluster (what `shard_rows` puts on device `d` of an `n`-device mesh
            axis), and the `d`-th `batch_size / n` items are drawn by the law above
            restricted to block `d`: `P_d(i) = w_c / sum_{c' in D_d} w_c' * p_i**alpha /
            T_{c,d}`, `T_{c,d}` the sum of `p**alpha` over cluster `c`'s slots in block `d`
            and `D_d` the clusters of positive weight holding an item of positive priority
            there. `probabilities` are these, and `weights` use `n_{c,d}` (the items cluster
            `c` holds in block `d`) and are normalised by the largest of their block: each
            block is the sample its device would draw from its own slots (see
            [Scaling](../scaling.md)). Default 1: all slots.

        **Returns:**

        A [`equibuffer.PrioritisedClusteredSample`][]: `experience`, `indices`, `steps`,
        `cluster`, `probabilities` and `weights`.

        Fails (inside jit: recorded, raised by [`equibuffer.check`][]) when no cluster of
        positive weight holds an item, or when every item they hold has priority 0 (with
        `row_blocks`, in one of the blocks).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedClusteredBuffer(
                {"x": jnp.float32(0)}, add_batch_size=3, num_clusters=2, cluster_capacity=4,
                alpha=1.0, cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.array([-1.0, 2.0, 3.0])})  # cluster 0: 1 item, 1: 2
            sample = buffer.sample(jax.random.key(0), batch_size=16, beta=1.0)
            # each cluster half the time; inside cluster 1, each of its 2 items half of that
            p = jnp.where(sample.cluster == 0, 0.5, 0.25)
            assert jnp.allclose(sample.probabilities, p) and jnp.allclose(sample.weights, 1.0)
            ```
        """
        where, batch_size, blocks = self._sample_arguments(key, batch_size, row_blocks)
        exponent = check_beta(where, beta)
        request = ClusterRequest(key, batch_size, self._shares(), where, blocks, exponent)
        drawn = self.rule.draw(self.storage, request)
        return PrioritisedClusteredSample(
            experience=self._gather(drawn.cluster, drawn.slot, blocks),
            indices=drawn.cluster * self.cluster_capacity + drawn.slot,
            steps=drawn.number,
            probabilities=drawn.probabilities,
            weights=drawn.weights,
            cluster=drawn.cluster,
        )

    @on_auto_axes()
    @recorded
    def set_priorities(
        self,
        sample: AbstractSample | Int[ArrayLike, " batch"],
        priorities: Float[ArrayLike, " batch"],
        *,
        steps: Steps | None = None,
    ) -> "PrioritisedClusteredBuffer":
        """Return the buffer with new priorities for sampled items, each set in its own
        cluster's tree.

        **Arguments:**

        - `sample`: the sample the priorities are for, or its `indices` together with
            `steps=sample.steps`.
        - `priorities`: `(batch,)` non-negative finite priorities, before the exponent `alpha`.
            A negative, NaN or infinite value fails (inside jit: recorded, raised by
            [`equibuffer.check`][] or [`equibuffer.filter_jit`][]) and the whole update is
            refused: no priority changes. So is an update from a sample holding a failure.
        - `steps`: only when `sample` is an index array: `sample.steps`.

        **Returns:**

        The updated buffer. An update is **dropped** when its slot no longer holds the item
        that was sampled (its cluster has overwritten it since). When an item appears more
        than once, the last of its updates that is not dropped is applied, as in NumPy, on
        every platform. The largest priority applied raises the priority at which new items
        enter.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedClusteredBuffer(
                {"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2, cluster_capacity=2,
                cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.array([-1.0, 2.0])})
            sample = buffer.sample(jax.random.key(0), batch_size=4)
            updated = buffer.set_priorities(sample, jnp.full(4, 5.0))
            assert float(updated.max_priority) == 5.0  # new items will enter at priority 5
            overwritten = buffer.add({"x": jnp.array([[-2.0, -3.0], [4.0, 5.0]])})
            stale = overwritten.set_priorities(sample, jnp.full(4, 5.0))
            assert float(stale.max_priority) == 1.0  # every sampled item was replaced: dropped
            ```
        """
        where = "PrioritisedClusteredBuffer.set_priorities()"
        update = priority_update(where, sample, priorities, steps)
        return eqx.tree_at(lambda b: b.rule, self, self.rule.reprioritised(self.storage, update))
