"""What the clustered buffers share: `AbstractClusteredBuffer` (`add`, `can_sample`, `size`,
`cluster_sizes`, epochs, written once for both rules) and `configure_clusters`, the checked
storage and cluster weights their `__init__` builds from its arguments.

As for the ring buffers, a clustered buffer is a storage (`ClusterStorage`: the K rings) plus
a rule (`UniformInCluster`, `PrioritisedInCluster`: the state a draw needs).
"""

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._axes import on_auto_axes
from .._buffers._base import AbstractRowBlocked
from .._buffers._epochs import check_epoch, Epoch, epoch_batch_windows, shuffle_valid
from .._checks import check_fits, check_positive_int, check_row_blocks, check_shares
from .._custom_types import BoolScalar, ExampleTree, ExperienceBatch, IntScalar, StepCount
from .._errors import error_if, record, recorded
from .._protocol import AbstractReplayBuffer
from .._ring import stored_steps
from ._rules import AbstractClusterRule
from ._samples import ClusteredSample
from ._storage import ClusterStorage


_Clustered = TypeVar("_Clustered", bound="AbstractClusteredBuffer")
_C = TypeVar("_C", bound=AbstractClusterRule)


def configure_clusters(
    where: str,
    example: ExampleTree,
    add_batch_size: int,
    num_clusters: int,
    cluster_capacity: int,
    cluster_fn: Any,
    weights: Sequence[float] | None,
    frames: Any = None,
) -> tuple[ClusterStorage, tuple[float, ...] | None]:
    """The storage of a clustered buffer and its cluster weights, every argument checked
    (`frames` refused: a cluster keeps no time order)."""
    if frames is not None:
        raise TypeError(
            f"{where}: a clustered buffer refuses `frames`: its items keep no time order (a "
            "cluster holds items of any step, from any row), so no item has the previous "
            "frames a stack is built from. Store the stacked observation whole here, or use a "
            "ring buffer (TransitionBuffer, TrajectoryBuffer, ...) with `frames=`."
        )
    rows = check_positive_int(where, "add_batch_size", add_batch_size)
    k = check_positive_int(where, "num_clusters", num_clusters)
    cap = check_positive_int(where, "cluster_capacity", cluster_capacity)
    if not callable(cluster_fn):
        raise TypeError(f"{where}: `cluster_fn` must be a function of one item.")
    if weights is not None:
        weights = check_shares(where, "weights", weights, k, "cluster", "num_clusters")
    given = f"`num_clusters`={k} and `cluster_capacity`={cap}"
    check_fits(where, given, k, cap, stored_steps(where, example, None)[1])
    storage = ClusterStorage(example, rows, k, cap)
    out = jax.eval_shape(cluster_fn, storage.item())
    if not hasattr(out, "dtype") or not jnp.issubdtype(out.dtype, jnp.integer) or out.shape != ():
        dtype = getattr(out, "dtype", type(out).__name__)
        got = f"{dtype} of shape {getattr(out, 'shape', None)}"
        raise TypeError(
            f"{where}: `cluster_fn` must return a 0-d integer cluster id for one item, got {got}."
        )
    return storage, weights


