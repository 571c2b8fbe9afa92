from typing import Unpack

import equinox as eqx

from .._custom_types import ExampleTree
from .._frames import Frames
from .._ring import RingStorage
from ..rules._base import AbstractUniformRule
from ..rules._uniform import UNIFORM
from ..views._base import AbstractView
from ..views._window import window_view
from ._base import AbstractUniformBuffer
from ._generic import compose
from ._sizes import Sizes


class TrajectoryBuffer(AbstractUniformBuffer):
    """A buffer of trajectories: samples windows of `sequence_length` consecutive steps of one
    row, starting at absolute steps that are multiples of `period`, uniformly over all valid
    windows.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(4), "reward": jnp.float32(0)}
        buffer = eb.TrajectoryBuffer(example, add_batch_size=2, max_length_time_axis=100,
                                     sequence_length=8, period=4)
        buffer = buffer.add({"obs": jnp.ones((2, 10, 4)), "reward": jnp.ones((2, 10))})
        sample = buffer.sample(jax.random.key(0), batch_size=32)
        assert sample.experience["obs"].shape == (32, 8, 4)
        ```

    It is [`equibuffer.Buffer`][] with `rule=Uniform()` and `view=WindowView(sequence_length)`.
    """

    storage: RingStorage
    rule: AbstractUniformRule
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        sequence_length: int,
        period: int = 1,
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`: one step of experience, a pytree of arrays (numbers and NumPy arrays are
            taken as `jnp.asarray` takes them); fixes every leaf's shape and dtype. Storage
            of zeros shaped `(add_batch_size, max_length_time_axis, *leaf)` is allocated.
        - `add_batch_size`: the number of rows each `add` writes (e.g. parallel environments).
        - `sequence_length`: the number of consecutive steps in each sampled window.
        - `period`: windows start at absolute steps that are multiples of `period` (1: every
            step; `sequence_length`: non-overlapping windows).
        - `frames`: an [`equibuffer.Frames`][], to store one frame per step of a stacked
            observation leaf and return the stacks in every sample (see
            [Pixels](../pixels.md)). Default: every leaf is stored as given.
        - `**sizes`: `capacity` (steps in total) or `max_length_time_axis` (per row), and
            optionally `min_size` or `min_length_time_axis` (default and least: one window per
            row), as [`equibuffer.Sizes`][] says.
        """
        where = "TrajectoryBuffer()"
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where,
            example,
            add_batch_size,
            sizes,
            UNIFORM,
            window_view(where, sequence_length),
            period=period,
            frames=frames,
        )
