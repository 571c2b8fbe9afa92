import equinox as eqx

from .._checks import check_positive_int
from .._custom_types import ExampleTree
from .._ring import RingStorage
from ._base import AbstractUniformBuffer, check_window_config, resolve_length
from ._rules import AbstractUniformRule, Uniform
from ._views import AbstractView, WindowView


class TrajectoryBuffer(AbstractUniformBuffer):
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
    rule: AbstractUniformRule
    view: AbstractView
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
        sequence_length, self.period, self.min_length = check_window_config(
            where, length, sequence_length, period, min_length
        )
        self.storage = RingStorage(example, rows, length)
        self.rule = Uniform()
        self.view = WindowView(sequence_length)