class AbstractClusteredBuffer(AbstractRowBlocked, AbstractReplayBuffer, Generic[_C]):
    """A buffer of items split into `num_clusters` clusters (as in dejax's clustered
    replay): `add` routes every item to the cluster `cluster_fn(item)` names (e.g. high vs
    low return), each cluster a ring of `cluster_capacity` items that overwrites its own
    oldest items. A draw picks a cluster by `weights` (uniform by default) among those it
    can draw from, then an item inside it by the buffer's rule: uniformly
    ([`equibuffer.ClusteredBuffer`][]) or by priority
    ([`equibuffer.PrioritisedClusteredBuffer`][]).

    It is an [`equibuffer.AbstractReplayBuffer`][]: a `Mixer` source, wrapped by
    `RateLimited` (its items count as steps). `add`, `can_sample`, `size` and
    `cluster_sizes` are the same for both rules.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        for kind in (eb.ClusteredBuffer, eb.PrioritisedClusteredBuffer):
            buffer = kind({"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2,
                          cluster_capacity=4,
                          cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            assert isinstance(buffer, eb.AbstractClusteredBuffer)
            buffer = buffer.add({"x": jnp.array([[1.0, -1.0], [2.0, 3.0]])})
            assert buffer.cluster_sizes().tolist() == [1, 3] and int(buffer.size()) == 4
        ```
    """

    storage: eqx.AbstractVar[ClusterStorage]
    rule: eqx.AbstractVar[_C]
    cluster_fn: eqx.AbstractVar[Callable[[Any], Any]]
    weights: eqx.AbstractVar[tuple[float, ...] | None]

    @property
    def add_batch_size(self) -> int:
        """The number of rows each `add` brings."""
        return self.storage.rows

    @property
    def num_clusters(self) -> int:
        """The number of clusters `K`."""
        return self.storage.num_clusters

    @property
    def cluster_capacity(self) -> int:
        """The number of items each cluster holds."""
        return self.storage.cluster_capacity

    def _row_blocks(self, where: str, row_blocks: int, batch_size: int) -> int:
        """`row_blocks` checked: a positive int dividing `cluster_capacity` and
        `batch_size`."""
        sizes = {"cluster_capacity": self.cluster_capacity, "batch_size": batch_size}
        return check_row_blocks(where, row_blocks, sizes, "block d of every cluster's slots")

    def _gather(
        self, cluster: Int[Array, " batch"], slot: Int[Array, " batch"], blocks: int
    ) -> Any:
        if blocks == 1:
            return self.storage.gather(cluster, slot)
        return self.storage.gather_blocks(cluster, slot, blocks)

    def _shares(self) -> Float[Array, " clusters"]:
        """The clusters' weights, before renormalising over those that can be drawn."""
        if self.weights is None:
            return jnp.ones(self.num_clusters, jnp.float32)
        return jnp.asarray(self.weights, jnp.float32)

    @on_auto_axes()
    @recorded
    def epoch(self, key: PRNGKeyArray, batch_size: int) -> Epoch:
        """Plan an epoch: every item held now, once each, in a uniformly random order, cut
        into batches of `batch_size` (the last one short); fetch batch `i` with
        `epoch_batch(epoch, i)`. As for the ring buffers (see
        [`equibuffer.AbstractBuffer.epoch`][]): inside jit, under `vmap`, with donation.

        An epoch visits the items of every cluster, whatever its weight (0 included) and
        whatever the items' priorities: the clusters' shares and the priorities make the law
        of `sample`, with replacement; an epoch is every item once. Its plan holds one entry
        per slot, `num_clusters * cluster_capacity`, with the `indices` and `steps` of
        `sample` (`cluster * cluster_capacity + slot`, the item's number in its cluster).

        **Arguments:**

        - `key`: a JAX PRNG key; two keys give two independent orders.
        - `batch_size`: the items per batch (static), at least 1.

        **Returns:**

        An [`equibuffer.Epoch`][]. Fails (inside jit: recorded in the plan and in every batch
        fetched with it, raised by [`equibuffer.check`][]) when no item was added yet.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2,
                                        cluster_capacity=4, weights=(1.0, 0.0),
                                        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.array([[-1.0, 2.0, 3.0], [-4.0, 5.0, -6.0]])})
            epoch = buffer.epoch(jax.random.key(0), batch_size=4)
            assert int(epoch.count) == 6 and int(epoch.num_batches()) == 2
            seen = []
            for i in range(int(epoch.num_batches())):
                sample, valid = buffer.epoch_batch(epoch, i)
                seen += sample.experience["x"][valid].tolist()
            assert sorted(seen) == [-6.0, -4.0, -1.0, 2.0, 3.0, 5.0]  # cluster 1's weight 0 too
            ```
        """
        where, batch_size = self._keyed_arguments("epoch", key, batch_size)
        cap = self.cluster_capacity
        # A cluster's ring fills from slot 0 and wraps only once full: it holds `[0, fill)`.
        held = jnp.arange(cap, dtype=jnp.int32)[None, :] < self.storage.fill[:, None]
        indices, count = shuffle_valid(held.reshape(-1), key)
        _, steps = self.storage.numbers(indices // cap, indices % cap)
        count = error_if(
            count,
            count == 0,
            f"{where}: no item was added yet. Add data first, or check `buffer.can_sample()`.",
        )
        return Epoch(indices=indices, steps=steps, count=count, batch_size=batch_size)

    @on_auto_axes()
    @recorded
    def epoch_batch(
        self, epoch: Epoch, i: Int[ArrayLike, ""]
    ) -> tuple[ClusteredSample, Bool[Array, " batch"]]:
        """Batch `i` of an epoch planned by `epoch`: the items at positions
        `i * batch_size` to `(i + 1) * batch_size - 1` of its order.

        **Arguments:**

        - `epoch`: an [`equibuffer.Epoch`][] of this buffer (one made by a buffer of another
            size is refused).
        - `i`: the batch number, a 0-d integer (a Python int, or the counter of a
            `lax.fori_loop` / `lax.scan`).

        **Returns:**

        `(sample, valid)`: `sample` is a [`equibuffer.ClusteredSample`][] of `batch_size`
        items (no probabilities or weights: an epoch is not drawn by priority), whose
        `indices` and `steps` may be given to `set_priorities`; `valid`, `(batch_size,)`
        bool, is true at the items of the epoch and false at the end of the last batch,
        which runs short (those places repeat items from the start of the epoch, to be
        masked out of the loss), and everywhere in a batch `i` outside `[0,
        epoch.num_batches())`. When adds have written over an item of the batch since the
        plan was made (its cluster wrapped over it), the batch fails (inside jit: recorded in
        the sample, raised by [`equibuffer.check`][]).

        !!! example

            ```python
            import equibuffer as eb, equinox as eqx, jax, jax.numpy as jnp
            from jax import lax

            buffer = eb.PrioritisedClusteredBuffer(
                {"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2, cluster_capacity=8,
                cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.array([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]])})

            @eqx.filter_jit
            def epoch_sum(buffer, key):
                epoch = buffer.epoch(key, batch_size=4)

                def body(i, total):
                    sample, valid = buffer.epoch_batch(epoch, i)
                    return total + jnp.sum(jnp.where(valid, sample.experience["x"], 0.0))

                return lax.fori_loop(0, epoch.num_batches(), body, jnp.float32(0))

            assert float(epoch_sum(buffer, jax.random.key(0))) == 5.0  # each item once
            ```
        """
        where = f"{type(self).__name__}.epoch_batch()"
        cap = self.cluster_capacity
        check_epoch(where, epoch, self.num_clusters * cap, "num_clusters * cluster_capacity")
        record(epoch.error)  # a failure recorded while planning goes on to every batch
        indices, steps, valid = epoch_batch_windows(epoch, i, where)
        cluster, slot = indices // cap, indices % cap
        held, number = self.storage.numbers(cluster, slot)
        indices = error_if(
            indices,
            jnp.any(valid & ~(held & (number == steps))),
            f"{where}: an item of this epoch was written over by adds made after `epoch()` "
            f"planned it (each cluster holds cluster_capacity={cap} items). Plan the epoch "
            "after the adds, or add fewer items while an epoch runs.",
        )
        experience = self.storage.gather(cluster, slot)
        sample = ClusteredSample(
            experience=experience, indices=indices, steps=steps, cluster=cluster
        )
        return sample, valid

    def can_sample(self) -> BoolScalar:
        """Whether any item was ever added (0-d bool; independent of the routing, so it
        stays unbatched under `vmap`).

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
        return self.storage.added

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
        return jnp.sum(self.storage.fill, dtype=jnp.int32)

    def steps_added(self) -> StepCount:
        """The number of steps ever added to each row: every `add` of `T` steps per row
        routes `add_batch_size * T` items. A 0-d `uint32`, readable inside jit, exact below
        `2**32` items routed to any one cluster (each cluster counts its items mod `2**32`).

        !!! example

            ```python
            import equibuffer as eb, equinox as eqx, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2,
                                        cluster_capacity=4,
                                        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.ones((2, 3))})  # 3 steps of 2 rows, all to cluster 1
            assert int(buffer.steps_added()) == 3
            assert int(eqx.filter_jit(lambda b: b.steps_added())(buffer)) == 3
            ```
        """
        total = jnp.sum(self.storage.count, dtype=jnp.uint32)
        return total // jnp.uint32(self.add_batch_size)

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
        return self.storage.fill

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
        return self.storage.steps_in(batch, where)

    @on_auto_axes()
    @recorded
    def add(self: _Clustered, batch: ExperienceBatch) -> _Clustered:
        """Route every item of `batch` to its cluster and append it there (a full cluster
        overwrites its oldest items; when one `add` brings more than `cluster_capacity` items
        to a cluster, only its newest ones are kept). Items are taken in time order, rows in
        order within a step. An add of `N` items costs `O(N * num_clusters)` integer work
        plus one scatter of the `N` items (and, prioritised, a write of their leaves in each
        cluster's tree).

        Fails (inside jit: recorded, raised by [`equibuffer.check`][]) when `cluster_fn`
        gives an id outside `[0, num_clusters)`.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=2, num_clusters=2,
                                        cluster_capacity=2,
                                        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
            buffer = buffer.add({"x": jnp.array([1.0, -1.0])})  # one item per row
            buffer = buffer.add({"x": jnp.array([[2.0, 3.0], [-2.0, 4.0]])})  # two items per row
            assert buffer.cluster_sizes().tolist() == [2, 2]
            held = buffer.storage.data["x"][1]
            assert sorted(held.tolist()) == [3.0, 4.0]  # cluster 1 kept its newest 2
            ```
        """
        return self._add(batch)

    def _add(self: _Clustered, batch: ExperienceBatch, refused: Any = None) -> _Clustered:
        """`add`, refused where the 0-d bool `refused` is true (by a wrapper's check, as
        `RateLimited`'s): nothing is written or counted then."""
        where = f"{type(self).__name__}.add()"
        storage, routed = self.storage.append(batch, self.cluster_fn, where, refused=refused)
        rule = self.rule.added(storage, routed)
        return eqx.tree_at(lambda b: (b.storage, b.rule), self, (storage, rule))
