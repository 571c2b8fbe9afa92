from typing import Unpack

from .._custom_types import ExampleTree
from ..rules._uniform import UNIFORM
from ..views._item import ItemView
from ._generic import Buffer, compose, init_buffer
from ._sizes import Sizes


class ItemBuffer(Buffer):
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

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`: one item, a pytree of arrays.
        - `add_batch_size`: the number of items (rows) each `add` of one step writes.
        - `**sizes`: `capacity` (items in total; Flashbax's `max_length` too) or
            `max_length_time_axis` (per row), and optionally `min_size` (`min_length`) or
            `min_length_time_axis` (default and least: 1 per row), as [`equibuffer.Sizes`][]
            says.
        """
        where = "ItemBuffer()"
        parts = compose(where, example, add_batch_size, sizes, UNIFORM, ItemView(), flat=True)
        init_buffer(self, parts)
