"""The generic buffers: a ring, a sampling rule and a view, composed by the user.

`Buffer` takes a rule that draws uniformly ([`equibuffer.rules.AbstractUniformRule`][]),
`PrioritisedBuffer` one that draws by priority; both take any view. Every method (`add`,
`sample`, `can_sample`, `epoch`, `update`, `with_storage`, `set_priorities`) is the one the
named buffers share, in `_base.py` and `_prioritised.py`: a combination no named class offers
behaves as the named ones do.
"""

from collections.abc import Mapping
from typing import Any, TypeVar, Unpack

import equinox as eqx

from .._checks import as_example, check_positive_int
from .._custom_types import ExampleTree
from .._frames import as_frames, Frames
from .._ring import RingStorage
from ..rules._base import AbstractRule, AbstractUniformRule
from ..rules._episode_ends import EpisodeEnds
from ..rules._uniform import UNIFORM
from ..views._base import AbstractView
from ._base import AbstractUniformBuffer
from ._sizes import SizeArgs, Sizes


_R = TypeVar("_R", bound=AbstractRule)
_Kind = TypeVar("_Kind")


def compose(
    where: str,
    example: ExampleTree,
    add_batch_size: int,
    sizes: Mapping[str, Any],
    rule: _R,
    view: AbstractView,
    *,
    period: int = 1,
    flat: bool = False,
    frames: Frames | None = None,
) -> tuple[RingStorage, _R, AbstractView, int, int]:
    """A composed buffer's parts, built and checked, in the order of its fields (what each
    constructor assigns: `self.storage, self.rule, ... = compose(...)`): the ring sized by
    `sizes` (a constructor's `**sizes`, checked) and stacking `frames` when given, `view`
    checked against it, `rule` sized to it (once), the period and the steps per row before
    sampling (one window of the view at least). Errors start with `where`; `flat` marks the
    buffers whose Flashbax counterpart is flat or item-shaped (see `equibuffer.Sizes`)."""
    if not isinstance(view, AbstractView):
        raise TypeError(
            f"{where}: `view` must be an equibuffer.views.AbstractView, got {type(view).__name__}."
        )
    given = SizeArgs.of(where, sizes)
    example = as_example(example)
    frames = as_frames(where, frames)
    if frames is not None:
        # The frames take the rule's episode ends, where it has them (stated once).
        episodes = getattr(rule, "episodes", None)
        rule_end = episodes.episode_end if isinstance(episodes, EpisodeEnds) else None
        frames = frames.checked(where, example, rule_end)
    storage = given.storage(where, example, add_batch_size, flat=flat, frames=frames)
    view = view.checked(where, storage)
    if storage.lookback and storage.length < view.window_length + storage.lookback:
        # Once the ring wraps, its `k - 1` oldest steps start no window: with fewer steps per
        # row than a window and them, nothing could be drawn again.
        raise ValueError(
            f"{where}: with frames stacked by k={storage.lookback + 1}, a row must hold one "
            f"window of {view.window_name} and the k - 1 = {storage.lookback} steps before it, "
            f"{view.window_length + storage.lookback} steps, but it holds "
            f"max_length_time_axis={storage.length}; raise the size (capacity or "
            "max_length_time_axis)."
        )
    period = check_positive_int(where, "period", period)
    minimum = given.min_length_time_axis_for(
        where, storage, view.window_length, view.window_name, flat=flat
    )
    return storage, rule.sized(where, storage), view, period, minimum


def check_rule(where: str, rule: object, kind: type[_Kind], use: str) -> _Kind:
    """`rule`, checked to be a rule of `kind` (`use`: the buffer to build for another)."""
    if not isinstance(rule, kind):
        got = type(rule).__name__
        if isinstance(rule, AbstractRule):
            raise TypeError(
                f"{where}: the rule {got} is not an equibuffer.rules.{kind.__name__}; "
                f"build an {use} for it."
            )
        raise TypeError(f"{where}: `rule` must be an equibuffer.rules.{kind.__name__}, got {got}.")
    return rule


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
    rule: AbstractUniformRule
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
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`: one step of experience, a pytree of arrays (numbers and NumPy arrays
            are taken as `jnp.asarray` takes them); fixes every leaf's shape and dtype.
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
        - `frames`: an [`equibuffer.Frames`][], to store one frame per step of a stacked
            observation leaf and return the stacks in every sample (see
            [Pixels](../pixels.md)). Default: every leaf is stored as given.
        - `**sizes`: `capacity` (steps in total) or `max_length_time_axis` (per row), and
            optionally `min_size` or `min_length_time_axis` (default and least: one window per
            row), as [`equibuffer.Sizes`][] says.
        """
        where = "Buffer()"
        rule = check_rule(where, rule, AbstractUniformRule, "eb.PrioritisedBuffer")
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where, example, add_batch_size, sizes, rule, view, period=period, frames=frames
        )
