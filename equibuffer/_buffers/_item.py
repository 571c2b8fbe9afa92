from .._checks import refuse_flashbax_only
from .._custom_types import ExampleTree
from ._generic import Buffer, compose, init_buffer
from ._rules import UNIFORM
from ._sizes import SizeArgs
from ._views import ItemView


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

    @refuse_flashbax_only
    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        capacity: int | None = None,
        max_size: int | None = None,
        max_length: int | None = None,
        max_length_time_axis: int | None = None,
        min_size: int | None = None,
        min_length: int | None = None,
        min_length_time_axis: int | None = None,
    ):
        """**Arguments:**

        - `example`: one item, a pytree of arrays.
        - `add_batch_size`: the number of items (rows) each `add` of one step writes.
        - `capacity` (aliases `max_size` and, as in Flashbax's flat and item buffers,
            `max_length_time_axis`): items held in total, rounded up to whole rows. Or instead
            `max_length_time_axis`: items held per row.
        - `min_size` (alias `min_length`, as in Flashbax's flat and item buffers): items held
            in total before `can_sample()` is true, rounded up to whole rows; or instead
            `min_length_time_axis`, per row. Default and least: 1 per row.
        """
        where = "ItemBuffer()"
        sizes = SizeArgs.of(locals())
        parts = compose(where, example, add_batch_size, sizes, UNIFORM, ItemView(), flat=True)
        init_buffer(self, parts)
