"""Placing a buffer on several devices: the rows axis of its storage split over a mesh axis."""

from typing import TypeVar

import equinox as eqx
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._buffers._rules import EpisodeEnds, PrioritisedEpisodic
from ._cluster import ClusterStorage
from ._ring import RingStorage


_Tree = TypeVar("_Tree")


def shard_rows(tree: _Tree, mesh: Mesh, axis_name: str) -> _Tree:
    """Return `tree` (a buffer, or any pytree holding buffers, such as a training state) with
    the stored steps of every [`equibuffer.RingStorage`][] in it split along their rows over
    the mesh axis `axis_name`, the items of every clustered buffer
    ([`equibuffer.ClusteredBuffer`][], [`equibuffer.PrioritisedClusteredBuffer`][]) split
    along the slots of each cluster, and every other array (counters, sum trees, parameters)
    replicated over the mesh.

    Each device then holds its own rows (typically its own environments), `add` of a batch
    sharded the same way writes locally, and `sample` gathers on every device from its own
    rows and combines the `(batch, ...)` result, never the stored data, across devices.
    Jitted steps keep the placement, donation included.

    **Arguments:**

    - `tree`: the buffer or state to place.
    - `mesh`: a `jax.sharding.Mesh` whose axis `axis_name` is of type `AxisType.Auto` (the
        sampling gathers let XLA choose how to combine the shards).
    - `axis_name`: the mesh axis the rows are split over; its size must divide every
        storage's `rows` (the buffer's `add_batch_size`) and every clustered buffer's
        `cluster_capacity`.

    **Returns:**

    `tree` with its arrays placed on `mesh` (`jax.device_put`).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp
        from jax.sharding import AxisType

        mesh = jax.make_mesh((jax.device_count(),), ("envs",), axis_types=(AxisType.Auto,))
        buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(3)}, add_batch_size=4 * jax.device_count(),
                                     max_length_time_axis=16, sequence_length=4)
        buffer = eb.shard_rows(buffer, mesh, "envs")
        assert buffer.storage.data["obs"].sharding.spec == jax.sharding.PartitionSpec("envs")
        ```
    """
    where = "shard_rows()"
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{where}: the mesh has no axis {axis_name!r}; its axes are {mesh.axis_names}."
        )
    axis_type = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis_name]
    if axis_type != AxisType.Auto:
        raise ValueError(
            f"{where}: mesh axis {axis_name!r} is of type {axis_type}; the buffers need "
            "`AxisType.Auto` (their sampling gathers leave the combination of shards to XLA). "
            f"Build the mesh with `jax.make_mesh(..., axis_types=(AxisType.Auto, ...))`."
        )
    devices = mesh.shape[axis_name]
    split = NamedSharding(mesh, PartitionSpec(axis_name))
    whole = NamedSharding(mesh, PartitionSpec())

    def place(node: object) -> object:
        if isinstance(node, RingStorage):
            if node.rows % devices:
                raise ValueError(
                    f"{where}: a storage of rows={node.rows} (the buffer's add_batch_size) "
                    f"cannot be split evenly over the {devices} devices of mesh axis "
                    f"{axis_name!r}; use a multiple of {devices} rows."
                )
            data = jax.device_put(node.data, split)
            rest = jax.device_put((node.head, node.fill, node.count_lo, node.count_hi), whole)
            return eqx.tree_at(
                lambda s: (s.data, s.head, s.fill, s.count_lo, s.count_hi), node, (data, *rest)
            )
        if isinstance(node, EpisodeEnds | PrioritisedEpisodic):
            # Their `(rows, length)` flags (episode ends, valid windows) go with the rows.
            rows = node.ends if isinstance(node, EpisodeEnds) else node.valid
            placed = jax.tree.map(place, node, is_leaf=lambda x: x is not node and is_leaf(x))
            flags = jax.device_put(rows, split)
            if isinstance(node, EpisodeEnds):
                return eqx.tree_at(lambda e: e.ends, placed, flags)
            return eqx.tree_at(lambda r: r.valid, placed, flags)
        if isinstance(node, ClusterStorage):
            if node.cluster_capacity % devices:
                raise ValueError(
                    f"{where}: a clustered buffer of cluster_capacity={node.cluster_capacity} "
                    f"cannot split every cluster's slots evenly over the {devices} devices of "
                    f"mesh axis {axis_name!r}; use a multiple of {devices}."
                )
            slots = NamedSharding(mesh, PartitionSpec(None, axis_name))
            data = jax.device_put(node.data, slots)
            rest = jax.device_put((node.head, node.fill, node.count, node.added), whole)
            return eqx.tree_at(
                lambda s: (s.data, s.head, s.fill, s.count, s.added), node, (data, *rest)
            )
        if eqx.is_array(node):
            return jax.device_put(node, whole)
        return node

    is_leaf = lambda x: isinstance(  # noqa: E731
        x, RingStorage | ClusterStorage | EpisodeEnds | PrioritisedEpisodic
    )
    return jax.tree.map(place, tree, is_leaf=is_leaf)
