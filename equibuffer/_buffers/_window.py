"""The window a sampling rule draws, and what one draw returns: the types every rule and
every buffer share (public as `equibuffer.rules.Window` and `equibuffer.rules.Drawn`)."""

from typing import NamedTuple

from jaxtyping import Array, Float

from .._custom_types import Indices, Steps


class Window(NamedTuple):
    """The static window configuration a rule works with: its length (the view's
    `window_length`), the period of its starts, and how errors name the window (the view's
    `window_name`, e.g. `sequence_length=4`).

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp

        buffer = eb.TrajectoryBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=8,
                                     sequence_length=3, period=2)
        assert buffer.window == eb.rules.Window(3, 2, "sequence_length=3")
        ```
    """

    length: int
    period: int
    name: str


class Drawn(NamedTuple):
    """What a rule's draw gives the buffer: the flat index (`row * max_length_time_axis +
    slot`) and absolute start step of each window, and for prioritised rules the probability
    and importance weight of each.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=4)
        buffer = buffer.add({"x": jnp.arange(3.0)[None]})
        drawn = buffer.rule.draw(buffer.storage, buffer.window, jax.random.key(0), 5,
                                 buffer.can_sample(), "not ready", "draw")
        assert isinstance(drawn, eb.rules.Drawn) and drawn.probabilities is None
        assert bool((drawn.indices < 3).all())  # slots 0-2 hold items
        ```
    """

    indices: Indices
    steps: Steps
    probabilities: Float[Array, " batch"] | None = None
    weights: Float[Array, " batch"] | None = None
