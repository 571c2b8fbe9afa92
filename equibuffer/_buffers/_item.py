import equinox as eqx
from jaxtyping import PRNGKeyArray

from .._checks import check_positive_int
from .._custom_types import ExampleTree, ExperienceBatch
from .._ring import RingStorage
from .._windows import gather_steps
from ._base import AbstractBuffer, add_to_storage, check_window_config, resolve_length, Sample


class ItemBuffer(AbstractBuffer):
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
    sequence_length: int = eqx.field(static=True)
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
        self.sequence_length, self.period, self.min_length = check_window_config(
            where, length, 1, 1, min_length
        )
        self.storage = RingStorage(example, rows, length)

    def add(self, batch: ExperienceBatch) -> "ItemBuffer":
        """Append one step `(add_batch_size, *leaf)` or `T` steps
        `(add_batch_size, T, *leaf)` to every row; see [`equibuffer.AbstractBuffer.add`][].

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.zeros(3)}, add_batch_size=4, capacity=8)
            buffer = buffer.add({"x": jnp.ones((4, 3))})  # one item per row
            buffer = buffer.add({"x": jnp.ones((4, 5, 3))})  # 5 per row: only the newest 2 are kept
            assert buffer.max_length == 2 and int(buffer.size()) == 8
            ```
        """
        return add_to_storage(self, batch)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> Sample:
        """Draw `batch_size` items uniformly over all items held (with replacement).

        **Returns:**

        A [`equibuffer.Sample`][] whose `experience` leaves are `(batch_size, *leaf)`.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.ItemBuffer({"x": jnp.int32(0)}, add_batch_size=2, capacity=10)
            buffer = buffer.add({"x": jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)})
            x = buffer.sample(jax.random.key(0), batch_size=16).experience["x"]
            assert x.shape == (16,) and x.dtype == jnp.int32 and ((x >= 1) & (x <= 6)).all()
            ```
        """
        indices, steps = self._draw_indices(key, batch_size)
        (items,) = gather_steps(self.storage, indices, 1)
        return Sample(experience=items, indices=indices, steps=steps)
