"""Clustered replay: items routed at `add` time to one of K clusters, each its own ring."""

import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PRNGKeyArray, PyTree, Shaped

from ._checks import check_positive_int
from ._custom_types import BoolScalar, ExampleTree, ExperienceBatch, IntScalar
from ._ring import RingStorage


class ClusteredSample(eqx.Module):
    """What [`equibuffer.ClusteredBuffer.sample`][] returns.

    - `experience`: the sampled items, leaves `(batch, *leaf)`.
    - `cluster`: `(batch,)` int32, the cluster each item was drawn from.
    - `indices`: `(batch,)` int32, `cluster * cluster_capacity + slot` of each item.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=4, num_clusters=2,
                                    cluster_capacity=8,
                                    cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
        buffer = buffer.add({"x": jnp.array([-1.0, 2.0, -3.0, 4.0])})
        sample = buffer.sample(jax.random.key(0), batch_size=8)
        assert isinstance(sample, eb.ClusteredSample) and sample.cluster.dtype == jnp.int32
        assert ((sample.experience["x"] > 0) == (sample.cluster == 1)).all()
        assert (sample.indices // 8 == sample.cluster).all()  # cluster * cluster_capacity + slot
        ```
    """

    experience: PyTree[Shaped[Array, "batch ..."]]
    cluster: Int[Array, " batch"]
    indices: Int[Array, " batch"]


