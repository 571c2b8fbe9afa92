"""Buffers on a mesh whose axes are `Explicit` (JAX's default since 0.7: shardings in the
types): every public method runs its body on the mesh's `Auto` axes and says the sharding
of what it returns.

A buffer's methods are written once, for the global view: `add` writes each row where it is
stored, `sample` gathers from the rows of every device and combines the `(batch, ...)`
result. On `Auto` axes XLA chooses how each gather's result is combined; on `Explicit` axes
JAX asks every gather, reshape and `vmap` over stored data to state the sharding of its
result. Rather than state it at every such operation inside the library, a method called on
arrays typed with `Explicit` axes (the outermost one: the methods it calls are then on
`Auto` axes already) runs its body as JAX's own `jax.sharding.auto_axes` does: its inputs
cast to the same mesh with those axes `Auto` (no data moves: the same shards, untyped), and
its outputs resharded to the sharding it declares:

- a buffer it returns keeps the sharding its input had, leaf for leaf (its stored steps stay
    on their devices: the add and the sample compile to the programs of `Auto` axes);
- a sample drawn by one global law is replicated over the mesh (`P()`): every device holds
    the batch, as a learner replicated over the mesh reads it;
- a sample of row blocks (`row_blocks=n`, `n` a multiple of the size of the axis the rows
    are split over: every device draws whole blocks from its own rows) and the `Queue`'s
    sample (each device's rows) are split over that axis, block `d` on device `d`:
    `P(axis)` on their leading axis (where the axis divides it). On an axis of one device
    the global law is one block: split over that one device (the same as replicated).

Inside `shard_map` the axes are `Manual` and inside `vmap` the arrays are the per-copy
ones: nothing is cast there.
"""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
from jax.sharding import AxisType, PartitionSpec


_Method = TypeVar("_Method", bound=Callable[..., Any])
# `(self, *args, **kwargs) -> n`: the number of blocks of consecutive rows what a method
# returns besides buffers is drawn in; split over the rows' axis when it has whole blocks on
# every device, else replicated.
SplitOut = Callable[..., int]


def _mesh(x: Any) -> Any:
    """The mesh `x` is typed with when it has `Explicit` axes, else None."""
    if not isinstance(x, jax.Array):
        return None
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh if getattr(mesh, "explicit_axes", ()) else None


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _rows_axis(tree: Any) -> Any:
    """The first `PartitionSpec` entry naming a mesh axis among the leaves of `tree` (the
    axis, or axes, its stored rows are split over), or None."""
    for x in jax.tree.leaves(tree):
        if _mesh(x) is not None:
            for entry in jax.typeof(x).sharding.spec:
                if _names(entry):
                    return entry
    return None


def on_auto_axes(split: SplitOut | None = None) -> Callable[[_Method], _Method]:
    """Mark a public buffer method (every one that reads or writes the stored steps: `add`,
    `sample`, `set_priorities`, `epoch`, `epoch_batch`, `update`, `with_storage`): called on a
    buffer (or with arguments) whose arrays are typed on a mesh with `Explicit` axes, its
    body runs on that mesh with those axes `Auto` and its results are resharded as the
    module says; otherwise it is called as it is.

    **Arguments:**

    - `split`: `(self, *args, **kwargs) -> n`: the results other than buffers are drawn in
        `n` blocks of consecutive rows (a sample of row blocks); they are split over the
        rows' axis on their leading axis when `n` is a multiple of that axis's size (a leaf
        whose leading size the axis does not divide stays replicated). By default (and for
        `n` not a multiple) they are replicated.
    """

    def decorate(method: _Method) -> _Method:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            inputs = (self, args, kwargs)
            mesh = next(filter(None, map(_mesh, jax.tree.leaves(inputs))), None)
            if mesh is None:
                return method(self, *args, **kwargs)
            auto = mesh.update_axis_types({a: AxisType.Auto for a in mesh.explicit_axes})
            before = [_spec(x) for x in jax.tree.leaves(self)]
            with jax.sharding.use_abstract_mesh(auto):
                cast = jax.tree.map(lambda x: _cast(x, auto), inputs)
                out = method(cast[0], *cast[1], **cast[2])
            axis = None  # what the buffers return is replicated, unless drawn by blocks ...
            if split is not None:
                axis = _rows_axis(self)
                if axis is not None and split(self, *args, **kwargs) % _size(mesh, axis):
                    axis = None  # ... that fall whole on the devices
            return _declare(out, self, before, mesh, axis)

        return wrapper  # pyright: ignore[reportReturnType]

    return decorate


def _spec(x: Any) -> PartitionSpec | None:
    return jax.typeof(x).sharding.spec if isinstance(x, jax.Array) else None


def _cast(x: Any, auto: Any) -> Any:
    """`x` on the mesh `auto` (every axis of it made `Auto`: its type says no sharding, its
    shards stay where they are)."""
    if _mesh(x) is None:
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(auto, PartitionSpec()))


def _declare(out: Any, self: Any, before: list[PartitionSpec | None], mesh: Any, axis: Any) -> Any:
    """`out` resharded on `mesh`: a buffer of `self`'s type as `self` was (`before`), other
    leaves split over `axis` (None: replicated) on their leading axis where it divides."""
    like = jax.tree.structure(self)
    devices = _size(mesh, axis)

    def is_buffer(x: Any) -> bool:
        return isinstance(x, eqx.Module) and jax.tree.structure(x) == like

    def place(node: Any) -> Any:
        if is_buffer(node):
            leaves = jax.tree.leaves(node)
            kept = [
                x if s is None else _put(x, mesh, s) for x, s in zip(leaves, before, strict=True)
            ]
            return jax.tree.unflatten(like, kept)
        if not isinstance(node, jax.Array):
            return node
        split = axis is not None and node.ndim >= 1 and node.shape[0] % devices == 0
        return _put(node, mesh, PartitionSpec(axis) if split else PartitionSpec())

    return jax.tree.map(place, out, is_leaf=is_buffer)


def _put(x: Any, mesh: Any, spec: PartitionSpec) -> Any:
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def _size(mesh: Any, axis: Any) -> int:
    """The number of devices along `axis` (a `PartitionSpec` entry) of `mesh`."""
    devices = 1
    for name in _names(axis):
        devices *= mesh.shape[name]
    return devices


def in_blocks(_: Any, *args: Any, row_blocks: int = 1, **kwargs: Any) -> int:
    """The `split` of `sample(key, batch_size, ..., row_blocks=n)`: its `n` blocks."""
    del args, kwargs
    return row_blocks
