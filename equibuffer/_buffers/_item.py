import equinox as eqx

from .._checks import check_positive_int
from .._custom_types import ExampleTree
from .._ring import RingStorage
from ._base import AbstractUniformBuffer, check_window_config, resolve_length
from ._rules import AbstractUniformRule, Uniform
from ._views import AbstractView, ItemView


class ItemBuffer(AbstractUniformBuffer):
    """A buffer of independent items: every stored step is one item, sampled uniformly.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.ItemBuffer({"x": jnp.zeros(3)}, add_batch_size=4, capacity=100)
        buffer = buffer.add({"x": jnp.ones((4, 3))})
        sample = buffer.sample(jax.random.key(0), batch_size=16)
        assert sample.experience["x"].shape == (16, 3)
        ```
    """

    storage: RingStorage
    rule: AbstractUniformRule
    view: AbstractView
    period: int = eqx.field(static=True)
    min_length: int = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
    ):
        """**Arguments:**

        - `example`: one item, a pytree of arrays.
        - `add_batch_size`: the number of items (rows) each `add` of one step writes.
        - `max_length`: items held per row. Or instead:
        - `capacity` (alias `max_size`): items held in total, rounded up to a multiple of
            `add_batch_size`.
        - `min_length`: items per row before `can_sample()` is true (default 1).
        """
        where = "ItemBuffer()"
        rows = check_positive_int(where, "add_batch_size", add_batch_size)
        length = resolve_length(where, rows, max_length, capacity, max_size)
        _, self.period, self.min_length = check_window_config(where, length, 1, 1, min_length)
        self.storage = RingStorage(example, rows, length)
        self.rule = Uniform()
        self.view = ItemView()
