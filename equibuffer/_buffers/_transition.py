from typing import Unpack

import equinox as eqx

from .._custom_types import ExampleTree
from .._frames import Frames
from .._ring import RingStorage
from ..rules._base import AbstractUniformRule
from ..rules._episode_ends import check_mode, EpisodeEnd, Mode
from ..rules._episodic import episodic
from ..rules._uniform import UNIFORM
from ..views._base import AbstractView
from ..views._nstep import check_discount, check_n_step, NStepView
from ..views._pair import PairView
from ._base import AbstractUniformBuffer
from ._generic import compose
from ._sizes import Sizes


class TransitionBuffer(AbstractUniformBuffer):
    """A buffer of transitions: samples consecutive pairs `(first, second)` of steps of one row
    (Flashbax's flat buffer). Each step is stored once; the pair is gathered at sample time.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(4), "action": jnp.int32(0)}
        buffer = eb.TransitionBuffer(example, add_batch_size=8, capacity=1_000)
        for _ in range(3):
            buffer = buffer.add({"obs": jnp.ones((8, 4)), "action": jnp.zeros(8, jnp.int32)})
        sample = buffer.sample(jax.random.key(0), batch_size=32)
        assert sample.experience.first["obs"].shape == (32, 4)
        ```

    With `n_step=n`, `sample` returns n-step transitions computed from the `n + 1` stored
    steps that follow each sampled step (nothing is stored twice), cut at episode ends; see
    [`equibuffer.n_step_transition`][] for the convention.

    It is [`equibuffer.Buffer`][] with `rule=Uniform()` (or `Episodic(episode_end, mode)`)
    and `view=PairView()` (or `NStepView(n_step, discount, ...)`).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(4), "reward": jnp.float32(0),
                   "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)}
        buffer = eb.TransitionBuffer(example, add_batch_size=2, capacity=100, n_step=3,
                                     discount=0.99)
        buffer = buffer.add({"obs": jnp.ones((2, 5, 4)), "reward": jnp.ones((2, 5)),
                             "terminated": jnp.zeros((2, 5), bool),
                             "truncated": jnp.zeros((2, 5), bool)})
        sample = buffer.sample(jax.random.key(0), batch_size=8)
        assert sample.experience.second["obs"].shape == (8, 4)
        assert jnp.allclose(sample.experience.reward, 1 + 0.99 + 0.99**2)
        ```
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
        n_step: int | None = None,
        discount: float | None = None,
        reward: str = "reward",
        terminated: str = "terminated",
        truncated: str | None = "truncated",
        episode_end: EpisodeEnd | None = None,
        mode: Mode = "never_cross",
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`: one step of experience, a pytree of arrays (numbers and NumPy arrays
            are taken as `jnp.asarray` takes them).
        - `add_batch_size`: the number of rows each `add` writes.
        - `frames`: an [`equibuffer.Frames`][], to store one frame per step of a stacked
            observation leaf and return the stacks in every sample (see
            [Pixels](../pixels.md)). Default: every leaf is stored as given.
        - `**sizes`: `capacity` (steps in total; Flashbax's `max_length` too) or
            `max_length_time_axis` (per row), and optionally `min_size` (`min_length`) or
            `min_length_time_axis` (default and least: 2 per row, `n_step + 1` with `n_step`),
            as [`equibuffer.Sizes`][] says.
        - `n_step`: sample n-step transitions ([`equibuffer.NStepTransition`][]) instead
            of pairs; at least 1. Needs `discount` and the leaves named by:
        - `reward`, `terminated`, `truncated`: the names (keys or attributes of the example)
            of the float reward leaf and the bool episode-end leaves; `truncated=None` when
            there is none.
        - `episode_end`: to make transitions episode-aware, what marks the last step of an
            episode, as for [`equibuffer.EpisodeTrajectoryBuffer`][] (a bool leaf's name or
            a function of one step). Default `None`: transitions are drawn uniformly over
            every pair (or `n_step + 1` window) held, across episode ends.
        - `mode`: with `episode_end`, `"never_cross"` (default: a transition never joins the
            last step of an episode to the first of the next, and an n-step transition is
            drawn only where all its `n_step` steps lie in one episode) or `"pad"` (every
            step is a transition, the terminal ones included, as soon as it is held: what
            lies past the episode end, `second` of a terminal pair or of a cut n-step
            transition, comes back zero, with `sample.mask` false there).
        """
        where = "TransitionBuffer()"
        view = transition_view(where, n_step, discount, reward, terminated, truncated)
        check_mode(where, mode, episode_end)
        rule = UNIFORM if episode_end is None else episodic(where, episode_end, mode)
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where, example, add_batch_size, sizes, rule, view, flat=True, frames=frames
        )


def transition_view(
    where: str,
    n_step: int | None,
    discount: float | None,
    reward: str,
    terminated: str,
    truncated: str | None,
) -> PairView | NStepView:
    """The view of a transition buffer: pairs, or n-step transitions (`n_step` and
    `discount` checked; the leaves it reads are checked against the example when a buffer
    is built with it: `NStepView.checked`)."""
    if n_step is None and discount is None:
        return PairView()
    if n_step is None or discount is None:
        raise TypeError(f"{where}: give both `n_step` and `discount`, or neither.")
    n_step = check_n_step(where, n_step)
    discount = check_discount(where, discount)
    return NStepView(n_step, discount, reward, terminated, truncated)
