import equinox as eqx
from jaxtyping import PRNGKeyArray

from .._checks import check_positive_int
from .._custom_types import ExampleTree, ExperienceBatch
from .._ring import RingStorage
from .._windows import gather
from ._base import AbstractBuffer, add_to_storage, check_window_config, resolve_length, Sample


class TrajectoryBuffer(AbstractBuffer):
    """A buffer of trajectories: samples windows of `sequence_length` consecutive steps of one
    row, starting at absolute steps that are multiples of `period`, uniformly over all valid
    windows.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(4), "reward": jnp.float32(0)}
        buffer = eb.TrajectoryBuffer(example, add_batch_size=2, max_length=100,
                                     sequence_length=8, period=4)
        buffer = buffer.add({"obs": jnp.ones((2, 10, 4)), "reward": jnp.ones((2, 10))})
        sample = buffer.sample(jax.random.key(0), batch_size=32)
        assert sample.experience["obs"].shape == (32, 8, 4)
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
        sequence_length: int,
        period: int = 1,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
    ):
        """**Arguments:**

        - `example`: one step of experience, a pytree of arrays; fixes every leaf's shape and
            dtype. Storage of zeros shaped `(add_batch_size, max_length, *leaf)` is allocated.
        - `add_batch_size`: the number of rows each `add` writes (e.g. parallel environments).
        - `sequence_length`: the number of consecutive steps in each sampled window.
        - `period`: windows start at absolute steps that are multiples of `period` (1: every
            step; `sequence_length`: non-overlapping windows).
        - `max_length`: steps held per row. Or instead:
        - `capacity` (alias `max_size`): steps held in total; `max_length` becomes
            `ceil(capacity / add_batch_size)`, rounded up so nothing asked for is lost.
        - `min_length`: steps per row before `can_sample()` is true (default
            `sequence_length`), between `sequence_length` and `max_length`.
        """
        where = "TrajectoryBuffer()"
        rows = check_positive_int(where, "add_batch_size", add_batch_size)
        length = resolve_length(where, rows, max_length, capacity, max_size)
        self.sequence_length, self.period, self.min_length = check_window_config(
            where, length, sequence_length, period, min_length
        )
        self.storage = RingStorage(example, rows, length)

    def add(self, batch: ExperienceBatch) -> "TrajectoryBuffer":
        """Append one step `(add_batch_size, *leaf)` or `T` steps
        `(add_batch_size, T, *leaf)` to every row; see [`equibuffer.AbstractBuffer.add`][].

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(4)}, add_batch_size=2, max_length=10,
                                         sequence_length=3)
            buffer = buffer.add({"obs": jnp.ones((2, 4))})  # one step per row
            buffer = buffer.add({"obs": jnp.ones((2, 5, 4))})  # five steps per row
            assert int(buffer.size()) == 12 and buffer.can_sample()
            ```
        """
        return add_to_storage(self, batch)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> Sample:
        """Draw `batch_size` windows uniformly over all valid windows (with replacement).

        **Returns:**

        A [`equibuffer.Sample`][] whose `experience` leaves are
        `(batch_size, sequence_length, *leaf)`.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TrajectoryBuffer({"t": jnp.int32(0)}, add_batch_size=2, max_length=10,
                                         sequence_length=4, period=2)
            buffer = buffer.add({"t": jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))})
            t = buffer.sample(jax.random.key(0), batch_size=5).experience["t"]
            assert t.shape == (5, 4) and (t[:, 0] % 2 == 0).all()  # starts at multiples of period
            ```
        """
        indices, steps = self._draw_indices(key, batch_size)
        windows = gather(self.storage, indices, self.sequence_length)
        return Sample(experience=windows, indices=indices, steps=steps)