class ClusteredBuffer(eqx.Module):
    """A buffer of items split into `num_clusters` clusters (as in dejax's clustered
    replay): `add` routes every item to the cluster `cluster_fn(item)` names (e.g. high vs
    low return), each cluster a ring of `cluster_capacity` items that overwrites its own
    oldest items; `sample` draws a cluster uniformly (or by `weights`) among the non-empty
    ones, then an item uniformly inside it.

    Storage is one array per leaf shaped `(num_clusters, cluster_capacity, *leaf)`, with a
    write head and a fill count per cluster. An `add` of `N` items costs `O(N * num_clusters)`
    integer work (a running count per cluster gives each item its slot) plus one scatter of the
    `N` items; a `sample` of `B` items costs one gather of `B` items.

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

    data: PyTree[Shaped[Array, "clusters capacity ..."]]
    head: Int[Array, " clusters"]
    fill: Int[Array, " clusters"]
    any_added: Bool[Array, ""]
    num_clusters: int = eqx.field(static=True)
    cluster_capacity: int = eqx.field(static=True)
    add_batch_size: int = eqx.field(static=True)
    cluster_fn: Callable[[Any], Any] = eqx.field(static=True)
    weights: tuple[float, ...] | None = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        num_clusters: int,
        cluster_capacity: int,
        cluster_fn: Callable[[Any], Any],
        weights: Sequence[float] | None = None,
    ):
        """**Arguments:**

        - `example`: one item, a pytree of arrays.
        - `add_batch_size`: the number of rows each `add` brings (leaves `(add_batch_size,
            *leaf)`, or `(add_batch_size, T, *leaf)` for `T` items per row).
        - `num_clusters`: the number of clusters `K`.
        - `cluster_capacity`: the number of items each cluster holds.
        - `cluster_fn`: a function of one item returning its cluster id, a 0-d integer in
            `[0, num_clusters)`; an id out of range raises inside jit (`eqx.error_if`).
        - `weights`: the probability of drawing each cluster (non-negative, summing to 1),
            renormalised over the clusters holding items; default uniform over them.
        """
        where = "ClusteredBuffer()"
        self.add_batch_size = check_positive_int(where, "add_batch_size", add_batch_size)
        self.num_clusters = check_positive_int(where, "num_clusters", num_clusters)
        self.cluster_capacity = check_positive_int(where, "cluster_capacity", cluster_capacity)
        if not callable(cluster_fn):
            raise TypeError(f"{where}: `cluster_fn` must be a function of one item.")
        self.cluster_fn = cluster_fn
        if weights is not None:
            weights = tuple(float(w) for w in weights)
            if len(weights) != self.num_clusters:
                raise ValueError(
                    f"{where}: {len(weights)} weights for num_clusters={self.num_clusters}."
                )
            if not all(math.isfinite(w) and w >= 0 for w in weights):
                raise ValueError(f"{where}: weights must be finite and >= 0, got {weights}.")
            if abs(sum(weights) - 1) > 1e-6:
                raise ValueError(f"{where}: weights must sum to 1, got {weights}.")
        self.weights = weights
        # A (clusters, capacity) ring allocates and checks the example the usual way.
        self.data = RingStorage(example, self.num_clusters, self.cluster_capacity).data
        self.head = jnp.zeros(self.num_clusters, jnp.int32)
        self.fill = jnp.zeros(self.num_clusters, jnp.int32)
        self.any_added = jnp.array(False)
        item = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), self.data)
        out = jax.eval_shape(cluster_fn, item)
        if (
            not hasattr(out, "dtype")
            or not jnp.issubdtype(out.dtype, jnp.integer)
            or tuple(out.shape) != ()
        ):
            dtype = getattr(out, "dtype", type(out).__name__)
            got = f"{dtype} of shape {getattr(out, 'shape', None)}"
            raise TypeError(
                f"{where}: `cluster_fn` must return a 0-d integer cluster id for one item, got "
                f"{got}."
            )

    def can_sample(self) -> BoolScalar:
        """Whether any item was ever added (0-d bool; independent of the routing).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2,
                                        cluster_capacity=4,
                                        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            assert not buffer.can_sample()
            buffer = buffer.add({"x": jnp.ones(2)})
            assert buffer.can_sample() and buffer.can_sample().dtype == jnp.bool_
            ```
        """
        return self.any_added

    def size(self) -> IntScalar:
        """The number of items held over all clusters (0-d int32).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2,
                                        cluster_capacity=4,
                                        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.ones((2, 3))})  # 6 items, all to cluster 1, which holds 4
            assert int(buffer.size()) == 4 and buffer.size().dtype == jnp.int32
            ```
        """
        return jnp.sum(self.fill, dtype=jnp.int32)

    def cluster_sizes(self) -> Int[Array, " clusters"]:
        """The number of items held in each cluster, `(num_clusters,)` int32.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2,
                                        cluster_capacity=4,
                                        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.array([[1.0, -1.0, 2.0], [-3.0, 4.0, 5.0]])})
            assert buffer.cluster_sizes().tolist() == [2, 4]
            ```
        """
        return self.fill

    def steps_in(self, batch: ExperienceBatch, where: str = "add()") -> int | None:
        """Check `batch` as `add` does (structure, shapes, dtypes, `add_batch_size` rows) and
        return its number of items per row: `None` for leaves `(add_batch_size, *leaf)`,
        else `T` for `(add_batch_size, T, *leaf)`. Errors start with `where`.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=2,
                                        num_clusters=2, cluster_capacity=4,
                                        cluster_fn=lambda item: (item["x"] > 0).astype(int))
            assert buffer.steps_in({"x": jnp.zeros((2, 3))}) == 3
            ```
        """
        # The ring's own batch check, against `add_batch_size` rows.
        checker: Any = types.SimpleNamespace(data=self.data, rows=self.add_batch_size)
        return RingStorage.steps_in(checker, batch, where)

    def add(self, batch: ExperienceBatch) -> "ClusteredBuffer":
        """Route every item of `batch` to its cluster and append it there (a full cluster
        overwrites its oldest items; when one `add` brings more than `cluster_capacity` items
        to a cluster, only its newest ones are kept). Items are taken in time order, rows in
        order within a step.

        Raises inside jit (through `eqx.error_if`) when `cluster_fn` gives an id outside
        `[0, num_clusters)`.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2,
                                        cluster_capacity=2,
                                        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.array([1.0, -1.0])})  # one item per row
            buffer = buffer.add({"x": jnp.array([[2.0, 3.0], [-2.0, 4.0]])})  # two items per row
            assert buffer.cluster_sizes().tolist() == [2, 2]
            assert sorted(buffer.data["x"][1].tolist()) == [3.0, 4.0]  # cluster 1 kept its newest 2
            ```
        """
        where = "ClusteredBuffer.add()"
        t = self.steps_in(batch, where)

        def flatten(x: Any) -> Array:
            x = jnp.asarray(x)
            if t is None:
                return x
            return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])  # time-major

        items = jax.tree.map(flatten, batch)
        k, cap = self.num_clusters, self.cluster_capacity
        ids = jax.vmap(self.cluster_fn)(items).astype(jnp.int32)
        ids = eqx.error_if(
            ids,
            jnp.any((ids < 0) | (ids >= k)),
            f"{where}: `cluster_fn` returned a cluster id outside [0, num_clusters={k}).",
        )
        onehot = (ids[:, None] == jnp.arange(k, dtype=jnp.int32)[None, :]).astype(jnp.int32)
        counts = jnp.sum(onehot, axis=0, dtype=jnp.int32)
        rank = (
            jnp.take_along_axis(jnp.cumsum(onehot, axis=0, dtype=jnp.int32), ids[:, None], axis=1)[
                :, 0
            ]
            - 1
        )
        keep = rank >= counts[ids] - cap  # only the newest `cap` items of one cluster
        slot = (self.head[ids] + rank) % cap
        target = jnp.where(keep, ids, k)  # out of range: dropped by the scatter
        data = jax.tree.map(
            lambda d, x: d.at[target, slot].set(x, mode="drop", unique_indices=True),
            self.data,
            items,
        )
        head = (self.head + counts) % cap
        fill = jnp.minimum(self.fill + counts, cap)
        return eqx.tree_at(
            lambda b: (b.data, b.head, b.fill, b.any_added),
            self,
            (data, head, fill, jnp.array(True)),
        )

    def sample(self, key: PRNGKeyArray, batch_size: int) -> ClusteredSample:
        """Draw `batch_size` items (with replacement): for each, a cluster among those holding
        items, uniformly or by `weights` (renormalised over them), then an item uniformly in
        that cluster.

        Raises inside jit (through `eqx.error_if`) when the buffer holds no item.

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
        batch_size = check_positive_int("ClusteredBuffer.sample()", "batch_size", batch_size)
        k, cap = self.num_clusters, self.cluster_capacity
        base = (
            jnp.ones(k, jnp.float32)
            if self.weights is None
            else jnp.asarray(self.weights, jnp.float32)
        )
        w = jnp.where(self.fill > 0, base, 0.0)
        key_c, key_i = jax.random.split(key)
        cluster = jax.random.categorical(key_c, jnp.log(w), shape=(batch_size,)).astype(jnp.int32)
        cluster = eqx.error_if(
            cluster,
            ~(jnp.sum(w) > 0),
            "ClusteredBuffer.sample(): no cluster of positive weight holds an item yet. Add "
            "data first, or check `buffer.can_sample()` and the weights.",
        )
        fill = self.fill[cluster]
        u = jax.random.uniform(key_i, (batch_size,), jnp.float32)
        j = jnp.minimum((u * fill.astype(jnp.float32)).astype(jnp.int32), fill - 1)
        slot = (self.head[cluster] - fill + j + cap) % cap
        experience = jax.tree.map(
            lambda d: d.at[cluster, slot].get(mode="promise_in_bounds"), self.data
        )
        return ClusteredSample(experience=experience, cluster=cluster, indices=cluster * cap + slot)
