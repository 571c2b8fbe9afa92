"""The view of the trajectory buffers: windows of consecutive steps."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .._checks import check_positive_int
from .._custom_types import Indices
from .._ring import RingStorage
from ._base import AbstractView, Mask
from ._gather import gather


class WindowView(AbstractView):
    """Windows of `sequence_length` consecutive steps of one row, leaves
    `(batch, sequence_length, *leaf)`: the view of the trajectory buffers.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.Buffer({"t": jnp.int32(0)}, add_batch_size=1, capacity=8,
                           view=eb.views.WindowView(2))
        buffer = buffer.add({"t": jnp.arange(4, dtype=jnp.int32)[None]})
        t = buffer.sample(jax.random.key(0), batch_size=4).experience["t"]
        assert t.shape == (4, 2) and bool((t[:, 1] == t[:, 0] + 1).all())
        ```
    """

    sequence_length: int = eqx.field(static=True)

    def checked(self, where: str, storage: RingStorage) -> "WindowView":
        return window_view(where, self.sequence_length)

    @property
    def window_length(self) -> int:
        return self.sequence_length

    def gather(self, storage: RingStorage, indices: Indices, mask: Mask | None) -> Any:
        return gather(storage, indices, self.sequence_length)

    def padded(self, experience: Any, mask: Bool[Array, "batch window"]) -> Any:
        def zero(x: Array) -> Array:
            m = mask.reshape(*mask.shape, *(1,) * (x.ndim - 2))
            return jnp.where(m, x, jnp.zeros((), x.dtype))

        return jax.tree.map(zero, experience)

    @property
    def window_name(self) -> str:
        return f"sequence_length={self.sequence_length}"

    def needs(self, steps: int) -> str:
        return f"at least {steps} steps per row and one window of {self.window_name}"


def window_view(where: str, sequence_length: int) -> WindowView:
    """A [`equibuffer.views.WindowView`][] of `sequence_length >= 1` steps
    (errors start with `where`)."""
    return WindowView(check_positive_int(where, "sequence_length", sequence_length))
