"""The generic buffers: a ring, a sampling rule and a view, composed by the user.

`Buffer` takes a rule that draws uniformly ([`equibuffer.rules.AbstractUniformRule`][]),
`PrioritisedBuffer` one that draws by priority; both take any view. Every method (`add`,
`sample`, `can_sample`, `epoch`, `update`, `with_storage`, `set_priorities`) is the one the
named buffers share, in `_base.py` and `_prioritised.py`: a combination no named class offers
behaves as the named ones do.
"""

from typing import NamedTuple

import equinox as eqx
import jax

from .._checks import refuse_flashbax_only
from .._custom_types import ExampleTree
from .._ring import RingStorage
from ._base import AbstractUniformBuffer
from ._prioritised import AbstractPrioritisedBuffer
from ._rules import AbstractPrioritisedRule, AbstractRule, AbstractUniformRule, UNIFORM
from ._sizes import configure, SizeArgs
from ._views import AbstractView


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
    sizes: SizeArgs,
    rule: AbstractRule,
    view: AbstractView,
    *,
    period: int = 1,
    flat: bool = False,
) -> Composed:
    """The ring sized by `sizes`, `view` checked against it, `rule` sized to it, and the
    steps per row before sampling (errors start with `where`)."""
    if not isinstance(view, AbstractView):
        raise TypeError(
            f"{where}: `view` must be an equibuffer.views.AbstractView (e.g. "
            f"`eb.views.WindowView(sequence_length)`), got {type(view).__name__}."
        )
    storage, view, period, minimum = configure(
        where,
        example,
        add_batch_size,
        sizes,
        lambda storage: view.checked(where, storage),
        flat=flat,
        period=period,
    )
    return Composed(storage, rule.sized(where, storage), view, period, minimum)


def _check_rule(where: str, rule: object, kind: type, use: str) -> None:
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

    A rule without arrays (`Uniform`) is kept as static configuration, as the named
    buffers keep it: a jitted call flattens only the ring.

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
    # A rule without arrays is configuration: static, so a jitted call flattens and rebuilds
    # only the storage (measured: ~12 us per call for `Uniform` as a pytree node); a rule with
    # arrays is a pytree field. `rule` reads whichever is set.
    static_rule: AbstractUniformRule | None = eqx.field(static=True)
    dynamic_rule: AbstractUniformRule | None
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)

    @refuse_flashbax_only
    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        view: AbstractView,
        rule: AbstractRule = UNIFORM,
        period: int = 1,
        capacity: int | None = None,
        max_size: int | None = None,
        max_length: int | None = None,
        max_length_time_axis: int | None = None,
        min_size: int | None = None,
        min_length: int | None = None,
        min_length_time_axis: int | None = None,
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
        - `capacity` (alias `max_size`): steps held in total, rounded up to whole rows; or
            instead `max_length_time_axis`, steps per row.
        - `min_size`: steps held in total before `can_sample()` is true, rounded up to
            whole rows; or instead `min_length_time_axis`, per row. Default and least: one
            window per row.
        - `max_length`, `min_length`: refused, with an error saying what to pass (Flashbax's
            names for a flat buffer's totals: here `capacity` and `min_size`).
        """
        where = "Buffer()"
        _check_rule(where, rule, AbstractUniformRule, "eb.PrioritisedBuffer")
        parts = compose(where, example, add_batch_size, SizeArgs.of(locals()), rule, view,
                        period=period)  # fmt: skip
        self.storage, _, self.view, self.period, self.min_length_time_axis = parts
        self.static_rule, self.dynamic_rule = split_rule(parts.rule)

    @property
    def rule(self) -> AbstractUniformRule:  # pyright: ignore[reportIncompatibleVariableOverride]
        """The sampling rule, sized to the ring."""
        rule = self.static_rule if self.dynamic_rule is None else self.dynamic_rule
        assert rule is not None
        return rule


def split_rule(
    rule: AbstractRule,
) -> tuple[AbstractUniformRule | None, AbstractUniformRule | None]:
    """`(static, dynamic)`: a uniform rule without arrays as static configuration, one with
    arrays as a pytree field."""
    assert isinstance(rule, AbstractUniformRule)
    return (rule, None) if not jax.tree.leaves(rule) else (None, rule)


class PrioritisedBuffer(AbstractPrioritisedBuffer):
    """A buffer composed of parts whose rule draws by priority: a ring, a prioritised rule
    ([`equibuffer.rules.Prioritised`][] or [`equibuffer.rules.PrioritisedEpisodic`][]) and
    any view. `sample` returns probabilities and importance weights, and `set_priorities`
    updates the sampled windows, as for the named prioritised buffers (which are such
    compositions: `PrioritisedTrajectoryBuffer` is `rule=Prioritised(alpha)` with
    `view=WindowView(sequence_length)`).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        # prioritised, episode-aware windows of 3 steps starting every 2 steps
        example = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
        buffer = eb.PrioritisedBuffer(example, add_batch_size=1, capacity=32, period=2,
                                      rule=eb.rules.PrioritisedEpisodic(episode_end="done"),
                                      view=eb.views.WindowView(3))
        done = jnp.zeros((1, 12), bool).at[:, 7].set(True)
        buffer = buffer.add({"obs": jnp.ones((1, 12, 2)), "done": done})
        assert int(buffer.num_valid_windows()) == 4  # starts 0, 2, 4 and 8
        sample = buffer.sample(jax.random.key(0), batch_size=8, beta=0.4)
        buffer = buffer.set_priorities(sample, jnp.arange(1.0, 9.0))
        ```
    """

    storage: RingStorage
    rule: AbstractPrioritisedRule
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)

    @refuse_flashbax_only
    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        view: AbstractView,
        rule: AbstractRule,
        period: int = 1,
        capacity: int | None = None,
        max_size: int | None = None,
        max_length: int | None = None,
        max_length_time_axis: int | None = None,
        min_size: int | None = None,
        min_length: int | None = None,
        min_length_time_axis: int | None = None,
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `view`, `period`, the sizes: as for
            [`equibuffer.Buffer`][].
        - `rule`: an [`equibuffer.rules.AbstractPrioritisedRule`][]:
            [`equibuffer.rules.Prioritised`][]`(alpha)`, or
            [`equibuffer.rules.PrioritisedEpisodic`][]`(episode_end, mode, alpha)`. A rule
            that draws uniformly takes an [`equibuffer.Buffer`][].
        """
        where = "PrioritisedBuffer()"
        _check_rule(where, rule, AbstractPrioritisedRule, "eb.Buffer")
        parts = compose(where, example, add_batch_size, SizeArgs.of(locals()), rule, view,
                        period=period)  # fmt: skip
        self.storage, rule, self.view, self.period, self.min_length_time_axis = parts
        assert isinstance(rule, AbstractPrioritisedRule)
        self.rule = rule
