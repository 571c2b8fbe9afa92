import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from .._checks import check_positive_int
from .._custom_types import ExampleTree
from .._ring import RingStorage
from ._base import AbstractBuffer, check_window_config, resolve_length, Sample, Transition


class TransitionBuffer(AbstractBuffer):
    """A buffer of transitions: samples consecutive pairs `(first, second)` of steps of one row
    (Flashbax's flat buffer). Each step is stored once; the pair is gathered at sample time.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(4), "action": jnp.int32(0)}
        buffer = eb.TransitionBuffer(example, add_batch_size=8, capacity=1_000)
        for _ in range(3):
            buffer = buffer.add({"obs": jnp.ones((8, 4)), "action": jnp.zeros(8, jnp.int32)})
        sample = buffer.sample(jax.random.key(0), batch_size=32)
        assert sample.experience.first["obs"].shape == (32, 4)
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

        - `example`: one step of experience, a pytree of arrays.
        - `add_batch_size`: the number of rows each `add` writes.
        - `max_length`: steps held per row (at least 2). Or instead:
        - `capacity` (alias `max_size`): steps held in total, rounded up to a multiple of
            `add_batch_size`.
        - `min_length`: steps per row before `can_sample()` is true (default 2).
        """
        where = "TransitionBuffer()"
        rows = check_positive_int(where, "add_batch_size", add_batch_size)
        length = resolve_length(where, rows, max_length, capacity, max_size)
        self.sequence_length, self.period, self.min_length = check_window_config(
            where, length, 2, 1, min_length
        )
        self.storage = RingStorage(example, rows, length)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> Sample:
        """Draw `batch_size` transitions uniformly over all consecutive pairs held.

        **Returns:**

        A [`equibuffer.Sample`][] whose `experience` is a [`equibuffer.Transition`][] with
        leaves `(batch_size, *leaf)`.
        """
        indices, steps, windows = self._draw(key, batch_size)
        pair = Transition(
            first=jax.tree.map(lambda x: x[:, 0], windows),
            second=jax.tree.map(lambda x: x[:, 1], windows),
        )
        return Sample(experience=pair, indices=indices, steps=steps)
