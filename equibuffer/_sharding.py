"""Placing a buffer on several devices: the rows axis of its storage split over a mesh axis."""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._cluster import ClusterStorage
from ._ring import RingStorage
from .rules._base import AbstractRule


_Tree = TypeVar("_Tree")


def _axis_size(where: str, mesh: Mesh, axis_name: str) -> int:
    """The number of devices along the mesh axis `axis_name`, checked to be one of the
    mesh's axes."""
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{where}: the mesh has no axis {axis_name!r}; its axes are {mesh.axis_names}."
        )
    return mesh.shape[axis_name]


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
    - `mesh`: a `jax.sharding.Mesh`; its axes may be `Explicit` (JAX's default) or `Auto`.
        On `Explicit` axes every method says the sharding of its results: a buffer keeps
        its own, a sample is replicated, a sample of `row_blocks` split over `axis_name`
        (see [Scaling](../scaling.md)).
    - `axis_name`: the mesh axis the rows are split over; its size must divide every
        storage's `rows` (the buffer's `add_batch_size`) and every clustered buffer's
        `cluster_capacity`.

    **Returns:**

    `tree` with its arrays placed on `mesh` (`jax.device_put`). A tree of shapes (leaves
    `jax.ShapeDtypeStruct`, as `eqx.filter_eval_shape(make_state)` returns) comes back with
    each leaf given the sharding its array would have, allocating nothing: the template an
    orbax checkpoint is restored into, sharded (see [Checkpoints](../checkpoints.md)).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        mesh = jax.make_mesh((jax.device_count(),), ("envs",))  # Explicit axes: the default
        buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(3)}, add_batch_size=4 * jax.device_count(),
                                     max_length_time_axis=16, sequence_length=4)
        buffer = eb.shard_rows(buffer, mesh, "envs")
        assert buffer.storage.data["obs"].sharding.spec == jax.sharding.PartitionSpec("envs")
        ```
    """
    where = "shard_rows()"
    devices = _axis_size(where, mesh, axis_name)
    split = NamedSharding(mesh, PartitionSpec(axis_name))
    whole = NamedSharding(mesh, PartitionSpec())

    slots = NamedSharding(mesh, PartitionSpec(None, axis_name))
    # Each kind of node: the part of it that is split, and how; the rest is replicated.
    parts: dict[type, tuple[Callable[[Any], Any], NamedSharding]] = {
        RingStorage: (lambda s: s.data, split),
        ClusterStorage: (lambda s: s.data, slots),
        # What each rule declares has one entry per row (episode ends, valid windows).
        AbstractRule: (lambda r: r.row_leaves(), split),
    }

    def place(node: object) -> object:
        if isinstance(node, RingStorage) and node.rows % devices:
            raise ValueError(
                f"{where}: a storage of rows={node.rows} (the buffer's add_batch_size) "
                f"cannot be split evenly over the {devices} devices of mesh axis "
                f"{axis_name!r}; use a multiple of {devices} rows."
            )
        if isinstance(node, ClusterStorage) and node.cluster_capacity % devices:
            raise ValueError(
                f"{where}: a clustered buffer of cluster_capacity={node.cluster_capacity} "
                f"cannot split every cluster's slots evenly over the {devices} devices of "
                f"mesh axis {axis_name!r}; use a multiple of {devices}."
            )
        for kind, (part, sharding) in parts.items():
            if isinstance(node, kind):
                return place_split(node, part(node), sharding)
        return _put(node, whole)

    def place_split(node: object, part: object, sharding: NamedSharding) -> object:
        split_ids = {id(leaf) for leaf in jax.tree.leaves(part)}

        def inner(x: object) -> object:
            return _put(x, sharding) if id(x) in split_ids else place(x)

        return jax.tree.map(inner, node, is_leaf=lambda x: x is not node and is_leaf(x))

    is_leaf = lambda x: isinstance(x, tuple(parts))  # noqa: E731
    return jax.tree.map(place, tree, is_leaf=is_leaf)


def _put(x: Any, sharding: NamedSharding) -> Any:
    """An array placed with `sharding`; a `jax.ShapeDtypeStruct` (a leaf of a template made
    by `eqx.filter_eval_shape`) given it, allocating nothing; anything else as it is."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.device_put(x, sharding) if eqx.is_array(x) else x


def per_device(tree: _Tree, mesh: Mesh, axis_name: str) -> _Tree:
    """Return one independent copy of `tree` (a buffer, or any pytree holding buffers, such
    as a training state, built for what one device holds) on every device of the mesh axis
    `axis_name`: each array stacked `n` times on a new leading axis, split over the axis.

    This is the layout of per-device code: Flashbax's `pmap` recipe (one buffer state per
    device) and a `jax.shard_map` step, where each device adds its own batch to its own
    buffer and samples its own batch from it. Every buffer kind works in it unchanged (each
    device's copy is a whole buffer, with its own counters and sum tree), and nothing
    crosses devices: a compiled per-device step has no collective over stored data. Inside
    `shard_map` with `in_specs=P(axis_name)` a device sees its copy with a leading axis of
    1: `jax.tree.map(lambda x: x[0], tree)` is its buffer, and `x[None]` puts it back.
    Outside, `eqx.filter_vmap` over the leading axis runs every device's copy at once (under
    `jit`, each on its own device).

    Compare [`equibuffer.shard_rows`][]: one buffer whose rows are split over the devices,
    sampled by one global law (or per device with `row_blocks`), for code written for the
    whole mesh rather than per device.

    **Arguments:**

    - `tree`: the buffer or state one device holds; its non-array leaves are kept as they
        are (they are the same on every device).
    - `mesh`: a `jax.sharding.Mesh`.
    - `axis_name`: the mesh axis to place one copy per device on; the copies are
        replicated over the mesh's other axes.

    **Returns:**

    `tree` with every array `x` replaced by an array of shape `(n, *x.shape)`, `n` the size
    of the mesh axis, split over it: device `d` holds copy `d`. No device holds more than
    its own copy at any time (each is placed from `x` directly). A leaf
    `jax.ShapeDtypeStruct` (a template made by `eqx.filter_eval_shape`) becomes the shape
    and sharding of its copies, allocating nothing (to restore a checkpoint into).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp
        from functools import partial
        from jax.sharding import PartitionSpec as P

        n = jax.device_count()
        mesh = jax.make_mesh((n,), ("envs",))
        buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(3)}, add_batch_size=4,
                                     max_length_time_axis=16, sequence_length=4)
        buffers = eb.per_device(buffer, mesh, "envs")  # one buffer of 4 rows per device

        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=P("envs"), out_specs=P("envs"))
        def step(buffers, batch, keys):
            buffer = jax.tree.map(lambda x: x[0], buffers)  # this device's buffer
            buffer = buffer.add(batch)
            sample = buffer.sample(keys[0], 8)
            return jax.tree.map(lambda x: x[None], buffer), sample.experience

        batch = {"obs": jnp.ones((n * 4, 5, 3))}  # 5 steps for each device's 4 rows
        keys = jax.random.split(jax.random.key(0), n)  # one key per device
        split = jax.sharding.NamedSharding(mesh, P("envs"))
        buffers, obs = step(buffers, *jax.device_put((batch, keys), split))
        assert obs["obs"].shape == (n * 8, 4, 3)  # each device's 8 windows, side by side
        ```
    """
    where = "per_device()"
    devices = _axis_size(where, mesh, axis_name)
    sharding = NamedSharding(mesh, PartitionSpec(axis_name))

    def place(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):  # a template's leaf: its copies' shape
            return jax.ShapeDtypeStruct((devices, *x.shape), x.dtype, sharding=sharding)
        if not eqx.is_array(x):
            return x
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # a key: its data, wrapped
            data = place(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)[None]  # each device's part is the whole copy

        def part(index: Any) -> np.ndarray:
            return host[(slice(None), *tuple(index)[1:])]

        return jax.make_array_from_callback((devices, *host.shape[1:]), sharding, part)

    return jax.tree.map(place, tree)
