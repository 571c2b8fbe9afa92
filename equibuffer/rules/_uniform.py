"""The uniform rule: every window valid by the counters, drawn uniformly, with no state."""

from jaxtyping import Array

from .._errors import error_if
from .._ring import Appended, RingStorage
from ._base import AbstractUniformRule, ByTheCounters
from ._request import Drawn, Request, Window
from ._valid import uniform_windows


class Uniform(ByTheCounters, AbstractUniformRule):
    """Uniform over the windows valid by the counters (held, complete, on the period): no
    state at all, so it costs nothing at `add`. The rule of `TrajectoryBuffer`,
    `TransitionBuffer` and `ItemBuffer`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.Buffer({"t": jnp.int32(0)}, add_batch_size=1, capacity=8,
                           rule=eb.rules.Uniform(), view=eb.views.WindowView(3))
        buffer = buffer.add({"t": jnp.arange(5, dtype=jnp.int32)[None]})
        assert int(buffer.num_valid_windows()) == 3  # starts 0, 1 and 2
        ```
    """

    def sized(self, where: str, storage: RingStorage) -> "Uniform":
        return self

    def row_leaves(self) -> tuple[Array, ...]:
        return ()

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Uniform":
        return self

    def updated(self, storage: RingStorage, window: Window, *, restored: bool = False) -> "Uniform":
        return self

    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        key, batch_size, ready, not_ready, _, blocks, _ = request
        indices, steps = uniform_windows(
            storage, key, batch_size, window.length, window.period, blocks
        )
        return Drawn(error_if(indices, ~ready, not_ready), steps)


# The one `Uniform` rule: it has no state, so every buffer may share it (and `_with` sees
# `added` return the very rule it holds).
UNIFORM = Uniform()
