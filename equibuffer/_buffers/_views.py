"""Views: what a sample returns for the windows a sampling rule drew.

Public as `equibuffer.views`. A view is static configuration only (no arrays). It says how
many consecutive steps one of its samples spans (`window_length`: the window the rule
draws), gathers them from the ring, and zeroes what lies past an episode end when the rule
pads.

- `WindowView(sequence_length)`: the window itself, leaves `(batch, sequence_length, *leaf)`.
- `PairView()`: a [`equibuffer.Transition`][] `(first, second)` of two consecutive steps.
- `NStepView(n, discount, ...)`: an [`equibuffer.NStepTransition`][] over `n + 1` steps.
- `ItemView()`: one step, leaves `(batch, *leaf)`.

Adding a view is one class with these members (`window_length`, `window_name`,
`needs`, `checked`, `gather`, `padded`); no rule and no buffer changes.
"""

import abc
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .._checks import check_positive_int
from .._custom_types import Indices
from .._nstep import check_discount, check_leaves, check_n_step, n_step_from_storage
from .._ring import RingStorage
from .._windows import gather, gather_steps
from ._samples import Transition


Mask = Bool[Array, "batch window"]
_View = TypeVar("_View", bound="AbstractView")


def _zero_where_not(mask: Bool[Array, " batch"], tree: Any) -> Any:
    """`tree` (leaves `(batch, *leaf)`) with the entries where `mask` is false set to zero."""

    def zero(x: Array) -> Array:
        m = mask.reshape(-1, *(1,) * (x.ndim - 1))
        return jnp.where(m, x, jnp.zeros((), x.dtype))

    return jax.tree.map(zero, tree)


