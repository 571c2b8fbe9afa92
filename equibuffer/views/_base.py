"""The interface every view implements (`AbstractView`), and what a buffer does with a
view: its gather by blocks of rows."""

import abc
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .._custom_types import Indices
from .._ring import RingStorage


Mask = Bool[Array, "batch window"]
_View = TypeVar("_View", bound="AbstractView")


def zero_where_not(mask: Bool[Array, " batch"], tree: Any) -> Any:
    """`tree` (leaves `(batch, *leaf)`) with the entries where `mask` is false set to zero."""

    def zero(x: Array) -> Array:
        m = mask.reshape(-1, *(1,) * (x.ndim - 1))
        return jnp.where(m, x, jnp.zeros((), x.dtype))

    return jax.tree.map(zero, tree)


class AbstractView(eqx.Module):
    """What a buffer's `sample` returns for each drawn window: static configuration only (no
    arrays), so a buffer keeps its view as a static field and a jitted call pays nothing for
    it. A view says how many consecutive steps one element spans (`window_length`: the window
    the rule draws), gathers them from the ring, and zeroes what lies past an episode end.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        view = eb.views.WindowView(sequence_length=3)
        assert isinstance(view, eb.views.AbstractView) and view.window_length == 3
        buffer = eb.Buffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8, view=view)
        buffer = buffer.add({"x": jnp.arange(4.0)[None]})
        assert buffer.sample(jax.random.key(0), batch_size=2).experience["x"].shape == (2, 3)
        ```
    """

    @property
    @abc.abstractmethod
    def window_length(self) -> int:
        """The number of consecutive steps one sampled element spans."""

    @abc.abstractmethod
    def gather(self, storage: RingStorage, indices: Indices, mask: Mask | None) -> Any:
        """The experience of the windows starting at the flat `indices`. `mask` (from an
        episode rule in pad mode, else None) says which steps of each window lie inside its
        episode: what a view computes over several steps must not reach past it."""

    @abc.abstractmethod
    def padded(self, experience: Any, mask: Bool[Array, "batch window"]) -> Any:
        """`experience` with the steps where `mask` is false (past an episode end) zeroed."""

    @property
    @abc.abstractmethod
    def window_name(self) -> str:
        """How errors name one window (by the arguments a user of this view sets)."""

    @abc.abstractmethod
    def needs(self, steps: int) -> str:
        """What the sample-too-early error says a row needs: `steps` per row (the buffer's
        minimum) and what one sample spans, naming only arguments a user of this view sets."""

    @abc.abstractmethod
    def checked(self: _View, where: str, storage: RingStorage) -> _View:
        """This view with its configuration checked (errors start with `where`), also
        against the ring's example (the leaves it reads): called when a buffer is built."""

    def reference(self) -> Any:
        """This view's NumPy model, for [`equibuffer.testing.BufferReference`][]: what a
        sample holds for each drawn window (a model of `equibuffer.testing`'s `WindowView`
        kind: `experience(history, row, start)`, ...). A view of your own that returns one
        gets the reference model's checks; by default there is none, and
        `BufferReference.from_buffer` refuses the buffer, saying so."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no reference model: give it a `reference()` "
            "method returning one (see equibuffer.testing's WindowView, PairView, ItemView "
            "and NStepView)."
        )


def gather_by_blocks(
    view: AbstractView, storage: RingStorage, indices: Indices, mask: Mask | None, blocks: int
) -> Any:
    """`view.gather(storage, indices, mask)` for indices drawn by blocks of rows (the `b`-th
    `batch / blocks` indices all in the `b`-th of `blocks` equal blocks of rows): each block
    gathers from its own rows only (a gather batched over the blocks), so with the rows split
    over devices block by block (`shard_rows`) every device gathers its block's windows from
    the rows it holds, and nothing crosses devices."""
    rows = storage.rows // blocks
    local = indices.reshape(blocks, -1)
    local = local - (jnp.arange(blocks, dtype=local.dtype) * (rows * storage.length))[:, None]
    treedef = jax.tree.structure(
        jax.eval_shape(
            lambda: RingStorage(
                storage.stacked_example(), rows, storage.length, frames=storage.frames
            )
        )
    )
    data = jax.tree.map(lambda x: x.reshape(blocks, rows, *x.shape[1:]), storage.data)
    masks = None if mask is None else mask.reshape(blocks, -1, *mask.shape[1:])

    def block(data: Any, local: Indices, mask: Mask | None) -> Any:
        own = jax.tree.unflatten(treedef, [*jax.tree.leaves(data), storage.counters])
        return view.gather(own, local, mask)

    out = jax.vmap(block)(data, local, masks)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)
