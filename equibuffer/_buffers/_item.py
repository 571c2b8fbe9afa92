from typing import Unpack

import equinox as eqx

from .._custom_types import ExampleTree
from .._frames import Frames
from .._ring import RingStorage
from ..rules._base import AbstractUniformRule
from ..rules._uniform import UNIFORM
from ..views._base import AbstractView
from ..views._item import ItemView
from ._base import AbstractUniformBuffer
from ._generic import compose
from ._items import item_rows, ItemAdds
from ._sizes import Sizes


class ItemBuffer(ItemAdds, AbstractUniformBuffer):
    """A buffer of independent items: every stored step is one item, sampled uniformly.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.ItemBuffer({"x": jnp.zeros(3)}, add_batch_size=4, capacity=100)
        buffer = buffer.add({"x": jnp.ones((4, 3))})
        sample = buffer.sample(jax.random.key(0), batch_size=16)
        assert sample.experience["x"].shape == (16, 3)
        ```

    It is [`equibuffer.Buffer`][] with `rule=Uniform()` and `view=ItemView()`.
    """

    storage: RingStorage
    rule: AbstractUniformRule
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)
    add_batches: bool = eqx.field(static=True)
    add_sequences: bool = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int | None = None,
        add_batches: bool = False,
        add_sequences: bool = False,
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`: one item, a pytree of arrays (numbers and NumPy arrays are taken as
            `jnp.asarray` takes them).
        - `add_batch_size`: the number of items (rows) each `add` of one step writes.
        - `add_batches`, `add_sequences`: as Flashbax's item buffer takes them, instead of
            `add_batch_size`: every `add` takes leaves `(batch, *leaf)`, `(time, *leaf)` or,
            with both, `(batch, time, *leaf)` (a time-major rollout `(time, envs, *leaf)` as
            well), of any sizes, and stores each of their items (in one row). Each new shape
            of an add is traced once.
        - `frames`: an [`equibuffer.Frames`][], to store one frame per step of a stacked
            observation leaf and return the stacks in every sample (see
            [Pixels](../pixels.md)). Default: every leaf is stored as given.
        - `**sizes`: `capacity` (items in total; Flashbax's `max_length` too) or
            `max_length_time_axis` (per row), and optionally `min_size` (`min_length`) or
            `min_length_time_axis` (default and least: 1 per row), as [`equibuffer.Sizes`][]
            says.
        """
        where = "ItemBuffer()"
        rows = item_rows(where, add_batch_size, add_batches, add_sequences, frames)
        self.add_batches, self.add_sequences = add_batches, add_sequences
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where, example, rows, sizes, UNIFORM, ItemView(), flat=True, frames=frames
        )