class AbstractView(eqx.Module):
    """What a buffer's `sample` returns for each drawn window: static configuration only (no
    arrays), so a buffer keeps its view as a static field and a jitted call pays nothing for
    it. A view says how many consecutive steps one element spans (`window_length`: the window
    the rule draws), gathers them from the ring, and zeroes what lies past an episode end.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        view = eb.views.WindowView(sequence_length=3)
        assert isinstance(view, eb.views.AbstractView) and view.window_length == 3
        buffer = eb.Buffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8, view=view)
        buffer = buffer.add({"x": jnp.arange(4.0)[None]})
        assert buffer.sample(jax.random.key(0), batch_size=2).experience["x"].shape == (2, 3)
        ```
    """

    @property
    @abc.abstractmethod
    def window_length(self) -> int:
        """The number of consecutive steps one sampled element spans."""

    @abc.abstractmethod
    def gather(self, storage: RingStorage, indices: Indices, mask: Mask | None) -> Any:
        """The experience of the windows starting at the flat `indices`. `mask` (from an
        episode rule in pad mode, else None) says which steps of each window lie inside its
        episode: what a view computes over several steps must not reach past it."""

    @abc.abstractmethod
    def padded(self, experience: Any, mask: Bool[Array, "batch window"]) -> Any:
        """`experience` with the steps where `mask` is false (past an episode end) zeroed."""

    @property
    @abc.abstractmethod
    def window_name(self) -> str:
        """How errors name one window (by the arguments a user of this view sets)."""

    @abc.abstractmethod
    def needs(self, steps: int) -> str:
        """What the sample-too-early error says a row needs: `steps` per row (the buffer's
        minimum) and what one sample spans, naming only arguments a user of this view sets."""

    @abc.abstractmethod
    def checked(self: _View, where: str, storage: RingStorage) -> _View:
        """This view with its configuration checked (errors start with `where`), also
        against the ring's example (the leaves it reads): called when a buffer is built."""

    def reference(self) -> Any:
        """This view's NumPy model, for [`equibuffer.testing.BufferReference`][]: what a
        sample holds for each drawn window (a model of `equibuffer.testing`'s `WindowView`
        kind: `experience(history, row, start)`, ...). A view of your own that returns one
        gets the reference model's checks; by default there is none, and
        `BufferReference.from_buffer` refuses the buffer, saying so."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no reference model: give it a `reference()` "
            "method returning one (see equibuffer.testing's WindowView, PairView, ItemView "
            "and NStepView)."
        )


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

    def reference(self) -> Any:
        from ..testing import _models

        return _models.WindowView(self.sequence_length)

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

    def reference(self) -> Any:
        from ..testing import _models

        return _models.PairView()

    @property
    def window_length(self) -> int:
        return 2

    def gather(self, storage: RingStorage, indices: Indices, mask: Mask | None) -> Transition:
        # Each step gathered on its own: slicing a gathered (batch, 2, ...) pair costs a copy.
        first, second = gather_steps(storage, indices, 2)
        return Transition(first=first, second=second)

    def padded(self, experience: Transition, mask: Bool[Array, "batch window"]) -> Transition:
        return Transition(experience.first, _zero_where_not(mask[:, 1], experience.second))

    @property
    def window_name(self) -> str:
        return "2 steps (one transition)"

    def needs(self, steps: int) -> str:
        return f"at least {steps} steps per row (two consecutive steps make a transition)"


class NStepView(AbstractView):
    """n-step transitions ([`equibuffer.NStepTransition`][]) from `n + 1` consecutive steps,
    cut at episode ends (see [`equibuffer.n_step_transition`][] for the convention): the
    view of `TransitionBuffer(n_step=n)`. Nothing is stored twice: the sums are computed
    from the stored steps at sample time.

    **Arguments:** `n` (at least 1), `discount` (in `[0, 1]`), and the names of the float
    `reward` leaf and the bool `terminated` and `truncated` leaves (`truncated=None` when
    there is none), checked against the example when a buffer is built.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"reward": jnp.float32(0), "terminated": jnp.bool_(False)}
        view = eb.views.NStepView(n=2, discount=0.5, truncated=None)
        buffer = eb.Buffer(example, add_batch_size=1, capacity=8, view=view)
        buffer = buffer.add({"reward": jnp.ones((1, 4)), "terminated": jnp.zeros((1, 4), bool)})
        sample = buffer.sample(jax.random.key(0), batch_size=4)
        assert jnp.allclose(sample.experience.reward, 1 + 0.5)
        ```
    """

    n: int = eqx.field(static=True)
    discount: float = eqx.field(static=True)
    reward: str = eqx.field(static=True, default="reward")
    terminated: str = eqx.field(static=True, default="terminated")
    truncated: str | None = eqx.field(static=True, default="truncated")

    def checked(self, where: str, storage: RingStorage) -> "NStepView":
        n, discount = check_n_step(where, self.n), check_discount(where, self.discount)
        check_leaves(where, storage.example(), self.reward, self.terminated, self.truncated)
        return NStepView(n, discount, self.reward, self.terminated, self.truncated)

    def reference(self) -> Any:
        from ..testing import _models

        return _models.NStepView(
            self.n, self.discount, self.reward, self.terminated, self.truncated
        )

    @property
    def window_length(self) -> int:
        return self.n + 1

    def gather(self, storage: RingStorage, indices: Indices, mask: Mask | None) -> Any:
        names = (self.reward, self.terminated, self.truncated)
        return n_step_from_storage(storage, indices, self.n, self.discount, *names, within=mask)

    def padded(self, experience: Any, mask: Bool[Array, "batch window"]) -> Any:
        # The sums stop at an end already; `second` (the step after the last one summed) lies
        # past the end when the episode ended within the n steps: zero, as the mask says.
        inside = jnp.take_along_axis(mask, experience.steps[:, None], axis=1)[:, 0]
        return eqx.tree_at(
            lambda e: e.second, experience, _zero_where_not(inside, experience.second)
        )

    @property
    def window_name(self) -> str:
        return f"n_step + 1 = {self.n + 1} steps"

    def needs(self, steps: int) -> str:
        return (
            f"at least {steps} steps per row (n_step + 1 = {self.n + 1} make one n-step transition)"
        )


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

    def reference(self) -> Any:
        from ..testing import _models

        return _models.ItemView()

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


def gather_by_blocks(
    view: AbstractView, storage: RingStorage, indices: Indices, mask: Mask | None, blocks: int
) -> Any:
    """`view.gather(storage, indices, mask)` for indices drawn by blocks of rows (the `b`-th
    `batch / blocks` indices all in the `b`-th of `blocks` equal blocks of rows): each block
    gathers from its own rows only (a gather batched over the blocks), so with the rows split
    over devices block by block (`shard_rows`) every device gathers its block's windows from
    the rows it holds, and nothing crosses devices."""
    rows = storage.rows // blocks
    local = indices.reshape(blocks, -1)
    local = local - (jnp.arange(blocks, dtype=local.dtype) * (rows * storage.length))[:, None]
    treedef = jax.tree.structure(
        jax.eval_shape(lambda: RingStorage(storage.example(), rows, storage.length))
    )
    data = jax.tree.map(lambda x: x.reshape(blocks, rows, *x.shape[1:]), storage.data)
    masks = None if mask is None else mask.reshape(blocks, -1, *mask.shape[1:])

    def block(data: Any, local: Indices, mask: Mask | None) -> Any:
        own = jax.tree.unflatten(treedef, [*jax.tree.leaves(data), storage.counters])
        return view.gather(own, local, mask)

    out = jax.vmap(block)(data, local, masks)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)
