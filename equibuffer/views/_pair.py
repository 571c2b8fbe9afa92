"""The view of the transition buffers: consecutive pairs of steps (`Transition`)."""

import equinox as eqx
from jaxtyping import Array, Bool, PyTree, Shaped

from .._custom_types import Indices
from .._ring import RingStorage
from ._base import AbstractView, Mask, zero_where_not
from ._gather import gather_steps


class Transition(eqx.Module):
    """A batch of consecutive pairs of steps of one row: `first` at time `t`, `second` at
    `t + 1`, each a tree with leaves `(batch, *leaf)`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.TransitionBuffer({"t": jnp.int32(0)}, add_batch_size=1, capacity=8)
        buffer = buffer.add({"t": jnp.arange(5, dtype=jnp.int32)[None]})
        pair = buffer.sample(jax.random.key(0), batch_size=16).experience
        assert isinstance(pair, eb.Transition) and pair.first["t"].shape == (16,)
        assert (pair.second["t"] == pair.first["t"] + 1).all()
        ```
    """

    first: PyTree[Shaped[Array, "batch ..."]]
    second: PyTree[Shaped[Array, "batch ..."]]


class PairView(AbstractView):
    """Consecutive pairs `(first, second)` of one row: a [`equibuffer.Transition`][] (the
    view of the transition buffers; Flashbax's flat buffer).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.Buffer({"t": jnp.int32(0)}, add_batch_size=1, capacity=8,
                           view=eb.views.PairView())
        buffer = buffer.add({"t": jnp.arange(4, dtype=jnp.int32)[None]})
        pair = buffer.sample(jax.random.key(0), batch_size=4).experience
        assert bool((pair.second["t"] == pair.first["t"] + 1).all())
        ```
    """

    def checked(self, where: str, storage: RingStorage) -> "PairView":
        return self

    @property
    def window_length(self) -> int:
        return 2

    def gather(self, storage: RingStorage, indices: Indices, mask: Mask | None) -> Transition:
        # Each step gathered on its own: slicing a gathered (batch, 2, ...) pair costs a copy.
        first, second = gather_steps(storage, indices, 2)
        return Transition(first=first, second=second)

    def padded(self, experience: Transition, mask: Bool[Array, "batch window"]) -> Transition:
        return Transition(experience.first, zero_where_not(mask[:, 1], experience.second))

    @property
    def window_name(self) -> str:
        return "2 steps (one transition)"

    def needs(self, steps: int) -> str:
        return f"at least {steps} steps per row (two consecutive steps make a transition)"
