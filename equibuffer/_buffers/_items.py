"""Flashbax's item adds (`add_batches`, `add_sequences`) on the item buffers: each add's
leading axes, of any size, flattened into items of the buffer's one row."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_structure, keystr
from .._custom_types import ExperienceBatch
from .._ring import RingStorage


def item_rows(
    where: str, add_batch_size: Any, add_batches: Any, add_sequences: Any, frames: Any
) -> int:
    """The rows of an item buffer given these arguments: those given, or 1 with a flag
    set."""
    for name, value in (("add_batches", add_batches), ("add_sequences", add_sequences)):
        if not isinstance(value, bool):
            raise TypeError(f"{where}: `{name}` must be a bool, got {value!r}.")
    axes = int(add_batches) + int(add_sequences)
    if not axes:
        if add_batch_size is None:
            raise TypeError(
                f"{where}: give `add_batch_size`, the rows each `add` writes (leaves "
                "`(add_batch_size, *leaf)` or `(add_batch_size, T, *leaf)`); or, as Flashbax's "
                "item buffer, `add_batches=True` and/or `add_sequences=True` to add items with "
                "leading axes of any size."
            )
        return add_batch_size
    if add_batch_size is not None and add_batch_size != 1:
        raise ValueError(
            f"{where}: with `add_batches`/`add_sequences` every add's items are flattened into "
            f"one row: leave `add_batch_size` out (got {add_batch_size!r}), or give "
            f"`add_batch_size={add_batch_size}` without them to add `(add_batch_size, T, "
            "*leaf)` a row per environment."
        )
    if frames is not None:
        raise TypeError(
            f"{where}: `frames` needs each row's steps in time order, and `add_batches`/"
            "`add_sequences` flatten every add into one row of items (several environments "
            "would interleave): give `add_batch_size=` the number of environments and add "
            "`(add_batch_size, T, *leaf)` instead."
        )
    return 1


def as_items(
    where: str, storage: RingStorage, flags: tuple[bool, bool], batch: ExperienceBatch
) -> ExperienceBatch:
    """`batch` with its leading axes (`flags`: `add_batches`, `add_sequences`) flattened into
    the items of the ring's one row, `(1, items, *leaf)`; as it is without flags."""
    axes = sum(flags)
    if not axes:
        return batch
    example = storage.example()
    structs, treedef = jax.tree.flatten(example)
    got = check_structure(where, treedef, batch)
    lead = ", ".join(n for n, f in zip(("batch", "time"), flags, strict=True) if f)
    named = " and ".join(
        f"`{n}=True`" for n, f in zip(("add_batches", "add_sequences"), flags, strict=True) if f
    )
    out = []
    for (path, x), struct in zip(got, structs, strict=True):
        x = x if isinstance(x, np.ndarray | jax.Array) else jnp.asarray(x)
        if x.ndim != len(struct.shape) + axes or tuple(x.shape[axes:]) != struct.shape:
            raise ValueError(
                f"{where}: leaf {keystr(path)} has shape {tuple(x.shape)}; with {named} "
                f"each leaf is ({lead}, *leaf) for the example's leaf of shape "
                f"{struct.shape}, its leading axes flattened into items."
            )
        out.append(x.reshape(1, -1, *struct.shape))
    return jax.tree.unflatten(treedef, out)


class ItemAdds(eqx.Module):
    """The item buffers' `add` and `steps_in` with Flashbax's item adds: a batch's leading
    axes flattened (`as_items`) as the buffer's `add_batches` and `add_sequences` say."""

    add_batches: eqx.AbstractVar[bool]
    add_sequences: eqx.AbstractVar[bool]
    storage: eqx.AbstractVar[RingStorage]

    def _add(self, batch: ExperienceBatch, refused: Any = None) -> Any:
        where = f"{type(self).__name__}.add()"
        items = as_items(where, self.storage, (self.add_batches, self.add_sequences), batch)
        return super()._add(items, refused)  # pyright: ignore[reportAttributeAccessIssue]

    def steps_in(self, batch: ExperienceBatch, where: str = "add()") -> int | None:
        """Check `batch` as `add` does and return its number of steps per row (see
        [`equibuffer.RingStorage.steps_in`][]): with `add_batches`/`add_sequences`, the
        items it holds, its leading axes flattened into the one row.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(3)}, add_batches=True, add_sequences=True,
                                   capacity=64)
            assert buffer.steps_in({"x": jnp.zeros((5, 4, 3))}) == 20
            ```
        """
        items = as_items(where, self.storage, (self.add_batches, self.add_sequences), batch)
        return super().steps_in(items, where)  # pyright: ignore[reportAttributeAccessIssue]
