"""The generic buffers: a ring, a sampling rule and a view, composed by the user.

`Buffer` takes a rule that draws uniformly ([`equibuffer.rules.AbstractUniformRule`][]),
`PrioritisedBuffer` one that draws by priority; both take any view. Every method (`add`,
`sample`, `can_sample`, `epoch`, `update`, `with_storage`, `set_priorities`) is the one the
named buffers share, in `_base.py` and `_prioritised.py`: a combination no named class offers
behaves as the named ones do.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias, Unpack

import equinox as eqx

from .._custom_types import ExampleTree
from .._ring import RingStorage
from ..rules._base import AbstractRule, AbstractUniformRule
from ..rules._uniform import UNIFORM
from ..views._base import AbstractView
from ._base import AbstractUniformBuffer
from ._sizes import configure, Sizes


# A part, or (for the named buffers, whose arguments are checked against the example with
# their own messages) a function of the sized ring that builds it.
_Part: TypeAlias = AbstractRule | AbstractView | Callable[[RingStorage], object]


class Composed(NamedTuple):
    """A buffer's parts, built and checked: what every constructor assigns."""

    storage: RingStorage
    rule: AbstractRule
    view: AbstractView
    period: int
    min_length_time_axis: int


def compose(
    where: str,
    example: ExampleTree,
    add_batch_size: int,
    sizes: Mapping[str, Any],
    rule: _Part,
    view: _Part,
    *,
    period: int = 1,
    flat: bool = False,
) -> Composed:
    """The ring sized by `sizes` (a constructor's `**sizes`), `view` checked against it, `rule`
    sized to it, and the steps per row before sampling (errors start with `where`). `rule` and
    `view` may be functions of the ring that build them (the named buffers' arguments, checked
    there)."""

    def built(part: _Part, kind: type, name: str, storage: RingStorage) -> object:
        made: object = part
        if not isinstance(part, AbstractRule | AbstractView) and callable(part):
            made = part(storage)
        if not isinstance(made, kind):
            raise TypeError(
                f"{where}: `{name}` must be an equibuffer.{name}s.{kind.__name__}, got "
                f"{type(made).__name__}."
            )
        return made

    def checked_view(storage: RingStorage) -> AbstractView:
        part = built(view, AbstractView, "view", storage)
        assert isinstance(part, AbstractView)
        return part.checked(where, storage)

    storage, checked, period, minimum = configure(
        where, example, add_batch_size, sizes, checked_view, flat=flat, period=period
    )
    sized = built(rule, AbstractRule, "rule", storage)
    assert isinstance(sized, AbstractRule)
    return Composed(storage, sized.sized(where, storage), checked, period, minimum)


def check_rule(where: str, rule: object, kind: type, use: str) -> None:
    if not isinstance(rule, kind):
        got = type(rule).__name__
        if isinstance(rule, AbstractRule):
            raise TypeError(
                f"{where}: the rule {got} is not an equibuffer.rules.{kind.__name__}; "
                f"build an {use} for it."
            )
        raise TypeError(f"{where}: `rule` must be an equibuffer.rules.{kind.__name__}, got {got}.")


class Buffer(AbstractUniformBuffer):
    """A buffer composed of parts: a ring of `add_batch_size` rows, a sampling `rule` that
    draws its valid windows uniformly, and a `view` saying what a sample returns. The named
    uniform buffers are such compositions (`TrajectoryBuffer` is `rule=Uniform()` with
    `view=WindowView(sequence_length)`); build any other from the parts in
    `equibuffer.rules` and `equibuffer.views` (see [Composing buffers](../composing.md)).

    | named buffer | `rule` | `view` |
    |---|---|---|
    | `TrajectoryBuffer` | `Uniform()` | `WindowView(sequence_length)` |
    | `TransitionBuffer` | `Uniform()` or `Episodic(...)` | `PairView()` or `NStepView(...)` |
    | `ItemBuffer` | `Uniform()` | `ItemView()` |
    | `EpisodeTrajectoryBuffer` | `Episodic(episode_end, mode)` | `WindowView(sequence_length)` |

    The rule is a pytree field; one without arrays (`Uniform`) has no leaves, so a jitted
    call flattens only the ring's arrays.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        # windows of 4 steps inside one episode, returned as 3-step transitions
        example = {"obs": jnp.zeros(2), "reward": jnp.float32(0),
                   "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)}
        buffer = eb.Buffer(example, add_batch_size=2, capacity=64,
                           rule=eb.rules.Episodic(episode_end="terminated"),
                           view=eb.views.NStepView(n=3, discount=0.99))
        done = jnp.zeros((2, 10), bool).at[:, 4].set(True)
        buffer = buffer.add({"obs": jnp.ones((2, 10, 2)), "reward": jnp.ones((2, 10)),
                             "terminated": done, "truncated": jnp.zeros((2, 10), bool)})
        sample = buffer.sample(jax.random.key(0), batch_size=8)
        assert jnp.allclose(sample.experience.reward, 1 + 0.99 + 0.99**2)  # never cut
        ```
    """

    storage: RingStorage
    # A pytree field like every buffer's rule; one without arrays (`Uniform`) has no leaves,
    # so a jitted call still flattens only the ring's arrays.
    rule: AbstractUniformRule  # pyright: ignore[reportIncompatibleVariableOverride]
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        view: AbstractView,
        rule: AbstractRule = UNIFORM,
        period: int = 1,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`: one step of experience, a pytree of arrays; fixes every leaf's shape
            and dtype.
        - `add_batch_size`: the number of rows each `add` writes.
        - `view`: what a sample returns, an [`equibuffer.views.AbstractView`][]
            (`WindowView(sequence_length)`, `PairView()`, `NStepView(n, discount)`,
            `ItemView()`, or one of your own); its `window_length` is the window the rule
            draws.
        - `rule`: an [`equibuffer.rules.AbstractUniformRule`][] (default
            [`equibuffer.rules.Uniform`][]; [`equibuffer.rules.Episodic`][] for
            episode-aware windows). A prioritised rule takes an
            [`equibuffer.PrioritisedBuffer`][].
        - `period`: windows start at absolute steps that are multiples of `period`.
        - `**sizes`: `capacity` (steps in total) or `max_length_time_axis` (per row), and
            optionally `min_size` or `min_length_time_axis` (default and least: one window per
            row), as [`equibuffer.Sizes`][] says.
        """
        where = "Buffer()"
        check_rule(where, rule, AbstractUniformRule, "eb.PrioritisedBuffer")
        parts = compose(where, example, add_batch_size, sizes, rule, view,
                        period=period)  # fmt: skip
        init_buffer(self, parts)


def init_buffer(buffer: Buffer, parts: Composed) -> None:
    """Set the fields of a `Buffer` (or a named one) being initialised."""
    rule = parts.rule
    assert isinstance(rule, AbstractUniformRule)
    buffer.storage, buffer.view, buffer.period = parts.storage, parts.view, parts.period
    buffer.min_length_time_axis = parts.min_length_time_axis
    buffer.rule = rule
