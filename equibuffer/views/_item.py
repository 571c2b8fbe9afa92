"""The view of the item buffers: single steps."""

from typing import Any

from jaxtyping import Array, Bool

from .._custom_types import Indices
from .._ring import RingStorage
from ._base import AbstractView, Mask
from ._gather import gather_steps


class ItemView(AbstractView):
    """Single steps, leaves `(batch, *leaf)`: the view of the item buffers.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.Buffer({"x": jnp.zeros(3)}, add_batch_size=2, capacity=8,
                           view=eb.views.ItemView())
        buffer = buffer.add({"x": jnp.ones((2, 3))})
        assert buffer.sample(jax.random.key(0), batch_size=5).experience["x"].shape == (5, 3)
        ```
    """

    def checked(self, where: str, storage: RingStorage) -> "ItemView":
        return self

    @property
    def window_length(self) -> int:
        return 1

    def gather(self, storage: RingStorage, indices: Indices, mask: Mask | None) -> Any:
        return gather_steps(storage, indices, 1)[0]

    def padded(self, experience: Any, mask: Bool[Array, "batch window"]) -> Any:
        return experience

    @property
    def window_name(self) -> str:
        return "1 step"

    def needs(self, steps: int) -> str:
        return f"at least {steps} item{'s' if steps > 1 else ''} per row"
